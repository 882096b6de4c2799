"""What every engine replica shares (`EngineReplica`, the base of Prefill, Decode and Colocated): its
engine (in a process of its own), its name, its ledger buffer, its health check, and the loop that
posts its stats and metrics."""

from __future__ import annotations

import asyncio
import logging

import torch
from ray import serve
from ray.serve.schema import LoggingConfig

from pegaserve.config import EngineConfig, Role, SpeculativeConfig
from pegaserve.deployments.config import AppArgs
from pegaserve.deployments.ledger import LedgerBuffer, ledger_actor
from pegaserve.deployments.metrics import EngineMetrics
from pegaserve.deployments.registry import stats_board
from pegaserve.engine.async_engine import AsyncEngine, StepSink
from pegaserve.engine.process import EngineRecipe, ProcessLink, build_engine
from pegaserve.messages import EngineStats
from pegaserve.models.tiny import ensure_model_dir
from pegaserve.testing.hook import active_doubles

log = logging.getLogger("ray.serve")
STALL_S = 60.0  # work waiting and no step for this long: the replica is unhealthy
# The engine replicas' logging: no access log line per call (the ingress logs each request; a line
# per call cost ~8% of an engine replica's event loop). Serve gives a deployment the app's
# `logging_config` only when it has none of its own, so to change these replicas' logging (a log
# level, JSON), set `logging_config` on Prefill, Decode or Colocated in the config file itself.
QUIET = LoggingConfig(enable_access_log=False)


class EngineUnhealthy(RuntimeError):
    pass


def engine_config(args: AppArgs, role: Role) -> EngineConfig:
    e, s = args.engine, args.speculative
    return EngineConfig(
        role=role,
        block_size=e.block_size,
        num_blocks=e.num_blocks,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len,
        max_queued_requests=e.max_queued_requests,
        enable_prefix_caching=e.enable_prefix_caching,
        speculative=None if s is None else SpeculativeConfig(s.method, s.num_draft_tokens, s.prompt_lookup_min,
                                                            s.prompt_lookup_max),
        lease_timeout_s=args.lease_timeout_s,
        scheduling_policy=e.scheduling_policy,
    )


def start_engine(args: AppArgs, role: Role, on_step: StepSink | None = None) -> AsyncEngine:
    """The replica's engine: in its own process by default. A scripted model replaces the weights
    when the test-doubles hook says so (`pegaserve.testing.hook`)."""
    recipe = EngineRecipe(str(ensure_model_dir(args.model)), engine_config(args, role), args.engine.attention_backend,
                      args.engine.device, args.engine.torch_threads)
    doubles = active_doubles()
    if doubles is not None and doubles.script is not None:
        recipe = EngineRecipe(recipe.model_dir, recipe.config, recipe.attention_backend, recipe.device, recipe.torch_threads,
                          builder="pegaserve.testing.scripted:build_from_recipe", builder_args=(doubles.script,))
    if args.engine.separate_process:
        return AsyncEngine(ProcessLink(recipe), on_step)
    torch.set_num_threads(recipe.torch_threads)
    return AsyncEngine.in_thread(build_engine(recipe), on_step)


def replica_name() -> str:
    """`app/Deployment#id`: unique per replica, stable for its life, readable in the ledger."""
    context = serve.get_replica_context()
    return f"{context.app_name}/{context.deployment}#{context.replica_id.unique_id}"


def app_name() -> str:
    return serve.get_replica_context().app_name


def ledger_buffer(args: AppArgs, component: str) -> LedgerBuffer:
    return LedgerBuffer(ledger_actor(args.ledger_max_records, args.ledger_journal), component)


def check_engine(engine: AsyncEngine) -> None:
    """Serve's health check: fails (so Serve replaces the replica) when the engine loop is gone or
    has work waiting and has not stepped for `STALL_S`."""
    health = engine.health()
    if not health.alive:
        raise EngineUnhealthy("the engine loop is not running")
    if health.has_work and health.seconds_since_step > STALL_S:
        raise EngineUnhealthy(f"the engine has work but has not stepped for {health.seconds_since_step:.0f} s")


def stats_view(stats: EngineStats) -> dict:
    """A replica's entry in /admin/stats: its engine's counters and the rates they make."""
    return {
        **stats.__dict__,
        "prefix_cache_hit_rate": (stats.prefix_cache_hit_tokens / stats.prefix_cache_queried_tokens
                                  if stats.prefix_cache_queried_tokens else None),
        "acceptance_rate": stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else None,
        "mean_tokens_per_step": (stats.num_spec_emitted_tokens / stats.num_spec_steps
                                 if stats.num_spec_steps else None),  # of the steps that verified drafts
    }


async def post_stats_forever(engine: AsyncEngine, metrics: EngineMetrics, name: str, role: str,
                             period_s: float = 1.0) -> None:
    """Every `period_s`: this replica's engine stats to the stats board (for /admin/stats, which
    must see every replica) and to the Ray metrics gauges."""
    board = stats_board()
    while True:
        try:
            stats = await engine.stats()
            metrics.update(stats)
            board.post.remote(name, {**stats_view(stats), "role": role})
        except Exception:  # a dead engine fails the health check; this loop only reports
            log.warning("posting the engine stats failed", exc_info=True)
        await asyncio.sleep(period_s)


class EngineReplica:
    """A Serve replica around one engine of `role`, reported as `deployment` in metrics. Subclasses
    add what their role serves and call `freeze_startup_heap()` once they are up."""

    role: Role
    deployment: str

    def __init__(self, args: dict, on_step: StepSink | None = None) -> None:
        self.args = AppArgs.model_validate(args)
        self.name = replica_name()
        self.engine = start_engine(self.args, self.role, on_step)
        self.ledger = ledger_buffer(self.args, self.name)
        metrics = EngineMetrics(self.args.served_name, self.deployment, self.name)
        self._stats = asyncio.ensure_future(post_stats_forever(self.engine, metrics, self.name, self.role.value))

    async def check_health(self) -> None:
        check_engine(self.engine)

    def __del__(self) -> None:
        self.engine.shutdown()
