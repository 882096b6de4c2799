"""Direct, authenticated connections between replicas: length-prefixed frames over TCP.

Serve routes a call to *some* replica; the token stream of a request and the KV handoff's control
messages must reach one particular replica, as often as every engine step, and a Ray call per
message costs milliseconds of CPU. So a replica that must be reachable listens on its node's
address; the address and a random token travel in an ordinary Ray/Serve call (the trusted control
plane), and a connection counts only once its first frame presents that token. Frames are
pickles: the peers trust each other as Ray's own workers do.

No Ray here: where a listener listens (its node's address) is given by its caller (the Ray edge,
`pegaserve.deployments.node`, passes the address Ray knows the node by; tests pass 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("ray.serve")
_HEADER = struct.Struct("!Q")
MAX_FRAME_BYTES = 1 << 31
TOKEN_BYTES = 32


@dataclass(frozen=True)
class Address:
    """Where a replica listens, and the token a peer must present."""

    host: str
    port: int
    token: str


class Connection:
    """One side of a connection: `send` queues a frame without waiting (the stream buffers it),
    `recv` awaits the next one (None at the end)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str = "") -> None:
        self.reader = reader
        self.writer = writer
        self.peer = peer

    def send(self, message: object) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(_HEADER.pack(len(payload)) + payload)

    async def drain(self) -> None:
        await self.writer.drain()

    async def recv(self) -> object | None:
        try:
            header = await self.reader.readexactly(_HEADER.size)
            (size,) = _HEADER.unpack(header)
            if size > MAX_FRAME_BYTES:
                raise ConnectionError(f"frame of {size} bytes")
            return pickle.loads(await self.reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            return None

    @property
    def closed(self) -> bool:
        return self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


Handler = Callable[[Connection], Awaitable[None]]


class Listener:
    """A TCP server on `host` (this node's address); each authenticated connection gets its own handler."""

    def __init__(self, handler: Handler, host: str) -> None:
        self.handler = handler
        self.host = host
        self.token = secrets.token_hex(TOKEN_BYTES // 2)
        self.address: Address | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> Address:
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = Address(self.host, port, self.token)
        return self.address

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(reader, writer)
        try:
            # the hello is raw bytes: nothing is unpickled before the peer proved it holds the token
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), 10)
            if not hmac.compare_digest(token, self.token.encode()):
                log.warning("refused a connection without the right token from %s", writer.get_extra_info("peername"))
                return
            (name_len,) = struct.unpack("!H", await reader.readexactly(2))
            connection.peer = (await reader.readexactly(name_len)).decode(errors="replace")
            await self.handler(connection)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass  # the peer went away (or never spoke)
        except Exception:
            log.exception("connection from %s failed", connection.peer or writer.get_extra_info("peername"))
        finally:
            writer.close()

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.is_serving()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


async def connect(address: Address, name: str, timeout_s: float = 10.0) -> Connection:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), timeout_s)
    connection = Connection(reader, writer, f"{address.host}:{address.port}")
    raw_name = name.encode()[:65535]
    writer.write(address.token.encode() + struct.pack("!H", len(raw_name)) + raw_name)
    return connection
