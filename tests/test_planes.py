"""proxy/decide/planes.py: every plane takes a reload one way, `configure(Update)`, and an update
changes what it names and nothing else. The planes' own re-decisions of live connections:
test_frontdoor.py, test_engine.py, test_websocket.py (a narrower policy), test_learn.py and
test_ask.py (learning and asking stopped, through the real process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy import compile_policy, load_manifest
from proxy.app.inputs import compile_inputs, read_inputs
from proxy.common.settings import Config
from proxy.decide.planes import Update
from proxy.decide.vetting import Vetter
from proxy.dns_responder.responder import DnsResponder
from proxy.dns_responder.server import DnsServer, ServerLimits
from proxy.l7.injector import CredentialInjector

MANIFEST = "network:\n  egress: [a.test, b.test]\n"


def test_an_update_changes_what_it_names_and_nothing_else() -> None:
    wide = compile_policy(load_manifest(MANIFEST))
    vetter = Vetter(wide, None, plane="l4", learn=True, asks=object())  # type: ignore[arg-type]
    narrow = compile_policy(load_manifest("network:\n  egress: [a.test]\n"))
    vetter.configure(Update(policy=narrow))
    assert (vetter.policy, vetter.resolver, vetter.learn) == (narrow, None, True)
    assert vetter.asks is not None
    vetter.configure(Update(stop_learning=True))
    assert (vetter.policy, vetter.learn, vetter.asks is not None) == (narrow, False, True)
    vetter.configure(Update(stop_asking=True))
    assert (vetter.policy, vetter.learn, vetter.asks) == (narrow, False, None)


def test_which_updates_decide_live_connections_again() -> None:
    assert Update(policy=compile_policy(load_manifest(MANIFEST))).redecides
    assert Update(stop_learning=True).redecides and Update(stop_asking=True).redecides
    assert not Update(config=Config()).redecides and not Update().redecides


def test_the_dns_listeners_take_an_update_and_close_nothing() -> None:
    wide = compile_policy(load_manifest(MANIFEST))
    vetter = Vetter(wide, None, plane="l4")  # type: ignore[arg-type]
    server = DnsServer(DnsResponder(vetter), ServerLimits(header_timeout=1, idle_timeout=1))
    narrow = compile_policy(load_manifest("network:\n  egress: [a.test]\n"))
    assert server.configure(Update(policy=narrow, stop_learning=True)) == []  # answers are sent
    assert server.responder.vetter.policy is narrow


def test_the_injector_takes_the_reloaded_credentials_and_closes_nothing(tmp_path: Path) -> None:
    manifest, config = tmp_path / "agent.yaml", tmp_path / "config.yaml"
    manifest.write_text(MANIFEST)
    config.write_text(
        "credentials:\n  - name: api\n    host: a.test\n    header: Authorization\n"
        "    placeholder: EGRESS-PLACEHOLDER-api\n    value_env: PLANES_TEST_TOKEN\n"
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PLANES_TEST_TOKEN", "rotated")
        compiled = compile_inputs(read_inputs(str(manifest), config=str(config)))
    injector = CredentialInjector((), None)
    assert injector.configure(Update(policy=compiled.policy)) == []
    assert injector.credentials == ()  # no config in the update: unchanged
    assert injector.configure(Update(config=compiled.config)) == []
    assert [c.name for c in injector.credentials] == ["api"]
