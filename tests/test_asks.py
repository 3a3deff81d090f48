"""The holding of asks (proxy/decide/asks.py) on an event loop of its own, and the token file
(proxy/app/ask_token.py): shared asks, caps, timeout, a reload's reconsidering, the lines."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from support.running import eventually

from policy.asking import ALLOW_SESSION, Question
from proxy.app.ask_token import read_or_create_token
from proxy.common.errors import ProxyError
from proxy.decide import asks as asks_module
from proxy.decide.asks import HELD_CLIENT, AskEvent, AskLimits, Asks
from proxy.decide.vetting import Peer

PEER = Peer(("127.0.0.1", 5000), "c-1")


def hold(asks: Asks, question: Question, target: str = "a.test:443"):  # type: ignore[no-untyped-def]
    return asks.hold(
        question, target=target, entry=question.host, reason="not_allowed",
        protocol="connect", plane="l4", peer=PEER,
    )  # fmt: skip


def test_identical_questions_share_one_ask_and_a_grant_is_made() -> None:
    async def main() -> None:
        lines: list[AskEvent] = []
        counted: list[str] = []
        asks = Asks(AskLimits(timeout=10), audit=lines.append, count=counted.append)
        question = Question("a.test", 443)
        first = asyncio.ensure_future(hold(asks, question))
        second = asyncio.ensure_future(hold(asks, question))
        await eventually(lambda: asks.held == 2, what="both held")
        (pending,) = asks.pending()
        assert pending["held"] == 2 and asks.holding("a.test:443")
        done = asks.answer(pending["id"], ALLOW_SESSION)
        assert done is not None and done["grant"]["decision"] == ALLOW_SESSION
        assert await first == (ALLOW_SESSION, pending["id"]) == await second
        assert asks.pending() == [] and asks.held == 0 and not asks.holding("a.test:443")
        assert asks.answer(pending["id"], ALLOW_SESSION) is None
        assert [line.action for line in lines] == ["asked", "answered", "granted"]
        assert counted == [ALLOW_SESSION]
        with pytest.raises(ValueError):
            asks.answer("x", "maybe")

    asyncio.run(main())


def test_caps_timeout_reconsider_and_a_waiter_that_leaves() -> None:
    async def main() -> None:
        asks = Asks(AskLimits(timeout=0.2, max_pending=1, max_held=2))
        waiting = asyncio.ensure_future(hold(asks, Question("a.test", 443)))
        await eventually(lambda: asks.held == 1, what="the first held")
        assert await hold(asks, Question("b.test", 443)) == ("overloaded", None)
        assert (await waiting)[0] == "timeout"
        # A reload that no longer leaves it to a person ends the ask.
        kept = asyncio.ensure_future(hold(asks, Question("a.test", 443)))
        await eventually(lambda: asks.held == 1, what="held again")
        assert asks.reconsider(lambda target: True) == 0
        assert asks.reconsider(lambda target: False) == 1
        assert (await kept)[0] == "reload"
        # A waiter that is cancelled (its client went away) is forgotten; the ask stays.
        gone = asyncio.ensure_future(hold(asks, Question("c.test", 443), "c.test:443"))
        await eventually(lambda: asks.held == 1, what="held")
        gone.cancel()
        await eventually(lambda: asks.held == 0, what="the waiter forgotten")
        (pending,) = asks.pending()
        assert pending["held"] == 0 and asks.held == 0

    asyncio.run(main())


def test_the_stream_queue_and_an_ask_line() -> None:
    async def main() -> None:
        asks = Asks(AskLimits(timeout=5))
        queue = asks.subscribe()
        waiting = asyncio.ensure_future(hold(asks, Question("a.test", 443, "/v1/", "https")))
        await eventually(lambda: not queue.empty(), what="the ask on the stream")
        shown = queue.get_nowait()
        assert shown is not None and shown["path"] == "/v1/" and shown["held"] == 1
        asks.close()
        assert queue.get_nowait() is None
        asks.answer(shown["id"], "deny")
        assert (await waiting)[0] == "deny"

    asyncio.run(main())
    long = AskEvent("asked", "1", Question("a.test", 443, "/" + "x" * 5000, "https"))
    line = json.loads(long.line(session="s", now=0))
    assert line["event"] == "ask" and len(line["path"]) == 2048


class Client:
    """A connection as the asks core sees it (asks.HeldClient): what it was told, in order."""

    def __init__(self, task: asyncio.Future[object] | None = None) -> None:
        self.told: list[str] = []
        self.gone = False
        self.task = task

    def held(self) -> None:
        self.told.append("held")

    def released(self) -> None:
        self.told.append("released")

    def abandoned(self) -> bool:
        self.told.append("abandoned?")
        if self.gone and self.task is not None:
            self.task.cancel()  # as the front door ends a connection whose client went away
        return self.gone


def test_a_held_connection_is_told_it_is_held_and_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asks_module, "WATCH_SECONDS", 0.01)

    async def main() -> None:
        asks = Asks(AskLimits(timeout=5))
        answered, left = Client(), Client()
        HELD_CLIENT.set(answered)  # a task copies the context it is created in
        waiting = asyncio.ensure_future(hold(asks, Question("a.test", 443)))
        await eventually(lambda: "abandoned?" in answered.told, what="held and watched")
        asks.answer(asks.pending()[0]["id"], "deny")
        assert (await waiting)[0] == "deny"
        assert answered.told[0] == "held" and answered.told[-1] == "released"
        assert set(answered.told[1:-1]) == {"abandoned?"}
        HELD_CLIENT.set(left)
        leaving = asyncio.ensure_future(hold(asks, Question("b.test", 443), "b.test:443"))
        left.task = leaving
        await eventually(lambda: "abandoned?" in left.told, what="held and watched")
        left.gone = True
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert left.told[-1] == "released" and asks.held == 0

    asyncio.run(main())


def test_token_files(tmp_path: Path) -> None:
    made = tmp_path / "token"
    token = read_or_create_token(str(made))
    assert (made.stat().st_mode & 0o777) == 0o600 and read_or_create_token(str(made)) == token
    for content, mode, words in (
        ("short\n", 0o600, "does not hold a token"),
        ("\xff" * 40, 0o600, "does not hold a token"),
        ("a-long-enough-token-0123456789\n", 0o640, "chmod 600"),
    ):
        bad = tmp_path / f"bad{mode}{len(content)}"
        bad.write_text(content, errors="surrogateescape")
        bad.chmod(mode)
        with pytest.raises(ProxyError, match=words):
            read_or_create_token(str(bad))
    with pytest.raises(ProxyError, match="not a regular file"):
        read_or_create_token(str(tmp_path))
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(ProxyError):
        read_or_create_token(str(link))
    with pytest.raises(ProxyError, match="cannot create"):
        read_or_create_token(str(tmp_path / "missing-dir" / "token"))
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.write_text("a-long-enough-token-0123456789\n")
        theirs.chmod(0o600)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ProxyError, match="owned by uid"):
            read_or_create_token(str(theirs))
