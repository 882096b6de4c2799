"""`csrc/gloo_pair.cpp`, the gloo pair's handoff with no Python between a fetch and its bytes.

Built with torch's extension builder (it calls into torch.distributed's C++ `Backend`), ~20 s: ahead
of time by `python -m pegaserve.pd.transports.native` (`make model` runs it), else in the background as a
replica starts; kept per torch version under `~/.cache/pegaserve/torch_extensions/`. Where it cannot
be built (no compiler, no ninja), `module()` answers None, logged once, and the pairs run the same
protocol in Python (`PEGASERVE_NATIVE_HANDOFF=0` chooses that too).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gloo_pair.cpp"
DISABLE_ENV = "PEGASERVE_NATIVE_HANDOFF"  # "0": the Python protocol
_building = threading.Lock()  # one build per process (torch's own lock keeps processes apart)


def module() -> ModuleType | None:
    """The built extension, or None (the Python protocol runs). Blocks while it builds."""
    with _building:
        return _module()


def warm_up() -> None:
    """Build it in the background now (a replica's start), not in its first pair's rendezvous."""
    threading.Thread(target=module, name="pegaserve-native-handoff-build", daemon=True).start()


@functools.cache
def _module() -> ModuleType | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        import torch  # noqa: PLC0415
        from torch.utils import cpp_extension  # noqa: PLC0415 - its import pulls in setuptools

        build_dir = Path.home() / ".cache" / "pegaserve" / "torch_extensions" / f"gloo_pair-torch-{torch.__version__}"
        build_dir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load("pegaserve_gloo_pair", [str(SOURCE)], extra_cflags=["-O2"],
                                  build_directory=str(build_dir), verbose=False)
    except Exception as error:  # any failure to build or load leaves the Python protocol, which is whole
        log.warning("the native gloo handoff did not build (%s: %s); using the Python one",
                    type(error).__name__, str(error)[-500:])
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if module() is not None else 1)
