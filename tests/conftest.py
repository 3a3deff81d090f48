"""Suite-wide set-up: the tests never touch the developer's home directory (the inspection CA
defaults to ~/.local/share/egress-proxy/ca, curl reads ~/.curlrc), for in-process code and the
processes the tests start alike."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_home() -> Iterator[None]:
    previous = os.environ.get("HOME")
    with tempfile.TemporaryDirectory(prefix="egress-home-") as home:
        os.environ["HOME"] = home
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("HOME", None)
            else:
                os.environ["HOME"] = previous
