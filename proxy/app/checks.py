"""Start-up and reload checks of the operator config against the running proxy: a nameserver
that is one of our own listeners, and what a reload cannot change without a restart."""

from __future__ import annotations

from proxy.common.errors import ProxyError
from proxy.common.listeners import OwnListeners, format_listen
from proxy.common.settings import Config
from proxy.net.resolver import Resolver


def refuse_own_nameservers(resolver: Resolver, own: OwnListeners) -> None:
    """A nameserver that is one of our own listeners would have the proxy ask itself (a DNS
    listener: every lookup a query to ourselves, answered by asking ourselves again)."""
    for address, port in resolver.nameservers:
        listener = own.listener(address, port)
        if listener is not None:
            raise ProxyError(
                "dns_config",
                f"nameserver {format_listen(address, port)} is this proxy's own listener "
                f"{listener}: name a DNS server it does not serve itself",
            )


def needs_restart(old: Config, new: Config) -> str | None:
    """What a reload cannot change in a running engine (mitmproxy's TLS set-up is made once,
    and whether the engine is loaded at all is decided at start)."""
    if old.operator.inspection_enabled != new.operator.inspection_enabled and (
        new.operator.inspection_enabled
    ):
        return "inspection.enabled turned on needs a restart (the CA is loaded at start)"
    if old.inspection_mode != new.inspection_mode:
        return (
            f"inspection.mode changed from {old.inspection_mode!r} to {new.inspection_mode!r}: "
            "that needs a restart (which connections are intercepted is set at start)"
        )
    if new.operator.inspection_enabled and (old.ca_dir, old.upstream_ca) != (
        new.ca_dir,
        new.upstream_ca,
    ):
        return "inspection.ca_dir and inspection.upstream_ca changes need a restart"
    return None
