"""The load generators: loadgen.c (beside this file) built with the machine's gcc, its targets
files, its upstream process, and one client phase (any client that speaks the ready/go lines).

The binary goes to benchmarks/build/ (gitignored) and is rebuilt when the source, the compiler
or the flags change (a stamp holds their digest). With OpenSSL's headers it is built with TLS
(the https mode); without them it is built without, and the https workload is skipped with a
note. Without gcc nothing is built and the run stops with a clear message: the Python clients
it replaced cost as much per tunnel as the proxies they measured.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import shutil
import ssl
import struct
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .proc import cpu_deltas, read_cpus
from .stats import latency_summary

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "loadgen.c"
BUILD = HERE.parent / "build"  # benchmarks/build/, gitignored
BINARY = BUILD / "loadgen"
CFLAGS = ("-O2", "-Wall", "-Wextra", "-pthread")
TLS_FLAGS = ("-DBENCH_TLS",)
TLS_LIBS = ("-lssl", "-lcrypto")
READY_TIMEOUT_S = 60.0  # set-up and warm-up of a client process
SETTLE_AFTER_S = 0.2  # the proxy may still be closing the last tunnels: that CPU is theirs
COMPILE_TIMEOUT_S = 120.0
# The first flight of an opaque stream (neither TLS nor HTTP): an SSH client's identification
# string. The upstream's opaque port answers once it has read this line.
SSH_FLIGHT = b"SSH-2.0-bench\r\n"


class Unavailable(RuntimeError):
    """The load generator cannot be built here (the message says why and what to install)."""


@dataclass(frozen=True)
class Loadgen:
    binary: Path
    tls: bool  # built with OpenSSL: the https mode works
    note: str = ""  # what is missing, when something is


def _digest(compiler: str, flags: Sequence[str]) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.split("\n", 1)[0]
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update("\0".join([version, *flags]).encode())
    return h.hexdigest()


def _compile(compiler: str, flags: Sequence[str], libs: Sequence[str]) -> str | None:
    """Compiles into a temporary file and moves it into place; None, or the compiler's
    complaint."""
    partial = BUILD / f"loadgen.{os.getpid()}.tmp"
    done = subprocess.run(
        [compiler, *flags, "-o", str(partial), str(SOURCE), *libs],
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
    )
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return (done.stderr or done.stdout).strip()[-1500:]
    partial.replace(BINARY)
    return None


def build(compiler: str | None = None) -> Loadgen:
    """The built load generator (built now if the source or the compiler changed)."""
    compiler = compiler or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise Unavailable(
            "gcc is not installed: the harness compiles its C load generator "
            "(benchmarks/harness/loadgen.c) with it (`apt-get install gcc`)"
        )
    BUILD.mkdir(exist_ok=True)
    stamp = BUILD / "loadgen.stamp"
    with open(BUILD / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a test and a run may build at once
        variants = (
            (True, (*CFLAGS, *TLS_FLAGS), TLS_LIBS),
            (False, CFLAGS, ()),
        )
        for tls, flags, libs in variants:
            digest = _digest(compiler, (*flags, *libs))
            with contextlib.suppress(OSError, ValueError):
                if BINARY.exists() and json.loads(stamp.read_text())["digest"] == digest:
                    return _loaded(tls)
            complaint = _compile(compiler, flags, libs)
            if complaint is None:
                stamp.write_text(json.dumps({"digest": digest, "tls": tls}) + "\n")
                return _loaded(tls)
            if not tls:
                raise Unavailable(f"benchmarks/harness/loadgen.c does not compile:\n{complaint}")
    raise AssertionError("unreachable")


def _loaded(tls: bool) -> Loadgen:
    note = (
        ""
        if tls
        else "the load generator was built without OpenSSL (libssl-dev is not installed): "
        "the inspect workload is skipped"
    )
    return Loadgen(BINARY, tls, note)


# --------------------------------------------------------------------------------------------
# Targets: what each tunnel names, and its ClientHello


def client_hello(sni: str, context: ssl.SSLContext | None = None) -> bytes:
    """The first flight of a real TLS client (Python's ssl, that is OpenSSL) for `sni`: what a
    client behind the proxy really sends. One `context` for many names: a new default context
    loads the system's CA store (about 30 ms here)."""
    context = context or ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def write_targets(
    path: Path, hosts: Sequence[str], hello: bool = True, flight: bytes | None = None
) -> Path:
    """The targets file of loadgen.c: per host, [u16 length][host][u16 length][first flight],
    the first flight being the host's ClientHello. `hello=False`: empty ones (the https mode
    makes its own handshake); `flight`: these bytes for every host instead (an opaque stream's
    first flight, SSH_FLIGHT)."""
    context = ssl.create_default_context()
    parts = []
    for host in hosts:
        name = host.encode("ascii")
        first = flight
        if first is None:
            first = client_hello(host, context) if hello else b""
        parts += [struct.pack("!H", len(name)), name, struct.pack("!H", len(first)), first]
    path.write_bytes(b"".join(parts))
    return path


# --------------------------------------------------------------------------------------------
# Processes


def end_by_stdin(process: subprocess.Popen[bytes]) -> None:
    """Closes a process's stdin (its signal to end) and waits; SIGKILL after 10 s."""
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@contextlib.contextmanager
def upstream(loadgen: Loadgen, log: Path) -> Iterator[dict[str, Any]]:
    """The upstream process: {"pid", "tunnel", "opaque", "bulk"} (ports on 127.0.0.1)."""
    with open(log, "wb") as err:
        process = subprocess.Popen(
            [str(loadgen.binary), "upstream"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    try:
        info = _read_message(process, 10.0, log)
        yield info
    finally:
        end_by_stdin(process)


def _read_message(process: subprocess.Popen[bytes], timeout: float, log: Path) -> dict[str, Any]:
    """The next JSON line from a process, within `timeout` seconds."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    line = process.stdout.readline() if ready else b""
    if not line:
        process.kill()
        process.wait(timeout=10)
        raise RuntimeError(
            f"{log.stem} gave no answer within {timeout:g} s (exit "
            f"{process.returncode}): {log.read_text(errors='replace')[-1500:]}"
        )
    message = json.loads(line)
    if "failed" in message:
        raise RuntimeError(f"load generator: {message['failed']}")
    return message


def client_args(
    loadgen: Loadgen, mode: str, targets: Path, port: int, proxy: str, proxy_port: int | None
) -> list[str]:
    """The command line of a loadgen client; options of the phase follow it."""
    args = [str(loadgen.binary), mode, "--targets", str(targets), "--port", str(port)]
    args += ["--proxy", proxy]
    if proxy_port is not None:
        args += ["--proxy-port", str(proxy_port)]
    return args


def run_phase(
    command: Sequence[str],
    watch: Mapping[str, int | None],
    limit: float,
    log: Path,
    user: str | None = None,
) -> tuple[dict[str, Any], dict[str, float | None]]:
    """One phase of one client process (as `user`, when given): it sets up and warms up, says
    ready; the CPU times of the `watch`ed processes are read, "go" is sent, its result is
    awaited (at most `limit` s) and the CPU times read again 0.2 s later. The result and the CPU
    seconds of each watched process (`<name>_cpu_s`)."""
    with open(log, "wb") as err:
        process = subprocess.Popen(
            list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, user=user
        )
    try:
        _read_message(process, READY_TIMEOUT_S, log)
        before = read_cpus(watch)
        assert process.stdin is not None
        process.stdin.write(b"go\n")
        process.stdin.flush()
        result = _read_message(process, limit, log)
        time.sleep(SETTLE_AFTER_S)
        after = read_cpus(watch)
    finally:
        end_by_stdin(process)
    return result, cpu_deltas(before, after)


def figures(
    result: Mapping[str, Any], cpu: Mapping[str, float | None], done: int, unit: str, units: str
) -> dict[str, Any]:
    """What a counted phase reports: `done` units of work (a tunnel, a request, a query), its
    errors, the rate, the latency summary, every process's CPU seconds and CPU µs per unit (the
    client's as it measured itself)."""
    cpu = {**cpu, "client_cpu_s": result["client_cpu_s"]}
    seconds = result["seconds"]
    return {
        units: done,
        "errors": result["errors"],
        "first_errors": result["first_errors"],
        "seconds": seconds,
        f"{units}_per_s": done / seconds if seconds > 0 else 0.0,
        "latency_ms": latency_summary(x / 1e3 for x in result["latencies_us"]),
        **cpu,
        **per_unit(cpu, done, 1e6, f"us_per_{unit}"),
    }


def per_unit(
    cpu: Mapping[str, float | None], units: float, scale: float, suffix: str
) -> dict[str, float | None]:
    """{"<who>_cpu_<suffix>": seconds / units * scale} for every `<who>_cpu_s` in `cpu`."""
    out: dict[str, float | None] = {}
    for key, value in cpu.items():
        who = key.removesuffix("_cpu_s")
        out[f"{who}_cpu_{suffix}"] = None if value is None or not units else value / units * scale
    return out
