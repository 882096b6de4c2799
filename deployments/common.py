"""What every replica needs: its engine, its name, the ledger actor."""

from __future__ import annotations

import asyncio
import logging

import torch
from ray import serve

from deployments.config import AppArgs
from deployments.ledger import get_or_create_ledger
from deployments.metrics import EngineMetrics
from pegaserve.default_model import ensure_model_dir
from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.engine.build import load_engine, scripted_engine
from pegaserve.engine.engine import EngineConfig, Role

log = logging.getLogger("ray.serve")


def engine_config(args: AppArgs, role: Role) -> EngineConfig:
    e = args.engine
    return EngineConfig(
        role=role,
        block_size=e.block_size,
        num_blocks=e.num_blocks,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len,
        max_queued_requests=e.max_queued_requests,
    )


def build_engine(args: AppArgs, role: Role) -> AsyncEngine:
    if args.engine.torch_threads is not None:
        torch.set_num_threads(args.engine.torch_threads)
    model_dir = ensure_model_dir(args.model)
    config = engine_config(args, role)
    script = args.parsed_script()
    if script is not None:
        return AsyncEngine(scripted_engine(model_dir, script, config))
    return AsyncEngine(load_engine(model_dir, config, args.engine.attention_backend, args.engine.device))


def replica_name() -> str:
    """`app/Deployment#id`: unique per replica, stable for its life, readable in the ledger."""
    context = serve.get_replica_context()
    return f"{context.app_name}/{context.deployment}#{context.replica_id.unique_id}"


def app_name() -> str:
    return serve.get_replica_context().app_name


async def report_stats_forever(engine: AsyncEngine, ledger, metrics: EngineMetrics, name: str, role: str,
                               extra=dict, period_s: float = 1.0) -> None:
    """Every `period_s`: this replica's engine stats to the ledger actor (for /admin/stats, which
    must see every replica) and to the Ray metrics gauges."""
    while True:
        stats = await engine.call(lambda e: e.stats())
        metrics.update(stats)
        ledger.report_stats.remote(name, {**stats.__dict__, "role": role, **extra()})
        await asyncio.sleep(period_s)


def ledger_actor(args: AppArgs):
    """The cluster's one ledger actor, created by whichever replica asks first."""
    return get_or_create_ledger(args.ledger_max_records, args.ledger_journal)
