"""egress-proxy as the harness runs it: named configurations, their inputs, what the CLI under
test accepts, and one `egress-proxy run` process from exec to exit.

The harness knows egress-proxy only through its command line and its documented interfaces
(the manifest and operator config formats, `/readyz`, `/metrics`, the audit log file): it
measures whatever `egress-proxy run` is. A configuration is a manifest, operator config keys
merged over the harness's base config, and extra `run` arguments. One the proxy under test does
not accept (an option its `run --help` does not list, a key its `check` refuses) is skipped
with a note, not failed: `inspection.mode: all` is measured from the day it exists.

Built in: `egress-proxy` (the default data plane; an HTTP listener, a SOCKS5 listener and a DNS
listener, as a sidecar runs it), `egress-url-prefix` (an agent.toml with a URL-prefix rule for
another host: the interception engine is loaded, and its TLS is measured), `egress-toml` (an
agent.toml without one), `egress-inspect-all` (`inspection.mode: all`), `egress-engine-only`
(`--engine-only`, while it exists). More with `--egress-config FILE` (benchmarks/README.md).
`--baseline-tree PATH` runs a configuration from another checkout, for an A/B in the same rounds.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .proc import (
    LOOPBACK,
    ROOT,
    answers_200,
    connect_accepted,
    free_ports,
    http_get,
    race_probes,
    stop_child,
)

HOST = "bench.test"  # every workload's name; the DNS server maps it (and the others) to 127.0.0.1
INSPECTED_HOST = "inspected.test"  # egress-url-prefix's URL-prefix host
INSPECTED_PATH = "/api/bench"
# In a manifest, the port of the origin's HTTPS server (known once it runs): URL-prefix rules
# name the port when it is not the scheme's default.
ORIGIN_TLS_PORT = "@ORIGIN_TLS_PORT@"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0  # SIGTERM drains for at most 5 s
START_ATTEMPTS = 3  # a pre-picked port can be taken before the proxy binds it
NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")
CONFIG_FILE_KEYS = {
    "name",
    "description",
    "manifest",
    "format",
    "config",
    "args",
    "passthrough",
    "needs_engine",
    "inspected_host",
    "inspected_path",
}


class ConfigError(ValueError):
    """A configuration file the harness cannot use (the message names the file and key)."""


@dataclass(frozen=True)
class EgressConfig:
    name: str
    description: str
    manifest: str  # its text
    format: str  # agent.yaml | agent.toml
    config: Mapping[str, Any]  # operator keys merged over the base config
    args: tuple[str, ...] = ()
    passthrough: bool = True  # CONNECT/SOCKS5 to bench.test is relayed, not intercepted
    # It needs the interception engine (URL-prefix rules, inspection.mode: all, --engine-only):
    # the idle RSS target, which is about sessions that need none, does not judge it.
    needs_engine: bool = False
    inspected_host: str | None = None  # HTTPS to this host is intercepted: the inspect workload
    inspected_path: str = "/"
    tree: Path | None = None  # another checkout (--baseline-tree); None: this one
    listeners: bool = True  # a SOCKS5 and a DNS listener beside the HTTP one

    @property
    def manifest_file(self) -> str:
        return "agent.toml" if self.format == "agent.toml" else "agent.yaml"


YAML_MANIFEST = f"network:\n  egress: [{HOST}]\n"
BUILTIN: dict[str, EgressConfig] = {
    c.name: c
    for c in (
        EgressConfig(
            "egress-proxy",
            "egress-proxy run as a sidecar runs it: HTTP, SOCKS5 and DNS listeners, audit log "
            "to a file, metrics on the admin port; policy egress: [bench.test]",
            YAML_MANIFEST,
            "agent.yaml",
            {},
        ),
        EgressConfig(
            "egress-url-prefix",
            f"as egress-proxy, with an agent.toml allowing *.{HOST} and the URL prefix "
            f"https://{INSPECTED_HOST}{INSPECTED_PATH}/: the interception engine is loaded; "
            f"tunnels to {HOST} pass through, HTTPS to {INSPECTED_HOST} is intercepted",
            'schema_version = 1\nname = "bench"\n\n[network_access]\nallowed = '
            f'["*.{HOST}", "https://{INSPECTED_HOST}:{ORIGIN_TLS_PORT}{INSPECTED_PATH}/"]\n',
            "agent.toml",
            {},
            needs_engine=True,
            inspected_host=INSPECTED_HOST,
            inspected_path=f"{INSPECTED_PATH}/x",
        ),
        EgressConfig(
            "egress-toml",
            "as egress-proxy, with an agent.toml of exact and wildcard hosts (bench.test, "
            "*.bench.test) and no URL prefix",
            'schema_version = 1\nname = "bench"\n\n[network_access]\nallowed = '
            f'["{HOST}", "*.{HOST}"]\n',
            "agent.toml",
            {},
        ),
        EgressConfig(
            "egress-inspect-all",
            "as egress-proxy, with inspection.mode: all (every TLS connection intercepted)",
            YAML_MANIFEST,
            "agent.yaml",
            {"inspection": {"mode": "all"}},
            passthrough=False,
            needs_engine=True,
            inspected_host=HOST,
        ),
        EgressConfig(
            "egress-engine-only",
            "as egress-proxy, with --engine-only (every connection through mitmproxy)",
            YAML_MANIFEST,
            "agent.yaml",
            {},
            args=("--engine-only",),
            listeners=False,
            needs_engine=True,
        ),
    )
}


def load_config_file(path: Path) -> EgressConfig:
    """A named configuration from a YAML file (keys in CONFIG_FILE_KEYS; benchmarks/README.md)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a mapping of {', '.join(sorted(CONFIG_FILE_KEYS))}")
    if unknown := sorted(set(data) - CONFIG_FILE_KEYS):
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}")
    name = data.get("name")
    if not isinstance(name, str) or not NAME.match(name) or name in BUILTIN:
        raise ConfigError(f"{path}: name: lowercase letters, digits and '-', not a built-in")

    def typed(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = data.get(key, default)
        if not isinstance(value, kind):
            raise ConfigError(f"{path}: {key}: expected {getattr(kind, '__name__', kind)}")
        return value

    args = typed("args", list, [])
    if not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{path}: args: a list of strings")
    fmt = typed("format", str, "agent.yaml")
    if fmt not in ("agent.yaml", "agent.toml"):
        raise ConfigError(f"{path}: format: agent.yaml or agent.toml")
    return EgressConfig(
        name=name,
        description=typed("description", str, f"from {path}"),
        manifest=typed("manifest", str, YAML_MANIFEST),
        format=fmt,
        config=typed("config", dict, {}),
        args=tuple(args),
        passthrough=typed("passthrough", bool, True),
        needs_engine=typed("needs_engine", bool, False),
        inspected_host=typed("inspected_host", (str, type(None)), None),
        inspected_path=typed("inspected_path", str, "/"),
    )


def baseline_of(config: EgressConfig, tree: Path) -> EgressConfig:
    return dataclasses.replace(
        config, name=f"{config.name}-baseline", tree=tree, description=f"{config.name} from {tree}"
    )


# --------------------------------------------------------------------------------------------
# Inputs and what the CLI under test accepts


def merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def base_config(dns: tuple[str, int], ca_dir: Path, upstream_ca: Path | None) -> dict[str, Any]:
    """The operator config every configuration starts from: the harness's DNS server, loopback
    allowed as a destination, inspection on with the run's CA directory."""
    inspection: dict[str, Any] = {"enabled": True, "ca_dir": str(ca_dir)}
    if upstream_ca is not None:
        inspection["upstream_ca"] = str(upstream_ca)
    return {
        "dns": {"nameservers": [f"{dns[0]}:{dns[1]}"], "timeout": "2s"},
        "addresses": {"allow": ["127.0.0.0/8"]},
        "inspection": inspection,
    }


def write_inputs(
    directory: Path, config: EgressConfig, base: Mapping[str, Any], origin_tls_port: int | None
) -> None:
    """The manifest (with ORIGIN_TLS_PORT filled in) and the operator config (the base config
    with the configuration's keys merged over it) of `config`, into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = config.manifest.replace(ORIGIN_TLS_PORT, str(origin_tls_port or 443))
    (directory / config.manifest_file).write_text(manifest)
    # JSON is YAML: the operator config loader reads either.
    (directory / "config.json").write_text(json.dumps(merged(base, config.config), indent=1))


def launcher(tree: Path | None) -> tuple[list[str], dict[str, str]]:
    """The command that runs `egress-proxy` of `tree` (its `[project.scripts]` entry point, with
    the tree first on the path) and the environment additions; this checkout when None."""
    root = tree or ROOT
    try:
        scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
        module, _, function = scripts["egress-proxy"].partition(":")
    except (OSError, KeyError, ValueError) as exc:
        raise ConfigError(
            f"{root}: no egress-proxy entry point in pyproject.toml ({exc})"
        ) from None
    code = f"import sys; from {module} import {function} as main; sys.exit(main())"
    env = {"PYTHONPATH": str(root)} if tree else {}
    return [sys.executable, "-c", code], env


def _imports_elsewhere(tree: Path, env: Mapping[str, str]) -> str | None:
    """Why `tree`'s proxy and policy packages are not the ones its launcher imports (an A/B is
    only one when the other tree's code is what runs), or None."""
    done = subprocess.run(
        [sys.executable, "-c", "import proxy, policy; print(proxy.__file__, policy.__file__)"],
        capture_output=True,
        text=True,
        env=dict(env),
        cwd=tree,
        timeout=60,
    )
    files = done.stdout.split()
    if (
        done.returncode == 0
        and len(files) == 2
        and all(Path(f).is_relative_to(tree) for f in files)
    ):
        return None
    found = done.stdout.strip() or done.stderr.strip()[-300:]
    return f"its proxy and policy packages do not import from {tree}: {found}"


def unsupported(config: EgressConfig, directory: Path, env: Mapping[str, str]) -> str | None:
    """Why the proxy under test cannot run `config` (an option its `run --help` lacks, a config
    its `check` refuses), or None."""
    command, extra = launcher(config.tree)
    run_env = {**env, **extra}
    cwd = config.tree or ROOT
    if config.tree is not None and (wrong := _imports_elsewhere(config.tree, run_env)):
        return wrong
    done = subprocess.run(
        [*command, "run", "--help"],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=cwd,
        timeout=60,
    )
    needed = [a for a in config.args if a.startswith("--")]
    if config.listeners:
        needed.append("--dns-listen")
    if missing := [flag for flag in needed if flag.split("=")[0] not in done.stdout]:
        return f"`egress-proxy run` here has no {', '.join(missing)}"
    done = subprocess.run(
        [
            *command,
            "check",
            str(directory / config.manifest_file),
            "--config",
            str(directory / "config.json"),
        ],
        capture_output=True,
        text=True,
        env=run_env,
        cwd=cwd,
        timeout=120,
    )
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())
        return f"`egress-proxy check` refuses its inputs: {said[:400]}"
    return None


# --------------------------------------------------------------------------------------------
# The process


@dataclass
class EgressProxy:
    """One `egress-proxy run` process, ready."""

    name: str
    directory: Path
    process: subprocess.Popen[bytes]
    port: int  # the HTTP proxy listener
    admin_port: int
    socks_port: int | None
    dns_port: int | None
    ready_s: float  # exec to /readyz 200
    first_connect_s: float  # exec to the first CONNECT answered 200

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def audit_log(self) -> Path:
        return self.directory / "audit.jsonl"

    def stderr_tail(self, limit: int = 2000) -> str:
        return (self.directory / "stderr.txt").read_text(errors="replace")[-limit:]

    def metrics_ok(self) -> bool:
        """/metrics answers 200 with samples (a scrape, as Prometheus makes)."""
        status, body = http_get(self.admin_port, "/metrics")
        return status == 200 and b"\n" in body

    def stop(self) -> int:
        return stop_child(self.process, STOP_TIMEOUT_S)


def start(
    config: EgressConfig, directory: Path, env: Mapping[str, str], probe_port: int
) -> EgressProxy:
    """`egress-proxy run` of `config` with its inputs in `directory`, on free ports of
    127.0.0.1, until /readyz is 200 and a CONNECT bench.test:`probe_port` is answered 200 (both
    timed from exec). RuntimeError when it does not get there."""
    error = ""
    for _ in range(START_ATTEMPTS):
        listen, socks, dns, admin = free_ports(4, udp=(2,))
        args = ["run", str(directory / config.manifest_file)]
        args += ["--config", str(directory / "config.json"), "--listen", f"{LOOPBACK}:{listen}"]
        if config.listeners:
            args += [
                "--listen",
                f"socks5://{LOOPBACK}:{socks}",
                "--dns-listen",
                f"{LOOPBACK}:{dns}",
            ]
        args += ["--admin", f"{LOOPBACK}:{admin}", "--session-id", f"bench-{config.name}"]
        args += ["--audit-log", str(directory / "audit.jsonl"), *config.args]
        command, extra = launcher(config.tree)
        (directory / "audit.jsonl").unlink(missing_ok=True)
        with open(directory / "stderr.txt", "wb") as err:
            started = time.perf_counter()
            process = subprocess.Popen(
                [*command, *args],
                cwd=config.tree or ROOT,
                env={**env, **extra},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        probes = {
            "ready_s": answers_200(admin, "/readyz"),
            "first_connect_s": connect_accepted(listen, HOST, probe_port),
        }
        try:
            times = race_probes(process, started, probes, READY_TIMEOUT_S)
        except RuntimeError as exc:
            stop_child(process, STOP_TIMEOUT_S)
            error = f"{config.name}: {exc}: {_tail(directory)}"
            said = error.lower()
            if process.returncode == 2 and any(w in said for w in ("listen", "bind", "in use")):
                continue  # a port was taken in between: fresh ones
            break
        return EgressProxy(
            config.name,
            directory,
            process,
            listen,
            admin,
            socks if config.listeners else None,
            dns if config.listeners else None,
            times["ready_s"],
            times["first_connect_s"],
        )
    raise RuntimeError(error)


def _tail(directory: Path) -> str:
    try:
        return " ".join((directory / "stderr.txt").read_text(errors="replace")[-1500:].split())
    except OSError:
        return ""


def proxy_env(pycache: Path) -> dict[str, str]:
    """The proxy's environment: bytecode cached as an installed package has it. (This workplace
    sets PYTHONDONTWRITEBYTECODE, and the editable checkout has no __pycache__, so every start
    would compile proxy/ and policy/ from source.) The cache is the harness's own (gitignored);
    the checkout is not written to."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env
