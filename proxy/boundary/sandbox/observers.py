"""The canary's targets: sockets of the sandbox's own on the host side of the veth, which the
rules must keep every canary packet away from."""

from __future__ import annotations

import contextlib
import select
import socket
from dataclasses import dataclass, field

from proxy.boundary.sandbox.net import AddressPlan
from proxy.common.listeners import format_listen


@dataclass
class Observers:
    """Sockets of the sandbox's own on the host side: TCP listeners and UDP echo sockets the
    canary aims at. The rules must keep every canary packet away from them."""

    tcp: dict[str, socket.socket] = field(default_factory=dict)
    udp: dict[str, socket.socket] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, plan: AddressPlan) -> Observers:
        observers = cls()
        try:
            for host in (str(plan.host4), str(plan.host6)):
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                listener = socket.socket(family, socket.SOCK_STREAM)
                observers.tcp[host] = listener
                listener.bind((host, 0))
                listener.listen(8)
                listener.setblocking(False)
                echo = socket.socket(family, socket.SOCK_DGRAM)
                observers.udp[host] = echo
                echo.bind((host, 0))
                echo.setblocking(False)
        except OSError:
            observers.close()
            raise
        return observers

    def port(self, host: str, kind: str) -> int:
        sock = (self.tcp if kind == "tcp" else self.udp)[host]
        return int(sock.getsockname()[1])

    def serve(self, timeout: float) -> None:
        """Answer whatever arrives within `timeout`, as a server that is not the proxy would (a
        TCP answer without the proxy's headers, a UDP echo), and note it."""
        sockets = [*self.tcp.values(), *self.udp.values()]
        ready, _, _ = select.select(sockets, [], [], max(timeout, 0))
        for sock in ready:
            with contextlib.suppress(OSError):
                if sock.type == socket.SOCK_STREAM:
                    conn, peer = sock.accept()
                    with conn:
                        self.seen.append(f"TCP connection from {peer[0]} to {_name(sock)}")
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                else:
                    data, peer = sock.recvfrom(65535)
                    self.seen.append(f"UDP datagram from {peer[0]} to {_name(sock)}")
                    sock.sendto(data, peer)

    def close(self) -> None:
        for sock in [*self.tcp.values(), *self.udp.values()]:
            sock.close()


def _name(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return format_listen(host, port)
