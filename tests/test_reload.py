"""proxy/app/reload.py, in process: a reload is refused one way (one `ReloadRefused` with a reason
code and what refused it where; one line on stderr, one failure counted, nothing applied).
Through the real process: test_run.py (a broken ceiling on SIGHUP keeps serving the old policy
and says why), test_credentials.py (a secret that cannot be read keeps the last one)."""

from __future__ import annotations

import asyncio
import io
import re
from pathlib import Path

import pytest

from policy import PolicyError
from proxy.app.inputs import compile_inputs, read_inputs
from proxy.app.reload import ReloadRefused, refuse_restart, reload_update
from proxy.app.runtime import Runtime
from proxy.common.listeners import Listener, OwnListeners

MANIFEST = "network:\n  egress: [a.test, b.test]\n"
CEILING = "tenant: t\negress: [a.test, b.test]\n"


def session(
    tmp_path: Path, config: str = "learn: allow\n"
) -> tuple[Runtime, io.StringIO, dict[str, Path]]:
    files = {name: tmp_path / f"{name}.yaml" for name in ("agent", "ceiling", "config")}
    files["agent"].write_text(MANIFEST)
    files["ceiling"].write_text(CEILING)
    files["config"].write_text(config)
    inputs = read_inputs(
        str(files["agent"]), ceiling=str(files["ceiling"]), config=str(files["config"])
    )
    err = io.StringIO()
    runtime = Runtime(inputs, compile_inputs(inputs), listen=[], admin=("127.0.0.1", 0), err=err)
    return runtime, err, files


def failures(runtime: Runtime) -> int:
    text = runtime.metrics.render()[0].decode()
    found = re.search(r'^egress_reloads_total\{result="failure"\} (\S+)$', text, re.M)
    assert found, text
    return int(float(found.group(1)))


def reloaded(runtime: Runtime) -> bool:
    return asyncio.run(runtime.reload())


def test_a_broken_ceiling_is_refused_with_its_code_and_place_and_nothing_applied(
    tmp_path: Path,
) -> None:
    runtime, err, files = session(tmp_path)
    before = runtime.compiled
    files["ceiling"].write_text("egress: [\n")
    assert not reloaded(runtime)
    assert runtime.compiled is before  # the running policy stays in force, whole
    [line] = err.getvalue().splitlines()
    assert line.startswith(
        "egress-proxy: reload failed (yaml_syntax), keeping the previous policy: "
        f"{files['ceiling']}:2:1: YAML syntax error"
    ), line
    assert failures(runtime) == 1


def test_a_reload_of_a_proxy_that_is_not_serving_is_refused_the_same_way(
    tmp_path: Path,
) -> None:
    runtime, err, _ = session(tmp_path)
    assert not reloaded(runtime)  # nothing listens: starting, or shutting down
    assert err.getvalue() == (
        "egress-proxy: reload failed (not_running), keeping the previous policy: "
        "the proxy is starting or shutting down\n"
    )
    assert failures(runtime) == 1


def test_what_needs_a_restart_is_refused_naming_the_config_file(tmp_path: Path) -> None:
    running, _, files = session(tmp_path)
    files["config"].write_text("inspection:\n  mode: all\n")
    compiled = compile_inputs(running.inputs)
    with pytest.raises(ReloadRefused) as refused:
        reload_update(running.compiled.config, compiled, OwnListeners())
    assert refused.value.reason == "needs_restart"
    assert str(refused.value) == (
        f"{files['config']}: inspection.mode changed from 'prefixes' to 'all': that needs a "
        "restart (which connections are intercepted is set at start)"
    )
    refuse_restart(running.compiled.config, running.compiled.config)  # nothing changed: no error


def test_a_nameserver_that_is_our_own_listener_is_refused_naming_the_config_file(
    tmp_path: Path,
) -> None:
    running, _, files = session(tmp_path)
    files["config"].write_text("dns:\n  nameservers: ['127.0.0.1:5353']\n")
    compiled = compile_inputs(running.inputs)
    own = OwnListeners([Listener("dns", "127.0.0.1", 5353)])
    with pytest.raises(ReloadRefused) as refused:
        reload_update(running.compiled.config, compiled, own)
    assert refused.value.reason == "dns_config"
    assert str(refused.value).startswith(f"{files['config']}: nameserver 127.0.0.1:5353 is ")


def test_any_error_becomes_one_refusal() -> None:
    found = PolicyError("invalid_ceiling", "no", source="c.yaml", line=3, column=4, path="egress")
    refused = ReloadRefused.of(found)
    assert (refused.reason, str(refused)) == ("invalid_ceiling", "c.yaml:3:4: egress: no")
    assert ReloadRefused.of(refused) is refused
    bug = ReloadRefused.of(KeyError("x" * 1000), source="config.yaml")
    assert bug.reason == "internal_error" and bug.source == "config.yaml"
    assert bug.message.startswith("internal error KeyError: ") and len(bug.message) < 260
