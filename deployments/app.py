"""The app builder: `serve run configs/cluster.yaml` calls `build_app(args)`.

Each deployment's replicas, autoscaling and `ray_actor_options` come from the YAML's
`deployments:` list; the builder only wires them together."""

from __future__ import annotations

from ray.serve import Application

from pegaserve.deployments.colocated import Colocated
from pegaserve.deployments.config import AppArgs
from pegaserve.deployments.decode import Decode
from pegaserve.deployments.ingress import Ingress
from pegaserve.deployments.prefill import Prefill


def build_app(args: dict) -> Application:
    parsed = AppArgs.model_validate(args)  # a bad config fails here, with pydantic's message
    plain = parsed.model_dump(mode="json")
    engines = parsed.without_keys().model_dump(mode="json")  # engine replicas need no key: none in their args
    if parsed.mode == "colocated":
        return Ingress.bind(plain, colocated=Colocated.bind(engines))
    return Ingress.bind(plain, prefill=Prefill.bind(engines), decode=Decode.bind(engines))
