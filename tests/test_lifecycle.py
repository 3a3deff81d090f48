"""The life of a front-door connection (proxy/dataplane/lifecycle.py): the moves its module states,
no others (an impossible one raises ProxyError, which the front door's fail-closed paths turn
into a denial), and the rules they keep; then a Connection that asks for them."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections import deque
from types import SimpleNamespace
from typing import Any, cast

import pytest

from policy.reasons import Reason
from proxy.common.errors import ProxyError
from proxy.common.refusals import Refused
from proxy.dataplane import lifecycle
from proxy.dataplane.connection import Connection, Door
from proxy.dataplane.lifecycle import ENDED, MOVES, OWNED, SETTING_UP, Lifecycle, Mark, Phase
from proxy.decide.events import CloseEvent
from proxy.net.flow import Hold

PAIRS = list(itertools.product(Phase, Phase))


def at(phase: Phase) -> Lifecycle:
    life = Lifecycle()
    life.phase = phase
    return life


def reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, deque([start])
    while todo:
        for following in MOVES[todo.popleft()]:
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


# -- the table ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[f"{a.name}-{b.name}" for a, b in PAIRS])
def test_only_the_stated_moves_are_made(before: Phase, after: Phase) -> None:
    life = at(before)
    if after in MOVES[before]:
        life.to(after)
        assert life.phase is after
        return
    with pytest.raises(ProxyError) as raised:
        life.to(after)
    assert raised.value.reason == Reason.INTERNAL_ERROR
    message = raised.value.message
    assert before.name.lower() in message and after.name.lower() in message
    assert life.phase is before  # an impossible move changes nothing


def test_the_module_states_the_table_it_keeps() -> None:
    stated = {
        Phase[before]: frozenset(Phase[name] for name in moves.split() if name != "(final)")
        for before, moves in re.findall(r"^    ([A-Z]+) +-> (.+)$", lifecycle.__doc__ or "", re.M)
    }
    assert stated == MOVES


def test_a_connection_starts_accepted_with_no_marks() -> None:
    life = Lifecycle()
    assert life.phase is Phase.ACCEPTED
    assert not any(life.has(mark) for mark in Mark)


def test_every_phase_is_in_the_table_and_reachable() -> None:
    assert set(MOVES) == set(Phase)
    assert reachable(Phase.ACCEPTED) == set(Phase)


def test_handed_and_closed_are_final() -> None:
    # One close line, one writer of it: nothing leaves the engine's hands or a written line.
    assert MOVES[Phase.HANDED] == MOVES[Phase.CLOSED] == frozenset()


def test_every_phase_but_handed_ends_in_one_close_line() -> None:
    for phase in set(Phase) - {Phase.HANDED}:
        assert Phase.CLOSED in reachable(phase), phase


def test_an_owned_connection_is_never_set_up_refused_or_handed_again() -> None:
    for phase in OWNED:
        assert not reachable(phase) & (SETTING_UP | {Phase.REFUSED, Phase.CLOSING}), phase
    assert MOVES[Phase.SERVED] == {Phase.RELAYED, Phase.CLOSED}  # a WebSocket, or its end


def test_ends_lead_only_to_ends_and_a_refused_connection_is_never_owned() -> None:
    for phase in ENDED:
        assert MOVES[phase] <= ENDED, phase
    assert not reachable(Phase.REFUSED) & OWNED
    assert not reachable(Phase.CLOSING) & OWNED


def test_marks_are_orthogonal_and_stay() -> None:
    life = at(Phase.SERVED)
    life.mark(Mark.ANSWERED)
    life.mark(Mark.ANSWERED)
    life.to(Phase.CLOSED)
    life.mark(Mark.LOST)
    assert life.answered and life.lost and not life.has(Mark.COUNTED)
    assert repr(life) == "<Lifecycle closed LOST,ANSWERED>"


# -- a Connection asks for them -----------------------------------------------------------------


class Transport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.calls: list[str] = []

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 5000) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.written += data

    def __getattr__(self, name: str) -> Any:
        # close, abort, pause_reading, resume_reading: recorded.
        return lambda *args: self.calls.append(name)


def connected() -> tuple[Connection, Transport, list[CloseEvent]]:
    """A connection on a door that admits it and records its close lines, and whose vetter
    records the reasons of the refusal lines it is given."""
    closes: list[CloseEvent] = []
    door = SimpleNamespace(
        admit=lambda connection: True,
        forget=lambda connection: None,
        metrics=None,
        audit=SimpleNamespace(closed=closes.append),
        vetter=SimpleNamespace(refused=[]),
    )
    door.vetter.refusal = lambda refused, *args, **context: door.vetter.refused.append(
        refused.reason
    )
    connection = Connection(cast(Door, door), cast(Any, None))
    transport = Transport()
    connection.connection_made(cast(asyncio.Transport, transport))
    return connection, transport, closes


REFUSED = Refused(403, Reason.NOT_ALLOWED, "no")


def test_a_refused_connection_answers_once_and_is_never_served() -> None:
    connection, transport, closes = connected()
    connection.refuse(REFUSED, "a.test", 443, stage="name", record=False)
    assert connection.life.phase is Phase.REFUSED and connection.life.answered
    assert transport.written.startswith(b"HTTP/1.1 403 ") and transport.calls == ["close"]
    answered = bytes(transport.written)
    connection.refuse(REFUSED, "a.test", 443, stage="name", record=False)
    assert transport.written == answered  # no second answer
    with pytest.raises(ProxyError):
        connection.take_over(cast(Any, SimpleNamespace(quiesce=lambda: None)))
    connection.connection_lost(None)
    assert connection.life.phase is Phase.CLOSED and connection.life.lost
    assert [close.reason for close in closes] == [Reason.NOT_ALLOWED]


def test_a_closed_connection_writes_one_close_line_whoever_asks() -> None:
    connection, _, closes = connected()
    connection.connection_lost(None)
    connection.finish(Reason.CLOSED)
    connection.refuse(REFUSED, None, None, stage="accept", record=False)  # too late: nothing
    assert [close.reason for close in closes] == [Reason.CLIENT_CLOSED]
    assert connection.life.phase is Phase.CLOSED
    for ask in (connection.classifying, connection.setting_up):
        with pytest.raises(ProxyError):
            ask()


def test_the_setup_phases_and_a_person_s_answer() -> None:
    connection, _, _ = connected()
    connection.life.to(Phase.SETUP)  # as spawn does, without a task
    connection.held()
    assert connection.life.phase is Phase.HELD
    connection.released()
    connection.classifying()
    connection.held()  # only the setup asks a person: reading the first flight is not held
    assert connection.life.phase is Phase.CLASSIFYING
    connection.setting_up()
    connection.setting_up()  # vetting, then a dial: still setting up
    assert connection.life.phase is Phase.SETUP


def test_a_served_connection_stays_served_while_a_request_is_held() -> None:
    connection, _, _ = connected()
    connection.take_over(cast(Any, SimpleNamespace(quiesce=lambda: None)))
    connection.held()
    connection.released()
    assert connection.life.phase is Phase.SERVED


def test_the_client_eof_is_its_transport_s_and_no_pause_outlives_it() -> None:
    connection, transport, _ = connected()
    connection.buffer += b"x" * (64 << 10)
    connection.data_received(b"x")  # past MAX_PENDING while the setup task runs
    assert connection.reading.reasons == {Hold.PENDING_FULL}
    connection.life.to(Phase.SETUP)
    connection.task = cast(Any, SimpleNamespace(done=lambda: False))  # a setup task, running
    connection.eof_received()
    assert connection.reading.ended and connection.life.phase is Phase.SETUP
    assert connection.abandoned()  # a client that ended its side while held has gone
    assert transport.calls == ["pause_reading", "abort"]


def test_an_impossible_move_is_denied_on_the_fail_closed_path() -> None:
    connection, transport, closes = connected()
    connection.life.to(Phase.SETUP)
    with pytest.raises(ProxyError) as raised:
        connection.life.to(Phase.SERVED)  # a setup hands plain HTTP over only once classified
    connection.failed(raised.value)  # what the setup task's end does with any exception
    assert transport.written.startswith(b"HTTP/1.1 403 ")
    assert b"internal_error" in transport.written
    assert cast(Any, connection.door.vetter).refused == [Reason.INTERNAL_ERROR]
    connection.connection_lost(None)
    assert [close.reason for close in closes] == [Reason.INTERNAL_ERROR]
