"""TLS for the tests' own upstreams: a server context with a certificate from a trustme CA, and
a CA written to the file the proxy is told to trust it with (`inspection.upstream_ca`)."""

from __future__ import annotations

import ssl
from pathlib import Path

import trustme


def tls_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    """A TLS server context with a certificate for `names` issued by `ca`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


def trusted_ca(directory: Path) -> tuple[trustme.CA, Path]:
    """A CA for test upstreams, and the file the proxy is told to trust it with."""
    ca = trustme.CA()
    bundle = directory / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    return ca, bundle
