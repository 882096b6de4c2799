"""The KV handoff benchmark (`make bench-kv`): `python -m benchmarks.kv --help`."""
