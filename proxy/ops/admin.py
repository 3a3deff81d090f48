"""The admin listener: `/healthz`, `/readyz`, `/metrics` and `/denials` over a small HTTP/1.1
server of our own.

Why not a web framework or mitmproxy: the admin port must answer on the proxy's own event loop
(a blocked loop should fail `/healthz`), must not pull mitmproxy into a fast-path-only process,
and serves four fixed GET endpoints, so a few hundred lines with strict limits are simpler to
trust than a dependency.

Behaviour, hardened for clients that are slow, large or malformed:
- one request per connection: every response carries `Connection: close`, `Content-Length` and
  `Cache-Control: no-store`, then the server half-closes and drains what the client still sends
  (bounded), so the client reads the response instead of a reset;
- request line + headers at most MAX_HEAD_BYTES and MAX_HEADERS lines, else 431;
- the head must arrive within `header_timeout` (else 408, best effort, and close) and the whole
  connection must be over within `connection_timeout` (else it is dropped);
- at most `max_connections` connections at once: beyond it a new connection is closed at once,
  before anything is read, so a flood costs a socket accept and nothing more;
- a malformed request line or header → 400; an HTTP version other than 1.x → 505;
- a request that announces a body (`Content-Length` other than 0, or any `Transfer-Encoding`)
  → 413: no admin endpoint takes a body, and never reading one means a client cannot make the
  server parse or buffer it;
- GET and HEAD on the four paths; another path → 404; another method on them → 405 with
  `Allow: GET, HEAD`. A query string is ignored, except on `/denials`, whose only parameter is
  `since` (below); absolute-form targets (`http://h/healthz`) are accepted as RFC 9112 asks.
  `Host` is not required: nothing here depends on it.

`/denials?since=SEQ` answers the recent denials as JSON (proxy/ops/denials.py). `since` is
optional (default 0) and, if given, is given once, as 1 to 20 decimal digits worth at most
2**63; anything else in the query → 400 with a JSON error, so a harness with a bug hears of it
rather than silently reading from the start. Without a `Denials` ring the path is 404.

"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.errors import ProxyError
from proxy.netaddr import format_listen
from proxy.ops.denials import MAX_SINCE, Denials
from proxy.ops.readiness import Readiness

__all__ = ["AdminServer"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
MAX_HEADERS = 100
# After the response, how long and how much we keep reading (and discarding) so the client sees
# the response rather than a TCP reset caused by its unread bytes (RFC 9112 9.6 "lingering").
LINGER_SECONDS = 1.0
LINGER_BYTES = 64 * 1024
# How long stop() waits for connection handlers to finish after aborting their sockets.
STOP_GRACE_SECONDS = 1.0

MetricsFn = Callable[[], tuple[bytes, str]]


# --------------------------------------------------------------------------------------------
# HTTP


_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
# Field values: visible ASCII, space, tab and obs-text; never NUL, CR or other controls.
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_ABSOLUTE = re.compile(rb"https?://[^/?#]*", re.IGNORECASE)
_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/denials"})
# `since=` and at most 20 digits (2**63 has 19; a leading zero or so is still a decimal integer).
_SINCE = re.compile(r"since=([0-9]{1,20})")
_JSON = "application/json"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_TEXT = "text/plain; charset=utf-8"
_CONTENT_TYPE = re.compile(r"[\x20-\x7e]{1,200}")


@dataclass(slots=True)
class _Response:
    status: int
    body: bytes
    content_type: str = _TEXT
    extra: list[tuple[str, str]] = field(default_factory=list)
    head_only: bool = False

    def encode(self) -> bytes:
        lines = [
            f"HTTP/1.1 {self.status} {_REASONS[self.status]}",
            f"Content-Type: {self.content_type}",
            f"Content-Length: {len(self.body)}",
            "Cache-Control: no-store",
            "Connection: close",
            *(f"{name}: {value}" for name, value in self.extra),
        ]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
        return head if self.head_only else head + self.body


def _error(status: int, text: str) -> _Response:
    # Error bodies are fixed texts: nothing the client sent is echoed back.
    return _Response(status, f"{text}\n".encode())


def _json_error(status: int, text: str) -> _Response:
    # For /denials, whose clients parse JSON: the same fixed texts, nothing of the request.
    body = json.dumps({"error": text}, ensure_ascii=True).encode("ascii") + b"\n"
    return _Response(status, body, content_type=_JSON)


class _HeadTooLarge(Exception):
    pass


class _Incomplete(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """The request line and headers, without the blank line; None when the client closed before
    sending anything. Reads no further than MAX_HEAD_BYTES, so body bytes stay unread."""
    buf = bytearray()
    start = 0  # where the request line begins, once known
    scanned = 0  # everything before this has been searched for the blank line already
    while True:
        chunk = await reader.read(MAX_HEAD_BYTES - len(buf))
        if not chunk:
            if buf.strip(b"\r\n"):
                raise _Incomplete
            return None
        buf += chunk
        if start == scanned:
            # RFC 9112 2.2: ignore empty lines before the request line.
            while start < len(buf) and buf[start] in b"\r\n":
                start += 1
            scanned = start
        # Search only the new bytes (and the 2 before them, for a terminator split across
        # reads): a client sending one byte at a time must not cost a rescan of the whole head.
        since = max(start, scanned - 2)
        ends = [i for i in (buf.find(b"\n\r\n", since), buf.find(b"\n\n", since)) if i >= 0]
        if ends:
            return bytes(buf[start : min(ends) + 1])
        scanned = len(buf)
        if len(buf) >= MAX_HEAD_BYTES:
            raise _HeadTooLarge


class AdminServer:
    """Serves `/healthz`, `/readyz`, `/metrics` and `/denials` on the running event loop (see
    module doc).

    `metrics` returns (body, content type), e.g. prometheus_client's `generate_latest(registry)`
    with `CONTENT_TYPE_LATEST`; it is called on the loop for every GET or HEAD of `/metrics`, and
    if it raises the answer is 500 with a one-line body (the exception goes to the log).
    `denials` is the ring `/denials` reads (the one the audit log feeds); None: 404 there."""

    def __init__(
        self,
        readiness: Readiness,
        metrics: MetricsFn,
        *,
        denials: Denials | None = None,
        header_timeout: float = 5.0,
        max_connections: int = 64,
        connection_timeout: float = 10.0,
    ) -> None:
        if header_timeout <= 0 or connection_timeout <= 0:
            raise ValueError("admin timeouts must be positive")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._readiness = readiness
        self._metrics = metrics
        self._denials = denials
        self._header_timeout = header_timeout
        self._connection_timeout = connection_timeout
        self._max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._live: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._stopping = False

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound (host, port), once started."""
        return self._address

    @property
    def active_connections(self) -> int:
        return len(self._live)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (an IP literal; port 0 = ephemeral) and return the bound address.
        A bind failure → ProxyError('admin_bind') naming host:port and the OS error."""
        if self._server is not None or self._stopping:
            raise RuntimeError("AdminServer.start called twice")
        where = format_listen(host, port)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ProxyError(
                "invalid_listen", f"admin listen host {host!r} is not an IP address"
            ) from None
        try:
            self._server = await asyncio.start_server(
                self._handle,
                host,
                port,
                # AI_NUMERICHOST: even by mistake, never a name lookup through the OS.
                flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST,
            )
        except (OSError, socket.gaierror) as exc:
            why = exc.strerror or str(exc)
            raise ProxyError(
                "admin_bind", f"cannot listen on {where} for the admin endpoints: {why}"
            ) from None
        bound = self._server.sockets[0].getsockname()
        self._address = (str(bound[0]), int(bound[1]))
        return self._address

    async def stop(self) -> None:
        """Stop listening and drop every live admin connection; returns promptly."""
        self._stopping = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._live)
        for task, writer in list(self._live.items()):
            # abort, not close: close would wait to flush to a client that may never read.
            writer.transport.abort()
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_GRACE_SECONDS)
        if server is not None:
            # On 3.12+ wait_closed also waits for the connections; they are aborted already.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_GRACE_SECONDS):
                    await server.wait_closed()

    # ---- per connection

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._stopping or len(self._live) >= self._max_connections:
            # Over the cap: close before reading anything, so a flood costs nothing more.
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._live[task] = writer
        # High-water mark 0: drain() returns only once everything is handed to the kernel, so
        # no response bytes stay queued in the transport after the handler ends.
        writer.transport.set_write_buffer_limits(high=0)
        try:
            async with asyncio.timeout(self._connection_timeout):
                await self._serve(reader, writer)
        except (TimeoutError, ConnectionError, OSError):
            pass  # the overall limit, or the client went away: nothing left to tell it
        except Exception:
            logger.exception("admin connection failed")
        finally:
            self._live.pop(task, None)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()
            else:
                writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self._header_timeout):
                head = await _read_head(reader)
        except TimeoutError:
            # Best effort: the client may be too slow to read it too; no lingering for it.
            writer.write(_error(408, "request timeout").encode())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LINGER_SECONDS):
                    await writer.drain()
            return
        except _HeadTooLarge:
            response = _error(431, "request header fields too large")
        except _Incomplete:
            response = _error(400, "bad request: incomplete request head")
        else:
            if head is None:
                return
            response = self._respond(head)
        writer.write(response.encode())
        await writer.drain()
        await self._linger(reader, writer)

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Half-close, then read and discard what the client still sends (a body, the rest of an
        # oversized head) until it closes: closing with unread bytes would make the kernel send
        # a reset that can destroy the response before the client reads it. Bounded in time and
        # bytes.
        if writer.can_write_eof():
            writer.write_eof()
        discarded = 0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_SECONDS):
                while discarded < LINGER_BYTES:
                    chunk = await reader.read(LINGER_BYTES)
                    if not chunk:
                        break
                    discarded += len(chunk)

    # ---- request → response

    def _respond(self, head: bytes) -> _Response:
        lines = [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")]
        if lines and lines[-1] == b"":
            lines.pop()
        if not lines:
            return _error(400, "bad request: empty request")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
            return _error(400, "bad request: malformed request line")
        method, target, version = parts
        match = _VERSION.fullmatch(version)
        if match is None:
            return _error(400, "bad request: malformed request line")
        if match.group(1) != b"1":
            return _error(505, "only HTTP/1.x is served here")
        fields = lines[1:]
        if len(fields) > MAX_HEADERS:
            return _error(431, "too many header fields")
        body_announced = False
        for line in fields:
            name, colon, value = line.partition(b":")
            # No whitespace before the colon, no obs-fold continuation lines (RFC 9112 5).
            if not colon or not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
                return _error(400, "bad request: malformed header field")
            lname = name.lower()
            value = value.strip(b" \t")
            if lname == b"content-length":
                if not all(re.fullmatch(rb"[0-9]+", v.strip(b" \t")) for v in value.split(b",")):
                    return _error(400, "bad request: invalid Content-Length")
                if any(int(v) != 0 for v in value.split(b",")):
                    body_announced = True
            elif lname == b"transfer-encoding":
                body_announced = True
        if body_announced:
            return _error(413, "admin requests take no body")
        path, query = self._path(target)
        if path not in _PATHS or (path == "/denials" and self._denials is None):
            return _error(404, "not found")
        if method not in (b"GET", b"HEAD"):
            response = _error(405, "method not allowed")
            response.extra.append(("Allow", "GET, HEAD"))
            return response
        response = self._endpoint(path, query)
        response.head_only = method == b"HEAD"
        return response

    @staticmethod
    def _path(target: bytes) -> tuple[str, str | None]:
        """The path and the query (None without a `?`) of a request target."""
        absolute = _ABSOLUTE.match(target)
        if absolute is not None:
            target = target[absolute.end() :] or b"/"
        path, question, query = target.decode("ascii").partition("?")
        return path, query if question else None

    def _denials_response(self, query: str | None) -> _Response:
        assert self._denials is not None
        since = 0
        if query:  # no query, or an empty one (`/denials?`): everything in the ring
            match = _SINCE.fullmatch(query)
            if match is None:
                return _json_error(400, "bad request: the only parameter is since=SEQ")
            since = int(match.group(1))
            if since > MAX_SINCE:
                return _json_error(400, "bad request: since must be at most 2**63")
        return _Response(200, self._denials.render(since), content_type=_JSON)

    def _endpoint(self, path: str, query: str | None) -> _Response:
        if path == "/healthz":
            # Answering at all shows the process is alive and its event loop is turning.
            return _Response(200, b"ok\n")
        if path == "/readyz":
            ok, unmet = self._readiness.ready()
            lines = (["ready"] if ok else unmet) + self._readiness.notes()
            return _Response(200 if ok else 503, ("\n".join(lines) + "\n").encode())
        if path == "/denials":
            return self._denials_response(query)
        return self._metrics_response()

    def _metrics_response(self) -> _Response:
        try:
            body, content_type = self._metrics()
            if not isinstance(body, bytes | bytearray | memoryview):
                raise TypeError(f"metrics body must be bytes, not {type(body).__name__}")
            body = bytes(body)
            if not isinstance(content_type, str) or not _CONTENT_TYPE.fullmatch(content_type):
                raise TypeError(f"bad metrics content type {content_type!r:.100}")
        except Exception:
            # The client gets one line; the traceback goes to the operator's log only.
            logger.exception("metrics callable failed")
            return _error(500, "metrics unavailable")
        return _Response(200, body, content_type=content_type)
