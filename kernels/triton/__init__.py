"""pegaserve's Triton kernels, importable as `pegaserve.kernels` (never as `kernels`, a PyPI name).

Each kernel module holds a trio: the `@triton.jit` kernel, a launcher that checks its inputs and
raises `ValueError` naming the bad argument, and a pure-torch `*_reference` that is its spec.

- `store_kv`: new tokens' K/V into the paged cache by slot mapping.
- `decode_attention`: one query per request over its paged context (GQA, split-K).
- `prefill_attention`: causal varlen attention over the paged context (continues a cached prefix).
- `block_copy`: gather a request's blocks into one packed buffer, scatter one into other blocks
  (the handoff's pack and unpack on CUDA: `pegaserve.runner.model_runner.pack_blocks`).
- `norm_rope`: fused residual add + RMSNorm, and Qwen3's per-head q/k RMSNorm + RoPE (the
  `triton` attention backend's `qk_norm_rope`, pegaserve/attention/triton.py).

Support: `testing` (interpreter set-up, random paged batches), `compile_check` (compile every
kernel for sm_90 without a GPU). Microbenchmarks: benchmarks/kernels.py; on a GPU, `make gpu-check`.

This package imports nothing at import time: triton decides between compiling and interpreting
(`TRITON_INTERPRET=1`) when a kernel module is first imported, so callers set that up first.
"""
