"""pegaserve's benchmarks, one home for all of them (run from the repository root).

| make target | module | what |
|---|---|---|
| `make bench-engine` | `benchmarks.engine` | the engine alone against transformers `generate` |
| `make bench` | `benchmarks.serve` | P/D and colocated over HTTP against transformers offline |
| `make bench-kv` | `benchmarks.kv` | KV handoff per transport against the raw transport |
| `make bench-peers` | `benchmarks.peers` | pegaserve beside vLLM's CPU build, one client for all |
| `make gpu-check` | `benchmarks.gpu` | kernel tests, kernel microbenchmarks, engine throughput on a GPU |

Shared pieces: `cpu` (CPU accounting, waiting for a quiet machine), `local_serve` (pegaserve on an
in-process Ray cluster), `reports` (machine description, hand-written notes kept across rewrites),
`kernels` (kernel microbenchmarks). Stepping an engine until it is idle is
`pegaserve.engine.offline.run_until_idle`; random Qwen3 checkpoints of any shape come from
`pegaserve.models.tiny.write_random_checkpoint`.
"""
