"""The tunnel relay (proxy/net/relay.py, proxy/net/splice.py) on real loopback TCP sockets, in
its three modes: transports all along, splice from the first byte, and transports that move to
splice mid-stream once the tunnel turns bulk.

Each test builds two connections: the test's client end <-> the relay's client socket, and the
relay's upstream socket <-> the test's upstream end. The test's ends are driven on the same
event loop as the relay, and every wait is bounded by `LIMIT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from proxy.net import splice as relay_module
from proxy.net.relay import Counter, Relay
from proxy.net.splice import splice_available

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

LIMIT = 10.0  # seconds: no single test step may take longer
BULK = 64 << 20
NO_SPLICE = pytest.mark.skipif(not splice_available(), reason="os.splice is not available")
MODES = [
    pytest.param("splice", marks=NO_SPLICE),
    pytest.param("switch", marks=NO_SPLICE),
    "transport",
]
# Where each mode moves to splice: at once, after this many bytes, never.
SPLICE_AFTER = {"splice": 0, "switch": 200 << 10, "transport": None}
COPY_CHUNK = 64 << 10


@dataclass(frozen=True)
class RelayResult:
    up: int
    down: int
    reason: str


_LINGER_RESET = struct.pack("ii", 1, 0)


@dataclass
class Ends:
    """The test's two ends and the relay between them."""

    client: socket.socket  # the test's client end
    upstream: socket.socket  # the test's upstream end
    relay: Relay
    ended: asyncio.Future[str]
    counter: Counter

    async def result(self) -> RelayResult:
        async with asyncio.timeout(LIMIT):
            reason = await asyncio.shield(self.ended)
        return RelayResult(self.counter.up, self.counter.down, reason)


def tcp_pair(buffer: int | None = None) -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair (connecting end, accepted end), both non-blocking. With
    `buffer`, both ends get that SO_SNDBUF and SO_RCVBUF, set before the handshake (autotuning
    off), so the bytes the kernel holds are small and known."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    connecting = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if buffer is not None:
            for sock in (listener, connecting):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        connecting.settimeout(LIMIT)
        connecting.connect(listener.getsockname())
        listener.settimeout(LIMIT)
        accepted, _ = listener.accept()
    except BaseException:
        connecting.close()
        raise
    finally:
        listener.close()
    for sock in (connecting, accepted):
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connecting, accepted


async def transport_of(sock: socket.socket) -> asyncio.Transport:
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, sock)
    transport.pause_reading()  # as the front door hands them over: the relay resumes them
    return transport


@contextlib.asynccontextmanager
async def relayed(
    mode: str, buffer: int | None = None, initial_up: bytes = b"", **kwargs: Any
) -> AsyncIterator[Ends]:
    client, relay_client = tcp_pair(buffer)
    relay_upstream, upstream = tcp_pair(buffer)
    counter = Counter()
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[str] = loop.create_future()

    def on_end(reason: str) -> None:
        assert not ended.done(), "on_end called twice"
        ended.set_result(reason)

    relay = Relay(
        loop,
        await transport_of(relay_client),
        await transport_of(relay_upstream),
        counter,
        kwargs.pop("idle_timeout", LIMIT),
        on_end,
        splice_after=SPLICE_AFTER[mode],
    )
    relay.start(to_upstream=initial_up)
    try:
        yield Ends(client, upstream, relay, ended, counter)
    finally:
        if not ended.done():
            relay.close("test_over")
        client.close()
        upstream.close()


async def send_all(sock: socket.socket, data: bytes, shutdown: bool = True) -> None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, data)
    if shutdown:
        sock.shutdown(socket.SHUT_WR)


async def receive_all(sock: socket.socket, limit: int = BULK) -> tuple[int, str]:
    """Reads until EOF; the byte count and SHA-256 of what came."""
    loop = asyncio.get_running_loop()
    digest = hashlib.sha256()
    buffer = bytearray(256 << 10)
    view = memoryview(buffer)
    total = 0
    while total <= limit:
        n = await loop.sock_recv_into(sock, buffer)
        if n == 0:
            return total, digest.hexdigest()
        digest.update(view[:n])
        total += n
    raise AssertionError(f"more than {limit} bytes arrived")


async def receive_exactly(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = bytearray()
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        assert chunk, f"EOF after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


async def end_state(sock: socket.socket) -> str:
    """What the test's end sees after the relay closed its side: eof or reset (data before
    either is drained and ignored)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(LIMIT):
            for _ in range(100_000):
                if not await loop.sock_recv(sock, 1 << 16):
                    return "eof"
    except ConnectionResetError:
        return "reset"
    raise AssertionError("the relay never closed this side")


def reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


def open_fds() -> int:
    """Open fds, less the relay's spare pipes (kept open for the next relay on purpose) and
    /dev/null (uvloop opens it once per loop, with the loop's first transport)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{name}") != "/dev/null"
    return count - 2 * len(relay_module._spare_pipes)


async def fds_settle(expected: int) -> int:
    """Open fds once the loop has run its close callbacks (uvloop closes a transport's fd in a
    callback of its own, one loop iteration after the relay ended), bounded."""
    for _ in range(100):
        if open_fds() == expected:
            break
        await asyncio.sleep(0.01)
    return open_fds()


def pipe_bytes(fd: int) -> int:
    import fcntl
    import termios

    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, bytes(4)))[0]


def registered_fds() -> int | None:
    """Fds the running loop watches, where the loop lets us see them (the selector loops)."""
    selector = getattr(asyncio.get_running_loop(), "_selector", None)
    return None if selector is None else len(selector.get_map())


@pytest.fixture(scope="module")
def payloads() -> tuple[bytes, str, bytes, str]:
    """Two distinct 64 MiB payloads (one per direction) and their SHA-256."""
    up = random.Random(1).randbytes(BULK)
    down = random.Random(2).randbytes(BULK)
    return up, hashlib.sha256(up).hexdigest(), down, hashlib.sha256(down).hexdigest()


# ---- bulk and integrity


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_bulk_both_ways_at_once(mode: str, payloads: tuple[bytes, str, bytes, str]) -> None:
    up, up_digest, down, down_digest = payloads
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        _, _, at_upstream, at_client = await asyncio.gather(
            send_all(ends.client, up),
            send_all(ends.upstream, down),
            receive_all(ends.upstream),
            receive_all(ends.client),
        )
        result = await ends.result()
    assert at_upstream == (BULK, up_digest)
    assert at_client == (BULK, down_digest)
    assert result == RelayResult(up=BULK, down=BULK, reason="closed")
    assert (ends.counter.up, ends.counter.down) == (BULK, BULK)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_many_small_writes_arrive_whole_and_in_order(mode: str) -> None:
    rng = random.Random(3)
    messages = [rng.randbytes(rng.randint(1, 200)) for _ in range(2000)]
    expected = b"".join(messages)

    async def write_each() -> None:
        loop = asyncio.get_running_loop()
        for message in messages:
            await loop.sock_sendall(ends.client, message)
        ends.client.shutdown(socket.SHUT_WR)

    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        _, received = await asyncio.gather(write_each(), receive_all(ends.upstream))
        ends.upstream.shutdown(socket.SHUT_WR)
        assert await end_state(ends.client) == "eof"
        result = await ends.result()
    assert received == (len(expected), hashlib.sha256(expected).hexdigest())
    assert result == RelayResult(up=len(expected), down=0, reason="closed")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_ping_pong_small_messages_are_passed_on_at_once(mode: str) -> None:
    # Each message must reach the peer without waiting for more bytes: a relay that held bytes
    # back until a buffer filled would stall the first round trip.
    rng = random.Random(4)
    up_total = down_total = 0
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        loop = asyncio.get_running_loop()
        for _ in range(300):
            request = rng.randbytes(rng.randint(1, 100))
            await loop.sock_sendall(ends.client, request)
            assert await receive_exactly(ends.upstream, len(request)) == request
            reply = request[::-1] + b"!"
            await loop.sock_sendall(ends.upstream, reply)
            assert await receive_exactly(ends.client, len(reply)) == reply
            up_total += len(request)
            down_total += len(reply)
        assert (ends.counter.up, ends.counter.down) == (up_total, down_total)
        ends.client.shutdown(socket.SHUT_WR)
        ends.upstream.shutdown(socket.SHUT_WR)
        result = await ends.result()
    assert result == RelayResult(up=up_total, down=down_total, reason="closed")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_initial_up_is_delivered_first_and_counted(mode: str) -> None:
    hello = b"\x16\x03\x01" + bytes(range(256)) * 4
    async with relayed(mode, initial_up=hello) as ends, asyncio.timeout(LIMIT):
        await send_all(ends.client, b"after")
        ends.upstream.shutdown(socket.SHUT_WR)
        received = await receive_exactly(ends.upstream, len(hello) + 5)
        assert await end_state(ends.upstream) == "eof"
        result = await ends.result()
    assert received == hello + b"after"
    assert result == RelayResult(up=len(hello) + 5, down=0, reason="closed")


# ---- half-close, reset


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_client_half_close_then_upstream_keeps_sending(mode: str) -> None:
    request = b"GET / HTTP/1.0\r\n\r\n"
    response = random.Random(5).randbytes(3 << 20)
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        await send_all(ends.client, request)  # and shut down writing
        assert await receive_all(ends.upstream) == (len(request), _sha(request))
        # The upstream saw the EOF; the relay still carries the other direction.
        assert not ends.ended.done()
        _, at_client = await asyncio.gather(
            send_all(ends.upstream, response), receive_all(ends.client)
        )
        result = await ends.result()
    assert at_client == (len(response), _sha(response))
    assert result == RelayResult(up=len(request), down=len(response), reason="closed")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_upstream_half_close_then_client_keeps_sending(mode: str) -> None:
    banner = b"220 ready\r\n"
    upload = random.Random(6).randbytes(3 << 20)
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        await send_all(ends.upstream, banner)
        assert await receive_all(ends.client) == (len(banner), _sha(banner))
        assert not ends.ended.done()
        _, at_upstream = await asyncio.gather(
            send_all(ends.client, upload), receive_all(ends.upstream)
        )
        result = await ends.result()
    assert at_upstream == (len(upload), _sha(upload))
    assert result == RelayResult(up=len(upload), down=len(banner), reason="closed")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_upstream_reset_resets_the_client(mode: str) -> None:
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        await send_all(ends.upstream, b"partial", shutdown=False)
        assert await receive_exactly(ends.client, 7) == b"partial"
        reset(ends.upstream)
        result = await ends.result()
        # A clean EOF here would pass a truncated stream off as complete.
        assert await end_state(ends.client) == "reset"
    assert result == RelayResult(up=0, down=7, reason="reset")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_client_reset_during_a_download_resets_the_upstream(mode: str) -> None:
    # Small buffers: the upstream cannot have written everything yet when the reset comes.
    async with relayed(mode, buffer=64 << 10) as ends, asyncio.timeout(LIMIT):
        sending = asyncio.create_task(send_all(ends.upstream, bytes(16 << 20)))
        await receive_exactly(ends.client, 1 << 20)
        reset(ends.client)
        result = await ends.result()
        # The kernel reports the reset once, to whichever call comes first: here the send.
        with pytest.raises(ConnectionError):
            await sending
    assert result.reason == "reset"
    # The copy counts a chunk once all of it is written: a reset can cut one short, uncounted.
    assert (1 << 20) - COPY_CHUNK <= result.down < 16 << 20


# ---- idle timeout


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_idle_timeout_closes_both(mode: str) -> None:
    started = time.monotonic()
    async with relayed(mode, idle_timeout=0.3) as ends:
        result = await ends.result()
        elapsed = time.monotonic() - started
        assert await end_state(ends.client) == "eof"
        assert await end_state(ends.upstream) == "eof"
    assert result == RelayResult(up=0, down=0, reason="idle_timeout")
    assert 0.3 <= elapsed < 1.5


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_idle_timeout_counts_from_the_last_byte(mode: str) -> None:
    # A byte every 0.1 s keeps a 0.3 s timeout away for as long as it lasts, in either direction.
    async with relayed(mode, idle_timeout=0.3) as ends, asyncio.timeout(LIMIT):
        loop = asyncio.get_running_loop()
        for i in range(8):
            sender, receiver = (
                (ends.client, ends.upstream) if i % 2 else (ends.upstream, ends.client)
            )
            await loop.sock_sendall(sender, b"x")
            assert await receive_exactly(receiver, 1) == b"x"
            await asyncio.sleep(0.1)
        assert not ends.ended.done()
        last = time.monotonic()
        result = await ends.result()
        quiet = time.monotonic() - last
    assert result == RelayResult(up=4, down=4, reason="idle_timeout")
    assert 0.15 <= quiet < 1.5


@pytest.mark.asyncio
async def test_idle_timeout_must_be_positive() -> None:
    client, upstream = tcp_pair()
    try:
        loop = asyncio.get_running_loop()
        with pytest.raises(ValueError, match="idle_timeout"):
            Relay(loop, await transport_of(client), await transport_of(upstream), Counter(), 0,
                  lambda reason: None)  # fmt: skip
    finally:
        client.close()
        upstream.close()


# ---- back-pressure, cancellation


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_slow_reader_holds_the_sender_back(mode: str) -> None:
    # With 64 KiB socket buffers the kernel holds well under 1 MiB across the four sockets; the
    # relay adds one pipe (1 MiB) or one 64 KiB buffer. A relay that read ahead of its writes
    # would let the upstream push all 16 MiB while the client reads nothing.
    total = 16 << 20
    data = random.Random(7).randbytes(total)
    chunk = 64 << 10
    sent = 0

    async def push() -> None:
        nonlocal sent
        loop = asyncio.get_running_loop()
        for offset in range(0, total, chunk):
            await loop.sock_sendall(ends.upstream, data[offset : offset + chunk])
            sent = offset + chunk
        ends.upstream.shutdown(socket.SHUT_WR)

    async with relayed(mode, buffer=64 << 10) as ends, asyncio.timeout(LIMIT):
        pushing = asyncio.create_task(push())
        await asyncio.sleep(0.5)
        assert 0 < sent < 4 << 20
        assert 0 < ends.counter.down < 4 << 20  # live, while the relay runs
        stalled_at = sent
        await asyncio.sleep(0.2)
        assert sent == stalled_at
        # Now a slow reader: small reads with pauses, and the sender follows its pace.
        loop = asyncio.get_running_loop()
        received = bytearray()
        for i in range(100_000):
            piece = await loop.sock_recv(ends.client, 16 << 10)
            if not piece:
                break
            received += piece
            if i % 128 == 0:
                await asyncio.sleep(0.005)
        await pushing
        ends.client.shutdown(socket.SHUT_WR)
        result = await ends.result()
    assert bytes(received) == data
    assert result == RelayResult(up=0, down=total, reason="closed")


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_closing_from_outside_cleans_up_everything(mode: str) -> None:
    fds_before = open_fds()
    registered_before = registered_fds()
    async with relayed(mode, buffer=64 << 10) as ends, asyncio.timeout(LIMIT):
        loop = asyncio.get_running_loop()
        # Bytes in flight both ways, nobody reading: the relay is waiting on both directions.
        pushing = [
            asyncio.create_task(loop.sock_sendall(ends.upstream, bytes(8 << 20))),
            asyncio.create_task(loop.sock_sendall(ends.client, bytes(8 << 20))),
        ]
        for _ in range(200):
            if ends.counter.up and ends.counter.down:
                break
            await asyncio.sleep(0.01)
        assert ends.counter.up and ends.counter.down
        ends.relay.close("policy_reload")
        result = await ends.result()
        assert result.reason == "policy_reload"
        assert result.up > 0 and result.down > 0
        for task in pushing:
            task.cancel()
        await asyncio.gather(*pushing, return_exceptions=True)
    # The test's own ends are closed by now too: everything the test opened is gone.
    assert await fds_settle(fds_before) == fds_before
    assert registered_fds() == registered_before


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_no_fds_left_after_a_normal_end(mode: str) -> None:
    fds_before = open_fds()
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        await send_all(ends.client, b"ping")
        await send_all(ends.upstream, b"pong")
        assert await end_state(ends.client) == "eof"
        assert await end_state(ends.upstream) == "eof"
        assert (await ends.result()).reason == "closed"
    assert await fds_settle(fds_before) == fds_before


# ---- no pipes to be had: the transports carry on


@pytest.mark.asyncio
@pytest.mark.skipif(not splice_available(), reason="os.splice is not available")
@pytest.mark.parametrize("mode", ["splice", "switch"])
async def test_no_pipes_keeps_the_transports(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    calls: list[str] = []

    def refuse(*args: object, **kwargs: object) -> Any:
        calls.append("pipe2")
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "pipe2", refuse)
    monkeypatch.setattr(relay_module, "_spare_pipes", [])  # so that pipe2 is called
    payload = random.Random(8).randbytes(1 << 20)
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        _, _, at_upstream, at_client = await asyncio.gather(
            send_all(ends.client, payload),
            send_all(ends.upstream, payload[::-1]),
            receive_all(ends.upstream),
            receive_all(ends.client),
        )
        result = await ends.result()
    assert calls == ["pipe2"]  # tried once, then the tunnel stays on its transports
    assert at_upstream == (len(payload), _sha(payload))
    assert at_client == (len(payload), _sha(payload[::-1]))
    assert result == RelayResult(up=len(payload), down=len(payload), reason="closed")


@pytest.mark.asyncio
@pytest.mark.skipif(not splice_available(), reason="os.splice is not available")
async def test_splice_failing_after_bytes_moved_ends_both(monkeypatch: pytest.MonkeyPatch) -> None:
    real: Callable[..., int] = os.splice
    broken = False

    def flaky(*args: Any, **kwargs: Any) -> int:
        if broken:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, "splice", flaky)
    async with relayed("splice") as ends, asyncio.timeout(LIMIT):
        await send_all(ends.client, b"one", shutdown=False)
        assert await receive_exactly(ends.upstream, 3) == b"one"
        broken = True
        await send_all(ends.client, b"two", shutdown=False)
        result = await ends.result()
        assert await end_state(ends.client) == "reset"
        assert await end_state(ends.upstream) == "reset"
    assert result.reason == "error"
    assert result.up == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_a_bug_inside_the_relay_ends_both_and_is_logged(
    mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> Any:
        raise RuntimeError("bug")

    if mode == "transport":
        monkeypatch.setattr(Relay, "moved", broken)
    else:
        monkeypatch.setattr(os, "splice", broken)
    payload = bytes(SPLICE_AFTER[mode] or 0) + b"x"
    async with relayed(mode) as ends, asyncio.timeout(LIMIT):
        await send_all(ends.client, payload)
        result = await ends.result()
        assert await end_state(ends.upstream) == "reset"
    assert result.reason == "error"
    assert "the relay failed" in caplog.text or "the splice relay failed" in caplog.text
    assert "RuntimeError: bug" in caplog.text


@pytest.mark.asyncio
@pytest.mark.skipif(not splice_available(), reason="os.splice is not available")
async def test_pipes_grow_only_for_bulk_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pipe capacity is charged to the user: small exchanges must not take 1 MiB pipes.
    real = relay_module._grow_pipe
    grown: list[int] = []

    def recording(fd: int, size: int) -> int:
        grown.append(size)
        return real(fd, size)

    monkeypatch.setattr(relay_module, "_grow_pipe", recording)
    async with relayed("splice") as ends, asyncio.timeout(LIMIT):
        loop = asyncio.get_running_loop()
        for _ in range(20):
            await loop.sock_sendall(ends.client, bytes(1000))
            await receive_exactly(ends.upstream, 1000)
            await loop.sock_sendall(ends.upstream, bytes(1000))
            await receive_exactly(ends.client, 1000)
        assert grown == []
        _, received = await asyncio.gather(
            send_all(ends.client, bytes(4 << 20)), receive_all(ends.upstream)
        )
        assert received[0] == 4 << 20
        assert grown == [1 << 20]  # the upload direction only
        ends.upstream.shutdown(socket.SHUT_WR)
        assert (await ends.result()).reason == "closed"


def test_pipe_growth_refused_keeps_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    fcntl = pytest.importorskip("fcntl")
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        pytest.skip("no F_SETPIPE_SZ here")
    real = fcntl.fcntl

    def refuse_growth(fd: int, command: int, *args: Any) -> Any:
        if command == fcntl.F_SETPIPE_SZ:
            raise PermissionError(errno.EPERM, "over pipe-user-pages-soft")
        return real(fd, command, *args)

    monkeypatch.setattr(fcntl, "fcntl", refuse_growth)
    pipe_r, pipe_w = os.pipe()
    try:
        assert relay_module._grow_pipe(pipe_w, 1 << 20) == real(pipe_w, fcntl.F_GETPIPE_SZ)
    finally:
        os.close(pipe_r)
        os.close(pipe_w)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- spare pipes


@pytest.mark.asyncio
@pytest.mark.skipif(not splice_available(), reason="os.splice is not available")
async def test_the_next_relay_takes_the_pipes_of_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_module, "_spare_pipes", [])
    created: list[tuple[int, int]] = []
    real_pipe2 = os.pipe2

    def recording(flags: int) -> tuple[int, int]:
        created.append(real_pipe2(flags))
        return created[-1]

    monkeypatch.setattr(os, "pipe2", recording)
    try:
        for n in range(3):
            async with relayed("splice") as ends, asyncio.timeout(LIMIT):
                await send_all(ends.client, b"ping %d" % n)
                await send_all(ends.upstream, b"pong %d" % n)
                assert await receive_all(ends.upstream) == (6, _sha(b"ping %d" % n))
                assert await receive_all(ends.client) == (6, _sha(b"pong %d" % n))
                assert (await ends.result()).reason == "closed"
            assert len(created) == 2  # the first relay's two pipes, and none since
            assert sorted(fds[:2] for fds in relay_module._spare_pipes) == sorted(created)
            assert all(pipe_bytes(r) == 0 for r, _, _ in relay_module._spare_pipes)
    finally:
        for r, w, _ in relay_module._spare_pipes:
            os.close(r)
            os.close(w)


@pytest.mark.asyncio
@pytest.mark.skipif(not splice_available(), reason="os.splice is not available")
async def test_a_pipe_holding_bytes_is_never_spared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelled with bytes in both pipes (nobody reading either end): those pipes are closed,
    so no byte of this tunnel can come out of the next one."""
    monkeypatch.setattr(relay_module, "_spare_pipes", [])
    fds_before = open_fds()
    try:
        # Small socket buffers and less than GROW_AFTER each way: the pipes fill up, and stay
        # default ones (a grown pipe is never spared anyway).
        async with relayed("splice", buffer=8 << 10) as ends, asyncio.timeout(LIMIT):
            loop = asyncio.get_running_loop()
            size = relay_module.GROW_AFTER // 2
            pushing = [
                asyncio.create_task(loop.sock_sendall(ends.upstream, bytes(size))),
                asyncio.create_task(loop.sock_sendall(ends.client, bytes(size))),
            ]
            relay_state: list[Any] = []
            for _ in range(200):
                relay_state = [
                    d
                    for d in _live_directions()
                    if d.buffered and d.pipe_r >= 0 and pipe_bytes(d.pipe_r)
                ]
                if len(relay_state) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(relay_state) == 2, "both pipes should hold bytes by now"
            assert not any(d.grown for d in relay_state)
            ends.relay.close("policy_reload")
            assert (await ends.result()).reason == "policy_reload"
            for task in pushing:
                task.cancel()
            await asyncio.gather(*pushing, return_exceptions=True)
        assert relay_module._spare_pipes == []
        assert await fds_settle(fds_before) == fds_before
    finally:
        for r, w, _ in relay_module._spare_pipes:
            os.close(r)
            os.close(w)


@pytest.mark.asyncio
@pytest.mark.skipif(not splice_available(), reason="os.splice is not available")
async def test_a_grown_pipe_is_never_spared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_module, "_spare_pipes", [])
    payload = random.Random(9).randbytes(relay_module.GROW_AFTER * 2)
    try:
        async with relayed("splice") as ends, asyncio.timeout(LIMIT):
            await asyncio.gather(send_all(ends.client, payload), send_all(ends.upstream, b"small"))
            assert await receive_all(ends.upstream) == (len(payload), _sha(payload))
            assert await receive_all(ends.client) == (5, _sha(b"small"))
            assert (await ends.result()).reason == "closed"
        # The small direction's pipe is spared; the bulk one, grown, is closed.
        assert len(relay_module._spare_pipes) == 1
        [(r, w, size)] = relay_module._spare_pipes
        import fcntl

        assert size == fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) < 1 << 20
    finally:
        for r, w, _ in relay_module._spare_pipes:
            os.close(r)
            os.close(w)


def _live_directions() -> list[Any]:
    """The _Direction objects of the relays alive now (found through the garbage collector)."""
    import gc

    return [o for o in gc.get_objects() if type(o).__name__ == "_Direction"]
