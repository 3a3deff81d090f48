"""The certificate authority of TLS inspection: created in the CA directory on first start,
loaded (and checked) on every later one, before anything listens.

    ca = ensure_ca("~/.local/share/egress-proxy/ca")
    ca.cert_path     # the certificate (proxy/l7/trust.py publishes it with the system's roots)

The files are mitmproxy's (its TlsConfig addon loads them from the same directory under the
basename `mitmproxy`), so the engine and this module cannot disagree about which CA signs.
The private key is the proxy's most sensitive file: the directory is made 0700, the key 0600
(mitmproxy writes it under a 077 umask), and an existing key that others can read is refused
rather than used, because whoever reads it can impersonate every inspected host to the session.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from proxy.errors import ProxyError

BASENAME = "mitmproxy"  # mitmproxy.options.CONF_BASENAME: TlsConfig looks for these names
KEY_SIZE = 2048
ORGANIZATION = "egress-proxy"
COMMON_NAME = "egress-proxy session CA"


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    directory: Path
    created: bool  # True when this start created it

    @property
    def key_path(self) -> Path:
        return self.directory / f"{BASENAME}-ca.pem"

    @property
    def cert_path(self) -> Path:
        return self.directory / f"{BASENAME}-ca-cert.pem"

    def trust_hint(self) -> str:
        """The CA's line of the start-up message (how to trust it: proxy/l7/trust.py)."""
        state = "created now" if self.created else "existing"
        return f"TLS inspection CA {self.cert_path} ({state}; its key stays in {self.directory})"


def _fail(directory: Path, why: str) -> ProxyError:
    return ProxyError("ca_error", f"inspection CA in {directory}: {why}", source=str(directory))


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Two proxies starting at once with one CA directory must not both create a CA."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_ca(ca_dir: str | os.PathLike[str]) -> CertificateAuthority:
    """Load the CA in `ca_dir`, creating directory and CA when absent. Raises
    ProxyError('ca_error') naming the directory and the problem."""
    # Imported here: only `run` with inspection enabled needs cryptography's CA code.
    from mitmproxy import certs

    directory = Path(os.path.expanduser(os.fspath(ca_dir)))
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError as exc:
        raise _fail(directory, f"cannot create the directory: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise _fail(directory, "is not a directory")
    if info.st_mode & 0o022:
        raise _fail(directory, "the directory is writable by others; chmod 700 it")
    ca = CertificateAuthority(directory, created=False)
    try:
        with _locked(directory):
            created = not ca.key_path.exists()
            if created:
                certs.CertStore.create_store(
                    directory, BASENAME, KEY_SIZE, organization=ORGANIZATION, cn=COMMON_NAME
                )
            mode = ca.key_path.stat().st_mode
            if mode & 0o077:
                raise _fail(
                    directory,
                    f"the private key {ca.key_path.name} is readable by others "
                    f"(mode {stat.S_IMODE(mode):o}); chmod 600 it",
                )
            # Load it as the engine will, so a damaged file stops start-up here.
            certs.CertStore.from_store(directory, BASENAME, KEY_SIZE)
    except ProxyError:
        raise
    except OSError as exc:
        raise _fail(directory, f"{exc.strerror or exc}") from None
    except Exception as exc:  # unparsable key or certificate
        raise _fail(directory, f"cannot load the CA: {type(exc).__name__}: {exc}") from None
    return CertificateAuthority(directory, created=created)


def check_upstream_ca(path: str | os.PathLike[str]) -> Path:
    """The operator's bundle for verifying inspected upstreams: readable, with at least one PEM
    certificate. Raises ProxyError('ca_error')."""
    from cryptography import x509

    bundle = Path(os.path.expanduser(os.fspath(path)))
    try:
        data = bundle.read_bytes()
    except OSError as exc:
        raise ProxyError(
            "ca_error",
            f"inspection.upstream_ca {bundle}: {exc.strerror or exc}",
            source=str(bundle),
        ) from None
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ProxyError(
            "ca_error",
            f"inspection.upstream_ca {bundle}: no PEM certificate in the file",
            source=str(bundle),
        ) from None
    return bundle
