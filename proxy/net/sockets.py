"""Sockets the data plane opens itself: its listening sockets, and the original destination of a
connection that netfilter redirected to one of them."""

from __future__ import annotations

import socket

from proxy.common.listeners import Listener

BACKLOG = 1024
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST has the same number


def listening_socket(listener: Listener) -> socket.socket:
    """A bound, listening, non-blocking TCP socket for `listener` (IPv6 ones v6-only, so a v4
    listener on the same port can sit beside it)."""
    family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((listener.host, listener.port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (netfilter's conntrack), v4 or v6. Raises
    OSError for a connection that was not redirected."""
    if sock.family == socket.AF_INET6:
        raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)  # sockaddr_in6
        port = int.from_bytes(raw[2:4], "big")
        address = socket.inet_ntop(socket.AF_INET6, raw[8:24])
        return address, port
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)  # sockaddr_in
    return socket.inet_ntop(socket.AF_INET, raw[4:8]), int.from_bytes(raw[2:4], "big")
