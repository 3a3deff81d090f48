"""The far side of tests/test_boundary.py: run in a network namespace the test created, it plays
"the outside" at the probe addresses and writes one JSON line per thing that reached it, so the
test can show that nothing got out while the boundary held, and what did once it was gone.

    boundary_observer.py outside LOG V4 V6   # TCP 80/443 answering 200 (not the proxy), UDP 443,
                                             # DNS on V4:53 answering every A query (a leak)
    boundary_observer.py listen LOG ADDR PORT  # a TCP listener (the agent serving the outside)

Bounded: it exits by itself after LIFETIME seconds, and the test kills it sooner."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import dns.message
import dns.rdatatype
import dns.rrset

LIFETIME = 300.0
_lock = threading.Lock()


def log(path: str, **event: object) -> None:
    with _lock, open(path, "a") as handle:
        handle.write(json.dumps(event) + "\n")


def bound(address: str, port: int, kind: socket.SocketKind) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    if kind == socket.SOCK_STREAM:
        sock.listen(16)
    return sock


def tcp_server(path: str, server: socket.socket, answer: bytes) -> None:
    address, port = server.getsockname()[:2]
    while True:
        conn, peer = server.accept()
        log(path, kind="tcp", address=address, port=port, peer=peer[0])
        with conn:
            conn.settimeout(2)
            try:
                conn.recv(4096)
                conn.sendall(answer)
            except OSError:
                pass


def udp_server(path: str, sock: socket.socket) -> None:
    address, port = sock.getsockname()[:2]
    while True:
        data, peer = sock.recvfrom(4096)
        if port != 53:
            log(path, kind="udp", address=address, port=port, peer=peer[0])
            sock.sendto(data, peer)
            continue
        try:
            query = dns.message.from_wire(data)
        except Exception:
            continue
        name = query.question[0].name.to_text() if query.question else ""
        log(path, kind="dns", address=address, name=name, peer=peer[0])
        reply = dns.message.make_response(query)
        if query.question and query.question[0].rdtype == dns.rdatatype.A:
            reply.answer.append(dns.rrset.from_text(name, 60, "IN", "A", address))
        sock.sendto(reply.to_wire(), peer)


def main(argv: list[str]) -> int:
    mode, path = argv[0], argv[1]
    threads: list[tuple[object, tuple[object, ...]]] = []
    if mode == "outside":
        v4, v6 = argv[2], argv[3]
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\ndirect\n"
        for address in (v4, v6):
            for port in (80, 443):
                threads.append(
                    (tcp_server, (path, bound(address, port, socket.SOCK_STREAM), answer))
                )
            threads.append((udp_server, (path, bound(address, 443, socket.SOCK_DGRAM))))
        threads.append((udp_server, (path, bound(v4, 53, socket.SOCK_DGRAM))))
    elif mode == "listen":
        answer = b"served from inside\n"
        listener = bound(argv[2], int(argv[3]), socket.SOCK_STREAM)
        threads.append((tcp_server, (path, listener, answer)))
    else:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    for target, args in threads:
        threading.Thread(target=target, args=args, daemon=True).start()  # type: ignore[arg-type]
    log(path, kind="ready")
    time.sleep(LIFETIME)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
