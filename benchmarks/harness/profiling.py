"""`bench.py --profile DIR`: where egress-proxy spends its CPU, sampled by py-spy.

Every egress-proxy process the run starts (any egress configuration, `-baseline` ones too;
never a peer) gets a `py-spy record --pid PID --format raw` of its own, a child of the harness,
attached once the proxy is ready; it ends when the proxy exits. py-spy samples in its default
blocking mode (it pauses the process for each sample, which gives whole stacks) and leaves idle
threads out, so a sample is a moment a thread of the proxy was running: samples are CPU time.

After the run, DIR/PROFILE.md summarises each configuration over all its sample files: the share
of samples by area (our packages by subpackage, the event loop's own, the standard library,
third-party) and the top functions by inclusive and by self share. The parsing and the summary
are pure functions of the raw files' text (`frame;frame;... count` a line, root first, each frame
`name (path:line)`), so they are tested without py-spy; a line that does not read so is skipped
and counted, never the end of the summary.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .proc import ROOT

RATE = 100  # samples per second per process (py-spy's default)
ATTACH_TIMEOUT_S = 10.0  # py-spy says it samples, or has failed, within this
FINISH_TIMEOUT_S = 30.0  # after the last proxy stopped, for every py-spy to write and exit
INTERRUPT_TIMEOUT_S = 5.0  # an overstaying py-spy writes its file on SIGINT, or is killed
TOP = 25
OURS = ("proxy", "policy")  # the packages of the checkout under test
LOOP = "event loop (asyncio/uvloop's own)"
STDLIB = "standard library"
THIRD_PARTY = "third-party"
OTHER = "other"
NO_FRAME = "(no Python frame)"
# A leaf frame here means the time was spent in the event loop itself: uvloop's C code (its
# callbacks' C parts, the selector's wait and the kernel's work in it), which py-spy attributes
# to the innermost Python frame, asyncio.run's Runner.run; or the pure-Python loop's own frames.
LOOP_FILES = ("asyncio/runners.py", "selectors.py", "uvloop/__init__.py")
LOOP_FUNCTIONS = {
    "asyncio/base_events.py": (
        "BaseEventLoop.run_forever",
        "BaseEventLoop.run_until_complete",
        "BaseEventLoop._run_once",
    ),
    "asyncio/events.py": ("Handle._run",),
}
NOT_OF_RECORD = (
    "profiled with py-spy (--profile): each egress-proxy process was paused 100 times a second "
    "to be sampled, and py-spy ran on the same CPUs, so its figures are not of record"
)
SITE_MARKERS = ("/site-packages/", "/dist-packages/")
_FRAME = re.compile(r"^(?P<name>.+?) \((?P<path>.*?)(?::(?P<line>\d+))?\)$")
_MAX_COUNT = 10**12


class Unavailable(Exception):
    """--profile cannot run here; the message says why and what to do."""


# --------------------------------------------------------------------------------------------
# py-spy's raw format


@dataclass(frozen=True)
class Frame:
    name: str
    path: str
    line: int | None = None


Stack = tuple[Frame, ...]  # root first, leaf last


def parse_frame(text: str) -> Frame | None:
    """`name (path:line)` or `name (path)`; None for anything else."""
    match = _FRAME.match(text)
    if match is None or not match["path"]:
        return None
    line = match["line"]
    return Frame(match["name"], match["path"], int(line) if line else None)


def parse_raw(text: str) -> tuple[Counter[Stack], int]:
    """The stacks of a raw file with their sample counts, and the number of lines skipped (a
    line that is not `frame;frame;... count` with every frame readable and a positive count).
    An empty stack (` 5`) is samples taken with no Python frame."""
    stacks: Counter[Stack] = Counter()
    skipped = 0
    for raw in text.splitlines():
        line = raw.strip("\r\n")
        if not line.strip():
            continue
        stack_text, _, count_text = line.rpartition(" ")
        if not count_text.isascii() or not count_text.isdigit():
            skipped += 1
            continue
        count = int(count_text)
        if not 0 < count < _MAX_COUNT:
            skipped += 1
            continue
        frames = [parse_frame(f) for f in stack_text.split(";")] if stack_text else []
        if any(f is None for f in frames):
            skipped += 1
            continue
        stacks[tuple(f for f in frames if f is not None)] += count
    return stacks, skipped


# --------------------------------------------------------------------------------------------
# Where a frame's code lives


@dataclass(frozen=True)
class Places:
    """What tells our code from the rest: the checkouts run (this one, a baseline tree) and the
    interpreter's standard library directories."""

    roots: tuple[str, ...]
    stdlib: tuple[str, ...]

    @classmethod
    def of(cls, roots: Iterable[Path | str], stdlib: Iterable[str] | None = None) -> Places:
        paths = sysconfig.get_paths()
        std = stdlib if stdlib is not None else {paths["stdlib"], paths["platstdlib"]}
        # The longest first: a checkout inside another is its own.
        return cls(
            tuple(sorted({str(r).rstrip("/") for r in roots}, key=len, reverse=True)),
            tuple(sorted({s.rstrip("/") for s in std}, key=len, reverse=True)),
        )


def place(path: str, places: Places) -> tuple[str, str]:
    """(kind, path shown): kind is "ours", "stdlib", "third-party" or "other"; the path is
    relative to the checkout, the standard library or site-packages."""
    for marker in SITE_MARKERS:  # first: a virtualenv's site-packages may be inside a checkout
        if marker in path:
            return "third-party", path.rsplit(marker, 1)[1]
    for root in places.roots:
        if path.startswith(root + "/"):
            shown = path[len(root) + 1 :]
            return ("ours" if shown.split("/", 1)[0] in OURS else "other"), shown
    for std in places.stdlib:
        if path.startswith(std + "/"):
            return "stdlib", path[len(std) + 1 :]
    if path.startswith("<frozen "):
        return "stdlib", path
    if not path.startswith("/") and path.split("/", 1)[0] in OURS and "/" in path:
        return "ours", path  # a relative path (py-spy without --full-filenames)
    return "other", path


def subpackage(shown: str) -> str:
    """`proxy/dataplane` for proxy/dataplane/tunnel.py (and deeper); `proxy` for proxy/cli.py."""
    parts = shown.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def is_loop(frame: Frame, kind: str, shown: str) -> bool:
    if kind not in ("stdlib", "third-party"):
        return False
    return shown in LOOP_FILES or frame.name in LOOP_FUNCTIONS.get(shown, ())


def area(frame: Frame, places: Places) -> str:
    """The area a leaf frame's sample counts to."""
    kind, shown = place(frame.path, places)
    if is_loop(frame, kind, shown):
        return LOOP
    if kind == "ours":
        return subpackage(shown)
    return {"stdlib": STDLIB, "third-party": THIRD_PARTY}.get(kind, OTHER)


def function(frame: Frame, places: Places) -> str:
    """`name (path)`, the path relative to the checkout, stdlib or site-packages; no line."""
    return f"{frame.name} ({place(frame.path, places)[1]})"


# --------------------------------------------------------------------------------------------
# The summary


@dataclass
class Summary:
    samples: int = 0
    skipped: int = 0  # lines of the raw files that did not read
    by_leaf: Counter[str] = field(default_factory=Counter)  # area of the leaf frame
    by_ours: Counter[str] = field(default_factory=Counter)  # innermost frame of ours
    inclusive: Counter[str] = field(default_factory=Counter)  # samples with it on the stack
    own: Counter[str] = field(default_factory=Counter)  # samples with it the leaf (self)

    def add(self, stacks: Mapping[Stack, int], places: Places, skipped: int = 0) -> None:
        """Counts the stacks of one raw file in."""
        self.skipped += skipped
        for stack, count in stacks.items():
            self.samples += count
            if not stack:
                self.by_leaf[NO_FRAME] += count
                self.by_ours[NO_FRAME] += count
                continue
            leaf = area(stack[-1], places)
            self.by_leaf[leaf] += count
            self.by_ours[leaf if leaf == LOOP else _innermost_ours(stack, places, leaf)] += count
            for name in {function(f, places) for f in stack}:
                self.inclusive[name] += count
            self.own[function(stack[-1], places)] += count

    def share(self, count: int) -> float:
        return count / self.samples if self.samples else 0.0


def _innermost_ours(stack: Stack, places: Places, otherwise: str) -> str:
    """The subpackage of the innermost frame of ours above the event loop's frames (what called
    the stdlib or third-party code the sample is in), or `otherwise`."""
    kinds = [(f, *place(f.path, places)) for f in stack]
    start = 0
    for i, (frame, kind, shown) in enumerate(kinds):
        if is_loop(frame, kind, shown):
            start = i + 1
    for _frame, kind, shown in reversed(kinds[start:]):
        if kind == "ours":
            return subpackage(shown)
    return otherwise


def summarise(texts: Iterable[str], places: Places) -> Summary:
    """The summary of raw files' texts, taken together."""
    summary = Summary()
    for text in texts:
        stacks, skipped = parse_raw(text)
        summary.add(stacks, places, skipped)
    return summary


def percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_section(name: str, summary: Summary, files: Sequence[tuple[str, int]]) -> list[str]:
    """One configuration's part of PROFILE.md: its files, the areas and the top functions."""
    listed = ", ".join(f"`{f}` ({n:,})" for f, n in files)
    lines = [
        f"## {name}",
        "",
        f"{summary.samples:,} samples (about {summary.samples / RATE:,.1f} s of CPU at {RATE} a "
        f"second) from {len(files)} file(s): {listed or 'none'}.",
    ]
    if summary.skipped:
        lines.append(f"{summary.skipped:,} line(s) of them did not read as py-spy's raw format.")
    if not summary.samples:
        return [*lines, "", "No samples."]
    lines += [
        "",
        "### By area",
        "",
        "Self: the sample's leaf frame (time in the standard library counts there). With what "
        "it calls: the innermost frame of ours above the event loop, when there is one.",
        "",
        "| area | self | with what it calls |",
        "|---|---|---|",
    ]
    for key, count in sorted(summary.by_leaf.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(
            f"| {_cell(key)} | {percent(summary.share(count))} "
            f"| {percent(summary.share(summary.by_ours[key]))} |"
        )
    for key, count in sorted(summary.by_ours.items(), key=lambda kv: (-kv[1], kv[0])):
        if key not in summary.by_leaf:
            lines.append(f"| {_cell(key)} | 0.0% | {percent(summary.share(count))} |")
    for title, first, second in (
        ("inclusive", summary.inclusive, summary.own),
        ("self", summary.own, summary.inclusive),
    ):
        other = "self" if first is summary.inclusive else "inclusive"
        lines += [
            "",
            f"### Top {TOP} functions by {title} share",
            "",
            f"| # | function | {title} | {other} |",
            "|---|---|---|---|",
        ]
        ranked = sorted(first.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP]
        for i, (key, count) in enumerate(ranked, 1):
            lines.append(
                f"| {i} | `{_cell(key)}` | {percent(summary.share(count))} "
                f"| {percent(summary.share(second[key]))} |"
            )
    return lines


def render(
    sections: Mapping[str, tuple[Summary, Sequence[tuple[str, int]]]],
    head: Sequence[str] = (),
    problems: Sequence[str] = (),
) -> str:
    """PROFILE.md: a head, then a section per configuration."""
    lines = [
        "# Where egress-proxy spends its CPU (py-spy)",
        "",
        *head,
        f"Not figures of record: {NOT_OF_RECORD}. py-spy attached to each process once it was "
        f"ready, sampled it {RATE} times a second until it exited, and left idle threads out: a "
        "sample is a moment a thread of the proxy was running.",
    ]
    if problems:
        lines += ["", "Problems:", *(f"- {p}" for p in problems)]
    for name, (summary, files) in sections.items():
        lines += ["", *config_section(name, summary, files)]
    if not sections:
        lines += ["", "No egress-proxy process was profiled: the run started none."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# py-spy, found, checked and attached


def find_pyspy() -> str | None:
    """py-spy beside the interpreter running the harness (a virtualenv's), this checkout's
    .venv, or on PATH."""
    for candidate in (Path(sys.executable).parent / "py-spy", ROOT / ".venv" / "bin" / "py-spy"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("py-spy")


def _env() -> dict[str, str]:
    # Its errors in one line, without the backtrace a set RUST_BACKTRACE adds.
    return {**os.environ, "RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0"}


def said(text: str) -> str:
    """py-spy's error, from what it printed: its `Error:` lines, or the end of it."""
    errors = [line.strip() for line in text.splitlines() if line.startswith("Error")]
    return " ".join(errors or text.split())[-400:] or "(it printed nothing)"


def check(binary: str) -> str:
    """py-spy's version, once it has read a Python process of the harness's own (a child, as
    the proxies are); Unavailable, with what it said, when it cannot."""
    try:
        done = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, env=_env()
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"{binary} does not run: {exc}") from None
    if done.returncode != 0:
        raise Unavailable(f"{binary} --version failed: {said(done.stderr + done.stdout)}")
    version = done.stdout.strip()
    code = "import sys, time; print('up', flush=True); time.sleep(60)"
    target = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
    )
    try:
        assert target.stdout is not None
        target.stdout.readline()
        done = subprocess.run(
            [binary, "dump", "--pid", str(target.pid)],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(),
        )
    except subprocess.SubprocessError as exc:
        raise Unavailable(f"py-spy could not read a Python process here: {exc}") from None
    finally:
        target.kill()
        target.wait()
        if target.stdout is not None:
            target.stdout.close()
    if done.returncode != 0:
        raise Unavailable(
            f"py-spy cannot read a Python process here ({said(done.stderr + done.stdout)}); it "
            "needs ptrace: run as root, or give it CAP_SYS_PTRACE (a container: --cap-add "
            "SYS_PTRACE), or set kernel.yama.ptrace_scope to 0"
        )
    return version


@dataclass
class Attached:
    """One py-spy recording one proxy."""

    config: str
    label: str
    output: Path
    log: Path
    process: subprocess.Popen[bytes]


class Profiler:
    """The py-spy processes of a run, and their files by configuration."""

    def __init__(self, directory: Path, binary: str, version: str) -> None:
        self.directory = directory
        self.binary = binary
        self.version = version
        self.attached: list[Attached] = []
        self.finished: list[str] | None = None  # the problems finish() found
        self._lock = threading.Lock()
        self._names: set[str] = set()

    @classmethod
    def start(cls, directory: Path, binary: str | None = None) -> Profiler:
        """A profiler writing into `directory`; Unavailable when py-spy is not installed or
        cannot read a process here."""
        binary = binary or find_pyspy()
        if binary is None:
            raise Unavailable(
                "py-spy is not installed (`make bench-deps` installs it with the bench extra; "
                "or .venv/bin/python -m pip install 'py-spy>=0.4,<0.5')"
            )
        version = check(binary)
        try:
            (directory / "logs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Unavailable(f"cannot write to {directory}: {exc}") from None
        return cls(directory, binary, version)

    def _stem(self, config: str, label: str) -> str:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{config}-{label}")
        with self._lock:
            unique, n = stem, 1
            while unique in self._names:
                n += 1
                unique = f"{stem}-{n}"
            self._names.add(unique)
        return unique

    def attach(self, pid: int, config: str, label: str) -> str | None:
        """py-spy recording `pid` into DIR/<config>-<label>.txt, sampling when this returns;
        a problem's text when it failed to."""
        stem = self._stem(config, label)
        output, log = self.directory / f"{stem}.txt", self.directory / "logs" / f"{stem}.log"
        output.unlink(missing_ok=True)
        command = [self.binary, "record", "--pid", str(pid), "--rate", str(RATE)]
        command += ["--format", "raw", "--full-filenames", "--output", str(output)]
        with open(log, "wb") as out:
            try:
                process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=_env()
                )
            except OSError as exc:
                return f"profile {stem}: py-spy did not start: {exc}"
        with self._lock:
            self.attached.append(Attached(config, label, output, log, process))
        deadline = time.perf_counter() + ATTACH_TIMEOUT_S
        while time.perf_counter() < deadline:
            if b"Sampling process" in _read(log):
                return None
            if process.poll() is not None:
                break
            time.sleep(0.01)
        if process.poll() is None:
            return f"profile {stem}: py-spy has not begun sampling within {ATTACH_TIMEOUT_S:g} s"
        return f"profile {stem}: py-spy exited {process.returncode}: {said(_text(log))}"

    def finish(self, timeout: float = FINISH_TIMEOUT_S) -> list[str]:
        """Waits for every py-spy (they end when their proxy exits): at most `timeout` for all,
        then SIGINT (it writes what it has), then SIGKILL. The problems found (the same on a
        second call)."""
        if self.finished is not None:
            return self.finished
        problems: list[str] = []
        deadline = time.monotonic() + timeout
        for one in self.attached:
            process, name = one.process, one.output.name
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problems.append(f"profile {name}: py-spy still ran {timeout:g} s after the run")
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGINT)
                try:
                    process.wait(INTERRUPT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                continue
            if process.returncode != 0:
                problems.append(
                    f"profile {name}: py-spy exited {process.returncode}: {said(_text(one.log))}"
                )
            elif not one.output.exists():
                problems.append(f"profile {name}: py-spy wrote no file")
        self.finished = problems
        return problems

    def files(self) -> dict[str, list[Path]]:
        """The sample files written, by configuration, in the order of the run."""
        out: dict[str, list[Path]] = {}
        for one in self.attached:
            if one.output.exists():
                out.setdefault(one.config, []).append(one.output)
        return out

    def write(self, roots: Iterable[Path], head: Sequence[str] = ()) -> Path:
        """DIR/PROFILE.md from the files written; its path."""
        places = Places.of(roots)
        sections: dict[str, tuple[Summary, list[tuple[str, int]]]] = {}
        for config, paths in self.files().items():
            summary = Summary()
            listed = []
            for path in paths:
                stacks, skipped = parse_raw(_text(path))
                before = summary.samples
                summary.add(stacks, places, skipped)
                listed.append((path.name, summary.samples - before))
            sections[config] = (summary, listed)
        where = self.directory / "PROFILE.md"
        intro = [*head, f"{self.version}: `py-spy record --rate {RATE} --format raw`.", ""]
        where.write_text(render(sections, intro, self.finished or ()))
        return where


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _text(path: Path) -> str:
    return _read(path).decode(errors="replace")
