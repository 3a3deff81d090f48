"""Guards of proxy/l7/patches.py and of the mitmproxy extension points the engine builds on: each
fails when the installed mitmproxy changes under the engine, so that a new release is reviewed
before it runs (the engine itself refuses to start then: `patches.verify`).

- DialingHandler re-implements ConnectionHandler.open_connection with our dial: the source of
  that method must be the one it was written from (behaviour: the fallback, timeout and
  not-vetted tests of tests/test_engine.py).
- InterceptInstance.serve re-implements ServerInstance.handle_stream for our handler and stack.
- AnsweringHttpLayer relies on HttpLayer.event_to_child and HttpStream.handle_protocol_error
  (behaviour: the 502 upstream_tls / upstream_refused and 504 tests), and, for invalid requests
  and refused HTTP/2 streams, on HttpStream.check_invalid, validate_request, check_killed and
  HttpLayer._handle_event; EgressHttp2Server on Http2Server.handle_h2_event and the HTTP/2
  header parsing (behaviour: tests/test_h2_interception.py).
- The custom mode is found through mitmproxy's own registries (ProxyMode.parse,
  ServerInstance.make).
"""

from __future__ import annotations

import asyncio
from importlib import metadata

import pytest
from mitmproxy.proxy import mode_servers, mode_specs

from proxy.common.errors import ProxyError
from proxy.l7 import patches
from proxy.l7.modes import InterceptInstance, InterceptMode

pytestmark = pytest.mark.integration  # it opens sockets or starts processes


@pytest.mark.parametrize("name", sorted(patches.GUARDED))
def test_each_guarded_mitmproxy_function_is_as_reviewed(name: str) -> None:
    function, digest = patches.GUARDED[name]
    assert patches.source_digest(function) == digest, (
        f"{name} changed in mitmproxy {metadata.version('mitmproxy')}: review proxy/l7/patches.py "
        "against the new source, then record its digest"
    )


def test_a_changed_function_stops_the_engine_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "mitmproxy.proxy.server.ConnectionHandler.open_connection"
    function, _ = patches.GUARDED[name]
    monkeypatch.setitem(patches.GUARDED, name, (function, "0" * 64))
    assert patches.changed() == [name]
    with pytest.raises(ProxyError, match="changed what the interception engine builds on") as info:
        patches.verify()
    assert info.value.reason == "mitmproxy_changed" and name in info.value.message


def test_an_unreadable_source_counts_as_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Installed without sources (bytecode only): nothing can be checked, so nothing is trusted.
    name = "mitmproxy.proxy.layers.http.HttpLayer.event_to_child"
    _, digest = patches.GUARDED[name]
    monkeypatch.setitem(patches.GUARDED, name, (len, digest))  # a builtin: no source
    assert patches.changed() == [name]


def test_the_interception_mode_is_found_through_mitmproxy_registries() -> None:
    mode = mode_specs.ProxyMode.parse(InterceptMode.type_name)
    assert isinstance(mode, InterceptMode)
    assert mode.listen_port() is None  # never listens
    instance = mode_servers.ServerInstance.make(mode, manager=None)  # type: ignore[arg-type]
    assert isinstance(instance, InterceptInstance)
    assert (instance.is_running, instance.listen_addrs) == (False, ())
    with pytest.raises(ValueError, match="takes no data"):
        mode_specs.ProxyMode.parse(f"{InterceptMode.type_name}:data")


def test_the_mode_never_serves_through_mitmproxy_s_own_entry() -> None:
    # ServerInstance.handle_stream would serve with mitmproxy's own dial: refused, closed.
    instance = mode_servers.ServerInstance.make(InterceptMode.type_name, None)  # type: ignore[arg-type]

    class Writer:
        closed = False

        def close(self) -> None:
            self.closed = True

    writer = Writer()
    with pytest.raises(ProxyError, match="serve"):
        asyncio.run(instance.handle_stream(None, writer))
    assert writer.closed


def test_the_pin_admits_the_installed_mitmproxy() -> None:
    # pyproject.toml: mitmproxy>=12.3,<13 (12.3.1 is the newest release).
    major, minor, *_ = (int(x) for x in metadata.version("mitmproxy").split(".")[:2])
    assert (major, minor) >= (12, 3) and major < 13
