"""The attributed workload (issue 18; root only): connections that carry no name, attributed to
one by the proxy's DNS answers, on a transparent listener inside a network namespace the harness
creates, beside TLS on the same listener (decided on its SNI).

The namespace has only its loopback interface. In it run a DNS server of the harness's own
(tests/support/dns_server.py: bench.test is ADDRESS there), an upstream of the load generator, each
egress-proxy under test (its usual listeners plus `--listen transparent://127.0.0.1:PORT`,
resolving with that DNS server) and the clients. Its nftables rules send TCP to ADDRESS, a
loopback address nothing listens on:
  - from root (the proxy dialling the address it answered, and direct's client) to the same
    port on 127.0.0.1, where the upstream listens;
  - from anyone else (the client, run as `nobody` through a proxy) to the transparent listener,
    which reads the original destination (ADDRESS:port) with SO_ORIGINAL_DST.
The client resolves bench.test once through the proxy's DNS listener (`--dns-listen`), then
opens new connections to the answer: an SSH identification line (attributed by DNS, relayed
opaque to that address) or a TLS ClientHello (the SNI gate). Every address is a loopback
address inside the namespace; nothing leaves it and nothing reaches the machine's resolver.

The harness enters the namespace on one thread of its own (os.setns: a thread's namespace is
its own): every socket, thread and process that thread makes lives in the namespace, so the
proxy, its readiness probes, the DNS server and the clients are started by the harness's usual
functions, called on that thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from . import egress
from .context import Run
from .loadgen import Loadgen, upstream
from .proc import LOOPBACK
from .workloads import opaque_route, tunnels_workload

HOST = egress.HOST
ADDRESS = "127.0.0.5"  # bench.test inside the namespace: redirected, never listened on
# The transparent listener's port: below the ephemeral range, so that no port the harness picks
# in the (otherwise empty) namespace is ever this one.
TRANSPARENT_PORT = 15001
CLIENT_USER = "nobody"  # the client's user: its connections go to the proxy, root's do not
CALL_TIMEOUT_S = 600.0  # one call on the namespace's thread (a whole workload) at most
COMMAND_TIMEOUT_S = 30.0
T = TypeVar("T")


def nft_rules(address: str, proxy_port: int) -> str:
    """The namespace's redirects (see the module's docstring)."""
    return f"""\
table ip egress_bench {{
  chain out {{
    type nat hook output priority -100; policy accept;
    ip daddr {address} meta l4proto tcp meta skuid 0 redirect
    ip daddr {address} meta l4proto tcp redirect to :{proxy_port}
  }}
}}
"""


def unavailable() -> str | None:
    """Why the attributed workload cannot run here, or None."""
    if os.geteuid() != 0:
        return "attributed workload skipped: it needs root (a network namespace and nftables)"
    if missing := [tool for tool in ("ip", "nft") if shutil.which(tool) is None]:
        return f"attributed workload skipped: {' and '.join(missing)} not installed"
    if not hasattr(os, "setns"):
        return "attributed workload skipped: this Python has no os.setns"
    try:
        pwd.getpwnam(CLIENT_USER)
    except KeyError:
        return f"attributed workload skipped: no user {CLIENT_USER!r} to run the client as"
    return None


def _command(*args: str, stdin: str | None = None) -> None:
    done = subprocess.run(
        list(args), input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {(done.stderr or done.stdout).strip()[:300]}")


def _enter(name: str) -> None:
    """The namespace's thread enters it (the other threads of the harness stay outside)."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        os.setns(fd, os.CLONE_NEWNET)
    finally:
        os.close(fd)


@dataclass
class Namespace:
    """The attributed workload's network namespace, its thread, DNS server and upstream."""

    name: str
    thread: concurrent.futures.ThreadPoolExecutor
    dns: Any = None  # tests/support/dns_server.DNSServer, inside
    upstream: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    transparent_port: int = TRANSPARENT_PORT

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """function(*args) on the namespace's thread."""
        return self.thread.submit(function, *args).result(timeout=CALL_TIMEOUT_S)


@contextlib.contextmanager
def namespace(loadgen: Loadgen, directory: Path) -> Iterator[Namespace]:
    """A fresh network namespace with its loopback up, the redirects, a DNS server (bench.test:
    ADDRESS) and an upstream in it; all of it removed on exit."""
    from support.dns_server import running_dns_server  # tests/, on the path (bench.measure)

    name = f"egress-bench-{uuid.uuid4().hex[:8]}"
    directory.mkdir(parents=True, exist_ok=True)
    _command("ip", "netns", "add", name)
    thread = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix=name, initializer=_enter, initargs=(name,)
    )
    inside = Namespace(name, thread)
    # Entered and left on the namespace's thread: their sockets and processes are there.
    servers = contextlib.ExitStack()
    try:
        inside.call(_command, "ip", "link", "set", "lo", "up")
        rules = nft_rules(ADDRESS, inside.transparent_port)
        inside.call(lambda: _command("nft", "-f", "-", stdin=rules))
        inside.dns = inside.call(servers.enter_context, running_dns_server())
        inside.dns.set(HOST, a=[ADDRESS], ttl=3600)
        log = directory / "upstream.txt"
        inside.upstream = inside.call(servers.enter_context, upstream(loadgen, log))
        yield inside
    finally:
        try:
            with contextlib.suppress(concurrent.futures.BrokenExecutor):  # never entered
                inside.call(servers.close)
        finally:
            thread.shutdown(wait=True)
            subprocess.run(
                ["ip", "netns", "delete", name], capture_output=True, timeout=COMMAND_TIMEOUT_S
            )


def resolve(dns_port: int, name: str) -> str:
    """`name`'s A record through the proxy's DNS listener on 127.0.0.1:`dns_port` (on the
    namespace's thread: the listener inside); it must be a loopback address."""
    import dns.message
    import dns.query
    import dns.rcode
    import dns.rdatatype

    answer = dns.query.udp(
        dns.message.make_query(name, dns.rdatatype.A), LOOPBACK, port=dns_port, timeout=2.0
    )
    found = [r.address for rrset in answer.answer for r in rrset if r.rdtype == dns.rdatatype.A]
    if answer.rcode() != dns.rcode.NOERROR or not found:
        raise RuntimeError(f"{name}: {dns.rcode.to_text(answer.rcode())}, no A record")
    if not found[0].startswith("127."):
        raise RuntimeError(f"{name}: answered {found[0]}, not a loopback address")
    return str(found[0])


def _run_by_client(run: Run, directory: Path) -> Run:
    """`run` with its load generator copied into `directory` (0755), for a client run as
    CLIENT_USER: the checkout it was built in may be in a directory only root can enter (a
    clone in `mktemp -d`'s)."""
    binary = directory / run.loadgen.binary.name
    shutil.copy2(run.loadgen.binary, binary)
    binary.chmod(0o755)
    return dataclasses.replace(run, loadgen=dataclasses.replace(run.loadgen, binary=binary))


def _measure(run: Run, config: str, directory: Path, label: str) -> dict[str, Any]:
    """On the namespace's thread: the SSH first flight and the TLS ClientHello to bench.test's
    address, through `config`'s transparent listener (direct: straight to the upstream)."""
    inside: Namespace = run.namespace
    here = dataclasses.replace(run, upstream=inside.upstream)
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)  # the client (nobody) writes nothing here, but reads its targets
    if config == "direct":  # root's connections to ADDRESS go to the upstream, redirected
        route: dict[str, Any] = {"address": ADDRESS}
        return {
            "address": ADDRESS,
            "ssh": tunnels_workload(here, None, directory, **route, **opaque_route(here)),
            "tls": tunnels_workload(here, None, directory, **route),
        }
    chosen = run.egress[config]
    listen = ("--listen", f"transparent://{LOOPBACK}:{inside.transparent_port}")
    chosen = dataclasses.replace(chosen, args=(*chosen.args, *listen))
    base = {**run.base_config, "dns": {**run.base_config["dns"]}}
    base["dns"]["nameservers"] = [f"{inside.dns.address[0]}:{inside.dns.address[1]}"]
    port = run.origin_tls.port if run.origin_tls else None
    egress.write_inputs(directory, chosen, base, port)
    proxy = egress.start(chosen, directory, run.env, int(inside.upstream["tunnel"]))
    try:
        run.profiled(proxy.pid, config, label)
        if proxy.dns_port is None:
            raise RuntimeError(f"{config} has no DNS listener")
        address = resolve(proxy.dns_port, HOST)  # once: the proxy now attributes it
        route = {"kind": "transparent", "address": address, "user": CLIENT_USER}
        here = _run_by_client(here, directory)
        out = {
            "address": address,
            "ssh": tunnels_workload(here, proxy, directory, **route, **opaque_route(here)),
            "tls": tunnels_workload(here, proxy, directory, **route),
        }
    finally:
        if proxy.stop() != 0:
            run.problem(f"attributed {config}: egress-proxy exited non-zero on SIGTERM")
    out["audit"] = audit_counts(proxy.audit_log)
    streams = sum(int(p.get("tunnels") or 0) for p in out["ssh"].values()) + run.settings.warmup
    if out["audit"].get("close ssh dns", 0) < streams:
        run.problem(
            f"attributed {config}: {streams} SSH streams, but the audit log has "
            f"{out['audit'].get('close ssh dns', 0)} closes of protocol ssh attributed by dns: "
            f"{out['audit']}"
        )
    return out


def audit_counts(log: Path) -> dict[str, int]:
    """The audit log's lines counted by "event protocol attribution" (e.g. `close ssh dns`)."""
    counts: Counter[str] = Counter()
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                entry = json.loads(line)
                counts[
                    " ".join(str(entry.get(k)) for k in ("event", "protocol", "attribution"))
                ] += 1
    return dict(counts)


def attributed_workload(
    run: Run, config: str, directory: Path, label: str = "attributed"
) -> dict[str, Any]:
    """The attributed workload of `config` (an egress-proxy configuration with listeners, or
    direct), run inside the run's namespace (its proxy profiled under `label` with --profile)."""
    if run.namespace is None:
        raise RuntimeError("the attributed workload's namespace is not set up")
    return run.namespace.call(_measure, run, config, directory, label)
