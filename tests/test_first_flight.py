"""What a tunnel's first bytes say it is (proxy/decide/first_flight.py), and the refusal an
SSH client reads (proxy/common/refusals.py `refusal_ssh`), parsed as RFC 4253 lays a packet out."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.reasons import Reason
from proxy.common.refusals import SSH_IDENTIFICATION, Refused, refusal_ssh
from proxy.decide.first_flight import HTTP_METHODS, FirstFlight, classify, is_opaque

HELLO_START = b"\x16\x03\x01\x02\x00\x01"


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (HELLO_START, FirstFlight.TLS),
        (b"\x16", FirstFlight.TLS),  # judged on what is there: the gate reads on
        (b"GET / HTTP/1.1\r\n", FirstFlight.HTTP),
        (b"M-SEARCH * HTTP/1.1\r\n", FirstFlight.HTTP),
        (b"PRI * HTTP/2.0\r\n", FirstFlight.HTTP),
        (b"SSH-2.0-OpenSSH_9.2p1\r\n", FirstFlight.SSH),
        (b"SSH-1.99-old\r\n", FirstFlight.SSH),
        (b"EHLO client.test\r\n", FirstFlight.TCP),  # a method-like token that is no method
        (b"get / HTTP/1.1\r\n", FirstFlight.TCP),  # methods are case-sensitive
        (b"*1\r\n$4\r\nPING\r\n", FirstFlight.TCP),  # redis
        (b"\x00\x00\x00\x08\x04\xd2\x16\x2f", FirstFlight.TCP),  # PostgreSQL SSLRequest
        (b"PING\r\n", FirstFlight.TCP),
        (b"GETX", FirstFlight.TCP),
        (b"SSX", FirstFlight.TCP),
    ],
)
def test_first_bytes_name_the_stream(data: bytes, kind: FirstFlight) -> None:
    assert classify(data) == kind


@pytest.mark.parametrize("data", [b"", b"S", b"SS", b"SSH", b"G", b"GE", b"GET", b"PROPPAT"])
def test_too_few_bytes_to_tell_wait_for_more(data: bytes) -> None:
    assert classify(data) is None


@given(st.binary(min_size=1, max_size=64))
def test_any_bytes_are_told_or_wait_and_a_longer_flight_is_always_told(data: bytes) -> None:
    kind = classify(data)
    assert kind is None or isinstance(kind, FirstFlight)
    assert classify(data + b" x" * 8) is not None


def test_every_method_then_a_space_is_http() -> None:
    for method in HTTP_METHODS:
        assert classify(method + b" /") == FirstFlight.HTTP


def test_only_ssh_and_tcp_are_opaque() -> None:
    assert [k for k in FirstFlight if is_opaque(k)] == [FirstFlight.SSH, FirstFlight.TCP]


def _packet(data: bytes) -> tuple[int, int, bytes, bytes]:
    """(packet length, padding length, payload, padding) of one unencrypted binary packet."""
    (length,) = struct.unpack_from("!I", data)
    padding = data[4]
    payload = data[5 : 4 + length - padding]
    return length, padding, payload, data[4 + length - padding : 4 + length]


@pytest.mark.parametrize(
    ("refused", "code"),
    [
        (Refused(403, Reason.OPAQUE_NOT_ALLOWED, "no", remedy="add port 22 to opaque_ports"), 1),
        (Refused(502, Reason.UPSTREAM_REFUSED, "down", error=True), 10),
    ],
)
def test_an_ssh_refusal_is_our_identification_and_a_disconnect_naming_the_reason(
    refused: Refused, code: int
) -> None:
    data = refusal_ssh(refused, "git.test", 2222)
    assert data.startswith(SSH_IDENTIFICATION) and SSH_IDENTIFICATION.endswith(b"\r\n")
    packet = data[len(SSH_IDENTIFICATION) :]
    length, padding, payload, pad = _packet(packet)
    assert len(packet) == 4 + length and (4 + length) % 8 == 0 and padding >= 4
    assert pad == bytes(padding)
    assert payload[0] == 1  # SSH_MSG_DISCONNECT
    (reason_code, size) = struct.unpack_from("!II", payload, 1)
    description = payload[9 : 9 + size]
    assert reason_code == code
    assert payload[9 + size :] == b"\0\0\0\0"  # an empty language tag
    assert description.startswith(b"egress-proxy: git.test:2222 ")
    assert refused.reason.encode() in description and b"\n" not in description
    if not refused.error:
        assert description.endswith(b": add port 22 to opaque_ports")


def test_a_hostile_host_in_an_ssh_refusal_stays_printable_and_bounded() -> None:
    refused = Refused(403, Reason.NOT_ALLOWED, "no", remedy="add 'x' to network.egress")
    data = refusal_ssh(refused, "\x1b[31mevil\r\n" + "a" * 5000, 22)
    _, _, payload, _ = _packet(data[len(SSH_IDENTIFICATION) :])
    (size,) = struct.unpack_from("!I", payload, 5)
    description = payload[9 : 9 + size]
    assert size < 1024 and all(0x20 <= b < 0x7F for b in description)
