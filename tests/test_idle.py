"""The idle timer the relay, its splice mode and the HTTP plane share (proxy/net/idle.py): it fires
once nothing has moved for its timeout, and moving bytes costs no timer (one is armed, and armed
again only when it fires early). On a clock of the test's own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from proxy.net.idle import IdleTimer


class Handle:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    """The two things an IdleTimer asks of its loop, on a clock that moves when told."""

    def __init__(self) -> None:
        self.now = 100.0
        self.armed: list[Handle] = []
        self.calls = 0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> Handle:
        handle = Handle(when, callback)
        self.calls += 1
        self.armed.append(handle)
        return handle

    def run_until(self, when: float) -> None:
        """Moves the clock to `when`, firing what is due on the way."""
        while due := sorted(
            (h for h in self.armed if not h.cancelled and h.when <= when), key=lambda h: h.when
        ):
            handle = due[0]
            self.armed.remove(handle)
            self.now = handle.when
            handle.callback()
        self.now = when


def timer(timeout: float | None) -> tuple[IdleTimer, Clock, list[float]]:
    clock = Clock()
    fired: list[float] = []
    idle = IdleTimer(
        cast(asyncio.AbstractEventLoop, clock), timeout, lambda: fired.append(clock.now)
    )
    return idle, clock, fired


def test_it_fires_once_when_nothing_moved() -> None:
    idle, clock, fired = timer(5.0)
    idle.start()
    clock.run_until(200.0)
    assert fired == [105.0]


def test_it_counts_from_the_last_move_and_a_move_arms_nothing() -> None:
    idle, clock, fired = timer(5.0)
    idle.start()
    for step in range(1, 1000):
        clock.now = 100.0 + step * 0.004  # a thousand moves within four seconds
        idle.moved()
    assert clock.calls == 1
    clock.run_until(200.0)
    # Armed for 105 at the start, again for the last move's deadline when that fired: twice.
    assert clock.calls == 2
    assert len(fired) == 1 and abs(fired[0] - 108.996) < 1e-9


def test_stopped_or_without_a_timeout_it_never_fires() -> None:
    idle, clock, fired = timer(5.0)
    idle.start()
    idle.stop()
    clock.run_until(200.0)
    endless, endless_clock, endless_fired = timer(None)
    endless.start()
    endless_clock.run_until(10_000.0)
    assert fired == endless_fired == [] and endless_clock.armed == []
