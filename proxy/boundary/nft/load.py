"""Running nft: loading a rule set as one transaction, reading a table back, removing it. A rule
set that does not load exactly as rendered is removed again."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence

from proxy.boundary.nft.chains import BOUNDARY_FAILED, DEFAULT_TABLE, check_table_name
from proxy.boundary.nft.compare import ChainKey, compare_chains, expected_chains, loaded_chains
from proxy.common.errors import ProxyError

_NFT_TIMEOUT = 30.0


def _nft(
    nft: str, args: Sequence[str], text: str | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [nft, *args],
            input=text,
            capture_output=True,
            text=True,
            timeout=_NFT_TIMEOUT,
            check=False,
        )
    except FileNotFoundError:
        raise ProxyError(BOUNDARY_FAILED, f"{nft!r} not found: install nftables") from None
    except subprocess.TimeoutExpired:
        raise ProxyError(
            BOUNDARY_FAILED, f"{nft} {' '.join(args)} took over {_NFT_TIMEOUT:g}s"
        ) from None
    except OSError as exc:
        raise ProxyError(BOUNDARY_FAILED, f"cannot run {nft!r}: {exc.strerror or exc}") from None


def _first_lines(text: str, count: int = 3) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return "; ".join(lines[:count])[:400] or "no message"


def table_exists(table: str, *, nft: str = "nft") -> bool:
    check_table_name(table)
    return _nft(nft, ["list", "table", "inet", table]).returncode == 0


def remove_table(table: str, *, nft: str = "nft") -> bool:
    """Delete `table` if it exists; True when it was there. Raises ProxyError('boundary_failed')
    when it exists and cannot be deleted."""
    check_table_name(table)
    if not table_exists(table, nft=nft):
        return False
    done = _nft(nft, ["delete", "table", "inet", table])
    if done.returncode != 0 and table_exists(table, nft=nft):
        raise ProxyError(
            BOUNDARY_FAILED, f"cannot delete table inet {table}: {_first_lines(done.stderr)}"
        )
    return True


def read_back(table: str, *, nft: str = "nft") -> dict[str, ChainKey]:
    done = _nft(nft, ["-j", "list", "table", "inet", table])
    if done.returncode != 0:
        raise ProxyError(
            BOUNDARY_FAILED, f"cannot read table inet {table} back: {_first_lines(done.stderr)}"
        )
    try:
        listing = json.loads(done.stdout)
    except ValueError as exc:
        raise ProxyError(BOUNDARY_FAILED, f"nft -j list printed no JSON: {exc}") from None
    return loaded_chains(listing, table)


def apply_ruleset(text: str, table: str = DEFAULT_TABLE, *, nft: str = "nft") -> None:
    """Load `text` with `nft -f -`, read `table` back and compare it with what the text
    promises. On any failure or difference the table is deleted and ProxyError
    ('boundary_failed') raised: a half-applied or altered rule set never stays."""
    expected = expected_chains(text, table)  # before anything is loaded
    try:
        done = _nft(nft, ["-f", "-"], text)
        if done.returncode != 0:
            raise ProxyError(
                BOUNDARY_FAILED, f"nft refused the rule set: {_first_lines(done.stderr)}"
            )
        problems = compare_chains(expected, read_back(table, nft=nft))
        if problems:
            raise ProxyError(
                BOUNDARY_FAILED,
                "the loaded rules differ from the rendered ones: " + "; ".join(problems[:5]),
            )
    except ProxyError as exc:
        try:
            remove_table(table, nft=nft)
        except ProxyError as cleanup:
            raise ProxyError(
                BOUNDARY_FAILED, f"{exc.message}; and removing the table failed: {cleanup.message}"
            ) from None
        raise
