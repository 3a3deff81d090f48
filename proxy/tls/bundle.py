"""The session's trust: what a client inside the session reads so that it trusts the inspection
CA without losing every host that is not intercepted.

    files = publish(ca, directory)         # trust-bundle.pem and session-ca.pem, 0644
    files.environment()                     # {"SSL_CERT_FILE": ..., "NODE_EXTRA_CA_CERTS": ...}

Most tools *replace* their trust store with the file a variable names (pip, requests, curl, git,
npm, uv, gRPC): pointed at the CA alone, they would refuse every passthrough host. So the bundle
is the system's roots (what OpenSSL would load in this process: `SSL_CERT_FILE`, else its
compiled-in file or directory, else certifi's Mozilla bundle) followed by the session CA. Node
adds `NODE_EXTRA_CA_CERTS` to its own roots, so it gets the CA alone.

Both files are public (0644, the directory reachable by anyone); the CA's private key stays in
the CA directory, 0600, and is never copied. Writing is atomic (a reader never sees half a
bundle), and every start writes them again, so a changed system store is picked up.
No mitmproxy here, nor cryptography.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shlex
import ssl
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.common.errors import ProxyError

if TYPE_CHECKING:
    from proxy.tls.ca import CertificateAuthority

BUNDLE_NAME = "trust-bundle.pem"
CA_NAME = "session-ca.pem"

# (variable, which file, who reads it). BUNDLE: the system's roots plus the session CA, for
# tools that replace their store with the file; CA: the session CA alone, for tools that add it
# to roots of their own. Scripts outside this repo read these names: they are a contract.
BUNDLE = "bundle"
CA = "ca"
TRUST_VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("SSL_CERT_FILE", BUNDLE, "OpenSSL's default store: Python ssl/urllib/httpx/aiohttp, uv, wget"),
    ("REQUESTS_CA_BUNDLE", BUNDLE, "requests"),
    ("PIP_CERT", BUNDLE, "pip"),
    ("CURL_CA_BUNDLE", BUNDLE, "curl"),
    ("GIT_SSL_CAINFO", BUNDLE, "git"),
    ("NODE_EXTRA_CA_CERTS", CA, "Node (added to its own roots)"),
    ("npm_config_cafile", BUNDLE, "npm"),
    ("YARN_HTTPS_CA_FILE_PATH", BUNDLE, "yarn 2+"),
    ("AWS_CA_BUNDLE", BUNDLE, "AWS CLI and SDKs"),
    ("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH", BUNDLE, "gRPC (grpcio, grpc-go's C core peers)"),
    ("CARGO_HTTP_CAINFO", BUNDLE, "cargo"),
    ("HTTPLIB2_CA_CERTS", BUNDLE, "httplib2 (Google API clients)"),
)

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?\r?\n-----END CERTIFICATE-----", re.DOTALL)
# The system store's files are not hostile, but a directory of hashed links is large; a bound
# keeps a mistaken SSL_CERT_DIR (/ say) from reading the disk.
MAX_ROOT_FILES = 4096
MAX_ROOT_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TrustFiles:
    directory: Path
    roots: int  # system roots in the bundle
    roots_source: str  # where they came from

    @property
    def bundle(self) -> Path:
        return self.directory / BUNDLE_NAME

    @property
    def ca(self) -> Path:
        return self.directory / CA_NAME

    def environment(self) -> dict[str, str]:
        return trust_environment(self.bundle, self.ca)

    def hint(self) -> str:
        """What `run` says at start: the files, then the variables as a shell would set them."""
        return (
            f"trust bundle {self.bundle} ({self.roots} system roots from {self.roots_source}, "
            f"then the session CA {self.ca}); a client trusts it with: "
            f"{shell_assignments(self.environment())}"
        )


def trust_environment(bundle: Path | str, ca: Path | str) -> dict[str, str]:
    """Every variable of TRUST_VARIABLES set to its file."""
    files = {BUNDLE: str(bundle), CA: str(ca)}
    return {name: files[which] for name, which, _ in TRUST_VARIABLES}


def shell_assignments(environment: dict[str, str]) -> str:
    return " ".join(f"{name}={shlex.quote(value)}" for name, value in environment.items())


def publish(ca: CertificateAuthority, directory: Path | str | None = None) -> TrustFiles:
    """Write the bundle and the CA's certificate into `directory` (default: the CA's own),
    readable by anyone. Raises ProxyError('trust_error') naming the file and the problem."""
    target = Path(os.path.expanduser(os.fspath(directory))) if directory else ca.directory
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in str(target)):
        # The path travels in environment variables and NAME=VALUE lines.
        raise _fail(target, "the path holds control characters")
    try:
        ca_pem = _certificates(ca.cert_path.read_bytes())
    except OSError as exc:
        raise _fail(ca.cert_path, exc.strerror or str(exc)) from None
    if len(ca_pem) != 1:
        raise _fail(ca.cert_path, "not exactly one PEM certificate")
    roots, source = system_roots()
    roots = [root for root in roots if root != ca_pem[0]]  # the store may be an older bundle
    header = (
        f"# egress-proxy trust bundle: {len(roots)} system roots from {source}, then the "
        "session's inspection CA\n"
    ).encode()
    _reachable(target, own=target == ca.directory)
    _write(target / BUNDLE_NAME, header + b"".join(roots) + b"# the session CA\n" + ca_pem[0])
    _write(target / CA_NAME, ca_pem[0])
    return TrustFiles(target, len(roots), source)


def system_roots() -> tuple[list[bytes], str]:
    """(PEM blocks, where they came from) of the store OpenSSL would use in this process,
    deduplicated; certifi's bundle when the system has none."""
    paths = ssl.get_default_verify_paths()
    candidates: list[tuple[str, list[Path]]] = []
    if paths.cafile:
        candidates.append((paths.cafile, [Path(paths.cafile)]))
    if paths.capath and os.path.isdir(paths.capath):
        with contextlib.suppress(OSError):
            files = sorted(p for p in Path(paths.capath).iterdir() if p.is_file())
            candidates.append((paths.capath, files[:MAX_ROOT_FILES]))
    with contextlib.suppress(ImportError):
        import certifi

        candidates.append((f"certifi {certifi.where()}", [Path(certifi.where())]))
    for source, files in candidates:
        roots = _read_roots(files)
        if roots:
            return roots, source
    return [], "nowhere (no system store and no certifi: only the session CA is trusted)"


def _read_roots(files: list[Path]) -> list[bytes]:
    seen: set[bytes] = set()
    roots: list[bytes] = []
    budget = MAX_ROOT_BYTES
    for path in files:
        try:
            data = path.read_bytes()[:budget]
        except OSError:
            continue
        budget -= len(data)
        for block in _certificates(data):
            if block not in seen:
                seen.add(block)
                roots.append(block)
        if budget <= 0:
            break
    return roots


def _certificates(data: bytes) -> list[bytes]:
    """The PEM certificates in `data` whose body is base64 of a DER SEQUENCE, each with a final
    newline. Not parsed further: a tool's own parser judges a root, and cryptography warns
    about (and will one day refuse) old roots that OpenSSL still loads."""
    found = []
    for match in _PEM.finditer(data):
        block = match.group(0)
        body = b"".join(block.splitlines()[1:-1])
        try:
            der = base64.b64decode(body, validate=True)
        except ValueError:
            continue  # one damaged entry does not cost the rest of the store
        if der[:1] == b"\x30":
            found.append(block.replace(b"\r\n", b"\n") + b"\n")
    return found


def _reachable(directory: Path, *, own: bool) -> None:
    """A directory of its own is made 0755; the CA's (0700) gets search permission only
    (0711), so a known name can be read and nothing else listed."""
    try:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        mode = stat.S_IMODE(directory.stat().st_mode)
        wanted = mode | (0o711 if own else 0o755)
        if wanted != mode:
            directory.chmod(wanted)
    except OSError as exc:
        raise _fail(directory, exc.strerror or str(exc)) from None


def _write(path: Path, data: bytes) -> None:
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as exc:
        raise _fail(path, exc.strerror or str(exc)) from None


def _fail(path: Path, why: str) -> ProxyError:
    return ProxyError("trust_error", f"trust bundle: {why}", source=str(path))
