"""Upstreams of the tests' own for the real `egress-proxy run` process, each serving from threads
on loopback: a TLS server for tls.test that counts connections and the bytes before its
handshake (`tls_upstream`), and a keep-alive HTTP/1.1 server, plain or TLS, that records every
request head it gets (`recording_upstream`)."""

from __future__ import annotations

import contextlib
import http.server
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trustme

from support.running import recv_head, wait_for

TLS_BODY = b"hello over tls\n"


@dataclass
class TLSUpstream:
    """A TLS server for tls.test on loopback (127.0.0.1, and 127.0.0.2 on the same port, so a
    dial to a refused loopback address would be seen too). Every accepted TCP connection is
    counted before any byte is read; `received` counts the bytes that arrived before the
    handshake (a ClientHello)."""

    ca: trustme.CA
    ca_file: Path
    leaf_pem: str
    port: int = 0
    connections: int = 0
    received: int = 0
    handshakes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.connections, self.received

    def serve(self, listener: socket.socket, context: ssl.SSLContext) -> None:
        listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._handle, args=(conn, context), daemon=True).start()

    def _handle(self, conn: socket.socket, context: ssl.SSLContext) -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(conn)
            conn.settimeout(5)
            try:
                first = conn.recv(65536, socket.MSG_PEEK)
                with self._lock:
                    self.received += len(first)
                if not first:
                    return
                tls = stack.enter_context(context.wrap_socket(conn, server_side=True))
                with self._lock:
                    self.handshakes += 1
                if b"\r\n\r\n" not in recv_head(tls):
                    return
                tls.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                    % (len(TLS_BODY), TLS_BODY)
                )
                with contextlib.suppress(OSError, ssl.SSLError):
                    tls.unwrap()
            except (OSError, ssl.SSLError):
                return  # a client that gave up verification, or a closed tunnel


@contextlib.contextmanager
def tls_upstream(directory: Path) -> Iterator[TLSUpstream]:
    ca = trustme.CA()
    leaf = ca.issue_cert("tls.test")
    ca_file = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    leaf.configure_cert(context)
    upstream = TLSUpstream(ca, ca_file, leaf.cert_chain_pems[0].bytes().decode())
    listeners: list[socket.socket] = []
    for _ in range(20):  # the same free port on 127.0.0.1 and 127.0.0.2
        first = socket.create_server(("127.0.0.1", 0))
        port = first.getsockname()[1]
        try:
            second = socket.create_server(("127.0.0.2", port))
        except OSError:
            first.close()
            continue
        listeners = [first, second]
        upstream.port = port
        break
    assert listeners, "no port free on both 127.0.0.1 and 127.0.0.2"
    threads = [
        threading.Thread(target=upstream.serve, args=(s, context), daemon=True) for s in listeners
    ]
    try:
        for thread in threads:
            thread.start()
        # Both listeners are counted (the harness checks itself), then the counts start at 0.
        for address in ("127.0.0.1", "127.0.0.2"):
            socket.create_connection((address, upstream.port), timeout=2).close()
        wait_for(lambda: upstream.snapshot()[0] == 2, timeout=5, what="the upstream self-check")
        with upstream._lock:
            upstream.connections = upstream.received = 0
        yield upstream
    finally:
        upstream._stop.set()
        for thread in threads:
            thread.join(timeout=5)
        for listener in listeners:
            listener.close()


OK = b"ok\n"


REDIRECT = "/go/"


@dataclass
class Recorded:
    """What one upstream received: each request's line and header fields, in order."""

    heads: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)

    def values(self, name: str) -> list[list[str]]:
        """Per request, the values of every field `name` (any case)."""
        return [[v for k, v in fields if k.lower() == name.lower()] for _, fields in self.heads]

    def text(self) -> str:
        return "\n".join(line + "\n" + repr(fields) for line, fields in self.heads)


class _Recording(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        recorded: Recorded = self.server.recorded  # type: ignore[attr-defined]
        recorded.heads.append((self.requestline, list(self.headers.items())))
        if self.path.startswith(REDIRECT):  # /go/URL: a redirect to URL
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix(REDIRECT))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(OK)))
        self.end_headers()
        self.wfile.write(OK)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def recording_upstream(tls: ssl.SSLContext | None = None) -> Iterator[tuple[int, Recorded]]:
    """A keep-alive HTTP/1.1 server on 127.0.0.1 (TLS with `tls`) answering every GET with OK."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    server.daemon_threads = True
    server.recorded = Recorded()  # type: ignore[attr-defined]
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1], server.recorded  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
