"""The sidecar shape's activation for real (root only): in a network namespace the test creates
(the pod's), `egress-proxy boundary apply` loads the rules, the real `egress-proxy run` serves as
the proxy's UID, and `egress-proxy boundary verify` as the agent's UID shows every way out held;
with the rules flushed, verify fails and names each bypass. The probe addresses belong to a
second namespace the test creates (joined by a veth), where an observer logs whatever reaches it:
while the boundary holds nothing does, and a broken boundary's packets have nowhere else to go.
Also: a rule set that fails to load leaves no table behind. Skips when not root or without
`ip`, `nft`, `setpriv` or `unshare`."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from proxy.boundary.nft.pod_rules import pod_ruleset

ROOT = Path(__file__).resolve().parent.parent
IP, NFT = shutil.which("ip"), shutil.which("nft")
SETPRIV, UNSHARE = shutil.which("setpriv"), shutil.which("unshare")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
    pytest.mark.skipif(IP is None, reason="needs iproute2 (ip)"),
    pytest.mark.skipif(NFT is None, reason="needs nftables (nft)"),
    pytest.mark.skipif(SETPRIV is None or UNSHARE is None, reason="needs util-linux"),
]

PROXY_UID = 64000  # any UID but the agent's; no passwd entry is needed
AGENT_UID = 65534
TRANSPARENT, EXPLICIT, DNS, ADMIN = 15001, 13128, 15053, 19901
# Documentation ranges, assigned below to the test's own namespaces and nowhere else.
POD_V4, OUTSIDE_V4 = "192.0.2.2", "192.0.2.1"
POD_V6, OUTSIDE_V6 = "2001:db8:e::2", "2001:db8:e::1"
SERVED_PORT = 18080  # a port the agent listens on; the outside must not reach it
READY_TIMEOUT = 60.0


def ip(*args: str, namespace: str | None = None) -> str:
    command = [str(IP), *(["-n", namespace] if namespace else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise AssertionError(f"{shlex.join(command)}: {done.stderr or done.stdout}")
    return done.stdout


def reachable_interpreter() -> str:
    """Shell lines that make this interpreter, its venv and this checkout usable by any UID, in
    the private mount namespace of the command they precede: a directory on their paths that
    others cannot enter (a Python under /root, a fresh clone in `mktemp -d`: mode 0700) is
    covered by a tmpfs holding only the entries needed, bound back from descriptors opened
    before. Nothing changes outside that namespace, nothing is left on disk. Empty when nothing
    is in the way."""
    needed = (os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix), sys.prefix)
    covered: dict[Path, set[str]] = {}
    for target in (*needed, str(ROOT)):
        path = Path(target)
        for parent in reversed(path.parents):
            if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
                covered.setdefault(parent, set()).add(path.relative_to(parent).parts[0])
                break
    lines: list[str] = []
    descriptor = 9
    for parent, children in sorted(covered.items()):
        bind: list[str] = []
        for name in sorted(children):
            child = shlex.quote(str(parent / name))
            lines.append(f"exec {descriptor}<{child}")
            bind += [
                f"mkdir -p {child}",
                f"mount --no-canonicalize --bind /proc/self/fd/{descriptor} {child}",
                f"exec {descriptor}<&-",
            ]
            descriptor -= 1
        lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {shlex.quote(str(parent))}")
        lines += bind
    return "; ".join(lines)


def in_namespace(namespace: str, argv: list[str], *, uid: int | None = None) -> list[str]:
    """A command line running `argv` in `namespace`, as `uid` if given (no new privileges, no
    supplementary groups), with the interpreter reachable for that user."""
    if uid is not None:
        argv = [
            str(SETPRIV),
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--no-new-privs",
            *argv,
        ]
    script = reachable_interpreter()
    inner = f"{script}; exec {shlex.join(argv)}" if script else f"exec {shlex.join(argv)}"
    return [
        str(IP),
        "netns",
        "exec",
        namespace,
        str(UNSHARE),
        "-m",
        "--propagation",
        "private",
        "sh",
        "-ec",
        inner,
    ]


def egress_proxy(*args: str) -> list[str]:
    return [sys.executable, "-m", "proxy", *args]


def run_in(
    namespace: str, argv: list[str], *, uid: int | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        in_namespace(namespace, argv, uid=uid),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def wait_until(predicate: Any, what: str, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@dataclass
class Pod:
    pod: str  # the namespace of the pod (agent + proxy)
    outside: str  # the namespace that owns the probe addresses
    work: Path
    outside_log: Path
    proxy_err: Path


@contextmanager
def pod_and_outside() -> Iterator[Pod]:
    """Two namespaces joined by a veth: the pod's (192.0.2.2, 2001:db8:e::2) and the outside
    (192.0.2.1, 2001:db8:e::1), with the observer running in the outside. No route beyond."""
    tag = uuid.uuid4().hex[:8]
    pod, outside = f"egp-pod-{tag}", f"egp-out-{tag}"
    work = Path(tempfile.mkdtemp(prefix="egp-boundary-"))
    work.chmod(0o755)  # the proxy's UID reads its inputs here
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        for namespace in (pod, outside):
            ip("netns", "add", namespace)
            stack.callback(
                subprocess.run, [str(IP), "netns", "delete", namespace], capture_output=True
            )
        ip(
            "link",
            "add",
            "eth0",
            "netns",
            pod,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            outside,
        )
        for namespace, v4, v6 in ((pod, POD_V4, POD_V6), (outside, OUTSIDE_V4, OUTSIDE_V6)):
            ip("link", "set", "lo", "up", namespace=namespace)
            ip("addr", "add", f"{v4}/24", "dev", "eth0", namespace=namespace)
            ip("-6", "addr", "add", f"{v6}/64", "dev", "eth0", "nodad", namespace=namespace)
            ip("link", "set", "eth0", "up", namespace=namespace)
        # As container runtimes set it: any user may open an ICMP ping socket, so the ICMP
        # probe really sends (instead of passing because it cannot).
        subprocess.run(
            [
                str(IP),
                "netns",
                "exec",
                pod,
                "sysctl",
                "-qw",
                "net.ipv4.ping_group_range=0 2147483647",
            ],
            check=True,
            timeout=30,
        )
        log = work / "outside.jsonl"
        observer = subprocess.Popen(
            in_namespace(
                outside,
                [
                    sys.executable,
                    str(ROOT / "tests" / "support" / "boundary_observer.py"),
                    "outside",
                    str(log),
                    OUTSIDE_V4,
                    OUTSIDE_V6,
                ],
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        stack.callback(stop, observer)
        wait_until(
            lambda: any(e["kind"] == "ready" for e in events(log)) or observer.poll() is not None,
            "the observer",
        )
        assert observer.poll() is None, "the observer exited"
        yield Pod(pod, outside, work, log, work / "proxy.err")


def stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def verify(pod: Pod) -> tuple[int, dict[str, dict[str, Any]], str]:
    done = run_in(
        pod.pod,
        egress_proxy(
            "boundary",
            "verify",
            "--as-user",
            f"{AGENT_UID}:{AGENT_UID}",
            "--probe-v4",
            OUTSIDE_V4,
            "--probe-v6",
            OUTSIDE_V6,
            "--proxy-port",
            str(EXPLICIT),
            "--denied-name",
            "denied.test",
            "--timeout",
            "5",
            "--json",
        ),
    )
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout) if done.stdout.strip() else {"results": []}
    return done.returncode, {r["name"]: r for r in report["results"]}, done.stderr


def connects(namespace: str, address: str, port: int) -> bool:
    """Whether a TCP connection from `namespace` to address:port is accepted (1 s)."""
    code = (
        "import socket,sys\n"
        "s=socket.socket()\ns.settimeout(1)\n"
        f"sys.exit(0 if s.connect_ex(({address!r},{port}))==0 else 1)\n"
    )
    return run_in(namespace, [sys.executable, "-c", code], timeout=30).returncode == 0


def http_status(namespace: str, address: str, port: int, path: str) -> str:
    code = (
        "import socket\n"
        f"s=socket.create_connection(({address!r},{port}),timeout=5)\n"
        f"s.sendall(b'GET {path} HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n')\n"
        "print(s.recv(100).split(b' ')[1].decode())\n"
    )
    done = run_in(namespace, [sys.executable, "-c", code], timeout=30)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def test_verify_holds_with_the_rules_and_names_every_bypass_without_them() -> None:
    with pod_and_outside() as pod, ExitStack() as stack:
        # 1. boundary-apply (root with NET_ADMIN in the pod's namespace).
        applied = run_in(
            pod.pod,
            egress_proxy(
                "boundary",
                "apply",
                f"--proxy-uid={PROXY_UID}",
                f"--transparent-port={TRANSPARENT}",
                f"--dns-port={DNS}",
                f"--explicit-port={EXPLICIT}",
                f"--admin-port={ADMIN}",
            ),
        )
        assert applied.returncode == 0, applied.stderr
        assert "read back as rendered" in applied.stdout

        # 2. The proxy, as its own UID, on the ports the rules name.
        (pod.work / "agent.yaml").write_text("network:\n  egress: [allowed.test]\n")
        (pod.work / "config.yaml").write_text(
            f'dns:\n  nameservers: ["{OUTSIDE_V4}:53"]\n  timeout: 2s\n'
        )
        listeners = [
            f"--listen=transparent://127.0.0.1:{TRANSPARENT}",
            f"--listen=transparent://[::1]:{TRANSPARENT}",
            f"--listen=http://127.0.0.1:{EXPLICIT}",
        ]
        listeners += [f"--dns-listen=127.0.0.1:{DNS}", f"--dns-listen=[::1]:{DNS}"]
        err = pod.proxy_err.open("w")
        stack.callback(err.close)
        proxy = subprocess.Popen(
            in_namespace(
                pod.pod,
                egress_proxy(
                    "run",
                    str(pod.work / "agent.yaml"),
                    f"--config={pod.work / 'config.yaml'}",
                    *listeners,
                    f"--admin=0.0.0.0:{ADMIN}",
                    "--session-id=boundary-test",
                ),
                uid=PROXY_UID,
            ),
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=ROOT,
        )
        stack.callback(stop, proxy)
        wait_until(
            lambda: "listening on" in pod.proxy_err.read_text() or proxy.poll() is not None,
            "the proxy to listen",
        )
        assert proxy.poll() is None, pod.proxy_err.read_text()
        # The kubelet's startupProbe comes from outside the pod: the admin port is let in.
        assert http_status(pod.outside, POD_V4, ADMIN, "/readyz") == "200"
        # Nothing else is: the agent serving a port is not reachable from outside.
        served = pod.work / "served.jsonl"
        served.touch(mode=0o666)
        served.chmod(0o666)  # the agent's UID writes it
        listener = subprocess.Popen(
            in_namespace(
                pod.pod,
                [
                    sys.executable,
                    str(ROOT / "tests" / "support" / "boundary_observer.py"),
                    "listen",
                    str(served),
                    "0.0.0.0",
                    str(SERVED_PORT),
                ],
                uid=AGENT_UID,
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        stack.callback(stop, listener)
        wait_until(lambda: events(served) or listener.poll() is not None, "the agent's listener")
        assert listener.poll() is None, "the agent's listener exited"
        assert not connects(pod.outside, POD_V4, SERVED_PORT)

        # 3. boundary-verify as the agent's UID: every probe held, and nothing reached outside.
        code, results, stderr = verify(pod)
        assert results, stderr
        held = {name: r["detail"] for name, r in results.items() if r["passed"]}
        failed = {name: r["detail"] for name, r in results.items() if not r["passed"]}
        expected = {
            *(f"tcp_{f}_direct_{p}" for f in ("v4", "v6") for p in (80, 443)),
            "tcp_v4_direct_ssh",
            "tcp_v6_direct_ssh",
            "tcp_explicit_proxy",
            "udp_v4",
            "udp_v6",
            "icmp_v4",
            "icmp_v6",
            "dns_denied_name",
        }
        assert set(results) == expected
        assert code == 0, (failed, stderr, pod.proxy_err.read_text()[-2000:])
        assert set(held) == expected
        assert "X-Egress-Denied" in held["tcp_v4_direct_80"]
        assert "X-Egress-Denied" in held["tcp_v6_direct_443"]
        # An SSH stream to an address never resolved through the proxy names no host.
        assert "unattributed" in held["tcp_v4_direct_ssh"], held["tcp_v4_direct_ssh"]
        for name in ("udp_v4", "udp_v6", "icmp_v4"):
            assert "refused locally" in held[name], held[name]
        # The kernel does not tell an ICMPv6 ping socket of the drop: no reply is the evidence
        # (the outside answers pings, as step 4 shows).
        assert "no reply" in held["icmp_v6"], held["icmp_v6"]
        seen = [e for e in events(pod.outside_log) if e["kind"] != "ready"]
        assert seen == [], seen
        # DNS was answered by the proxy's DNS listener (redirected), not dropped on the way.
        assert held["dns_denied_name"].endswith(("REFUSED", "NXDOMAIN")), held

        # 4. The rules gone (what root in the pod, or a failed apply, would leave): verify
        #    fails and names each way out; the observer saw them arrive.
        flushed = run_in(pod.pod, [str(NFT), "delete", "table", "inet", "egress_boundary"])
        assert flushed.returncode == 0, flushed.stderr
        code, results, stderr = verify(pod)
        assert code == 1, (results, stderr)
        failed = {name for name, r in results.items() if not r["passed"]}
        assert failed == expected - {"tcp_explicit_proxy"}, results
        assert "direct connection" in results["tcp_v4_direct_80"]["detail"]
        assert "192.0.2.1" in results["dns_denied_name"]["detail"]  # the outside's answer
        assert "was answered" in results["icmp_v6"]["detail"]
        kinds = [(e["kind"], e.get("port")) for e in events(pod.outside_log)]
        assert kinds.count(("tcp", 80)) == 2 and kinds.count(("tcp", 443)) == 2, kinds
        assert kinds.count(("udp", 443)) == 2, kinds
        assert ("dns", None) in kinds, kinds
        # ... and the agent's port is open to the outside once nothing drops inbound.
        assert connects(pod.outside, POD_V4, SERVED_PORT)


def test_a_rule_set_that_fails_to_load_leaves_no_table(tmp_path: Path) -> None:
    namespace = f"egp-apply-{uuid.uuid4().hex[:8]}"
    ip("netns", "add", namespace)
    try:
        arguments = [f"--transparent-port={TRANSPARENT}", f"--dns-port={DNS}"]
        good = run_in(namespace, egress_proxy("boundary", "apply", "--proxy-uid=64000", *arguments))
        assert good.returncode == 0, good.stderr
        assert (
            run_in(namespace, [str(NFT), "list", "table", "inet", "egress_boundary"]).returncode
            == 0
        )

        # A rule set nft refuses (a redirect in a filter chain), over the good one: the
        # transaction fails, and the table the good one left is removed too.
        broken = tmp_path / "broken.nft"
        broken.write_text(
            pod_ruleset(64000, TRANSPARENT, DNS).replace(
                "ct direction reply accept", f"redirect to :{TRANSPARENT}"
            )
        )
        failed = run_in(namespace, egress_proxy("boundary", "apply", f"--ruleset={broken}"))
        assert failed.returncode == 1, failed.stderr
        assert "boundary not applied" in failed.stderr and "Traceback" not in failed.stderr
        tables = run_in(namespace, [str(NFT), "list", "tables"])
        assert tables.returncode == 0 and "egress_boundary" not in tables.stdout, tables.stdout

        # Without NET_ADMIN (an unprivileged user): refused, nothing loaded, exit 1.
        unprivileged = run_in(
            namespace,
            egress_proxy("boundary", "apply", "--proxy-uid=64000", *arguments),
            uid=AGENT_UID,
        )
        assert unprivileged.returncode == 1, unprivileged.stderr
        assert "Traceback" not in unprivileged.stderr
        tables = run_in(namespace, [str(NFT), "list", "tables"])
        assert "egress_boundary" not in tables.stdout

        # verify refuses to probe as root: it would prove nothing about the agent.
        as_root = run_in(namespace, egress_proxy("boundary", "verify"))
        assert as_root.returncode == 2 and "as root it proves nothing" in as_root.stderr
    finally:
        subprocess.run([str(IP), "netns", "delete", namespace], capture_output=True, timeout=30)
