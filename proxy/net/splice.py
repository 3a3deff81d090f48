"""The bulk mode of a tunnel's relay: bytes move socket -> pipe -> socket with `os.splice` and
never enter user space, driven by the event loop's readiness callbacks (proxy/net/relay.py moves a
tunnel here once it has carried enough to be a bulk transfer).

    splice = SpliceRelay(loop, client, upstream, counter, idle_timeout, on_end)
    if splice.open_pipes(up_done=False, down_done=False):
        splice.start()

Semantics are the transport relay's: half-close passed on as `shutdown(SHUT_WR)` once all that was
read before it is written; a reset or error on either side ends both and resets the other
(`SO_LINGER` 0); the idle timeout counts from the last byte moved; a direction reads only after
what it read before is written, so one pipe per direction is all the relay ever holds. The relay
owns both sockets and closes them when it ends; `on_end(reason)` is called exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable
from typing import Final

from policy.reasons import Reason
from proxy.net.bytecount import Counter
from proxy.net.idle import IdleTimer

logger = logging.getLogger(__name__)


# A larger pipe means fewer splices and wake-ups per byte: about half the relay's CPU per GiB at
# 1 MiB against the default 64 KiB (benchmarks/relay_bulk.py). But the kernel charges pipe
# capacity to the user (all processes of the UID, node-wide without user namespaces): past
# /proc/sys/fs/pipe-user-pages-soft (64 MiB by default) an unprivileged user's pipes cannot grow
# and new ones get 8 KiB. So a pipe starts at the default and grows only once its direction
# has moved GROW_AFTER bytes, i.e. for bulk transfers; a refused growth is silent.
DEFAULT_PIPE_SIZE: Final = 1 << 20
GROW_AFTER: Final = 256 << 10
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
LINGER_RESET: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets


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


def reason_of(exc: BaseException) -> str:
    """The relay's end reason for a socket error."""
    # ETIMEDOUT is TCP giving up on the peer (retransmissions, keepalive): a reset in effect.
    if isinstance(exc, ConnectionError | TimeoutError):
        return Reason.RESET
    return Reason.ERROR


def _shutdown_write(sock: socket.socket) -> None:
    # A peer that is already gone will show as an error on the other direction, if it matters.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def close_socket(sock: socket.socket, abortive: bool) -> None:
    """Closes `sock`; `abortive`: with a reset (SO_LINGER 0), so the peer never mistakes a
    truncated stream for a complete one."""
    if abortive and sock.fileno() >= 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    sock.close()


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
        pending: int = _INT.unpack(fcntl.ioctl(fd, termios.FIONREAD, bytes(_INT.size)))[0]
        return pending == 0
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


class SpliceRelay:
    """One tunnel in bulk mode. Its idle timer (proxy/net/idle.py) is not pushed back on every
    chunk: moving bytes only notes the time."""

    __slots__ = (
        "_down",
        "_ended",
        "_on_end",
        "_pipe_size",
        "_up",
        "client",
        "counter",
        "idle",
        "idle_timeout",
        "loop",
        "upstream",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: socket.socket,
        upstream: socket.socket,
        counter: Counter,
        idle_timeout: float | None,
        on_end: Callable[[str], None],
        *,
        pipe_size: int = DEFAULT_PIPE_SIZE,
    ) -> None:
        self.loop = loop
        self.client = client
        self.upstream = upstream
        self.counter = counter
        self.idle_timeout = idle_timeout
        self.idle = IdleTimer(loop, idle_timeout, self._idled)
        self._on_end = on_end
        self._pipe_size = pipe_size
        self._up = _Direction(client, upstream, True)
        self._down = _Direction(upstream, client, False)
        self._ended = False

    def open_pipes(self, *, up_done: bool = False, down_done: bool = False) -> bool:
        """Takes a pipe for each direction still open (a direction already ended, its EOF
        passed on, stays ended). False when no pipe could be had (out of fds): nothing is held
        then, and the caller keeps its sockets on whatever carried them before."""
        self._up.done, self._down.done = up_done, down_done
        try:
            for direction in (self._up, self._down):
                if not direction.done:
                    direction.open_pipe()
        except OSError:
            for direction in (self._up, self._down):
                direction.close_pipe()
            return False
        return True

    def start(self) -> None:
        """Starts moving bytes (after `open_pipes`); the relay owns both sockets from here."""
        self.idle.start()
        self._on_ready(self._up)
        self._on_ready(self._down)
        if self._up.done and self._down.done:
            self.finish(Reason.CLOSED)

    def close(self, reason: str) -> None:
        """Ends the relay from outside (a reload, the drain): both sides closed."""
        self.finish(reason)

    def _idled(self) -> None:
        self.finish(Reason.IDLE_TIMEOUT)

    def finish(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        # Registrations go before any fd closes: a closed fd number can be reused at once, and
        # the loop would then watch (or drop) someone else's fd.
        self.idle.stop()
        for d in (self._up, self._down):
            self._unregister(d)
            d.close_pipe()
        abortive = reason in (Reason.RESET, Reason.ERROR)
        close_socket(self.client, abortive)
        close_socket(self.upstream, abortive)
        self._on_end(reason)

    def _on_ready(self, d: _Direction) -> None:
        try:
            self._pump(d)
        except Exception:
            logger.exception("egress: the splice relay failed")
            self.finish(Reason.ERROR)

    def _pump(self, d: _Direction) -> None:
        """Moves what can be moved now for one direction, then waits for what it needs next."""
        if self._ended or d.done:
            return
        moved = False
        try:
            for _ in range(_SPLICE_STEPS):
                if d.buffered:
                    n = os.splice(d.pipe_r, d.dst, d.buffered, flags=_SPLICE_FLAGS)
                    if n <= 0:
                        # A pipe holding bytes always gives some; no progress would spin.
                        self.finish(Reason.ERROR)
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
            self.finish(reason_of(exc))
            return
        finally:
            if moved:
                self.idle.moved()
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
            self.finish(Reason.CLOSED)

    def _unregister(self, d: _Direction) -> None:
        if d.reading:
            self.loop.remove_reader(d.src)
            d.reading = False
        if d.writing:
            self.loop.remove_writer(d.dst)
            d.writing = False
