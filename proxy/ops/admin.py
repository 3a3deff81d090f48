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
- at most `max_connections` connections at once. A new connection over the cap sheds the
  oldest one that has not sent a whole head yet (or is only lingering after its answer), so
  clients that connect and stay silent, or trickle a head, can never keep a probe out: a
  kubelet's `/readyz` sends its head at once and is answered. Only when every connection is
  being answered (streams, a body being read) is the new one closed at once, before anything
  is read;
- a malformed request line or header → 400; an HTTP version other than 1.x → 505;
- a request that announces a body (`Content-Length` other than 0, or any `Transfer-Encoding`)
  → 413, but for `POST /asks/ID` (below): never reading one means a client cannot make the
  server parse or buffer it;
- GET and HEAD on the read-only paths, POST on `/asks/ID`; another path → 404; another method
  → 405 with `Allow`. A query string is ignored, except on `/denials`, whose only parameter is
  `since` (below); absolute-form targets (`http://h/healthz`) are accepted as RFC 9112 asks.
  `Host` is not required: nothing here depends on it.

Asking a person (`run --ask`, proxy/decide/asks.py), with an `Asks` given:
- `GET /asks`: `{"asks": [...]}`, the pending asks, oldest first; `GET /grants`:
  `{"grants": [...]}`, the session's grants. Both open, like `/denials`.
- `GET /asks/stream`: server-sent events, one `data: {ask}` line (and a blank line) per new
  ask, the pending ones first; a `: keep-alive` comment every KEEPALIVE_SECONDS. Exempt from the
  connection time limit, at most MAX_STREAMS at once (503 beyond).
- `POST /asks/ID` with `Authorization: Bearer TOKEN` and the JSON body `{"decision":
  "allow-once" | "allow-session" | "deny" | "deny-session"}` (Content-Length, at most MAX_BODY
  bytes): 200 with what the answer did; 401 without the token (compared in constant time,
  checked first: nobody without it learns which ids are pending); 404 for an id that is not
  pending; 400 for any other body. The only endpoint that takes a body.
Without an `Asks` these paths are 404.

`/denials?since=SEQ` answers the recent denials as JSON (proxy/ops/denials.py). `since` is
optional (default 0) and, if given, is given once, as 1 to 20 decimal digits worth at most
2**63; anything else in the query → 400 with a JSON error, so a harness with a bug hears of it
rather than silently reading from the start. Without a `Denials` ring the path is 404.

"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from policy.asking import ANSWERS
from proxy.common.errors import ProxyError
from proxy.common.listeners import format_listen
from proxy.common.refusals import STATUS_PHRASES
from proxy.decide.asks import Asks
from proxy.ops.denials import MAX_SINCE, Denials
from proxy.ops.readiness import Readiness

__all__ = ["AdminServer"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192
# Admin connections at once, by default: probes and scrapes are few and short.
MAX_CONNECTIONS = 64
MAX_HEADERS = 100
# After the response, how long and how much we keep reading (and discarding) so the client sees
# the response rather than a TCP reset caused by its unread bytes (RFC 9112 9.6 "lingering").
LINGER_SECONDS = 1.0
LINGER_BYTES = 64 * 1024
# How long stop() waits for connection handlers to finish after aborting their sockets.
STOP_GRACE_SECONDS = 1.0

MetricsFn = Callable[[], tuple[bytes, str]]

# Asking a person: the answer's body is one small JSON object; at most this many streams.
MAX_BODY = 1024
MAX_STREAMS = 8
KEEPALIVE_SECONDS = 15.0


# --------------------------------------------------------------------------------------------
# HTTP


_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(rb"HTTP/([0-9])\.([0-9])")
# Field values: visible ASCII, space, tab and obs-text; never NUL, CR or other controls.
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_ABSOLUTE = re.compile(rb"https?://[^/?#]*", re.IGNORECASE)
_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/denials"})
_ASK_PATHS = frozenset({"/asks", "/asks/stream", "/grants"})
_ASK = re.compile(r"/asks/([0-9a-f]{16})")
_ASK_PREFIX = "/asks/"
# `since=` and at most 20 digits (2**63 has 19; a leading zero or so is still a decimal integer).
_SINCE = re.compile(r"since=([0-9]{1,20})")
_JSON = "application/json"
_TEXT = "text/plain; charset=utf-8"
_CONTENT_TYPE = re.compile(r"[\x20-\x7e]{1,200}")


@dataclass(slots=True)
class _Response:
    status: int
    body: bytes
    content_type: str = _TEXT
    extra: list[tuple[str, str]] = field(default_factory=list)
    head_only: bool = False

    def encode(self, *, length: bool = True) -> bytes:
        """The response; without `length`, a head for a body that lasts until the close."""
        lines = [
            f"HTTP/1.1 {self.status} {STATUS_PHRASES[self.status]}",
            f"Content-Type: {self.content_type}",
            *([f"Content-Length: {len(self.body)}"] if length else []),
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


@dataclass(frozen=True, slots=True)
class _Request:
    """A request head that parsed: what the endpoints need of it."""

    method: bytes
    path: str
    query: str | None
    authorization: bytes | None
    length: int | None  # Content-Length, when given once (None: not given)
    chunked: bool  # any Transfer-Encoding


_EVENT_STREAM = "text/event-stream"


def _json(status: int, value: object) -> _Response:
    body = json.dumps(value, ensure_ascii=True).encode("ascii") + b"\n"
    return _Response(status, body, content_type=_JSON)


def _event(ask: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(ask, ensure_ascii=True).encode("ascii") + b"\n\n"


def _decision(body: bytes) -> str | None:
    """The answer of a `POST /asks/ID` body, or None for any other body."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or set(value) != {"decision"}:
        return None
    decision = value["decision"]
    return decision if isinstance(decision, str) and decision in ANSWERS else None


@dataclass(slots=True)
class _Live:
    """One admin connection. `sheddable` while shedding it loses nothing a client is owed: no
    whole head has come yet, or the answer is sent and only the lingering read is left."""

    writer: asyncio.StreamWriter
    sheddable: bool = True


class _HeadTooLarge(Exception):
    pass


class _Incomplete(Exception):
    pass


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The request line and headers, without the blank line, and what was read past them (the
    start of a body); None when the client closed before sending anything. Reads no further
    than MAX_HEAD_BYTES."""
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
            end = min(ends)
            blank = 3 if buf.startswith(b"\n\r\n", end) else 2
            return bytes(buf[start : end + 1]), bytes(buf[end + blank :])
        scanned = len(buf)
        if len(buf) >= MAX_HEAD_BYTES:
            raise _HeadTooLarge


class AdminServer:
    """Serves `/healthz`, `/readyz`, `/metrics` and `/denials` on the running event loop (see
    module doc).

    `metrics` returns (body, content type), e.g. prometheus_client's `generate_latest(registry)`
    with `CONTENT_TYPE_LATEST`; it is called on the loop for every GET or HEAD of `/metrics`, and
    if it raises the answer is 500 with a one-line body (the exception goes to the log).
    `denials` is the ring `/denials` reads (the one the audit log feeds); None: 404 there.
    `asks` and `token`: asking a person (the endpoints under `/asks`, `/grants`)."""

    def __init__(
        self,
        readiness: Readiness,
        metrics: MetricsFn,
        *,
        denials: Denials | None = None,
        asks: Asks | None = None,
        token: str | None = None,
        header_timeout: float = 5.0,
        max_connections: int = MAX_CONNECTIONS,
        connection_timeout: float = 10.0,
    ) -> None:
        if header_timeout <= 0 or connection_timeout <= 0:
            raise ValueError("admin timeouts must be positive")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._readiness = readiness
        self._metrics = metrics
        self._denials = denials
        self._asks = asks
        # Without a token nobody can answer: `POST /asks/ID` is 401 to everyone.
        self._token = token.encode() if token else None
        self._streams = 0
        self._header_timeout = header_timeout
        self._connection_timeout = connection_timeout
        self._max_connections = max_connections
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        # Oldest first (dicts keep insertion order): the order in which connections are shed.
        self._live: dict[asyncio.Task[Any], _Live] = {}
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
        for task, live in list(self._live.items()):
            # abort, not close: close would wait to flush to a client that may never read.
            live.writer.transport.abort()
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_GRACE_SECONDS)
        if server is not None:
            # On 3.12+ wait_closed also waits for the connections; they are aborted already.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_GRACE_SECONDS):
                    await server.wait_closed()

    # ---- per connection

    def _shed_oldest(self) -> bool:
        """Drop the oldest connection that is owed nothing; False when every one is."""
        oldest = next((task for task, live in self._live.items() if live.sheddable), None)
        if oldest is None:
            return False
        self._live.pop(oldest).writer.transport.abort()
        oldest.cancel()
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Refusing the newest at the cap would let a few hundred silent sockets keep every probe
        # out (a kubelet would restart a healthy proxy); the oldest idle one goes instead.
        if self._stopping or (len(self._live) >= self._max_connections and not self._shed_oldest()):
            # Every slot is being answered: close before reading anything.
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        live = self._live[task] = _Live(writer)
        # High-water mark 0: drain() returns only once everything is handed to the kernel, so
        # no response bytes stay queued in the transport after the handler ends.
        writer.transport.set_write_buffer_limits(high=0)
        try:
            async with asyncio.timeout(self._connection_timeout) as limit:
                await self._serve(reader, live, limit)
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

    async def _serve(
        self, reader: asyncio.StreamReader, live: _Live, limit: asyncio.Timeout
    ) -> None:
        writer = live.writer
        try:
            async with asyncio.timeout(self._header_timeout):
                read = await _read_head(reader)
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
            if read is None:
                return
            live.sheddable = False
            head, early = read
            parsed = self._parse(head)
            if isinstance(parsed, _Response):
                response = parsed
            elif parsed.path == "/asks/stream" and parsed.method == b"GET":
                limit.reschedule(None)  # a stream lasts as long as its client wants
                await self._stream(reader, writer)
                return
            elif parsed.method == b"POST":
                response = await self._answer(reader, parsed, early)
            else:
                response = self._endpoint(parsed.path, parsed.query)
                response.head_only = parsed.method == b"HEAD"
        writer.write(response.encode())
        await writer.drain()
        live.sheddable = True
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

    def _parse(self, head: bytes) -> _Request | _Response:
        """The request of a head, or the response that refuses it (nothing of the request is
        acted on before its whole head checked out)."""
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
        body_announced = chunked = False
        length: int | None = None
        authorization: bytes | None = None
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
                lengths = {int(v) for v in value.split(b",")}
                if any(lengths) or length is not None:
                    body_announced = True
                # Several differing lengths (or fields) are no length at all.
                length = lengths.pop() if len(lengths) == 1 and length is None else -1
            elif lname == b"transfer-encoding":
                body_announced = chunked = True
            elif lname == b"authorization":
                authorization = value if authorization is None else b""
        path, query = self._path(target)
        answering = path.startswith(_ASK_PREFIX) and path != "/asks/stream"
        if body_announced and not (answering and method == b"POST"):
            return _error(413, "admin requests take no body")
        if self._asks is not None and answering:
            allowed = b"POST"
        elif (path in _PATHS and (path != "/denials" or self._denials is not None)) or (
            path in _ASK_PATHS and self._asks is not None
        ):
            allowed = b"GET"
        else:
            return _error(404, "not found")
        if method != allowed and not (allowed == b"GET" and method == b"HEAD"):
            response = _error(405, "method not allowed")
            response.extra.append(("Allow", "POST" if allowed == b"POST" else "GET, HEAD"))
            return response
        return _Request(method, path, query, authorization, length, chunked)

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
        if path in _ASK_PATHS:
            assert self._asks is not None
            if path == "/grants":
                return _json(200, {"grants": self._asks.grants.to_json()})
            if path == "/asks":
                return _json(200, {"asks": self._asks.pending()})
            # HEAD of the stream: its head alone.
            return _Response(200, b"", content_type=_EVENT_STREAM)
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

    # ---- asking a person

    def _authorized(self, authorization: bytes | None) -> bool:
        if self._token is None or not authorization:
            return False
        scheme, _, given = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # Constant time: how much of a guess matched must not show in the answer's timing.
        return hmac.compare_digest(given.strip(b" "), self._token)

    async def _answer(
        self, reader: asyncio.StreamReader, request: _Request, early: bytes
    ) -> _Response:
        """`POST /asks/ID`: the token first, then the id, then the body."""
        asks = self._asks
        assert asks is not None
        if not self._authorized(request.authorization):
            response = _json_error(401, "a bearer token is required to answer an ask")
            response.extra.append(("WWW-Authenticate", 'Bearer realm="egress-proxy asks"'))
            return response
        match = _ASK.fullmatch(request.path)
        if match is None or match.group(1) not in {a["id"] for a in asks.pending()}:
            return _json_error(404, "no such pending ask")
        if request.chunked or request.length is None or request.length < 0:
            return _json_error(400, "bad request: send the JSON body with one Content-Length")
        if request.length > MAX_BODY:
            return _json_error(400, f"bad request: the body is over {MAX_BODY} bytes")
        body = early[: request.length]
        try:
            async with asyncio.timeout(self._header_timeout):
                body += await reader.readexactly(request.length - len(body))
        except (TimeoutError, asyncio.IncompleteReadError):
            return _json_error(400, "bad request: incomplete body")
        decision = _decision(body)
        if decision is None:
            expected = " | ".join(f'"{answer}"' for answer in ANSWERS)
            return _json_error(400, f'bad request: the body must be {{"decision": {expected}}}')
        done = asks.answer(match.group(1), decision)
        if done is None:  # answered or timed out while the body came
            return _json_error(404, "no such pending ask")
        return _json(200, done)

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """`GET /asks/stream`: the pending asks, then each new one, until the client goes
        (or falls behind, or the proxy stops)."""
        asks = self._asks
        assert asks is not None
        if self._streams >= MAX_STREAMS:
            writer.write(_json_error(503, "too many streams").encode())
            await writer.drain()
            return
        self._streams += 1
        queue = asks.subscribe()
        ended = asyncio.ensure_future(reader.read(1))  # the client closing, or sending more
        try:
            writer.write(_Response(200, b"", content_type=_EVENT_STREAM).encode(length=False))
            for ask in asks.pending():
                writer.write(_event(ask))
            await writer.drain()
            while True:
                got = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait(
                    {got, ended}, timeout=KEEPALIVE_SECONDS, return_when=asyncio.FIRST_COMPLETED
                )
                if got not in done:
                    got.cancel()
                    if ended in done:
                        return
                    writer.write(b": keep-alive\n\n")
                else:
                    new = got.result()
                    if new is None:
                        return
                    writer.write(_event(new))
                await writer.drain()
        finally:
            ended.cancel()
            asks.unsubscribe(queue)
            self._streams -= 1

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
