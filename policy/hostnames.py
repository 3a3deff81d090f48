"""Hostnames: the strict entry grammar, the lenient runtime normaliser, and name classes.

Two audiences with opposite needs, in two modules, both named here:

* Deploy time (`check_entry`, policy/entries.py): a manifest entry is taken exactly as written.
  Nothing is rewritten, so the value an author reads in review is the value enforced; a refusal
  names one stable reason code and the exact text to write instead.
* Run time (`normalize_host`, policy/names.py): a client's requested host is folded to one
  canonical spelling (one trailing dot, case, IDNA UTS-46) so that every spelling of a name
  meets the same decision, and every spelling of an IP address is refused before anything could
  resolve it.
"""

from __future__ import annotations

from policy.entries import EntryProblem, check_entry, suggest_entry
from policy.names import (
    DEFAULT_INTERNAL_SUFFIXES,
    is_under,
    name_refusal,
    normalize_host,
    parse_ip_literal,
)

__all__ = [
    "DEFAULT_INTERNAL_SUFFIXES",
    "EntryProblem",
    "check_entry",
    "is_under",
    "name_refusal",
    "normalize_host",
    "parse_ip_literal",
    "suggest_entry",
]
