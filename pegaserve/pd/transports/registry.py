"""The KV transports by name: a config names one (`transport:`), both replica sides make theirs from
this registry, and nothing else compares the name. The CPU transports are built in; others
register themselves where what they need lives (the Ray-backed ones from deployments/transports/,
a test's own from the test).
"""

from __future__ import annotations

from pegaserve.net.node import NodeInfo
from pegaserve.pd.transports.base import KvTransport
from pegaserve.pd.transports.gloo import GlooTransport
from pegaserve.pd.transports.shm import ShmTransport

DEFAULT_TRANSPORT = ShmTransport.name
_TRANSPORTS: dict[str, type[KvTransport]] = {ShmTransport.name: ShmTransport, GlooTransport.name: GlooTransport}


class UnknownTransport(ValueError):
    """No transport is registered under this name; the message names it and the known ones."""


def register_transport(transport: type[KvTransport]) -> type[KvTransport]:
    """Make `transport` available under its `name` (again: a no-op). A class decorator too."""
    known = _TRANSPORTS.get(transport.name)
    if known is not None and known is not transport:
        raise ValueError(f"transport {transport.name!r} is {known.__qualname__} already")
    _TRANSPORTS[transport.name] = transport
    return transport


def unregister_transport(name: str) -> None:
    _TRANSPORTS.pop(name, None)


def transport_names() -> tuple[str, ...]:
    return tuple(_TRANSPORTS)


def check_transport_name(name: str) -> str:
    """`name` if a transport is registered under it; else `UnknownTransport` (for config edges)."""
    if name not in _TRANSPORTS:
        raise UnknownTransport(f"unknown transport {name!r}: expected one of {', '.join(_TRANSPORTS)}")
    return name


def transport_class(name: str) -> type[KvTransport]:
    return _TRANSPORTS[check_transport_name(name)]


def make_transport(name: str, node: NodeInfo) -> KvTransport:
    """A replica side's transport `name`, on `node`."""
    return transport_class(name)(node)


def describe_transports() -> str:
    """The choices, each with its summary, for a config's description."""
    return _choices(f"{n} ({t.summary})" if t.summary else n for n, t in _TRANSPORTS.items())


def _choices(words) -> str:
    words = list(words)
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else "".join(words)
