"""This process's node as Ray names it (`this_node`), given to what must listen on its address or tell nodes apart — a channel's
listener, a KV handoff's sender and receiver (`pegaserve.pd`) — which never ask Ray themselves."""

from __future__ import annotations

import ray

from pegaserve.net.channel import Handler, Listener
from pegaserve.net.node import NodeInfo


def node_ip() -> str:
    """The address Ray knows this node by: where peers on other nodes reach this process."""
    return ray.util.get_node_ip_address()


def this_node() -> NodeInfo:
    return NodeInfo(ray.get_runtime_context().get_node_id(), node_ip())


def node_listener(handler: Handler) -> Listener:
    """A `Listener` on this node's address."""
    return Listener(handler, node_ip())
