"""The ingress deployment: the OpenAI app of `pegaserve.api`, talking to prefill and decode (or to
one colocated engine) through Serve handles, and to the ledger actor."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from deployments.common import app_name, ledger_actor
from deployments.config import AppArgs
from deployments.kv import PortDirectory, Release
from deployments.metrics import IngressMetrics
from pegaserve.api.app import build_app
from pegaserve.api.clients import EngineClient, LedgerClient
from pegaserve.api.local import model_info, served_name
from pegaserve.api.serving import Server
from pegaserve.api.validation import Limits
from pegaserve.default_model import ensure_model_dir
from pegaserve.engine.engine import EngineOverloaded
from pegaserve.engine.model_config import ModelConfig
from pegaserve.engine.request import EngineRequest, StepOutput
from pegaserve.ledger import LedgerEvent
from pegaserve.tokenizer import Tokenizer

log = logging.getLogger("ray.serve")


class DisaggregatedClient(EngineClient):
    """Prefill first; decode only when the first token is not terminal (rule 21)."""

    def __init__(self, prefill, decode, ledger) -> None:
        self.prefill = prefill
        self.decode = decode
        self.ledger = ledger
        self.ports = PortDirectory()
        self._tasks: set[asyncio.Task] = set()

    def _background(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefill(self, request: EngineRequest):
        """Prefill, retried once on another replica if the first one died (nothing was shown yet)."""
        for attempt in (1, 2):
            try:
                return await self.prefill.prefill.remote(request)
            except BackPressureError as exc:
                raise EngineOverloaded(f"prefill queue full: {exc}") from exc
            except RayActorError:
                if attempt == 2:
                    raise
                log.warning("prefill replica died under %s; retrying once", request.request_id)

    async def _release(self, lease) -> None:
        try:
            port = await self.ports.get(lease.port_name)
            port.call.remote(Release(lease.request_id))
        except Exception:  # the prefill replica is gone, and its blocks with it
            log.warning("could not release the KV lease of %s", lease.request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        result = await self._prefill(request)
        stream = None
        finished = result.lease is None
        try:
            yield result.output
            if result.lease is None:
                return
            first = result.output.tokens[0]
            stream = self.decode.options(stream=True).generate.remote(request, first, result.lease)
            async for output in _map_backpressure(stream):
                finished = output.finish is not None
                yield output
        finally:
            if result.lease is not None and not finished:
                # The client left, a stop string fired, or decode failed: abort there, and free the
                # prefill blocks now rather than at lease expiry (a no-op once decode claimed them).
                if stream is not None:
                    stream.cancel()
                self._background(self._release(result.lease))  # must not wait on a cancelled task

    async def stats(self) -> dict:
        return await app_stats(self.ledger)


async def _map_backpressure(stream) -> AsyncIterator[StepOutput]:
    try:
        async for output in stream:
            yield output
    except BackPressureError as exc:
        raise EngineOverloaded(f"queue full: {exc}") from exc


class ColocatedClient(EngineClient):
    def __init__(self, engine, ledger) -> None:
        self.engine = engine
        self.ledger = ledger

    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        stream = self.engine.options(stream=True).generate.remote(request)
        finished = False
        try:
            async for output in _map_backpressure(stream):
                finished = output.finish is not None
                yield output
        finally:
            if not finished:
                stream.cancel()

    async def stats(self) -> dict:
        return await app_stats(self.ledger)


async def app_stats(ledger) -> dict:
    """The latest engine stats of this app's replicas, as they reported them to the ledger actor."""
    prefix = f"{app_name()}/"
    return {name: s for name, s in (await ledger.stats.remote()).items() if name.startswith(prefix)}


class ActorLedgerClient(LedgerClient):
    def __init__(self, actor) -> None:
        self.actor = actor

    async def record(self, events: list[LedgerEvent], component: str) -> None:
        await self.actor.record.remote(events, component)

    async def get(self, request_id: str) -> dict | None:
        return await self.actor.get.remote(request_id)

    async def summary(self) -> dict:
        return await self.actor.summary.remote()


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    def __init__(self, args: dict, prefill=None, decode=None, colocated=None) -> None:
        self.args = AppArgs.model_validate(args)
        model_dir = ensure_model_dir(self.args.model)
        tokenizer = Tokenizer(model_dir)
        config = ModelConfig.from_dir(model_dir)
        info = model_info(served_name(self.args.model), config, self.args.engine.max_model_len, tokenizer)
        ledger = ledger_actor(self.args)
        if colocated is not None:
            engine: EngineClient = ColocatedClient(colocated, ledger)
        else:
            engine = DisaggregatedClient(prefill, decode, ledger)
        limits = Limits(**self.args.limits.model_dump())
        observer = IngressMetrics(info.name)
        self.server = Server(engine, tokenizer, info, ActorLedgerClient(ledger), limits, observer)

    def __serve_build_asgi_app__(self):
        return build_app(self.server, self.args.all_api_keys(), self.args.max_inflight_requests)
