"""`egress-proxy sandbox` without a namespace: its command line, the user it runs COMMAND as, the
address plan, the capability check and the host-side rule set (checked with `nft -c`, which
loads nothing). Every case here stops before anything is created; the end-to-end tests are in
tests/test_sandbox.py (root only)."""

from __future__ import annotations

import io
import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from policy import PolicyError
from proxy.boundary.nft.chains import check_table_name
from proxy.boundary.nft.compare import expected_chains
from proxy.boundary.nft.sandbox_rules import sandbox_chains, sandbox_ruleset
from proxy.boundary.sandbox import preflight
from proxy.boundary.sandbox.net import (
    AddressPlan,
    SessionNames,
    conflicts,
    parse_subnet,
    plan_addresses,
)
from proxy.boundary.sandbox.options import resolve_user
from proxy.boundary.sandbox.outcome import EXIT_PRIVILEGES
from proxy.cli import build_parser, main
from proxy.common.errors import ProxyError

pytestmark = pytest.mark.integration  # it opens sockets or starts processes

NFT = shutil.which("nft")


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def manifest(tmp_path: Path, text: str = "network:\n  egress: [allowed.test]\n") -> str:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return str(path)


# -- the command line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "command", "user"),
    [
        (["m.yaml", "--user", "x", "--", "curl", "--user", "y"], ["curl", "--user", "y"], "x"),
        (["--user", "x", "m.yaml", "--", "echo", "hi"], ["echo", "hi"], "x"),
        (["m.yaml", "echo", "hi"], ["echo", "hi"], None),
        (["m.yaml", "--", "sh", "-c", "a -- b", "--", "c"], ["sh", "-c", "a -- b", "--", "c"],
         None),
    ],
)  # fmt: skip
def test_command_is_everything_after_the_double_dash(
    argv: list[str], command: list[str], user: str | None
) -> None:
    args = build_parser().parse_args(["sandbox", *argv])
    assert args.manifest == "m.yaml"
    assert args.command_argv == command
    assert args.user == user


def test_words_before_and_after_the_double_dash_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["sandbox", "m.yaml", "echo", "--", "x"])
    assert exc.value.code == 2
    assert "write COMMAND after '--' only" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "no COMMAND"),
        (["--subnet4", "8.8.8.0/30", "--", "true"], "public address 8.8.8.1"),
        (["--subnet4", "10.0.0.1/30", "--", "true"], "host bits set"),
        (["--subnet4", "10.0.0.0/31", "--", "true"], "too small"),
        (["--subnet6", "10.0.0.0/30", "--", "true"], "not an IPv6 network"),
        (["--subnet6", "2606:4700::/64", "--", "true"], "public address"),
        (["--user", "no-such-user-here", "--", "true"], "no such user"),
        (["--user", "4000000:", "--", "true"], "write NAME, UID or UID:GID"),
        (["--ready-timeout", "0", "--", "true"], "--ready-timeout"),
        (["--admin", "example.com:1", "--", "true"], "invalid listen address"),
    ],
)
def test_usage_errors_exit_2_before_anything_is_created(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    code, _, err = run_cli("sandbox", manifest(tmp_path), *extra)
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err


def test_standard_input_is_commands_not_the_manifests() -> None:
    code, _, err = run_cli("sandbox", "-", "--", "cat")
    assert code == 2
    assert "standard input is COMMAND's" in err


def test_a_manifest_that_does_not_compile_exits_1_and_creates_nothing(tmp_path: Path) -> None:
    before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    code, _, err = run_cli("sandbox", manifest(tmp_path, "network:\n  egress: ['*.x.com']\n"),
                           "--", "true")  # fmt: skip
    assert code == 1
    assert "wildcard" in err
    after = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    assert after == before


def test_missing_capabilities_exit_77_naming_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]
    monkeypatch.setattr(preflight, "missing_capabilities", lambda: missing)
    code, _, _ = run_cli("sandbox", manifest(tmp_path), "--", "true")
    err = capsys.readouterr().err
    assert code == EXIT_PRIVILEGES == 77
    assert "missing CAP_NET_ADMIN, CAP_SYS_ADMIN" in err
    assert "nothing was created" in err


def test_capabilities_are_read_from_the_effective_set() -> None:
    everything = "CapEff:\t000001ffffffffff\n"
    assert preflight.missing_capabilities(everything) == []
    # NET_ADMIN (12) and SETUID (7) cleared
    assert preflight.missing_capabilities("CapEff:\t000001ffffffef7f\n") == [
        "CAP_NET_ADMIN",
        "CAP_SETUID",
    ]
    assert "CAP_SYS_ADMIN" in preflight.missing_capabilities("CapEff:\t0000000000000000\n")


# -- the user COMMAND runs as ----------------------------------------------------------------


def test_the_default_user_is_the_one_who_ran_sudo_else_nobody() -> None:
    assert resolve_user(None, {"SUDO_UID": "1234", "SUDO_GID": "2345"}).uid == 1234
    assert resolve_user(None, {"SUDO_UID": "1234", "SUDO_GID": "2345"}).gid == 2345
    nobody = resolve_user(None, {})
    assert nobody.name == "nobody" and nobody.uid != 0
    # sudo run by root: still not root by default.
    assert resolve_user(None, {"SUDO_UID": "0", "SUDO_GID": "0"}).name == "nobody"


def test_users_by_name_uid_and_uid_gid() -> None:
    assert resolve_user("root", {}).is_root
    assert resolve_user("0", {}).is_root
    numeric = resolve_user("4000000:4000001", {})
    assert (numeric.uid, numeric.gid, numeric.name) == (4000000, 4000001, None)
    with pytest.raises(Exception, match="has no password entry"):
        resolve_user("4000000", {})


def test_user_digits_are_ascii_only() -> None:
    # '²' is a digit to str.isdigit but not to int(): a name, and no user has it.
    with pytest.raises(PolicyError, match="no such user") as caught:
        resolve_user("²", {})
    assert caught.value.reason == "usage"
    with pytest.raises(PolicyError, match="no such group"):
        resolve_user("0:²", {})
    # Nor is it the sudo user's id: the default falls back to nobody.
    assert resolve_user(None, {"SUDO_UID": "1²", "SUDO_GID": "1"}).name == "nobody"


# -- addresses -------------------------------------------------------------------------------


def test_default_subnets_are_link_local_and_ula_and_avoid_what_is_in_use() -> None:
    # Every /30 of the pool taken (by an address inside it) but those in 169.254.255.0/24.
    busy = [
        ipaddress.ip_network(f"169.254.{third}.{fourth + 1}/32")
        for third in range(240, 255)
        for fourth in range(0, 256, 4)
    ]
    plan = plan_addresses(None, None, in_use=busy)
    assert plan.subnet4.subnet_of(ipaddress.ip_network("169.254.255.0/24"))
    assert plan.subnet4.prefixlen == 30
    assert plan.subnet6.subnet_of(ipaddress.ip_network("fd00::/8"))
    assert plan.subnet6.prefixlen == 64
    assert (str(plan.host4), str(plan.ns4)) == (
        str(plan.subnet4.network_address + 1),
        str(plan.subnet4.network_address + 2),
    )


def test_a_given_subnet_in_use_is_refused_but_a_wider_route_is_not_a_clash() -> None:
    given = parse_subnet("198.51.100.4/30", 4, "--subnet4")
    assert conflicts(given, [ipaddress.ip_network("198.51.100.5/32")])
    assert not conflicts(given, [ipaddress.ip_network("198.51.100.0/24")])
    with pytest.raises(ProxyError, match="in use on this host"):
        plan_addresses(given, None, in_use=[ipaddress.ip_network("198.51.100.4/30")])


def test_session_names_fit_interface_and_table_limits() -> None:
    names = SessionNames.new()
    assert len(names.host_link) <= 15 and len(names.ns_link) <= 15
    assert names.netns.startswith("egress-sb-") and names.table.startswith("egress_sb_")
    check_table_name(names.table)


# -- the host-side rules ---------------------------------------------------------------------


def _ruleset(names: SessionNames) -> str:
    plan = AddressPlan(
        ipaddress.IPv4Network("198.51.100.4/30"), ipaddress.IPv6Network("fd12:3456:789a:1::/64")
    )
    return sandbox_ruleset(
        names.table, names.host_link, str(plan.host4), str(plan.host6),
        explicit_port=3128, transparent_port=3129, dns_port=5353,
    )  # fmt: skip


def test_the_sandbox_rule_set_promises_what_the_design_says() -> None:
    names = SessionNames("0123abcd")
    chains = expected_chains(_ruleset(names), names.table)
    assert set(chains) == {"prerouting", "input", "forward"}
    nat = chains["prerouting"].rules
    assert [(r.verdict, r.redirect_port, r.nat_address) for r in nat[2:]] == [
        ("dnat", 5353, "198.51.100.5"),
        ("dnat", 5353, "fd12:3456:789a:1::1"),
        ("dnat", 3129, "198.51.100.5"),
        ("dnat", 3129, "fd12:3456:789a:1::1"),
    ]
    assert all(r.interface == names.host_link for c in chains.values() for r in c.rules[:-1])
    assert chains["input"].rules[-1].verdict == "drop"
    assert [r.verdict for r in chains["forward"].rules] == ["drop", "drop"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dns_port": 53}, "must not be 53"),
        ({"transparent_port": 3128}, "must differ"),
        ({"explicit_port": 0}, "not a port number"),
    ],
)
def test_bad_sandbox_rule_inputs_are_refused(kwargs: dict[str, int], message: str) -> None:
    ports = {"explicit_port": 3128, "transparent_port": 3129, "dns_port": 5353} | kwargs
    with pytest.raises(ProxyError, match=message):
        sandbox_ruleset("egress_sb_x", "egsbxh", "198.51.100.5", "fd00::1", **ports)
    with pytest.raises(ProxyError, match="interface name"):
        sandbox_chains(
            'egsb" accept #', "198.51.100.5", "fd00::1",
            explicit_port=1, transparent_port=2, dns_port=3,
        )  # fmt: skip


@pytest.mark.skipif(NFT is None, reason="needs nftables (nft)")
def test_the_sandbox_rule_set_is_valid_nft() -> None:
    # `nft -c` parses and checks without loading; unprivileged under a user namespace.
    command = [NFT, "-c", "-f", "-"]
    if os.geteuid() != 0:
        if shutil.which("unshare") is None:
            pytest.skip("needs root or unshare to run nft -c")
        command = ["unshare", "-rn", *command]
    done = subprocess.run(
        command, input=_ruleset(SessionNames("0123abcd")), capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
