"""COMMAND's trust of the inspection CA: a directory of its own for the session (the CA
directory is root's, often under /root, which COMMAND's user cannot enter), holding the bundle
of the system's roots plus the session CA and the CA's certificate, 0644 in a 0755 directory,
and the variables that point common tools at them (proxy/tls/bundle.py). Only for a session that
can intercept (the manifest, fixed for the session, has a rule that decides paths, or
`inspection.mode: all`): the CA is created here when there is none, before the proxy starts, so
the proxy loads this very one."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.decide.interception import engine_needed

if TYPE_CHECKING:
    from policy import Policy
    from proxy.common.settings import Config
    from proxy.tls.bundle import TrustFiles


def publish_session_trust(policy: Policy, config: Config, suffix: str) -> TrustFiles | None:
    """The session's trust files, or None when the session can intercept nothing (inspection
    disabled, or no rule that needs it: COMMAND's own store is right, and no CA is made).
    Raises ProxyError ('ca_error', 'trust_error')."""
    if not engine_needed(policy, config):
        return None
    # Imported here: cryptography's CA code, only for a session that may intercept.
    from proxy.tls.bundle import publish
    from proxy.tls.ca import ensure_ca

    ca = ensure_ca(config.ca_dir)
    directory = Path(tempfile.mkdtemp(prefix=f"egress-sb-{suffix}-trust-"))
    return publish(ca, directory)


def trust_message(files: TrustFiles) -> str:
    environment = files.environment()
    bundle = sorted(name for name, value in environment.items() if value == str(files.bundle))
    ca = sorted(name for name, value in environment.items() if value == str(files.ca))
    return (
        f"trust bundle {files.bundle} ({files.roots} system roots, then the session CA): "
        f"COMMAND gets {', '.join(bundle)} pointing at it, and {', '.join(ca)} at the CA "
        f"alone ({files.ca})"
    )
