"""pegaserve beside vLLM's CPU build (`make bench-peers`): `python -m benchmarks.peers --help`.

Modules here run in two virtualenvs: `run`, `servers`, `client` and `report` in the project's, and
`vllm_cli` and `ray_llm_app` in .venv-peers (as files, with `python -P`; they import nothing from here).
"""
