"""The engine: paged KV, continuous batching, the Qwen3 model, sampling and token-level stops."""
