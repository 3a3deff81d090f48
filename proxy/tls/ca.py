"""The certificate authority of TLS inspection: created in the CA directory on first start,
loaded (and checked) on every later one, before anything listens.

    ca = ensure_ca("~/.local/share/egress-proxy/ca")
    ca.cert_path     # the certificate (proxy/tls/bundle.py publishes it with the system's roots)

The files are laid out as mitmproxy reads them (its TlsConfig addon loads `mitmproxy-ca.pem`,
key and certificate, from the same directory), so the engine and this module cannot disagree
about which CA signs; the CA is made here with `cryptography` (what mitmproxy itself uses), so
`run`, `trust` and `sandbox` publish it without loading mitmproxy. The private key is the
proxy's most sensitive file: the directory is made 0700, the key 0600 (written under a 077
umask), and an existing key that others can read is refused rather than used, because whoever
reads it can impersonate every inspected host to the session.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from proxy.common.errors import ProxyError

BASENAME = "mitmproxy"  # mitmproxy's CONF_BASENAME: its TlsConfig looks for these names
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
        """The CA's line of the start-up message (how to trust it: proxy/tls/bundle.py)."""
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
                _create(ca)
            mode = ca.key_path.stat().st_mode
            if mode & 0o077:
                raise _fail(
                    directory,
                    f"the private key {ca.key_path.name} is readable by others "
                    f"(mode {stat.S_IMODE(mode):o}); chmod 600 it",
                )
            # Load it as the engine will, so a damaged file stops start-up here.
            _load(ca)
    except ProxyError:
        raise
    except OSError as exc:
        raise _fail(directory, f"{exc.strerror or exc}") from None
    except Exception as exc:  # unparsable key or certificate
        raise _fail(directory, f"cannot load the CA: {type(exc).__name__}: {exc}") from None
    return CertificateAuthority(directory, created=created)


# A CA made as mitmproxy makes its own (its certs.create_ca): valid from two days back (clocks
# disagree), for ten years, for signing server certificates only.
_VALIDITY_OFFSET = datetime.timedelta(days=-2)
_EXPIRY = datetime.timedelta(days=10 * 365)


def _create(ca: CertificateAuthority) -> None:
    """A new key and self-signed CA certificate: the key and certificate together in
    `key_path` (0600), the certificate alone in `cert_path`."""
    # Imported here: only a session that intercepts needs a CA at all.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=KEY_SIZE)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, COMMON_NAME),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    usage = x509.KeyUsage(
        digital_signature=False, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
    certificate = (
        x509.CertificateBuilder()
        .serial_number(x509.random_serial_number())
        .subject_name(name)
        .issuer_name(name)
        .not_valid_before(now + _VALIDITY_OFFSET)
        .not_valid_after(now + _VALIDITY_OFFSET + _EXPIRY)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(private_key=key, algorithm=hashes.SHA256())
    )
    pem = certificate.public_bytes(serialization.Encoding.PEM)
    secret = key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.TraditionalOpenSSL,
        encryption_algorithm=serialization.NoEncryption(),
    )
    _write(ca.key_path, secret + pem, 0o600)
    _write(ca.cert_path, pem, 0o644)


def _write(path: Path, data: bytes, mode: int) -> None:
    """`data` in a new file of `mode` (O_EXCL: the lock holder is the only writer)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _load(ca: CertificateAuthority) -> None:
    """Read key and certificate as the engine will; raises on a damaged or mismatched pair."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    raw = ca.key_path.read_bytes()
    key = serialization.load_pem_private_key(raw, None)
    certificate = x509.load_pem_x509_certificates(raw)[0]
    if certificate.public_key().public_numbers() != key.public_key().public_numbers():  # type: ignore[union-attr]
        raise ValueError("the certificate is not the key's")


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
