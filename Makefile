# Two commands on a fresh machine: `make serve` and `make test`. Everything installs into .venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch 2.13.0 lies on the dev/CI machines' disk; on a GPU box set TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/cluster.yaml

.PHONY: install model serve serve-colocated test test-fast bench-engine bench loadtest soak gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	touch $@

model: install
	$(PY) -m pegaserve.default_model

serve: model
	$(VENV)/bin/serve run $(CONFIG)

serve-colocated: model
	$(PY) -m pegaserve.api.server --model qwen3-tiny

test: model
	$(PY) -m pytest -q

bench-engine: model
	$(PY) -m pegaserve.bench_engine

clean:
	rm -rf $(VENV) models .pytest_cache
