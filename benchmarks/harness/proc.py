"""What the harness reads of processes: CPU time and memory from /proc, children, readiness
probes raced from the moment of exec, stopping a child, and the machine's description.

Nothing here knows what the process is: egress-proxy, a peer, the origin and the load
generators are all measured the same way.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Where a run writes (bench.json, REPORT.md, plots) and keeps its scratch files (tmp/, gitignored).
RESULTS = ROOT / "benchmarks" / "results"
LOOPBACK = "127.0.0.1"
MB = 1_000_000  # decimal: MB/s and memory MB
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROBE_INTERVAL_S = 0.002


def proc_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), from /proc/PID/stat."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15)


def memory(pid: int) -> dict[str, float]:
    """RSS, PSS and USS (private pages) of `pid` in MB, from /proc/PID/smaps_rollup. PSS splits
    every shared page between the processes that map it, so PSS sums over processes add up."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    kb: dict[str, int] = {}
    for line in text.splitlines()[1:]:
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            kb[key] = int(parts[0])
    return {
        "rss_mb": kb.get("Rss", 0) * 1024 / MB,
        "pss_mb": kb.get("Pss", 0) * 1024 / MB,
        "uss_mb": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024 / MB,
    }


def descendants(pid: int) -> list[int]:
    """The live child processes of `pid`, their children, and so on."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 10_000:
        current = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    children = [int(c) for c in (task / "children").read_text().split()]
                    out += children
                    todo += children
    return out


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (wrk, once it has exited)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_deltas(
    before: Mapping[str, float | None], after: Mapping[str, float | None]
) -> dict[str, float | None]:
    """{"<who>_cpu_s": after - before} for every process read both times."""
    out: dict[str, float | None] = {}
    for who, a in before.items():
        b = after.get(who)
        out[f"{who}_cpu_s"] = None if a is None or b is None else b - a
    return out


def read_cpus(pids: Mapping[str, int | None]) -> dict[str, float | None]:
    return {who: proc_cpu(pid) for who, pid in pids.items()}


def stop_child(process: subprocess.Popen[Any], timeout: float = 15.0) -> int:
    """SIGTERM (a proxy drains), SIGKILL after `timeout`; the exit status."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait(timeout=10)


# --------------------------------------------------------------------------------------------
# Readiness, raced from exec: every probe polls on its own thread until it succeeds


Probe = Callable[[], bool]


def race_probes(
    process: subprocess.Popen[Any], started: float, probes: Mapping[str, Probe], timeout: float
) -> dict[str, float]:
    """Seconds from `started` (just before exec) until each probe first returned True, polled
    every 2 ms on a thread of its own so that one slow probe does not delay another. Raises
    RuntimeError when the process exits first, or when a probe has not succeeded in time."""
    found: dict[str, float] = {}
    lock = threading.Lock()
    deadline = started + timeout

    def poll(name: str, probe: Probe) -> None:
        while time.perf_counter() < deadline and process.poll() is None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                if probe():
                    with lock:
                        found[name] = time.perf_counter() - started
                    return
            time.sleep(PROBE_INTERVAL_S)

    threads = [threading.Thread(target=poll, args=item, daemon=True) for item in probes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 1)
    missing = [name for name in probes if name not in found]
    if process.poll() is not None:
        raise RuntimeError(f"exited ({process.returncode}) before {', '.join(missing) or 'ready'}")
    if missing:
        raise RuntimeError(f"not ready within {timeout:g} s: {', '.join(missing)}")
    return found


def accepts(port: int) -> Probe:
    """The port accepts a TCP connection."""

    def probe() -> bool:
        with socket.create_connection((LOOPBACK, port), timeout=1.0):
            return True

    return probe


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of GET path on 127.0.0.1:port, the connection closed after it."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while len(data) < 1 << 22 and (chunk := sock.recv(65536)):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def answers_200(port: int, path: str) -> Probe:
    return lambda: http_get(port, path)[0] == 200


def connect_accepted(port: int, host: str, target_port: int) -> Probe:
    """A CONNECT host:target_port through the proxy on `port` is answered 200."""
    head = f"CONNECT {host}:{target_port} HTTP/1.1\r\nHost: {host}:{target_port}\r\n\r\n"

    def probe() -> bool:
        with socket.create_connection((LOOPBACK, port), timeout=2.0) as sock:
            sock.sendall(head.encode())
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 16384:
                chunk = sock.recv(4096)
                if not chunk:
                    return False
                data += chunk
            return data.split(b" ", 2)[1:2] == [b"200"]

    return probe


def free_ports(count: int, udp: Sequence[int] = ()) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1; those at the indexes in `udp` are free
    for UDP too. (Another process may take one before it is bound: callers retry.)"""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count and len(held) < 200:
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(tcp)
            tcp.bind((LOOPBACK, 0))
            port = tcp.getsockname()[1]
            if len(ports) in udp:
                datagram = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                held.append(datagram)
                try:
                    datagram.bind((LOOPBACK, port))
                except OSError:
                    continue
            ports.append(port)
    finally:
        for sock in held:
            sock.close()
    if len(ports) < count:
        raise RuntimeError("no free ports on 127.0.0.1")
    return ports


# --------------------------------------------------------------------------------------------
# The machine and the command


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
        "cpu_model": None,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "memory_mb": None,
        "loadavg_at_start": None,
        "git": None,
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_mb"] = int(line.split()[1]) * 1024 / MB
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = Path("/proc/loadavg").read_text().split()[:3]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["git"] = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    return info


def foreign_processes(names: Sequence[str]) -> Iterator[tuple[str, int]]:
    """Processes named `names` that are not ours (checked before the run starts any)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            comm = (entry / "comm").read_text().strip()
            if comm in names:
                yield comm, int(entry.name)


def command() -> str:
    argv = [sys.executable if os.path.isabs(sys.executable) else "python", *sys.argv]
    with contextlib.suppress(ValueError):
        argv[0] = os.path.relpath(argv[0], Path.cwd())
    return shlex.join(argv)
