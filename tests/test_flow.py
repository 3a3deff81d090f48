"""The read side of a transport (proxy/net/flow.py): paused while any reason holds it, resumed only
when the last one goes, never by a reason that did not pause it."""

from __future__ import annotations

import asyncio
import itertools
from typing import cast

import pytest

from proxy.net.flow import Hold, Reading


class Transport:
    """What a Reading calls on its transport, recorded; `reading` mirrors a real transport's
    state (pausing a paused one is nothing)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reading = True

    def pause_reading(self) -> None:
        self.calls.append("pause")
        self.reading = False

    def resume_reading(self) -> None:
        self.calls.append("resume")
        self.reading = True


def reading_of() -> tuple[Reading, Transport]:
    transport = Transport()
    return Reading(cast(asyncio.Transport, transport)), transport


@pytest.mark.parametrize(
    ("first", "other"),
    list(itertools.permutations(Hold, 2)),
    ids=[f"{a.name}-{b.name}" for a, b in itertools.permutations(Hold, 2)],
)
def test_one_reason_never_lifts_another(first: Hold, other: Hold) -> None:
    reading, transport = reading_of()
    reading.pause(first)
    reading.pause(other)
    reading.resume(first)
    assert not transport.reading and reading.reasons == {other}
    reading.resume(other)
    assert transport.reading and not reading.paused
    assert transport.calls == ["pause", "resume"]


def test_pause_and_resume_are_idempotent() -> None:
    reading, transport = reading_of()
    reading.pause(Hold.BODY_HELD)
    reading.pause(Hold.BODY_HELD)
    assert transport.calls == ["pause"]
    reading.resume(Hold.BODY_HELD)  # one resume undoes any number of pauses for one reason
    reading.resume(Hold.BODY_HELD)
    assert transport.calls == ["pause", "resume"]


def test_resuming_a_reason_that_does_not_hold_is_nothing() -> None:
    reading, transport = reading_of()
    reading.resume(Hold.CLIENT_SLOW)
    reading.pause(Hold.HANDOFF)
    reading.resume(Hold.CLIENT_SLOW)
    assert transport.calls == ["pause"] and reading.reasons == {Hold.HANDOFF}


def test_clear_drops_every_reason_and_reads() -> None:
    reading, transport = reading_of()
    reading.pause(Hold.EARLY_FULL)
    reading.pause(Hold.CLIENT_SLOW)
    reading.clear()
    assert transport.reading and reading.reasons == frozenset()
    # A new holder reads even a transport someone paused without its Reading.
    transport.pause_reading()
    reading.clear()
    assert transport.calls == ["pause", "resume", "pause", "resume"]


def test_an_ended_transport_is_never_paused_or_resumed_again() -> None:
    reading, transport = reading_of()
    reading.pause(Hold.PIPELINED)
    reading.end()
    reading.pause(Hold.BODY_HELD)
    reading.resume(Hold.PIPELINED)
    reading.resume(Hold.BODY_HELD)
    reading.clear()
    assert transport.calls == ["pause"]
    assert reading.ended


@pytest.mark.parametrize("hold", list(Hold))
def test_every_reason_is_a_bit_of_its_own(hold: Hold) -> None:
    assert hold.bit_count() == 1
    assert sum(Hold) == (1 << len(Hold)) - 1
