"""The benchmark harness: egress-proxy against squid (the yardstick of its targets), tinyproxy and
the others, side by side in one run, on loopback only (benchmarks/README.md).

    make bench                                   # full run
    make bench-quick                             # the same, small: under 2 minutes
    .venv/bin/python benchmarks/bench.py --quick --configs direct,egress-proxy,squid
    .venv/bin/python benchmarks/bench.py --baseline-tree /tmp/ep-baseline --configs \\
        direct,egress-proxy,squid                # A/B against another checkout, same rounds
    .venv/bin/python -m benchmarks.harness.report benchmarks/results/bench.json   # report again
    .venv/bin/python benchmarks/bench.py --configs egress-proxy --workloads tunnels --rounds 1 \\
        --profile /tmp/prof                      # py-spy on every egress-proxy: PROFILE.md

Load generators: benchmarks/harness/loadgen.c (built with the machine's gcc) for tunnels, SOCKS5,
bulk and intercepted HTTPS, with its own upstream; wrk for plain HTTP against nginx; dnspython for
the DNS listener. Workloads 1-7 run on one process of each configuration per round, memory read
between them; configurations are interleaved round by round (A B C, A B C, ...); summaries are
medians over rounds, and ratios (to direct, to squid for the targets) are taken within rounds.
Every figure comes with the proxy's CPU per unit of work (utime+stime from /proc), the figure of
record on a shared machine. Everything talks to 127.0.0.1 only; every phase is bounded in count
and time. Progress goes to stderr; the report to stdout and `--out` (bench.json, REPORT.md,
plots). Exit code 1 when a measurement failed (listed under "Problems"), 2 when the run could
not start (bad options, no gcc, --profile without a py-spy that can read a process here).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import attributed, egress, peers, proc, profiling, stats
from .context import FULL, MIB, QUICK, Run, Settings
from .loadgen import SSH_FLIGHT, Loadgen, Unavailable, build, upstream, write_targets
from .rounds import dns_round, main_round, scale_round, sessions_round, start_config
from .summary import build_document

HOST = egress.HOST
WORKLOADS = (
    "tunnels",
    "opaque",
    "attributed",
    "bulk",
    "http",
    "socks5",
    "dns-listen",
    "inspect",
    "scale",
    "dns",
    "sessions",
)
# The workloads of the main rounds (scale and dns have rounds of their own).
MAIN_WORKLOADS = set(WORKLOADS) - {"scale", "dns"}
FULL_CONFIGS = (
    "direct",
    "egress-proxy",
    "egress-url-prefix",
    "egress-inspect-all",
    "squid",
    "tinyproxy",
    "privoxy",
    "mitmdump",
)
QUICK_CONFIGS = ("direct", "egress-proxy", "squid", "tinyproxy")
ORIGIN_BODY_BYTES = 256


def choose(
    option: str | None, allowed: Sequence[str], default: Sequence[str], what: str
) -> list[str]:
    if not option:
        return list(default)
    chosen = [c.strip() for c in option.split(",") if c.strip()]
    if unknown := [c for c in chosen if c not in allowed]:
        raise ValueError(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(allowed)})")
    return list(dict.fromkeys(chosen))


def runnable(
    configs: Sequence[str], workloads: Sequence[str], statuses: dict[str, peers.PeerStatus]
) -> tuple[list[str], list[str]]:
    """The configurations that can run here, and a note for each one (or tool) that cannot:
    a missing peer is skipped, never an error."""
    notes = [s.note for name, s in statuses.items() if s.note and name in configs]
    for tool, what in (("nginx", "the HTTP origin"), ("wrk", "the HTTP load generator")):
        status = statuses.get(tool)
        if "http" in workloads and (status is None or not status.available):
            notes.append(
                f"http workload skipped: {what} ({tool}) is not installed ({peers.INSTALL_HINT})"
            )
    missing = peers.PeerStatus("", False)
    kept = [c for c in configs if c not in peers.PEERS or statuses.get(c, missing).available]
    return kept, notes


def parse(
    argv: Sequence[str] | None,
) -> tuple[argparse.Namespace, Settings, dict[str, egress.EgressConfig]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, 2 rounds, < 2 min")
    parser.add_argument("--configs", help="comma-separated (default: see benchmarks/README.md)")
    parser.add_argument("--workloads", help=f"comma-separated, of {','.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3, --quick 2)")
    parser.add_argument("--sessions", type=int, help="proxies side by side (default 50, quick 3)")
    parser.add_argument("--bulk-mib", type=int, help="bulk size each way (default 1024)")
    parser.add_argument(
        "--egress-config",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a named egress-proxy configuration (YAML: name, config, manifest, args, ...)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="PATH",
        help="another checkout: every selected egress-proxy configuration also runs from it "
        "(NAME-baseline), interleaved, for an A/B of a change",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="bench.json, REPORT.md and plots go here (default benchmarks/results; with "
        "--quick benchmarks/results/tmp/quick)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="py-spy samples every egress-proxy process the run starts into DIR, summarised in "
        "DIR/PROFILE.md (the run's figures are then not of record)",
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.rounds is not None:
        rounds = min(max(1, args.rounds), 50)
        changes.update(rounds=rounds, scale_rounds=rounds, dns_rounds=rounds)
    if args.sessions is not None:
        changes["sessions"] = min(max(1, args.sessions), 500)
    if args.bulk_mib is not None:
        changes["bulk_bytes"] = min(max(1, args.bulk_mib), 16 * 1024) * MIB
        changes["parallel_bytes"] = min(max(8, args.bulk_mib), 16 * 1024) * MIB
    settings = dataclasses.replace(settings, **changes)
    try:
        available = dict(egress.BUILTIN)
        files = [egress.load_config_file(path) for path in args.egress_config]
        available |= {c.name: c for c in files}
        known = ["direct", *available, *peers.PEERS]
        default = list(QUICK_CONFIGS if args.quick else FULL_CONFIGS)
        # A configuration given by file runs by default, after the built-in egress-proxy.
        default[2:2] = [c.name for c in files]
        args.configs = choose(args.configs, known, default, "configuration(s)")
        args.workloads = choose(args.workloads, WORKLOADS, WORKLOADS, "workload(s)")
    except (ValueError, egress.ConfigError) as exc:
        parser.error(str(exc))
    chosen = {c: available[c] for c in args.configs if c in available}
    if args.baseline_tree is not None:
        tree = args.baseline_tree.resolve()
        if not (tree / "pyproject.toml").is_file() or not (tree / "proxy").is_dir():
            parser.error(f"--baseline-tree {args.baseline_tree}: not a checkout of egress-proxy")
        for name in list(chosen):
            twin = egress.baseline_of(chosen[name], tree)
            chosen[twin.name] = twin
            args.configs.insert(args.configs.index(name) + 1, twin.name)
    return args, settings, chosen


def tls_material(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA and the origin's certificate for bench.test and inspected.test (trustme):
    (CA, certificate chain, key) files."""
    import trustme

    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert(HOST, egress.INSPECTED_HOST)
    ca_file, chain, key = directory / "ca.pem", directory / "origin.pem", directory / "origin.key"
    ca.cert_pem.write_to_path(str(ca_file))
    server.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    return ca_file, chain, key


def supported(run: Run, log: Any, notes: list[str]) -> None:
    """Drops the egress configurations the proxy under test cannot run, each with a note (the
    default one as a problem: it is what the run is for)."""
    for name, chosen in list(run.egress.items()):
        directory = run.tmp / name
        run.write_inputs(directory, chosen)
        if (why := egress.unsupported(chosen, directory, run.env)) is None:
            continue
        del run.egress[name]
        if name in ("egress-proxy", "egress-proxy-baseline"):
            run.problem(f"{name} cannot run: {why}")
        else:
            notes.append(f"{name} skipped: {why}")
            log(f"note: {name} skipped: {why}")


def rounds(run: Run, configs: Sequence[str], samples: dict[str, list[dict[str, Any]]]) -> None:
    """The main rounds, then scale, DNS and sessions (each bounded)."""
    s, log = run.settings, run.log
    # Untimed: fills the page cache and egress-proxy's bytecode cache (and mitmdump's CA).
    for config in configs:
        if s.warm_pass == "all" or config in run.egress:
            with contextlib.suppress(RuntimeError):  # the rounds report it
                proxy = start_config(run, config, run.tmp / "warm" / config, "warm")
                if proxy is not None:
                    proxy.stop()
    log(f"warm-up pass done ({s.warm_pass} started and stopped once)")
    if MAIN_WORKLOADS & set(run.workloads):
        samples["main"] = []
        for n in range(s.rounds):
            for config in configs:
                t0 = time.perf_counter()
                sample = main_round(run, config, n)
                samples["main"].append(sample)
                took = time.perf_counter() - t0
                log(f"round {n + 1}/{s.rounds} {config:<18} {round_line(sample)} ({took:.1f} s)")
    if run.wants("scale") and "egress-proxy" in run.egress:
        samples["scale"] = []
        for n in range(s.scale_rounds):
            for size in s.scale_sizes:
                sample = scale_round(run, size, n)
                samples["scale"].append(sample)
                ready = sample.get("ready_s") or 0
                log(f"scale round {n + 1} {size:>7,} rules: ready {ready:.3f} s")
    dns_configs = [c for c in ("egress-proxy", "egress-proxy-baseline") if c in run.egress]
    if run.wants("dns") and dns_configs:
        samples["dns"] = []
        for n in range(s.dns_rounds):
            for config in dns_configs:
                sample = dns_round(run, config, n)
                samples["dns"].append(sample)
                cold = stats.dig(sample, ("cold", "latency_ms", "p50")) or 0
                warm = stats.dig(sample, ("warm", "latency_ms", "p50")) or 0
                log(f"dns round {n + 1} {config}: cold p50 {cold:.3f} ms, warm {warm:.3f} ms")
    if run.wants("sessions"):
        samples["sessions"] = []
        for config in (c for c in configs if c != "direct"):
            sample = sessions_round(run, config, 0)
            samples["sessions"].append(sample)
            pss = sample.get("pss_mb_per_session") or 0
            log(f"sessions {config}: {sample.get('sessions')}, PSS {pss:.1f} MB each")


def round_line(sample: dict[str, Any]) -> str:
    parts = []
    for label, path, fmt in (
        ("tunnels/s @16", ("tunnels", "16", "tunnels_per_s"), ",.0f"),
        ("µs CPU/tunnel", ("tunnels", "16", "proxy_cpu_us_per_tunnel"), ",.0f"),
        ("µs CPU/opaque", ("opaque", "16", "proxy_cpu_us_per_tunnel"), ",.0f"),
        ("µs CPU/attributed ssh", ("attributed", "ssh", "16", "proxy_cpu_us_per_tunnel"), ",.0f"),
        ("µs CPU/transparent tls", ("attributed", "tls", "16", "proxy_cpu_us_per_tunnel"), ",.0f"),
        ("up MB/s", ("bulk", "up", "mb_per_s"), ",.0f"),
        ("http req/s", ("http", "requests_per_s"), ",.0f"),
        ("µs CPU/req", ("http", "proxy_cpu_us_per_request"), ",.0f"),
        ("socks5/s", ("socks5", "tunnels_per_s"), ",.0f"),
        ("dns q/s", ("dns_listen", "queries_per_s"), ",.0f"),
        ("https req/s", ("inspect", "request", "requests_per_s"), ",.0f"),
        ("worst RSS MB", ("worst_rss_mb",), ".1f"),
        ("ready s", ("ready_s",), ".3f"),
    ):
        value = stats.number(stats.dig(sample, path))
        if value is not None:
            parts.append(f"{format(value, fmt)} {label}")
    return ", ".join(parts) or sample.get("error", "")[:200]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def surroundings(statuses: dict[str, peers.PeerStatus], notes: list[str]) -> dict[str, Any]:
    """The machine and the versions of everything measured; a note when the peers' own system
    services run beside the harness (they share the CPUs)."""
    info = proc.machine()
    info["versions"] = {name: s.version for name, s in statuses.items()}
    info["versions"] |= {"egress-proxy": f"git {info.get('git')}", "python": info["python"]}
    if services := list(proc.foreign_processes(("squid", "tinyproxy", "privoxy", "nginx"))):
        notes.append(
            "system services of the peers' packages were running (not used by the harness, but "
            "sharing the CPUs): " + ", ".join(f"{name} (pid {pid})" for name, pid in services)
        )
    return info


def measure(
    stack: contextlib.ExitStack,
    args: argparse.Namespace,
    settings: Settings,
    chosen: dict[str, egress.EgressConfig],
    loadgen: Loadgen,
    statuses: dict[str, peers.PeerStatus],
    configs: list[str],
    notes: list[str],
    profiler: profiling.Profiler | None = None,
) -> tuple[Run, list[str], dict[str, list[dict[str, Any]]]]:
    """Everything the run needs, set up on loopback, then every round: the run, the
    configurations that ran, the samples."""
    sys.path.insert(0, str(proc.ROOT / "tests"))
    from support.dns_server import running_dns_server

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
    tmp.chmod(0o755)  # a peer that drops privileges (squid) reads its files under here
    dns = stack.enter_context(running_dns_server())
    for name in (HOST, egress.INSPECTED_HOST):
        dns.set(name, a=[proc.LOOPBACK], ttl=3600)
    ca_file = chain = key = None
    if "inspect" in args.workloads and loadgen.tls:
        ca_file, chain, key = tls_material(tmp / "tls")
    run = Run(
        settings=settings,
        workloads=args.workloads,
        tmp=tmp,
        dns=dns,
        loadgen=loadgen,
        upstream=stack.enter_context(upstream(loadgen, tmp / "upstream.txt")),
        targets=write_targets(tmp / "targets.bin", [HOST]),
        env=egress.proxy_env(proc.RESULTS / "tmp" / "pycache"),
        statuses=statuses,
        egress=dict(chosen),
        base_config=egress.base_config(dns.address, tmp / "ca", ca_file),
        tls_ca=ca_file,
        wrk=statuses["wrk"].binary if statuses["wrk"].available else None,
        log=log,
        profiler=profiler,
    )
    if {"opaque", "attributed"} & set(args.workloads):
        run.opaque_targets = write_targets(tmp / "opaque.bin", [HOST], flight=SSH_FLIGHT)
    if "attributed" in args.workloads:
        if (why := attributed.unavailable()) is not None:
            notes.append(why)
            log(f"note: {why}")
        else:
            run.namespace = stack.enter_context(attributed.namespace(loadgen, tmp / "namespace"))
    nginx = statuses["nginx"]
    if {"http", "inspect"} & set(args.workloads) and nginx.available and nginx.binary:
        tls = (chain, key) if chain and key else None
        run.origin, run.origin_tls = peers.start_origin(
            nginx.binary, tmp / "origin", ORIGIN_BODY_BYTES, tls
        )
        stack.callback(run.origin.stop)
    supported(run, log, notes)
    configs = [c for c in configs if c in run.egress or c not in chosen]
    log(f"configs {', '.join(configs)}; workloads {', '.join(args.workloads)}; {settings}")
    samples: dict[str, list[dict[str, Any]]] = {}
    rounds(run, configs, samples)
    return run, configs, samples


def profile_of(
    profiler: profiling.Profiler, run: Run, chosen: dict[str, egress.EgressConfig]
) -> dict[str, Any]:
    """After the run: every py-spy waited for (its failures are problems of the run), then
    PROFILE.md written; what bench.json says of it."""
    for problem in profiler.finish():
        run.problem(problem)
    roots = {proc.ROOT, *(c.tree for c in chosen.values() if c.tree is not None)}
    where = profiler.write(roots, [f"Command: `{proc.command()}`.", ""])
    return {
        "of_record": False,
        "why": profiling.NOT_OF_RECORD,
        "directory": str(profiler.directory),
        "summary": str(where),
        "files": {c: [p.name for p in paths] for c, paths in profiler.files().items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args, settings, chosen = parse(argv)
    out_dir = args.out or (proc.RESULTS / ("tmp/quick" if args.quick else ""))
    profiler = None
    try:
        if args.profile is not None:
            profiler = profiling.Profiler.start(args.profile)
        loadgen = build()
    except profiling.Unavailable as exc:
        log(f"bench: cannot run: --profile: {exc}")
        return 2
    except Unavailable as exc:
        log(f"bench: cannot run: {exc}")
        return 2
    began = time.perf_counter()
    wanted = [c for c in args.configs if c in peers.PEERS]
    statuses = {name: peers.peer_status(name) for name in (*wanted, "nginx", "wrk")}
    configs, notes = runnable(args.configs, args.workloads, statuses)
    if loadgen.note:
        notes.append(loadgen.note)
    info = surroundings(statuses, notes)
    for note in notes:
        log(f"note: {note}")
    with contextlib.ExitStack() as stack:
        if profiler is not None:  # the last to run: after every proxy has stopped
            stack.callback(profiler.finish)
        run, configs, samples = measure(
            stack, args, settings, chosen, loadgen, statuses, configs, notes, profiler
        )
    profile = profile_of(profiler, run, chosen) if profiler is not None else None
    elapsed = time.perf_counter() - began
    with contextlib.suppress(OSError):
        info["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    peer_info = {name: dataclasses.asdict(s) for name, s in statuses.items()}
    document = build_document(
        settings,
        args.quick,
        configs,
        run.egress,
        args.workloads,
        info,
        peer_info,
        notes,
        run.problems,
        samples,
        elapsed,
        profile,
    )
    from . import report

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(document, indent=1) + "\n")
    print(report.write(document, out_dir))
    wrote = f"{out_dir / 'bench.json'}, {out_dir / 'REPORT.md'} and the plots"
    if profile is not None:
        wrote += f"; the profile in {profile['summary']} (these figures are not of record)"
    log(f"wrote {wrote} in {elapsed:.0f} s")
    return 1 if run.problems else 0


if __name__ == "__main__":
    sys.exit(main())
