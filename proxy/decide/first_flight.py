"""What a tunnel is, told from the client's first bytes rather than its port (a manifest entry
admits a host on any port; the operator's `ports` and `opaque_ports` are the port policy):

- a TLS handshake record: the SNI gate decides (proxy/decide/sni_gate.py), on every port;
- an HTTP/1.x request line (a method llhttp knows, then a space): plain HTTP, each request
  decided by the front door's HTTP plane;
- anything else: an opaque stream, `ssh` when it starts with an SSH identification string
  (RFC 4253 4.2: `SSH-2.0-...`; `SSH-1.99-` too), else `tcp`.

    kind = classify(buffer)       # None: too few bytes to tell yet (read more, within a timer)

Pure: no I/O.
"""

from __future__ import annotations

from enum import StrEnum, unique
from typing import Final

from proxy.decide.clienthello import starts_like_tls

__all__ = ["FirstFlight", "classify", "is_opaque"]


@unique
class FirstFlight(StrEnum):
    TLS = "tls"
    HTTP = "http"
    SSH = "ssh"
    TCP = "tcp"


# The methods llhttp parses (its llhttp_method table), which the HTTP plane would take.
HTTP_METHODS: Final = frozenset(
    b"DELETE GET HEAD POST PUT CONNECT OPTIONS TRACE COPY LOCK MKCOL MOVE PROPFIND PROPPATCH "
    b"SEARCH UNLOCK BIND REBIND UNBIND ACL REPORT MKACTIVITY CHECKOUT MERGE M-SEARCH NOTIFY "
    b"SUBSCRIBE UNSUBSCRIBE PATCH PURGE MKCALENDAR LINK UNLINK SOURCE QUERY PRI".split()
)
_LONGEST_METHOD: Final = max(len(m) for m in HTTP_METHODS)
_SSH: Final = b"SSH-"


def classify(data: bytes | bytearray) -> FirstFlight | None:
    """The kind of stream `data` (what the client sent so far) begins; None while it could still
    begin more than one (an empty buffer, `SS`, `GE`)."""
    if not data:
        return None
    head = bytes(data[: _LONGEST_METHOD + 1])
    if starts_like_tls(head):
        # Two bytes or fewer that may still be a record header: the gate reads on from here and
        # refuses (not_tls) what does not become a ClientHello.
        return FirstFlight.TLS
    if head.startswith(_SSH):
        return FirstFlight.SSH
    if len(head) < len(_SSH) and _SSH.startswith(head):
        return None
    space = head.find(b" ")
    if space > 0:
        return FirstFlight.HTTP if head[:space] in HTTP_METHODS else FirstFlight.TCP
    if len(head) <= _LONGEST_METHOD and any(m.startswith(head) for m in HTTP_METHODS):
        return None  # a method's first letters, its space not yet here
    return FirstFlight.TCP


def is_opaque(kind: FirstFlight) -> bool:
    """Whether a stream of this kind is relayed as bytes, with no protocol of ours inside."""
    return kind in (FirstFlight.SSH, FirstFlight.TCP)
