"""Numbers in every input, through the real commands: `check`, `explain` and `run` (which must
exit before it listens). A number out of a document's bounds is refused where it is parsed,
at its line and column (tests/test_hostile_inputs.py tries those in every role); a number in
range that is wrong for its place (a port of 0, a limit written `0x40`, a prefix length of
33) is refused at its key path. Either way: a clear message, a bounded echo, no traceback,
never exit 70."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from support.dns_server import DNSServer
from support.hostile import COMMAND, HUGE, NUMBERS, VALID_MANIFEST, Run, cli, run
from support.real_servers import free_port
from support.running import RunningProxy, http_get, listening, make_config, wait_for

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

DIGITS = HUGE.decode()
# A message may name a number by its ends and length; it never prints thousands of digits.
MAX_ECHO = 1000


def assert_bounded(result: Run) -> None:
    assert "Traceback" not in result.err and "internal error" not in result.err, result.err
    assert DIGITS[:MAX_ECHO] not in result.err + result.out


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(VALID_MANIFEST)
    return path


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def run_proxy(*args: str | Path, timeout: float = 60) -> tuple[Run, int, int]:
    """`egress-proxy run ARGS` on two free loopback ports; returns when it exits."""
    port, admin = free_port(), free_port()
    argv = [*COMMAND, "run", *(str(a) for a in args)]
    argv += ["--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}"]
    done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    result = Run(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode())
    return result, port, admin


# -- operator config values ------------------------------------------------------------------------

# (file name, text, the path of the problem, what its message says)
CONFIG_VALUES: dict[str, tuple[str, str, str, str]] = {
    "port_zero": ("c.yaml", "ports: [443, 0]\n", "ports[1]", "from 1 to 65535"),
    "port_65536": ("c.json", '{"ports": [65536]}', "ports[0]", "from 1 to 65535"),
    "port_negative_zero": ("c.json", '{"ports": [-0]}', "ports[0]", "from 1 to 65535"),
    "port_2_to_the_64": ("c.yaml", f"ports: [{2**64 - 1}]\n", "ports[0]", "from 1 to 65535"),
    "port_hex": ("c.yaml", "ports: [0x1bb]\n", "ports[0]", "not plain decimal"),
    "port_yaml11_octal": ("c.yaml", "ports: [0777]\n", "ports[0]", "YAML 1.1 reads 511"),
    "port_sexagesimal": ("c.yaml", "ports: [7:23]\n", "ports[0]", "not plain decimal"),
    "port_on": ("c.yaml", "ports: [on]\n", "ports[0]", "is a boolean"),
    "port_float": ("c.toml", "ports = [443.0]\n", "ports[0]", "write 443"),
    "port_string": ("c.yaml", "ports: ['443']\n", "ports[0]", "without quotes"),
    "platform_port": (
        "c.yaml",
        "platform_destinations:\n  - {host: gw.example.net, ports: [99999]}\n",
        "platform_destinations[0].ports[0]",
        "from 1 to 65535",
    ),
    "platform_host_number": (
        "c.yaml",
        "platform_destinations:\n  - {host: 12345, ports: [443]}\n",
        "platform_destinations[0].host",
        "found a number",
    ),
    "nameserver_port": (
        "c.yaml",
        "dns:\n  nameservers: ['10.0.0.2:99999999999999999999']\n",
        "dns.nameservers[0]",
        "from 1 to 65535",
    ),
    "nameserver_hex_port": (
        "c.yaml",
        "dns:\n  nameservers: ['10.0.0.2:0x35']\n",
        "dns.nameservers[0]",
        "from 1 to 65535",
    ),
    "nameserver_number": (
        "c.yaml",
        "dns:\n  nameservers: [167772162]\n",
        "dns.nameservers[0]",
        "not a nameserver string",
    ),
    "dns_timeout_hours": ("c.yaml", "dns:\n  timeout: 99999999h\n", "dns.timeout", "168h"),
    "duration_exponent": ("c.yaml", "limits:\n  idle_timeout: 1e9s\n", "limits.idle_timeout", ""),
    "duration_float": ("c.yaml", "limits:\n  idle_timeout: 1.5\n", "limits.idle_timeout", ""),
    "duration_negative": ("c.yaml", "limits:\n  idle_timeout: -5s\n", "limits.idle_timeout", ""),
    "duration_hex": ("c.yaml", "limits:\n  idle_timeout: 0x10s\n", "limits.idle_timeout", ""),
    "duration_digits": (
        "c.yaml",
        f"limits:\n  idle_timeout: {DIGITS}s\n",
        "limits.idle_timeout",
        "168h",
    ),
    "duration_bare_number": (
        "c.toml",
        "[limits]\nconnect_timeout = 30\n",
        "limits.connect_timeout",
        "'30s'",
    ),
    "max_connections_huge": (
        "c.yaml",
        f"limits:\n  max_connections: {2**63}\n",
        "limits.max_connections",
        "from 1 to 1000000",
    ),
    "max_connections_1e400": (
        "c.yaml",
        "limits:\n  max_connections: 1e400\n",  # text to YAML 1.1 (no dot)
        "limits.max_connections",
        "'1e400'",
    ),
    "max_connections_true": (
        "c.json",
        '{"limits": {"max_connections": true}}',
        "limits.max_connections",
        "is a boolean",
    ),
    "max_connections_yes": (
        "c.yaml",
        "limits:\n  max_connections: yes\n",
        "limits.max_connections",
        "is a boolean",
    ),
    "max_connections_underscores": (
        "c.yaml",
        "limits:\n  max_connections: 1_000\n",
        "limits.max_connections",
        "not plain decimal",
    ),
    "cidr_twenty_digits": (
        "c.yaml",
        "addresses:\n  allow: ['10.0.0.0/99999999999999999999']\n",
        "addresses.allow[0]",
        "0 to 32",
    ),
    "cidr_negative": ("c.yaml", "addresses:\n  deny: ['::/-1']\n", "addresses.deny[0]", "0 to 128"),
    "cidr_huge": (
        "c.json",
        '{"addresses": {"in_cluster": ["10.0.0.0/' + DIGITS + '"]}}',
        "addresses.in_cluster[0]",
        "out of range",
    ),
    "cidr_number": ("c.yaml", "addresses:\n  allow: [167772160]\n", "addresses.allow[0]", ""),
    "platform_cidr": (
        "c.yaml",
        "platform_destinations:\n  - {host: gw.example.net, ports: [443], cidrs: ['::/129']}\n",
        "platform_destinations[0].cidrs[0]",
        "0 to 128",
    ),
    "enabled_number": ("c.yaml", "inspection:\n  enabled: 1\n", "inspection.enabled", ""),
    "suffix_number": ("c.yaml", "internal_suffixes: [12345]\n", "internal_suffixes[0]", ""),
    "numeric_key": ("c.yaml", "limits:\n  5: 1\n", "limits.5", "unknown key"),
    "huge_numeric_text_key": (
        "c.json",
        '{"limits": {"' + DIGITS + '": 1}}',
        "limits." + DIGITS[:20],
        "unknown key",
    ),
}


def assert_config_refused(result: Run, config: Path, path: str, says: str) -> None:
    assert result.code == 2, result.err
    assert_bounded(result)
    lines = result.err.splitlines()
    assert lines[0].startswith(f"egress-proxy: {config}: invalid config"), result.err
    line = next((x.strip() for x in lines[1:] if x.strip().startswith(path)), None)
    assert line is not None, result.err
    assert says in line, result.err


@pytest.mark.parametrize("case", list(CONFIG_VALUES))
def test_a_config_value_is_refused_at_its_path_by_check_and_explain(
    case: str, tmp_path: Path, manifest: Path
) -> None:
    name, text, path, says = CONFIG_VALUES[case]
    config = write(tmp_path, name, text)
    assert_config_refused(cli("check", manifest, "--config", config), config, path, says)
    explained = cli("explain", manifest, "--config", config, "github.com")
    assert_config_refused(explained, config, path, says)


@pytest.mark.parametrize(
    "case",
    ["port_yaml11_octal", "duration_digits", "max_connections_true", "cidr_huge", "numeric_key"],
)
def test_a_config_value_stops_run_before_it_listens(
    case: str, tmp_path: Path, manifest: Path
) -> None:
    name, text, path, says = CONFIG_VALUES[case]
    config = write(tmp_path, name, text)
    result, port, admin = run_proxy(manifest, "--config", config)
    assert_config_refused(result, config, path, says)
    assert "listening on" not in result.err
    assert not listening(port) and not listening(admin)


def test_numbers_in_range_and_in_decimal_are_read(tmp_path: Path, manifest: Path) -> None:
    # TOML's hexadecimal and `_` spellings have one meaning to every TOML reader: taken.
    config = write(
        tmp_path,
        "c.toml",
        "ports = [0x1bb, 8_443]\n[limits]\nmax_connections = 1_000_000\nidle_timeout = '168h'\n",
    )
    result = cli("check", manifest, "--config", config)
    assert result.code == 0, result.err


# -- document bounds, through explain and run --------------------------------------------------


@pytest.mark.parametrize("role", ["manifest", "ceiling", "config"])
@pytest.mark.parametrize("case", ["toml_huge_int", "json_1e400", "yaml_sexagesimal", "yaml_nan"])
def test_run_refuses_a_number_out_of_bounds_before_it_listens(
    case: str, role: str, tmp_path: Path, manifest: Path
) -> None:
    make, where = NUMBERS[case]
    hostile = make(tmp_path)
    args: list[str | Path] = [manifest]
    if role == "manifest":
        args = [hostile]
    else:
        args += [f"--{role}", hostile]
    result, port, admin = run_proxy(*args)
    assert result.code == 2, result.err
    assert_bounded(result)
    assert result.err.startswith(f"egress-proxy: {hostile}{where} "), result.err
    assert not listening(port) and not listening(admin)


@pytest.mark.parametrize("case", ["toml_huge_int_in_a_list", "json_huge_int", "yaml_huge_key"])
def test_explain_refuses_a_number_out_of_bounds(case: str, tmp_path: Path) -> None:
    make, where = NUMBERS[case]
    hostile = make(tmp_path)
    result = run("explain", hostile, "github.com")
    assert result.code == 2
    assert_bounded(result)
    assert result.err.startswith(f"egress-proxy: {hostile}{where} "), result.err


# -- manifest values: findings at their path ---------------------------------------------------

# (file name, text, the finding's path, its reason)
MANIFEST_VALUES: dict[str, tuple[str, str, str, str]] = {
    "hostname_as_number": (
        "agent.yaml",
        "network:\n  egress: [12345]\n",
        "network.egress[0]",
        "not_a_string",
    ),
    "hostname_as_float": (
        "agent.yaml",
        "network:\n  egress: [123.45]\n",
        "network.egress[0]",
        "not_a_string",
    ),
    "hostname_as_bool": (
        "agent.yaml",
        "network:\n  egress: [yes]\n",
        "network.egress[0]",
        "not_a_string",
    ),
    "pattern_as_number": (
        "agent.toml",
        "[network_access]\nallowed = [443]\n",
        "network_access.allowed[0]",
        "not_a_string",
    ),
    "schema_version_hex": (
        "agent.yaml",
        "schema_version: 0x1\nnetwork_access: {}\n",
        "schema_version",
        "unsupported_schema_version",
    ),
    "schema_version_float": (
        "agent.json",
        '{"schema_version": 1.0}',
        "schema_version",
        "unsupported_schema_version",
    ),
    "schema_version_true": (
        "agent.toml",
        "schema_version = true\n",
        "schema_version",
        "unsupported_schema_version",
    ),
    "egress_mode_number": (
        "agent.yaml",
        "network:\n  egress_mode: 1\n",
        "network.egress_mode",
        "invalid_egress_mode",
    ),
    "url_port_huge": (
        "agent.toml",
        f"[network_access]\nallowed = ['https://a.example.com:{DIGITS}/']\n",
        "network_access.allowed[0]",
        "port",
    ),
    "url_port_hex": (
        "agent.toml",
        "[network_access]\nallowed = ['https://a.example.com:0x1bb/']\n",
        "network_access.allowed[0]",
        "port",
    ),
    "url_port_zero": (
        "agent.toml",
        "[network_access]\nallowed = ['https://a.example.com:0/']\n",
        "network_access.allowed[0]",
        "port",
    ),
    "cidr_prefix_twenty_digits": (
        "agent.toml",
        "[network_access]\nblocked = ['10.0.0.0/99999999999999999999']\n",
        "network_access.blocked[0]",
        "invalid_cidr",
    ),
    "cidr_prefix_negative": (
        "agent.toml",
        "[network_access]\nblocked = ['::/-1']\n",
        "network_access.blocked[0]",
        "invalid_cidr",
    ),
    "cidr_prefix_huge": (
        "agent.json",
        '{"network_access": {"blocked": ["10.0.0.0/' + DIGITS + '"]}}',
        "network_access.blocked[0]",
        "invalid_cidr",
    ),
    "numeric_key": (
        "agent.yaml",
        "network:\n  egress: [github.com]\n  443: x\n",
        "network.443",
        "unknown_key",
    ),
    "huge_numeric_text_key": (
        "agent.json",
        '{"network": {"' + DIGITS + '": 1}}',
        "network." + DIGITS[:20],
        "unknown_key",
    ),
}


@pytest.mark.parametrize("case", list(MANIFEST_VALUES))
def test_a_manifest_value_is_a_finding_at_its_path(case: str, tmp_path: Path) -> None:
    name, text, path, reason = MANIFEST_VALUES[case]
    manifest = write(tmp_path, name, text)
    result = cli("check", manifest, "--json")
    assert result.code == 1, result.err
    assert_bounded(result)
    findings = json.loads(result.out)["findings"]
    assert any(f["path"].startswith(path) and f["reason"] == reason for f in findings), findings
    human = cli("check", manifest)
    assert human.code == 1 and path in human.out
    assert_bounded(human)
    explained = cli("explain", manifest, "github.com")
    assert explained.code == 1 and str(manifest) in explained.err
    assert_bounded(explained)


def test_a_manifest_value_stops_run_before_it_listens(tmp_path: Path) -> None:
    name, text, path, _ = MANIFEST_VALUES["cidr_prefix_twenty_digits"]
    manifest = write(tmp_path, name, text)
    result, port, admin = run_proxy(manifest)
    assert result.code == 1, result.err
    assert_bounded(result)
    assert path in result.err and "0 to 32" in result.err
    assert not listening(port) and not listening(admin)


# -- ceiling values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("egress: [12345, github.com]\n", "egress[0]"),
        ("egress: [0x1bb]\n", "egress[0]"),
        ('{"egress": [1e300]}', "egress[0]"),
        ("tenant: 5\negress: []\n", "tenant"),
        ("5: x\negress: []\n", "5"),
    ],
)
def test_a_ceiling_value_is_refused_at_its_path(
    text: str, path: str, tmp_path: Path, manifest: Path
) -> None:
    ceiling = write(tmp_path, "ceiling.json" if text.startswith("{") else "ceiling.yaml", text)
    result = cli("check", manifest, "--ceiling", ceiling)
    assert result.code == 2, result.err
    assert_bounded(result)
    assert result.err.startswith(f"egress-proxy: {ceiling}: invalid ceiling")
    assert any(line.strip().startswith(f"{path}:") for line in result.err.splitlines()[1:])


# -- command-line arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "resolve",
    [
        f"github.com={DIGITS}",
        f"github.com=1.1.1.{DIGITS}",
        f"github.com=::{DIGITS}",
        f"{DIGITS}=1.1.1.1",
        f"0x{DIGITS}=1.1.1.1",
        "github.com=4294967296",
        "github.com=1e400",
    ],
)
def test_a_huge_number_in_resolve_is_a_usage_error(resolve: str, manifest: Path) -> None:
    result = cli("explain", manifest, "--resolve", resolve, "github.com")
    assert result.code == 2, result.err
    assert_bounded(result)
    assert result.err.startswith("egress-proxy: --resolve ")


@pytest.mark.parametrize(
    "address",
    [
        f"127.0.0.1:{DIGITS}",
        f"[::1]:{DIGITS}",
        f"{DIGITS}:80",
        "127.0.0.1:99999",
        "127.0.0.1:-1",
        "127.0.0.1:0x50",
        "127.0.0.1:1e3",
        "127.0.0.1:" + "9" * 250,
    ],
)
@pytest.mark.parametrize("option", ["--listen", "--admin", "--dns-listen"])
def test_a_huge_port_on_the_command_line_is_a_usage_error(
    option: str, address: str, manifest: Path
) -> None:
    result = cli("run", manifest, option, address)
    assert result.code == 2, result.err
    assert_bounded(result)
    assert "invalid listen address" in result.err
    assert len(result.err) < 600


def test_a_huge_port_on_the_command_line_through_the_installed_command(manifest: Path) -> None:
    result, _, _ = run_proxy(manifest, "--listen", f"127.0.0.1:{DIGITS}")
    assert result.code == 2 and "invalid listen address" in result.err
    assert_bounded(result)


@pytest.mark.parametrize(
    "target", [DIGITS, f"0x{DIGITS}", f"github.com:{DIGITS}", f"http://github.com:{DIGITS}/"]
)
def test_a_huge_number_as_an_explain_target_is_denied(target: str, manifest: Path) -> None:
    result = cli("explain", "--json", manifest, target)
    assert result.code == 0, result.err
    (decision,) = json.loads(result.out)
    assert decision["allowed"] is False
    assert "Traceback" not in result.err


@pytest.mark.parametrize("address", [DIGITS, f"0x{DIGITS}", f"1.1.1.{DIGITS}", "4294967296"])
def test_a_huge_number_to_classify_is_no_address(address: str) -> None:
    result = cli("classify", "--json", address)
    assert result.code == 0, result.err
    (verdict,) = json.loads(result.out)
    assert (verdict["public"], verdict["reason"]) == (False, "invalid_address")


# -- reload ---------------------------------------------------------------------------------------


def test_a_number_out_of_bounds_on_reload_keeps_the_policy(tmp_path: Path, dns: DNSServer) -> None:
    with RunningProxy(tmp_path, VALID_MANIFEST, dns=dns) as proxy:
        config = make_config(dns) + "ports: [443, " + DIGITS + "]\n"
        line = config.count("\n")
        proxy.files.config.write_text(config)
        proxy.send_signal(signal.SIGHUP)
        wait_for(lambda: "reload failed" in proxy.stderr(), what="the failed reload")
        stderr = proxy.stderr()
        assert f"{proxy.files.config}:{line}:14: the integer 999999999999…9999" in stderr
        assert "Traceback" not in stderr and DIGITS[:MAX_ECHO] not in stderr
        assert http_get(f"http://127.0.0.1:{proxy.admin_port}/readyz")[0] == 200
