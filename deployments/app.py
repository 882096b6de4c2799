"""The app builder: `serve run configs/cluster.yaml` calls `build_app(args)`.

Each deployment's replicas, autoscaling and `ray_actor_options` come from the YAML's
`deployments:` list; the builder only wires them together."""

from __future__ import annotations

from ray.serve import Application

from deployments.colocated import ColocatedServer
from deployments.config import AppArgs
from deployments.decode import DecodeServer
from deployments.ingress import Ingress
from deployments.prefill import PrefillServer


def build_app(args: dict) -> Application:
    parsed = AppArgs.model_validate(args)  # a bad config fails here, with pydantic's message
    plain = parsed.model_dump(mode="json")
    if parsed.mode == "colocated":
        return Ingress.bind(plain, colocated=ColocatedServer.bind(plain))
    return Ingress.bind(plain, prefill=PrefillServer.bind(plain), decode=DecodeServer.bind(plain))
