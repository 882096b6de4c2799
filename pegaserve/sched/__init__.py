"""Scheduling: continuous batching with chunked prefill, its messages to the runner, speculation."""
