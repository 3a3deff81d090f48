"""Suite-wide set-up and shared fixtures.

The tests never touch the developer's home directory (the inspection CA defaults to
~/.local/share/egress-proxy/ca, curl reads ~/.curlrc), for in-process code and the processes the
tests start alike.

A test that opens a socket (binds or connects one) or starts a process must be marked
`integration` (tests/README.md), so that `pytest -m "not integration"` stays a quick inner loop:
an audit hook sees those events on the main thread, and a test that is not marked fails at its
teardown, naming what it did."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme
from support.dns_server import DNSServer, running_dns_server
from support.sandbox import Subnets, session_objects


@pytest.fixture(autouse=True, scope="session")
def _isolated_home() -> Iterator[None]:
    previous = os.environ.get("HOME")
    with tempfile.TemporaryDirectory(prefix="egress-home-") as home:
        os.environ["HOME"] = home
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("HOME", None)
            else:
                os.environ["HOME"] = previous


# Audit events of a socket or a process (docs.python.org: audit events table). A socketpair is
# neither (every event loop makes one): only what binds, connects or spawns counts.
OPENING = frozenset({"socket.bind", "socket.connect", "subprocess.Popen", "os.posix_spawn"})
_opened: list[str] = []


def _audit(event: str, args: tuple[object, ...]) -> None:
    # The main thread only: a server thread left by an earlier test must not blame this one.
    if event in OPENING and threading.current_thread() is threading.main_thread():
        _opened.append(event)


sys.addaudithook(_audit)  # for the whole run: audit hooks cannot be removed


@pytest.fixture(autouse=True)
def _integration_is_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    _opened.clear()
    yield
    if _opened and request.node.get_closest_marker("integration") is None:
        events = ", ".join(sorted(set(_opened)))
        pytest.fail(f"opens sockets or starts processes ({events}): mark it integration")


@pytest.fixture
def resolved_by_os(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """socket.getaddrinfo fails on every name (numeric addresses still work) and records it:
    a test using this proves no code path let mitmproxy or the OS resolve a name."""
    real = socket.getaddrinfo
    names: list[str] = []

    def numeric_only(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        text = host.decode() if isinstance(host, bytes) else host
        if text is not None:
            try:
                ipaddress.ip_address(str(text).split("%")[0])
            except ValueError:
                names.append(str(text))
                raise socket.gaierror(
                    socket.EAI_NONAME, f"test forbids resolving {text!r}"
                ) from None
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", numeric_only)
    return names


@pytest.fixture
def dns() -> Iterator[DNSServer]:
    """A DNS server of the test's own on 127.0.0.1 (tests/support/dns_server.py); modules that want
    names preset override this fixture and ask for it by the same name."""
    with running_dns_server() as server:
        yield server


# The data plane's in-process tests run on asyncio's own loop and on uvloop's (the one
# `egress-proxy run` uses): the two loops' transports differ in the details a relay relies on.
BOTH_LOOPS = frozenset({"test_relay.py", "test_frontdoor.py", "test_http.py", "test_engine.py"})


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name in BOTH_LOOPS:
        import uvloop

        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture(scope="module")
def upstream_ca() -> trustme.CA:
    """The CA of a module's own TLS upstreams (support/tls.py issues their certificates)."""
    return trustme.CA()


# -- sandbox sessions (support/sandbox.py) --------------------------------------------------


@pytest.fixture
def subnets() -> Subnets:
    """The session's subnets, random in documentation space (v4) and ULA (v6)."""
    return Subnets.random()


@pytest.fixture
def nothing_left(subnets: Subnets) -> Iterator[None]:
    """Nothing of the session may be left after the test: the sandbox modules use it on every
    test (`pytest.mark.usefixtures("nothing_left")` in their pytestmark)."""
    before = session_objects(subnets)
    yield
    left = session_objects(subnets) - before
    assert not left, f"the session left {sorted(left)}"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory COMMAND's user (nobody) can read, with one, `work`, it can write to."""
    directory = Path(tempfile.mkdtemp(prefix="egress-sb-shared-"))
    try:
        directory.chmod(0o755)
        (directory / "work").mkdir()
        (directory / "work").chmod(0o777)  # mkdir's mode goes through the umask
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
