"""A WebSocket echo server and a WebSocket client of the tests' own, both wsproto over asyncio
streams (no third-party WebSocket stack), loopback only, every wait bounded.

    async with serving_echo() as server:             # ws://127.0.0.1:{server.port}/...
        client, answer = await WSClient.through_proxy(proxy_port, f"ws.test:{server.port}", "/chat")
        assert answer.status == 101
        await client.send(TextMessage("hi"))
        assert await client.message() == "hi"
        assert await client.close() == 1000
        assert server.handshakes == [Handshake(f"ws.test:{server.port}", "/chat")]

The server answers every handshake with 101 and echoes each complete message (text as text,
binary as binary); pings are answered by wsproto's pong. The client sends its upgrade request
in absolute form (`GET http://host:port/path`), as a client of an explicit HTTP proxy does, or
(wss) in origin form inside TLS inside a CONNECT tunnel.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

LOOPBACK = "127.0.0.1"
TIMEOUT = 5.0  # any single wait of a test
_IDLE = 10.0  # a server connection with nothing to read for this long is closed
_CHUNK = 65536


@dataclass(frozen=True)
class Handshake:
    """What the echo server saw of an opening handshake."""

    host: str  # the Host header
    target: str  # the request target


@dataclass
class EchoServer:
    """Records handshakes, counts connections and messages, and the close codes it received.
    With `discard`, message data is counted in `received` and dropped (nothing echoed)."""

    discard: bool = False
    port: int = 0
    connections: int = 0
    handshakes: list[Handshake] = field(default_factory=list)
    messages: int = 0  # complete messages received (and echoed)
    received: int = 0  # bytes of message data received
    close_codes: list[int] = field(default_factory=list)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        ws = WSConnection(ConnectionType.SERVER)
        parts: list[str | bytes] = []
        try:
            while ws.state is not ConnectionState.CLOSED:
                data = await asyncio.wait_for(reader.read(_CHUNK), _IDLE)
                ws.receive_data(data or None)
                for event in ws.events():
                    if isinstance(event, Request):
                        self.handshakes.append(Handshake(event.host, event.target))
                        writer.write(ws.send(AcceptConnection()))
                    elif isinstance(event, Message):
                        self.received += len(event.data)
                        if self.discard:
                            self.messages += event.message_finished
                            continue
                        parts.append(event.data)
                        if event.message_finished:
                            reply: Message = (
                                TextMessage("".join(parts))  # type: ignore[arg-type]
                                if isinstance(event, TextMessage)
                                else BytesMessage(b"".join(parts))  # type: ignore[arg-type]
                            )
                            parts.clear()
                            self.messages += 1
                            writer.write(ws.send(reply))
                    elif isinstance(event, Ping):
                        writer.write(ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        self.close_codes.append(event.code)
                        if ws.state is ConnectionState.REMOTE_CLOSING:
                            writer.write(ws.send(event.response()))
                if not data:
                    break
                await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def close_all(self) -> None:
        for writer in list(self._writers):
            writer.close()


@contextlib.asynccontextmanager
async def serving_echo(
    host: str = LOOPBACK, *, discard: bool = False, tls: ssl.SSLContext | None = None
) -> AsyncIterator[EchoServer]:
    """An echo server on a random port of `host`; with `tls`, wss (TLS with that context)."""
    echo = EchoServer(discard=discard)
    server = await asyncio.start_server(echo.handle, host, 0, ssl=tls)
    echo.port = server.sockets[0].getsockname()[1]
    try:
        yield echo
    finally:
        server.close()
        echo.close_all()


@dataclass(frozen=True)
class Answer:
    """The proxy's answer to an opening handshake."""

    status: int
    headers: dict[str, str]  # lowercase names
    body: bytes
    status_line: bytes  # as received


class WSClient:
    """wsproto's client side over one asyncio connection to the proxy."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._pending: deque[Event] = deque()
        self._head = bytearray()  # bytes received before the handshake's answer

    @classmethod
    async def through_proxy(
        cls, proxy_port: int, authority: str, path: str, *, host: str | None = None
    ) -> tuple[WSClient, Answer]:
        """Open an upgrade through the explicit proxy on 127.0.0.1:proxy_port: `GET
        http://{authority}{path}` with `Host: {host or authority}`."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(LOOPBACK, proxy_port), TIMEOUT
        )
        client = cls(reader, writer)
        target = f"http://{authority}{path}"
        return client, await client.handshake(Request(host=host or authority, target=target))

    @classmethod
    async def through_tunnel(
        cls, proxy_port: int, host: str, port: int, path: str, tls: ssl.SSLContext
    ) -> tuple[WSClient, Answer]:
        """wss through the proxy: `CONNECT host:port`, TLS with `tls` (server name `host`)
        inside the tunnel, then the upgrade in origin form. A refused CONNECT is the answer."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(LOOPBACK, proxy_port), TIMEOUT
        )
        authority = f"{host}:{port}"
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
        line, *lines = head.decode("latin-1").split("\r\n")
        if line.split()[1] != "200":
            writer.close()
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)
            }
            return cls(reader, writer), Answer(int(line.split()[1]), headers, b"", line.encode())
        await asyncio.wait_for(writer.start_tls(tls, server_hostname=host), TIMEOUT)
        client = cls(reader, writer)
        return client, await client.handshake(Request(host=authority, target=path))

    async def handshake(self, request: Request) -> Answer:
        await self._write(self.ws.send(request))
        event = await self.event(record_head=True)
        line = bytes(self._head).split(b"\r\n", 1)[0]
        if isinstance(event, AcceptConnection):
            headers = {k.decode().lower(): v.decode() for k, v in event.extra_headers}
            return Answer(int(line.split()[1]), headers, b"", line)
        assert isinstance(event, RejectConnection), event
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
        body = bytearray()
        while event.has_body:
            data = await self.event()
            assert isinstance(data, RejectData), data
            body += data.data
            if data.body_finished:
                break
        return Answer(event.status_code, headers, bytes(body), line)

    async def _write(self, data: bytes) -> None:
        self.writer.write(data)
        await asyncio.wait_for(self.writer.drain(), TIMEOUT)

    async def send(self, event: Event) -> None:
        await self._write(self.ws.send(event))

    async def event(self, *, record_head: bool = False) -> Event:
        """The next event; ConnectionError on EOF with nothing pending."""
        while not self._pending:
            data = await asyncio.wait_for(self.reader.read(_CHUNK), TIMEOUT)
            if record_head:
                self._head += data
            if not data:
                if self.ws.state is ConnectionState.CLOSED:
                    raise ConnectionError("closed by the peer")
                # wsproto reports an unclean close as CloseConnection(1006).
                self.ws.receive_data(None)
                self._pending.extend(self.ws.events())
                if not self._pending:
                    raise ConnectionError("closed by the peer")
                break
            self.ws.receive_data(data)
            self._pending.extend(self.ws.events())
        return self._pending.popleft()

    async def message(self) -> str | bytes:
        """The next complete message (its fragments joined); anything else is a failure."""
        parts: list[str | bytes] = []
        for _ in range(100_000):  # fragments of one message
            event = await self.event()
            assert isinstance(event, Message), event
            parts.append(event.data)
            if event.message_finished:
                break
        if isinstance(parts[0], str):
            return "".join(parts)  # type: ignore[arg-type]
        return b"".join(parts)  # type: ignore[arg-type]

    async def close(self, code: int = 1000, reason: str = "bye") -> int:
        """Close handshake: returns the code of the peer's close frame, then waits for EOF."""
        await self.send(CloseConnection(code=code, reason=reason))
        event = await self.event()
        assert isinstance(event, CloseConnection), event
        eof = await asyncio.wait_for(self.reader.read(_CHUNK), TIMEOUT)
        assert eof == b"", eof
        self.writer.close()
        return event.code

    def abort(self) -> None:
        self.writer.close()
