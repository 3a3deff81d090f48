"""The policy package as other projects' unit tests use it."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # it opens sockets or starts processes


def test_three_lines() -> None:
    from policy import compile_policy, load_manifest

    policy = compile_policy(load_manifest("network:\n  egress: [github.com]\n"))
    assert policy.decide("api.github.com:443").allowed
    assert not policy.decide("example.org:443").allowed


def test_the_docstring_example_runs() -> None:
    import policy

    example = [
        line.strip() for line in (policy.__doc__ or "").splitlines() if line.startswith("    ")
    ]
    namespace: dict[str, object] = {}
    exec("\n".join(example), namespace)
    assert "policy" in namespace


def test_policy_is_pure() -> None:
    # No I/O, no event loop, no mitmproxy: importing the core must not pull them in.
    code = (
        "import sys, policy\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('socket', 'asyncio', 'ssl', 'mitmproxy', 'selectors', 'subprocess', 'threading',"
        " 'http', 'urllib', 'dns', 'prometheus_client', 'proxy'))\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


def test_public_names() -> None:
    import policy

    for name in policy.__all__:
        assert hasattr(policy, name), name
