"""Attention backends by name: each name maps to its class as a `"module:Class"` string, imported
only when chosen (`triton` needs triton, which a CPU install may lack).

Adding a backend: a module with an `AttentionBackend` subclass, and one line in `ATTENTION_BACKENDS`
(or, from outside the package, `register_backend`). `auto` is not a backend but a choice among
them, made where the engine is built.
"""

from __future__ import annotations

import pkgutil

import torch

from pegaserve.attention.backend import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "sdpa": "pegaserve.attention.backend:SdpaBackend",
    "triton": "pegaserve.attention.triton:TritonBackend",
}
AUTO = "auto"  # `triton` on CUDA where it imports, else `sdpa`


class UnknownAttentionBackend(ValueError):
    """No backend is registered under this name; the message names it and the known ones."""


def register_backend(name: str, target: str) -> None:
    """Register `target` (`"package.module:Class"`, an `AttentionBackend` subclass) as `name`; the
    module is imported when the backend is first chosen."""
    if name == AUTO:
        raise ValueError(f"{AUTO!r} names the automatic choice, not a backend")
    if target.count(":") != 1:
        raise ValueError(f"attention backend {name!r}: target {target!r} is not 'package.module:Class'")
    ATTENTION_BACKENDS[name] = target


def backend_names() -> tuple[str, ...]:
    """Every name `make_backend` takes: `auto`, then the registered backends."""
    return (AUTO, *ATTENTION_BACKENDS)


def check_backend_name(name: str) -> str:
    """`name` if `make_backend` takes it; else `UnknownAttentionBackend` (for config edges)."""
    if name not in backend_names():
        raise UnknownAttentionBackend(
            f"unknown attention backend {name!r}: expected one of {', '.join(backend_names())}"
        )
    return name


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered as `name`, its module imported now (ImportError if it cannot be)."""
    check_backend_name(name)
    if name == AUTO:
        raise UnknownAttentionBackend(f"{AUTO!r} is a choice among backends, not one: use make_backend")
    return pkgutil.resolve_name(ATTENTION_BACKENDS[name])


def make_backend(name: str) -> AttentionBackend:
    """A fresh backend: the one registered as `name`, or for `auto` `triton` on CUDA where it
    imports, else `sdpa`."""
    if name != AUTO:
        return backend_class(name)()
    if torch.cuda.is_available():
        try:
            return backend_class("triton")()
        except ImportError:
            pass  # no (working) triton: the torch path
    return backend_class("sdpa")()
