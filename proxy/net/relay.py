"""The byte relay of the L4 fast path: two connected TCP sockets, bytes both ways, until done.

On Linux the bytes never enter user space: each direction splices socket -> pipe -> socket
(`os.splice`), driven by the event loop's readiness callbacks. Elsewhere, or when splice is
refused, a plain asyncio copy (`loop.sock_recv_into` / `loop.sock_sendall`) does the same job.
Both implementations share the semantics:

- Half-close: an EOF from one side is passed on as `shutdown(SHUT_WR)` of the other, after
  everything read before it has been written; the opposite direction carries on until it ends
  too. Both EOFs end the relay with reason `closed`.
- A reset (or any send/receive error) on either side ends both; the other side is then reset as
  well (`SO_LINGER` 0), so a peer never mistakes a truncated stream for a complete one.
- Idle timeout: when no byte has moved either way for `idle_timeout` seconds, both sides are
  closed (`idle_timeout`). One timer per relay, re-armed only when it fires.
- Back-pressure: a direction reads only after what it read before has been written, so the
  relay never holds more than one pipe (or one buffer) per direction, whatever the peers do.
- Byte counts: `Counter.up` (client to upstream) and `Counter.down` (upstream to client) count
  bytes written to the receiving socket, live while the relay runs; `RelayResult` repeats them.
- Ownership: the relay owns both sockets from the call on and always closes them, whether it
  returns, raises or is cancelled. The sockets must not belong to an asyncio transport (the
  loop refuses readers on those): pass sockets from `loop.sock_accept` / `sock_connect`, or
  detached ones.

Cancellation re-raises `CancelledError` after the clean-up (loop registrations removed, pipes
and both sockets closed); the counter then holds `reason == "cancelled"` and the bytes moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import socket
import struct
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Final

CLOSED: Final = "closed"
IDLE_TIMEOUT: Final = "idle_timeout"
RESET: Final = "reset"
ERROR: Final = "error"
CANCELLED: Final = "cancelled"

# A larger pipe means fewer splices and wake-ups per byte: about half the relay's CPU per GiB at
# 1 MiB against the default 64 KiB (benchmarks/relay_bulk.py). But the kernel charges pipe
# capacity to the user (all processes of the UID, node-wide without user namespaces): past
# /proc/sys/fs/pipe-user-pages-soft (64 MiB by default) an unprivileged user's pipes cannot grow
# and new ones get 8 KiB. So a pipe starts at the default and grows only once its direction
# has moved GROW_AFTER bytes, i.e. for bulk transfers; a refused growth is silent.
DEFAULT_PIPE_SIZE: Final = 1 << 20
GROW_AFTER: Final = 256 << 10
# Per direction, allocated once per relay; large enough that per-chunk overhead stays small, small
# enough that thousands of connections do not add up to much.
COPY_CHUNK: Final = 64 << 10
# Splice calls one readiness callback may make before it returns to the loop: a direction that
# could always move bytes must not starve the other direction or other connections.
_SPLICE_STEPS: Final = 16

# Spare pipes: a relay ending hands its pipes (empty, checked with FIONREAD, and never grown)
# to the next one, instead of closing them for the next relay to create again: creating,
# sizing and closing two pipes is eight system calls per tunnel. Bounded: each spare pipe holds
# two fds and a default pipe's share of the user's pipe pages. 32 covers the churn of a few
# dozen concurrent tunnels (16 let half of the pipes go at 16 clients, measured with strace).
MAX_SPARE_PIPES: Final = 32
_spare_pipes: list[tuple[int, int, int]] = []  # (read fd, write fd, capacity)
_INT: Final = struct.Struct("i")

_SPLICE_FLAGS: Final = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
# errnos that mean "splice cannot work on these files", as opposed to a connection problem.
_UNSUPPORTED: Final = frozenset(
    {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES}
)
_ABORTIVE: Final = frozenset({RESET, ERROR})
_LINGER_RESET: Final = struct.pack("ii", 1, 0)


class Counter:
    """Bytes moved by one relay, readable at any time while it runs and after it ends.

    `reason` stays None until the relay ends; then it is the `RelayResult.reason`, or
    `cancelled` when the relay task was cancelled (no `RelayResult` is returned then)."""

    __slots__ = ("down", "reason", "up")

    def __init__(self) -> None:
        self.up = 0
        self.down = 0
        self.reason: str | None = None

    def __repr__(self) -> str:
        return f"Counter(up={self.up}, down={self.down}, reason={self.reason!r})"


@dataclass(frozen=True, slots=True)
class RelayResult:
    up: int  # bytes written to the upstream (including initial_up)
    down: int  # bytes written to the client
    reason: str  # closed, idle_timeout, reset or error


@functools.cache
def splice_available() -> bool:
    """True when `os.splice` exists and works here (checked once, on a socket pair): a seccomp
    filter may refuse the call although the function exists."""
    if not sys.platform.startswith("linux") or not hasattr(os, "splice"):
        return False
    try:
        left, right = socket.socketpair()
    except OSError:
        return False
    pipe_r = pipe_w = -1
    try:
        pipe_r, pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        left.setblocking(False)
        right.setblocking(False)
        left.send(b"x")
        if os.splice(right.fileno(), pipe_w, 1, flags=_SPLICE_FLAGS) != 1:
            return False
        if os.splice(pipe_r, right.fileno(), 1, flags=_SPLICE_FLAGS) != 1:
            return False
        return left.recv(1) == b"x"
    except OSError:
        return False
    finally:
        for fd in (pipe_r, pipe_w):
            if fd >= 0:
                os.close(fd)
        left.close()
        right.close()


async def relay(
    client: socket.socket,
    upstream: socket.socket,
    *,
    idle_timeout: float | None,
    counter: Counter | None = None,
    prefer_splice: bool = True,
    initial_up: bytes = b"",
    pipe_size: int = DEFAULT_PIPE_SIZE,
) -> RelayResult:
    """Relay between two connected TCP sockets until both directions have ended (or one resets,
    or nothing moves for `idle_timeout` seconds; None: no idle timeout), then close both.

    `initial_up` (bytes the caller already read from the client, such as the ClientHello it
    checked) is written to the upstream before anything else, and counted in `up`. The relay adds
    to `counter` when given one, so the caller can read the counts while it runs. `pipe_size` is
    what a splice pipe grows to once its direction turns out to be a bulk transfer."""
    if idle_timeout is not None and not idle_timeout > 0:
        raise ValueError(f"idle_timeout must be positive or None, not {idle_timeout!r}")
    loop = asyncio.get_running_loop()
    counter = counter if counter is not None else Counter()
    reason = ERROR  # until an implementation says otherwise: an exception resets both sides
    try:
        for sock in (client, upstream):
            if sock.gettimeout() != 0.0:  # one system call saved when it already is
                sock.setblocking(False)
        reason = await _run(
            loop, client, upstream, counter, idle_timeout, prefer_splice, initial_up, pipe_size
        )
    except asyncio.CancelledError:
        reason = CANCELLED
        raise
    finally:
        counter.reason = reason
        _close(client, reason in _ABORTIVE)
        _close(upstream, reason in _ABORTIVE)
    return RelayResult(counter.up, counter.down, reason)


async def _run(
    loop: asyncio.AbstractEventLoop,
    client: socket.socket,
    upstream: socket.socket,
    counter: Counter,
    idle_timeout: float | None,
    prefer_splice: bool,
    initial_up: bytes,
    pipe_size: int,
) -> str:
    ended = await _send_initial(loop, upstream, initial_up, counter, idle_timeout)
    if ended is not None:
        return ended
    if prefer_splice and splice_available():
        splice = _SpliceRelay(loop, client, upstream, counter, idle_timeout, pipe_size)
        ended = await splice.run()
        if ended is not None:
            return ended
        # None: splice refused before any byte moved; the copy starts from the same state.
    return await _CopyRelay(loop, client, upstream, counter, idle_timeout).run() or ERROR


async def _send_initial(
    loop: asyncio.AbstractEventLoop,
    upstream: socket.socket,
    data: bytes,
    counter: Counter,
    idle_timeout: float | None,
) -> str | None:
    """Writes `data` to the upstream; None when done, else why the relay ends."""
    if not data:
        return None
    # A ClientHello fits the socket buffer of a fresh connection: sent at once, without a timer.
    try:
        sent = upstream.send(data)
    except (BlockingIOError, InterruptedError):
        sent = 0
    except OSError as exc:
        return _reason_of(exc)
    if sent < len(data):
        try:
            async with asyncio.timeout(idle_timeout):
                await loop.sock_sendall(upstream, data[sent:])
        except TimeoutError:
            return IDLE_TIMEOUT
        except OSError as exc:
            return _reason_of(exc)
    counter.up += len(data)
    return None


def _reason_of(exc: BaseException) -> str:
    # ETIMEDOUT is TCP giving up on the peer (retransmissions, keepalive): a reset in effect.
    if isinstance(exc, ConnectionError | TimeoutError):
        return RESET
    return ERROR


def _shutdown_write(sock: socket.socket) -> None:
    # A peer that is already gone will show as an error on the other direction, if it matters.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def _close(sock: socket.socket, abortive: bool) -> None:
    if abortive and sock.fileno() >= 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


class _Session:
    """What both implementations share: the end of the relay (a future carrying the reason), the
    byte counter and the idle timer.

    The timer is not pushed back on every chunk: moving bytes only notes the time, and when the
    timer fires it either ends the relay or re-arms itself for the new deadline."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, counter: Counter, idle_timeout: float | None
    ) -> None:
        self.loop = loop
        self.counter = counter
        self.idle_timeout = idle_timeout
        self.finished: asyncio.Future[str | None] = loop.create_future()
        self.last_moved = loop.time()
        # A bug, rather than a connection problem, surfacing in a loop callback or a copy task:
        # re-raised by run(), so it is not lost in the loop's exception handler.
        self.failure: BaseException | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start_timer(self) -> None:
        if self.idle_timeout is not None:
            self._timer = self.loop.call_at(self.last_moved + self.idle_timeout, self._on_timer)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        assert self.idle_timeout is not None
        deadline = self.last_moved + self.idle_timeout
        if self.loop.time() < deadline:
            self._timer = self.loop.call_at(deadline, self._on_timer)
        else:
            self._timer = None
            self.finish(IDLE_TIMEOUT)

    def finish(self, reason: str | None) -> None:
        if not self.finished.done():
            self.finished.set_result(reason)

    def fail(self, exc: BaseException) -> None:
        if not self.finished.done():
            self.failure = exc
        self.finish(ERROR)

    async def outcome(self) -> str | None:
        reason = await self.finished
        if self.failure is not None:
            raise self.failure
        return reason


class _Direction:
    """One direction of the splice relay: src socket -> pipe -> dst socket.

    The pipe is read from the source only while it is empty. So a direction waits for exactly one
    thing at a time (source readable when the pipe is empty, destination writable otherwise),
    `buffered` says which, and EAGAIN is never ambiguous: a full pipe cannot be mistaken for a
    source without data, which would spin the loop on a readable socket."""

    __slots__ = (
        "buffered",
        "done",
        "dst",
        "dst_sock",
        "grown",
        "is_up",
        "pipe_r",
        "pipe_size",
        "pipe_w",
        "read",
        "reading",
        "src",
        "writing",
    )

    def __init__(self, src: socket.socket, dst: socket.socket, is_up: bool) -> None:
        self.src = src.fileno()
        self.dst = dst.fileno()
        self.dst_sock = dst
        self.is_up = is_up
        self.pipe_r = -1
        self.pipe_w = -1
        self.pipe_size = 0
        self.grown = False
        self.read = 0  # bytes read from src so far, to tell a bulk transfer
        self.buffered = 0  # bytes in the pipe, read from src and not yet written to dst
        self.done = False
        self.reading = False  # a reader is registered on src
        self.writing = False  # a writer is registered on dst

    def open_pipe(self) -> None:
        if _spare_pipes:
            self.pipe_r, self.pipe_w, self.pipe_size = _spare_pipes.pop()
            return
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.pipe_size = _pipe_capacity(self.pipe_w)

    def close_pipe(self) -> None:
        if self.pipe_r < 0:
            return
        if not self.grown and len(_spare_pipes) < MAX_SPARE_PIPES and _pipe_empty(self.pipe_r):
            _spare_pipes.append((self.pipe_r, self.pipe_w, self.pipe_size))
        else:
            os.close(self.pipe_r)
            os.close(self.pipe_w)
        self.pipe_r = self.pipe_w = -1


def _pipe_empty(fd: int) -> bool:
    """Whether a pipe holds no byte (so none of one tunnel can reach another); False when it
    cannot tell."""
    import fcntl
    import termios

    try:
        return _INT.unpack(fcntl.ioctl(fd, termios.FIONREAD, bytes(_INT.size)))[0] == 0
    except (OSError, AttributeError):
        return False


def _grow_pipe(fd: int, size: int) -> int:
    """Asks for a `size`-byte pipe and returns the capacity it has (unchanged if refused)."""
    import fcntl

    with contextlib.suppress(OSError, AttributeError):
        return int(fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size))
    return _pipe_capacity(fd)


def _pipe_capacity(fd: int) -> int:
    import fcntl

    try:
        return int(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
    except (OSError, AttributeError):
        return 64 << 10  # the Linux default since 2.6.11


class _SpliceRelay(_Session):
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: socket.socket,
        upstream: socket.socket,
        counter: Counter,
        idle_timeout: float | None,
        pipe_size: int,
    ) -> None:
        super().__init__(loop, counter, idle_timeout)
        self._pipe_size = pipe_size
        self._up = _Direction(client, upstream, True)
        self._down = _Direction(upstream, client, False)
        self._moved_any = False

    async def run(self) -> str | None:
        """The reason the relay ended, or None when splice does not work on these sockets and
        nothing has moved yet (the caller then copies instead)."""
        try:
            for direction in (self._up, self._down):
                direction.open_pipe()
        except OSError:
            # Out of fds (or pipes refused): the copy needs none, so it takes over.
            self._teardown()
            return None
        try:
            self.start_timer()
            self._on_ready(self._up)
            self._on_ready(self._down)
            return await self.outcome()
        finally:
            self._teardown()

    def _on_ready(self, d: _Direction) -> None:
        try:
            self._pump(d)
        except Exception as exc:
            self.fail(exc)

    def _pump(self, d: _Direction) -> None:
        """Moves what can be moved now for one direction, then waits for what it needs next."""
        if self.finished.done() or d.done:
            return
        moved = False
        try:
            for _ in range(_SPLICE_STEPS):
                if d.buffered:
                    n = os.splice(d.pipe_r, d.dst, d.buffered, flags=_SPLICE_FLAGS)
                    if n <= 0:
                        # A pipe holding bytes always gives some; no progress would spin.
                        self.finish(ERROR)
                        return
                    d.buffered -= n
                    if d.is_up:
                        self.counter.up += n
                    else:
                        self.counter.down += n
                    moved = True
                    continue
                n = os.splice(d.src, d.pipe_w, d.pipe_size, flags=_SPLICE_FLAGS)
                if n == 0:
                    self._end_of_stream(d)
                    return
                d.buffered += n
                moved = True
                d.read += n
                if not d.grown and d.read >= GROW_AFTER:
                    d.grown = True
                    if self._pipe_size > d.pipe_size:
                        d.pipe_size = _grow_pipe(d.pipe_w, self._pipe_size)
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno in _UNSUPPORTED and not self._moved_any and not moved:
                self.finish(None)
            else:
                self.finish(_reason_of(exc))
            return
        finally:
            if moved:
                self._moved_any = True
                self.last_moved = self.loop.time()
        # Steps used up or EAGAIN: readiness (level-triggered) calls back when it can go on.
        self._wait(d)

    def _wait(self, d: _Direction) -> None:
        loop = self.loop
        if d.buffered:
            if d.reading:
                loop.remove_reader(d.src)
                d.reading = False
            if not d.writing:
                loop.add_writer(d.dst, self._on_ready, d)
                d.writing = True
        else:
            if d.writing:
                loop.remove_writer(d.dst)
                d.writing = False
            if not d.reading:
                loop.add_reader(d.src, self._on_ready, d)
                d.reading = True

    def _end_of_stream(self, d: _Direction) -> None:
        # The pipe is empty (it is read from the source only then): everything is written.
        d.done = True
        self._unregister(d)
        d.close_pipe()
        _shutdown_write(d.dst_sock)
        if self._up.done and self._down.done:
            self.finish(CLOSED)

    def _unregister(self, d: _Direction) -> None:
        if d.reading:
            self.loop.remove_reader(d.src)
            d.reading = False
        if d.writing:
            self.loop.remove_writer(d.dst)
            d.writing = False

    def _teardown(self) -> None:
        # Registrations go before any fd closes: a closed fd number can be reused at once, and
        # the loop would then watch (or drop) someone else's fd.
        self.stop_timer()
        for d in (self._up, self._down):
            self._unregister(d)
            d.close_pipe()


class _CopyRelay(_Session):
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: socket.socket,
        upstream: socket.socket,
        counter: Counter,
        idle_timeout: float | None,
    ) -> None:
        super().__init__(loop, counter, idle_timeout)
        self._client = client
        self._upstream = upstream
        self._open = 2

    async def run(self) -> str | None:
        tasks = [
            self._spawn(self._copy(self._client, self._upstream, True)),
            self._spawn(self._copy(self._upstream, self._client, False)),
        ]
        try:
            self.start_timer()
            return await self.outcome()
        finally:
            self.stop_timer()
            await _cancel_and_wait(tasks)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self.loop.create_task(coro)
        task.add_done_callback(self._copy_done)
        return task

    async def _copy(self, src: socket.socket, dst: socket.socket, is_up: bool) -> None:
        loop = self.loop
        counter = self.counter
        buffer = bytearray(COPY_CHUNK)
        view = memoryview(buffer)
        while True:
            n = await loop.sock_recv_into(src, buffer)
            if n == 0:
                break
            self.last_moved = loop.time()
            await loop.sock_sendall(dst, view[:n])
            self.last_moved = loop.time()
            if is_up:
                counter.up += n
            else:
                counter.down += n
        _shutdown_write(dst)

    def _copy_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, OSError):
            self.finish(_reason_of(exc))
        elif exc is not None:
            self.fail(exc)
        else:
            self._open -= 1
            if self._open == 0:
                self.finish(CLOSED)


async def _cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancels the copy tasks and waits until they have run their cancellation: only then have
    they dropped their loop registrations, and only then may the sockets close. A second cancel
    of the caller meanwhile is held back until then and re-raised."""
    for task in tasks:
        task.cancel()
    interrupted = False
    for _ in range(4):  # a cancelled task ends on its next step; this only absorbs re-cancels
        pending = [task for task in tasks if not task.done()]
        if not pending:
            break
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            interrupted = True
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved
    if interrupted:
        raise asyncio.CancelledError


__all__ = [
    "CANCELLED",
    "CLOSED",
    "COPY_CHUNK",
    "DEFAULT_PIPE_SIZE",
    "ERROR",
    "GROW_AFTER",
    "IDLE_TIMEOUT",
    "RESET",
    "Counter",
    "RelayResult",
    "relay",
    "splice_available",
]
