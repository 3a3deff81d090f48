"""A check of the operator config against the running proxy, at start-up and on every reload: a
nameserver that is one of our own listeners. (What a reload cannot change without a restart is
proxy/app/reload.py's.)"""

from __future__ import annotations

from proxy.common.errors import ProxyError
from proxy.common.listeners import OwnListeners, format_listen
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
