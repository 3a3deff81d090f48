"""The TCP probe: a connection to anywhere must be answered by the proxy (redirected to it),
never by whoever is at the address."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from proxy.boundary.probes.result import ProbeResult, endpoint, family_of, oserror
from proxy.common.refusals import DENIED_HEADER, ERROR_HEADER, SSH_IDENTIFICATION, shown

PROBE_HOST = "egress-boundary-probe.invalid"
# A proxy's refusal is one short head and a one-line body; more than this is not the proxy.
_MAX_ANSWER = 16 * 1024


def _answer_headers(data: bytes) -> tuple[str, dict[str, str]] | None:
    """The status line and headers (lowercase names) of an HTTP/1.x answer, or None when the
    bytes are not one."""
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].startswith("HTTP/1."):
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _exchange(
    name: str,
    address: str,
    port: int,
    request: bytes,
    enough: Callable[[bytes], bool],
    timeout: float,
) -> bytes | ProbeResult:
    """Connects to address:port, sends `request` and reads until `enough` of an answer (or the
    end, or the time limit): what arrived, or the failed result when nothing could."""
    where = endpoint(address, port)
    deadline = time.monotonic() + timeout
    data = b""
    try:
        with socket.socket(family_of(address), socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect((address, port))
            except PermissionError as exc:
                return ProbeResult(
                    name,
                    False,
                    f"connect to {where} refused locally ({oserror(exc)}): TCP is dropped, "
                    "not redirected to the proxy",
                )
            except ConnectionRefusedError:
                return ProbeResult(
                    name,
                    False,
                    f"connect to {where} refused: nothing answered, so the redirect to the "
                    "proxy is broken or the proxy is down",
                )
            except TimeoutError:
                return ProbeResult(
                    name,
                    False,
                    f"connect to {where} timed out after {timeout:g}s: the redirect to the "
                    "proxy is broken or the proxy is down",
                )
            sock.sendall(request)
            while len(data) < _MAX_ANSWER and not enough(data):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sock.settimeout(left)
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        pass  # judged on what arrived
    except OSError as exc:
        if not data:
            return ProbeResult(name, False, f"{where}: {oserror(exc)}; no proxy answered")
    return data


def tcp_answered_by_proxy(
    name: str, address: str, port: int, *, timeout: float = 3.0
) -> ProbeResult:
    """Passed iff the answer to a plain HTTP request to address:port carries the proxy's refusal
    header: the redirect works, the proxy answered, no direct connection was made."""
    where = endpoint(address, port)
    request = (
        f"GET / HTTP/1.1\r\nHost: {PROBE_HOST}\r\nUser-Agent: egress-proxy-probe\r\n"
        "Connection: close\r\n\r\n"
    ).encode("ascii")
    data = _exchange(name, address, port, request, lambda d: b"\r\n\r\n" in d, timeout)
    if isinstance(data, ProbeResult):
        return data
    parsed = _answer_headers(data)
    if parsed is None:
        seen = shown(data[:60].decode("latin-1")) if data else "nothing"
        return ProbeResult(
            name, False, f"{where} did not answer as the proxy (no HTTP answer; got {seen})"
        )
    status, headers = parsed
    for header in (DENIED_HEADER, ERROR_HEADER):
        value = headers.get(header.lower())
        if value is not None:
            return ProbeResult(
                name,
                True,
                f"{where} answered by the proxy: {shown(status)}, {header}: {shown(value)}",
            )
    return ProbeResult(
        name,
        False,
        f"{where} answered {shown(status)!r} without {DENIED_HEADER} or {ERROR_HEADER}: "
        "a direct connection was made, not through the proxy",
    )


def ssh_refused_by_proxy(
    name: str, address: str, port: int, *, timeout: float = 3.0
) -> ProbeResult:
    """Passed iff an SSH client's first bytes to address:port, an address this probe never
    resolved through the proxy, are answered by the proxy's own SSH refusal: a stream that
    names no host reaches no one."""
    where = endpoint(address, port)
    data = _exchange(
        name, address, port, PROBE_SSH_IDENTIFICATION, lambda d: len(d) > _SSH_ENOUGH, timeout
    )
    if isinstance(data, ProbeResult):
        return data
    if data.startswith(SSH_IDENTIFICATION):
        reason = data[len(SSH_IDENTIFICATION) :].split(b" denied: ", 1)[-1].split(b":", 1)[0]
        return ProbeResult(
            name, True, f"{where} refused by the proxy: {shown(reason.decode('latin-1'))}"
        )
    seen = shown(data[:60].decode("latin-1")) if data else "nothing"
    return ProbeResult(
        name,
        False,
        f"{where} did not refuse as the proxy (got {seen}): a stream naming no host went out",
    )


PROBE_SSH_IDENTIFICATION = b"SSH-2.0-egress_proxy_probe\r\n"
# Our identification string and the start of the disconnect that names the reason.
_SSH_ENOUGH = len(SSH_IDENTIFICATION) + 96
