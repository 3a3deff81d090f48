"""Benchmark of the resolver (proxy/net/resolver.py): the proxy-side CPU of one cold lookup (A
and AAAA of a name never asked before) and of a cached one, against a loopback DNS server.

    .venv/bin/python benchmarks/dns_lookup.py                      # 5 rounds of 300 lookups
    .venv/bin/python benchmarks/dns_lookup.py --rounds 9 --count 500 --json /tmp/dns.json
    .venv/bin/python benchmarks/dns_lookup.py --compare /tmp/old_resolver.py

`--reference` adds the floor of dnspython's own query functions for the same two questions
(`dns.asyncquery.udp` for A and AAAA side by side, a fresh `make_query` each, no cache).
`--compare FILE` adds a second variant: the `Resolver` of FILE (a saved copy of another
version of proxy/net/resolver.py, importing this checkout's `policy` and `proxy`), measured in
the same rounds, interleaved with this checkout's (A B, B A, A B, ...), so a noisy moment of a
shared machine hits both alike.

The DNS server is a child process of this script (`--role serve`, dnspython messages, UDP on
127.0.0.1): its CPU is not the resolver's. It answers A and AAAA for any name (one record
each, TTL 300). The resolver runs in this process on asyncio's own loop (`--loop uvloop`:
uvloop's); its CPU is `time.process_time()` around each sample. The lookups are awaited one
after the other, so a sample's CPU over its count is the CPU of one lookup (the loop's own share
included, as it is in the proxy). Figures are medians over rounds. Talks to 127.0.0.1 only;
every loop is bounded in count and time (`--budget` seconds for all rounds; the server ends
with its parent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOOPBACK = "127.0.0.1"
MAX_COUNT = 10_000
MAX_ROUNDS = 50


# -- the DNS server (a child process) --------------------------------------------------------


def serve() -> None:
    """Answer every A/AAAA query on a UDP port of 127.0.0.1 until stdin closes."""
    import dns.flags
    import dns.message
    import dns.rdatatype
    import dns.rrset

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((LOOPBACK, 0))
    print(sock.getsockname()[1], flush=True)
    records = {dns.rdatatype.A: "192.0.2.1", dns.rdatatype.AAAA: "2001:db8::1"}
    while True:
        ready, _, _ = select.select([sock, sys.stdin], [], [])
        if sys.stdin in ready:
            return  # the parent is gone (or done)
        wire, peer = sock.recvfrom(4096)
        try:
            query = dns.message.from_wire(wire)
            question = query.question[0]
        except Exception:
            continue
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        value = records.get(question.rdtype)
        if value is not None:
            response.answer.append(
                dns.rrset.from_text(question.name, 300, "IN", question.rdtype, value)
            )
        sock.sendto(response.to_wire(), peer)


@contextlib.contextmanager
def dns_server() -> Iterator[int]:
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        yield port
    finally:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


# -- the measurement -------------------------------------------------------------------------


class BareDnspython:
    """The reference: what dnspython's own query functions need for the same two questions
    (`dns.asyncquery.udp`, A and AAAA side by side, fresh messages each time), no cache."""

    async def resolve(self, name: str) -> Any:
        import dns.asyncquery
        import dns.message

        answers = await asyncio.gather(
            *(
                dns.asyncquery.udp(dns.message.make_query(name, rdtype), LOOPBACK, 2.0, self.port)
                for rdtype in ("A", "AAAA")
            )
        )
        addresses = [
            rdata.address for answer in answers for rrset in answer.answer for rdata in rrset
        ]
        return argparse.Namespace(addresses=addresses)

    def __init__(self, port: int) -> None:
        self.port = port


def load_compared(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("compared_resolver", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def sample(resolver: Any, names: list[str]) -> dict[str, float]:
    """CPU and wall time per lookup of `names`, resolved one after the other."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    for name in names:
        answer = await resolver.resolve(name)
        if len(answer.addresses) != 2:
            raise SystemExit(f"unexpected answer for {name}: {answer}")
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"cpu_us": cpu / len(names) * 1e6, "wall_us": wall / len(names) * 1e6}


async def measure(args: argparse.Namespace, port: int) -> dict[str, Any]:
    from proxy.net import resolver as current

    variants: dict[str, ModuleType] = {"this checkout": current}
    if args.compare:
        variants[f"compared ({args.compare.name})"] = load_compared(args.compare)
    resolvers: dict[str, Any] = {
        label: module.Resolver([(LOOPBACK, port)], timeout=2.0)
        for label, module in variants.items()
    }
    if args.reference:
        resolvers["dnspython asyncquery.udp x2 (reference)"] = BareDnspython(port)
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        label: {"cold": [], "cached": []} for label in resolvers
    }
    for resolver in resolvers.values():  # warm up: imports, first sockets, the cached name
        await resolver.resolve("warm.bench.test")
        await resolver.resolve("cached.bench.test")
    deadline = time.monotonic() + args.budget
    rounds = 0
    for n in range(args.rounds):
        if time.monotonic() >= deadline:
            print(f"budget of {args.budget:g}s spent after {n} round(s)", file=sys.stderr)
            break
        order = list(resolvers.items())
        if n % 2:
            order.reverse()
        for label, resolver in order:
            cold = [
                f"r{n}-{i}.{len(samples[label]['cold'])}.cold.bench.test" for i in range(args.count)
            ]
            samples[label]["cold"].append(await sample(resolver, cold))
            if not isinstance(resolver, BareDnspython):  # it has no cache
                cached = ["cached.bench.test"] * args.count
                samples[label]["cached"].append(await sample(resolver, cached))
        rounds += 1
    summary = {
        label: {
            kind: {key: statistics.median(s[key] for s in runs) for key in ("cpu_us", "wall_us")}
            for kind, runs in kinds.items()
            if runs
        }
        for label, kinds in samples.items()
    }
    return {
        "settings": {"count": args.count, "rounds": rounds, "loop": args.loop},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "summary": summary,
        "samples": samples,
    }


def report(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [
        f"resolver lookups: {settings['rounds']} round(s) of {settings['count']} cold and "
        f"{settings['count']} cached lookups per variant on {settings['loop']}, medians "
        "(A and AAAA per cold lookup)",
        "",
        "| variant | cold CPU µs | cold wall µs | cached CPU µs |",
        "|---|---|---|---|",
    ]
    for label, kinds in result["summary"].items():
        cold, cached = kinds["cold"], kinds.get("cached")
        shown = f"{cached['cpu_us']:.1f}" if cached else "(no cache)"
        lines.append(f"| {label} | {cold['cpu_us']:.0f} | {cold['wall_us']:.0f} | {shown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["measure", "serve"], default="measure")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=300, help="lookups per sample")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for all rounds")
    parser.add_argument("--compare", type=Path, help="another resolver.py to measure beside")
    parser.add_argument(
        "--reference", action="store_true", help="also measure bare dns.asyncquery.udp pairs"
    )
    parser.add_argument("--json", type=Path, help="write every sample and the summary here")
    parser.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio", help="the resolver's loop"
    )
    args = parser.parse_args(argv)
    if args.role == "serve":
        serve()
        return 0
    if not 1 <= args.count <= MAX_COUNT or not 1 <= args.rounds <= MAX_ROUNDS:
        parser.error(f"--count is 1 to {MAX_COUNT}, --rounds 1 to {MAX_ROUNDS}")
    runner: Any = asyncio.run
    if args.loop == "uvloop":
        import uvloop  # the `bench` extra

        runner = uvloop.run
    with dns_server() as port:
        result = runner(measure(args, port))
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
