"""Client-side tunnels for clients without proxy support (psql, redis-cli, smtplib): an HTTP
CONNECT or SOCKS5 tunnel opened by hand, and a local forwarder that opens one per connection
and relays bytes both ways, as a user's `socat TCP-LISTEN,fork PROXY:...` would. Also the
`ProxyCommand` strings OpenSSH (and git through GIT_SSH_COMMAND) use with socat and
OpenBSD netcat. Every read is bounded by a timeout; every socket and thread ends with the
forwarder."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from support.real_servers import IP_FREEBIND, LOOPBACK, NC_OPENBSD, SOCAT

TIMEOUT = 15.0


def socat_proxy_command(proxy_port: int) -> str:
    """OpenSSH's ProxyCommand through the HTTP proxy on 127.0.0.1:`proxy_port` (CONNECT)."""
    return f"{SOCAT} - PROXY:{LOOPBACK}:%h:%p,proxyport={proxy_port}"


def nc_socks_proxy_command(socks_port: int) -> str:
    """OpenSSH's ProxyCommand through the SOCKS5 listener on 127.0.0.1:`socks_port`."""
    return f"{NC_OPENBSD} -X 5 -x {LOOPBACK}:{socks_port} %h %p"


@dataclass
class Refused(Exception):
    """The proxy refused the tunnel: the CONNECT response head or the SOCKS5 reply code."""

    status: int  # the HTTP status, or the SOCKS5 REP
    head: bytes = b""

    def __str__(self) -> str:
        return f"tunnel refused: {self.status} {self.head[:200]!r}"


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {data!r}, {size} bytes expected")
        data += chunk
    return data


def connect_tunnel(
    proxy_port: int, host: str, port: int, *, timeout: float = TIMEOUT
) -> socket.socket:
    """A socket through `CONNECT host:port` to the proxy on loopback, once it answered 2xx.
    Reads the head byte by byte, so no byte of the tunnel is taken; Refused on another status."""
    sock = socket.create_connection((LOOPBACK, proxy_port), timeout=timeout)
    try:
        authority = f"{host}:{port}"
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            byte = sock.recv(1)
            if not byte:
                raise Refused(0, head)
            head += byte
        status = int(head.split(b" ", 2)[1])
        if not 200 <= status < 300:
            raise Refused(status, head)
        return sock
    except BaseException:
        sock.close()
        raise


def socks5_request(host: str, port: int) -> bytes:
    """A SOCKS5 CONNECT request: ATYP 1/4 for an address, 3 for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        target = bytes([3, len(host)]) + host.encode()
    else:
        target = bytes([1 if address.version == 4 else 4]) + address.packed
    return b"\x05\x01\x00" + target + struct.pack("!H", port)


def socks5_tunnel(
    socks_port: int, host: str, port: int, *, timeout: float = TIMEOUT
) -> socket.socket:
    """A socket through the SOCKS5 listener on loopback once it replied 0; Refused(REP) else."""
    sock = socket.create_connection((LOOPBACK, socks_port), timeout=timeout)
    try:
        sock.sendall(b"\x05\x01\x00")
        if _read_exactly(sock, 2) != b"\x05\x00":
            raise Refused(-1)
        sock.sendall(socks5_request(host, port))
        head = _read_exactly(sock, 4)
        size = {1: 4, 4: 16}.get(head[3], 0)
        _read_exactly(sock, size + 2)
        if head[1] != 0:
            raise Refused(head[1], head)
        return sock
    except BaseException:
        sock.close()
        raise


def direct(host: str, port: int) -> Callable[[], socket.socket]:
    """An opener of plain TCP connections to host:port (a relay to a server elsewhere)."""
    return lambda: socket.create_connection((host, port), timeout=TIMEOUT)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@dataclass
class Forwarder:
    """Listens on host:port; every connection accepted is relayed to a socket `opener()` makes
    (a tunnel through the proxy, or a plain connection). A refused tunnel closes the client's
    connection without a byte; `refusals` keeps why."""

    opener: Callable[[], socket.socket]
    host: str = LOOPBACK
    freebind: bool = False
    port: int = 0
    refusals: list[BaseException] = field(default_factory=list)
    _listener: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Forwarder:
        listener = socket.socket()
        if self.freebind:
            listener.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        listener.bind((self.host, self.port))
        listener.listen(16)
        listener.settimeout(0.1)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._spawn(self._accept)
        return self

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                self._sockets.append(client)
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = self.opener()
        except (OSError, Refused) as exc:
            self.refusals.append(exc)
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._sockets.append(upstream)
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join(TIMEOUT * 4)
        client.close()
        upstream.close()

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in threads:
            thread.join(5)


@contextlib.contextmanager
def forwarding(
    opener: Callable[[], socket.socket], host: str = LOOPBACK, *, freebind: bool = False
) -> Iterator[Forwarder]:
    forwarder = Forwarder(opener, host, freebind).start()
    try:
        yield forwarder
    finally:
        forwarder.close()
