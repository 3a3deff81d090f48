"""`egress-proxy ask --admin HOST:PORT --token FILE [--json]`: a person's terminal prompt
against a running proxy in asking mode (`run --ask`, `sandbox --ask`).

Each pending ask is shown on one line, with its reason and the manifest entry that would allow
it, and one answer is read per line: `y` (allow once), `a` (allow for the session), `n`
(deny), `N` (deny for the session). `--json` prints each ask as a JSON line instead (and each
answer's result as one), for scripts that answer the same way. The proxy is polled on its
admin listener (`GET /asks`), and the answer posted with the token (`POST /asks/ID`). The end
of standard input ends the command (exit 0).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import sys
from typing import Any, TextIO

from policy import PolicyError
from policy.asking import ALLOW_ONCE, ALLOW_SESSION, DENY, DENY_SESSION
from proxy.app.ask_token import read_or_create_token
from proxy.cli.output import EXIT_OK
from proxy.common.listeners import format_listen, parse_listen
from proxy.common.terminal import printable

__all__ = ["add_ask_parser", "cmd_ask"]

KEYS = {"y": ALLOW_ONCE, "a": ALLOW_SESSION, "n": DENY, "N": DENY_SESSION}
PROMPT = "allow? [y once / a session / n deny / N deny for the session] "
POLL_SECONDS = 0.3
TIMEOUT = 10.0
MAX_RESPONSE = 4 << 20


def add_ask_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ask",
        help="answer the asks of a proxy running with --ask, at a terminal",
        description="Show each pending ask of a running proxy (run --ask, sandbox --ask) on "
        "one line and read one answer a line: y (allow once), a (allow for the session), "
        "n (deny), N (deny for the session). Ends at the end of standard input.",
    )
    p.add_argument("--admin", metavar="HOST:PORT", required=True, help="the admin listener")
    p.add_argument("--token", metavar="FILE", required=True, help="the proxy's --ask-token file")
    p.add_argument("--json", action="store_true", help="print asks as JSON lines, for scripts")


class _Admin:
    """The proxy's admin listener, one request per connection (as it serves them)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
        try:
            headers = {}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers = {
                    "Content-Type": "application/json",
                    "Authorization": f"Bearer {self.token}",
                }
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            raw = response.read(MAX_RESPONSE)
        except (OSError, http.client.HTTPException) as exc:
            where = format_listen(self.host, self.port)
            raise PolicyError("unreachable", f"ask: the admin listener {where}: {exc}") from None
        finally:
            connection.close()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, None


def cmd_ask(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    err = err or sys.stderr
    host, port = parse_listen(args.admin)
    # The token file is the proxy's: read only (never created here), with the proxy's checks.
    token = _read_token(args.token)
    admin = _Admin(host, port, token)
    status, listed = admin.request("GET", "/asks")
    if status != 200 or not isinstance(listed, dict):
        raise PolicyError("unreachable", f"ask: {args.admin} does not serve asks (HTTP {status})")
    if not args.json:
        err.write(f"egress-proxy ask: watching {args.admin}; {PROMPT.strip()}\n")
        err.flush()
    seen: set[str] = set()
    answers = _Lines(sys.stdin.fileno())
    while True:
        ask = _next_ask(admin, seen, answers)
        if ask is None:
            return EXIT_OK
        seen.add(ask["id"])
        if args.json:
            out.write(json.dumps(ask, ensure_ascii=True) + "\n")
        else:
            out.write(printable(_line(ask)) + "\n" + PROMPT)
        out.flush()
        decision = _read_answer(answers, out, args.json)
        if decision is None:
            return EXIT_OK
        status, result = admin.request("POST", f"/asks/{ask['id']}", {"decision": decision})
        if args.json:
            out.write(json.dumps({"id": ask["id"], "status": status, "result": result}) + "\n")
        elif status == 200:
            out.write(f"  {decision}\n")
        elif status == 404:
            out.write("  no longer pending (answered elsewhere, or timed out)\n")
        else:
            raise PolicyError("usage", f"ask: the proxy refused the answer (HTTP {status})")
        out.flush()


def _read_token(path: str) -> str:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise PolicyError("unreadable", f"ask: --token {path}: {exc.strerror or exc}") from None
    return read_or_create_token(path)


class _Lines:
    """Standard input, a line at a time, read from its descriptor so that waiting for an ask
    can also notice its end (a line typed ahead is kept for the next ask)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.ended = False

    def line(self, timeout: float | None) -> str | None:
        """The next line; None when none came within `timeout`. EOFError at the end."""
        while b"\n" not in self.buffer:
            if self.ended:
                if not self.buffer:
                    raise EOFError
                rest, self.buffer = self.buffer, b""
                return rest.decode("utf-8", "replace")
            readable, _, _ = select.select([self.fd], [], [], timeout)
            if not readable:
                return None
            chunk = os.read(self.fd, 4096)
            self.ended = not chunk
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")

    def waiting(self) -> bool:
        """Whether a whole line (or the end) is there already."""
        return b"\n" in self.buffer or self.ended


def _next_ask(admin: _Admin, seen: set[str], answers: _Lines) -> dict[str, Any] | None:
    """The oldest pending ask not shown yet (waits for one); None once standard input ended."""
    while True:
        status, listed = admin.request("GET", "/asks")
        asks = listed.get("asks") if status == 200 and isinstance(listed, dict) else None
        for ask in asks or ():
            if isinstance(ask, dict) and isinstance(ask.get("id"), str) and ask["id"] not in seen:
                return ask
        if answers.ended and not answers.buffer:
            return None
        if not answers.waiting():
            # Wait on standard input meanwhile: its end ends the command even with no ask.
            try:
                typed = answers.line(POLL_SECONDS)
            except EOFError:
                return None
            if typed is not None:
                answers.buffer = typed.encode() + b"\n" + answers.buffer
                select.select([], [], [], POLL_SECONDS)


def _line(ask: dict[str, Any]) -> str:
    where = ask.get("host") or "?"
    if ask.get("port") is not None:
        where += f":{ask['port']}"
    if ask.get("path"):
        where += str(ask["path"])
    held = ask.get("held")
    return (
        f"ask {ask.get('id')}: {where} ({ask.get('protocol')}, {ask.get('reason')}, "
        f"{held} held) entry: {ask.get('entry')}"
    )


def _read_answer(answers: _Lines, out: TextIO, quiet: bool) -> str | None:
    """One of KEYS from standard input, asked again until it is one; None at its end."""
    while True:
        try:
            line = answers.line(None)
        except EOFError:
            return None
        if line is None:
            continue
        decision = KEYS.get(line.strip())
        if decision is not None:
            return decision
        if not quiet:
            out.write(f"  answer y, a, n or N\n{PROMPT}")
            out.flush()
