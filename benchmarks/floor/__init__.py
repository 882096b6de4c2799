"""`make bench-floor`: what one streamed token costs the HTTP path alone, with no engine behind it.

A stand-in server (`app.py`: FastAPI, an OpenAI-shaped SSE chunk per token, one timer per "engine
step" for every running stream, as the ingress gets one frame per step) runs under plain uvicorn and
as a Ray Serve deployment the way `make serve` runs its ingress (HAProxy in front, Serve's
throughput mode); pegaserve P/D and colocated run beside it, under the same client and load. The CPU
per streamed token of each serving process is the floor under pegaserve's serving-path figure in
docs/bench/PEERS.md: what the HTTP stack spends before any engine, transport or Serve call does.
"""
