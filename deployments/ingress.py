"""The ingress deployment: the OpenAI app of `pegaserve.api`, talking to prefill and decode (or to
one colocated engine) through Serve handles, to the ledger actor through a buffer, and receiving
tokens on its `TokenInbox`."""

from __future__ import annotations

import asyncio

from ray import serve

from pegaserve.api.app import build_app
from pegaserve.api.frontend import Frontend
from pegaserve.api.model_info import model_info
from pegaserve.config import Limits
from pegaserve.deployments.config import AppArgs
from pegaserve.deployments.ledger import ActorLedgerClient
from pegaserve.deployments.metrics import HttpStatusMetrics, IngressMetrics
from pegaserve.deployments.node import node_ip
from pegaserve.deployments.orchestration import ColocatedClient, DisaggregatedClient
from pegaserve.deployments.replica import ledger_buffer, replica_name
from pegaserve.deployments.response_store import ActorResponseStore
from pegaserve.heap import freeze_startup_heap
from pegaserve.models.config import ModelConfig
from pegaserve.models.tiny import ensure_model_dir
from pegaserve.net.tokens import TokenInbox
from pegaserve.tokenizer import Tokenizer


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    async def __init__(self, args: dict, prefill=None, decode=None, colocated=None) -> None:
        self.args = AppArgs.model_validate(args)
        self.name = replica_name()
        model_dir = ensure_model_dir(self.args.model)
        tokenizer = Tokenizer(model_dir)
        info = model_info(self.args.served_name, ModelConfig.from_dir(model_dir), self.args.engine.max_model_len)
        self.inbox = TokenInbox(node_ip())
        await self.inbox.start()
        buffer = ledger_buffer(self.args, self.name)
        self._heartbeat = asyncio.ensure_future(buffer.heartbeat_forever(self.args.ledger_orphan_timeout_s))
        ledger = ActorLedgerClient(buffer)
        if colocated is not None:
            engine = ColocatedClient(colocated, self.inbox, self.name, info.name, self.args.max_migrations, ledger,
                                     self.args.stream_interval)
        else:
            engine = DisaggregatedClient(prefill, decode, self.inbox, self.name, info.name, self.args.max_migrations,
                                         ledger, self.args.stream_interval)
        limits = Limits(**self.args.limits.model_dump(), scheduling_policy=self.args.engine.scheduling_policy)
        responses = ActorResponseStore(self.args.max_stored_responses, self.args.max_stored_bytes, buffer.detached)
        self.frontend = Frontend(engine, tokenizer, info, ledger, limits, IngressMetrics(info.name), responses)
        freeze_startup_heap()

    def __serve_build_asgi_app__(self):
        # Serve answers every request with its X-Request-Id (the client's, else one it made): not twice
        app = build_app(self.frontend, self.args.all_api_keys(), self.args.max_inflight_requests,
                        echo_request_id=False, allowed_hosts=tuple(self.args.allowed_hosts),
                        admin_api_keys=self.args.all_admin_api_keys())
        app.add_middleware(HttpStatusMetrics, model=self.args.served_name)  # outermost: counts the guards' too
        return app

    async def check_health(self) -> None:
        if not self.inbox.serving:
            raise RuntimeError("the token inbox stopped")
