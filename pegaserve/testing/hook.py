"""The one hook through which test doubles reach a serving process.

A Serve replica (or an engine process) whose environment carries `PEGASERVE_TEST_DOUBLES` — a JSON
object — swaps in the doubles it names; production never sets it, and then `active_doubles()` is
None and nothing here is used. Tests set it per deployment with Serve's own
`ray_actor_options={"runtime_env": {"env_vars": as_env(...)}}`.

    {"script": {"151644,40000,198": [64, 293, 151645]},   # prompt ids -> scripted tokens
     "delay_kv_send_s": 4.0}                               # prefill waits before each KV send
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

ENV = "PEGASERVE_TEST_DOUBLES"


@dataclass(frozen=True)
class Doubles:
    script: dict[tuple[int, ...], tuple[int, ...]] | None = None  # None: the real weights
    delay_kv_send_s: float = 0.0


def active_doubles() -> Doubles | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    settings = json.loads(raw)
    script = settings.get("script")
    return Doubles(
        script=None if script is None else {tuple(int(t) for t in k.split(",")): tuple(v) for k, v in script.items()},
        delay_kv_send_s=float(settings.get("delay_kv_send_s", 0.0)),
    )


def as_env(script: dict[tuple[int, ...], tuple[int, ...]] | None = None, delay_kv_send_s: float = 0.0) -> dict[str, str]:
    """The environment variable a test gives a deployment to select these doubles."""
    settings: dict = {"delay_kv_send_s": delay_kv_send_s}
    if script is not None:
        settings["script"] = {",".join(map(str, k)): list(v) for k, v in script.items()}
    return {ENV: json.dumps(settings)}
