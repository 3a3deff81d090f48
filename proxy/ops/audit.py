"""The audit log: JSON lines, one per decision and one per connection close
(docs/observability.md).

Both planes (the L7 engine and the L4 fast path) write through `AuditLog`, so their lines have
one schema. Every key is present on every line of its kind (null when unknown), so consumers
need no per-plane cases; the only optional key is `truncated`, which names the fields that were
cut to their cap.

Hosts, SNI, paths and methods come from clients. Each string is capped, and lines are encoded
with `ensure_ascii=True`: newlines, U+2028, and terminal escape sequences all become `\\uXXXX`
escapes, so one record is always exactly one line, and `tail -f` on a terminal cannot be driven
by a client.

Lines are written in batches, one write per event-loop iteration: a busy proxy allows and
closes thousands of connections a second, and one `write(2)` per line was a tenth of the CPU
of a tunnel. A deny line is the exception: it is written (after any lines gathered before it)
before the caller goes on to send the refusal, so a client that reads the log the moment it is
refused finds its line there. Outside a running loop (the CLI, tests) every line is written at
once. `close` (and `flush`) write what is gathered.

A write failure (disk full, closed pipe) never raises: an audit log that fails must not take the
proxy down with it. Failures are counted in `write_errors` (and `egress_audit_write_errors_total`
when a `Metrics` is given) and reported once on stderr.

Given a `Denials` ring (proxy/ops/denials.py, served as `/denials`), every deny decision written
here is also added to it, with the same time as its line: one decision, one line, one entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from policy.dimensions import Verdict
from proxy.decide.events import CloseEvent, DecisionEvent

if TYPE_CHECKING:
    from proxy.decide.asks import AskEvent
    from proxy.ops.denials import Denials
    from proxy.ops.metrics import Metrics


# Lines gathered before a write regardless of the loop: bounds what one iteration holds.
MAX_PENDING = 512


class AuditLog:
    """Writes audit lines to a file path (appended, created 0600), a given text stream, or,
    by default, whatever `sys.stdout` is at write time."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        stream: TextIO | None = None,
        session: str | None = None,
        metrics: Metrics | None = None,
        denials: Denials | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if path is not None and stream is not None:
            raise ValueError("give an audit log path or a stream, not both")
        self.session = session
        self.metrics = metrics
        self.denials = denials
        self.write_errors = 0
        self._clock = clock
        self._stream = stream
        self._fd: int | None = None
        self._closed = False
        self._reported = False
        # Set after a partial write: the next line then starts with a newline, so a torn line
        # stays a line of its own instead of corrupting the next record too.
        self._torn = False
        # Lines gathered in this loop iteration, and whether their write is scheduled.
        self._pending: list[str] = []
        self._scheduled = False
        if path is not None:
            # Raw fd writes, one os.write per line: no userspace buffer keeps growing while the
            # disk is full, and with O_APPEND each line lands whole at the end even if another
            # process appends to the same file. Opening fails loudly: that
            # is start-up, where a misconfigured audit path must stop the proxy rather than run
            # unaudited.
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- events -------------------------------------------------------------------------------

    def decision(self, event: DecisionEvent | None = None, /, **fields: Any) -> None:
        """Log one decision: a `DecisionEvent`, or its fields as keyword arguments."""
        self.write(event if event is not None else DecisionEvent(**fields))

    def closed(self, event: CloseEvent | None = None, /, **fields: Any) -> None:
        """Log one connection close: a `CloseEvent`, or its fields as keyword arguments."""
        self.write(event if event is not None else CloseEvent(**fields))

    def write(self, event: DecisionEvent | CloseEvent | AskEvent) -> None:
        # The line is made now, with the time of the event; when it is written is `flush`'s.
        now = self._clock()
        try:
            line = event.line(session=self.session, now=now)
        except TypeError:
            # A caller's bug put an unhashable value in a text field: written as its text.
            event = _as_text(event)
            line = event.line(session=self.session, now=now)
        if (
            self.denials is not None
            and type(event) is DecisionEvent
            and event.decision == Verdict.DENY
        ):
            # Fed here, where the line is made, and whether or not the write succeeds: the
            # denial happened, and a harness reading /denials should hear of it either way.
            self.denials.add(event, now)
        pending = self._pending
        pending.append(line)
        if type(event) is DecisionEvent and event.decision == "deny":
            self.flush()
        elif not self._scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._scheduled = True
            loop.call_soon(self.flush)
        elif len(pending) >= MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        """Writes the lines gathered so far (one write)."""
        self._scheduled = False
        pending = self._pending
        if pending:
            self._pending = []
            pending.append("")
            self._emit("\n".join(pending))

    # -- output -------------------------------------------------------------------------------

    def _emit(self, lines: str) -> None:
        if self._closed:
            self._failed(ValueError("audit log is closed"), lines.count("\n"))
            return
        if self._torn:
            lines = "\n" + lines
        written = 0
        data = lines.encode("ascii")
        try:
            if self._fd is not None:
                try:
                    while written < len(data):
                        written += os.write(self._fd, data[written:])
                finally:
                    # Nothing written leaves the previous state: a torn line still needs its
                    # newline, and a clean one still does not.
                    self._torn = written < len(data) and (written > 0 or self._torn)
            else:
                stream = self._stream if self._stream is not None else sys.stdout
                stream.write(lines)
                stream.flush()
                self._torn = False
        # OSError: disk full, broken pipe. ValueError: a closed stream. RuntimeError: a
        # buffered stream re-entered (e.g. from a signal handler) refuses the nested write.
        except (OSError, ValueError, RuntimeError) as exc:
            self._failed(exc, max(data[written:].count(b"\n"), 1))

    def _failed(self, exc: BaseException, lines: int = 1) -> None:
        """`lines` audit lines are lost (a torn one counts as lost)."""
        self.write_errors += lines
        if self.metrics is not None:
            for _ in range(lines):
                self.metrics.audit_write_error()
        if self._reported:
            return
        # Set before writing to stderr, so a nested failure cannot report twice.
        self._reported = True
        with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
            print(
                f"egress-proxy: audit log write failed ({exc!r}); further failures are only "
                "counted (egress_audit_write_errors_total)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        """Closes a file the log opened; a stream it was given (or stdout) stays open."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


def _as_text(
    event: DecisionEvent | CloseEvent | AskEvent,
) -> DecisionEvent | CloseEvent | AskEvent:
    """`event` with every value that is not a str, int, float, tuple or None turned to text."""
    changes: dict[str, Any] = {
        name: str(value)
        for name in event.__dataclass_fields__
        if not isinstance(value := getattr(event, name), str | int | float | tuple | type(None))
    }
    return dataclasses.replace(event, **changes)
