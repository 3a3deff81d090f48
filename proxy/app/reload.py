"""A SIGHUP reload, up to the update every plane takes (proxy/decide/planes.py), and the one
error that refuses it.

    try:
        update = reload_update(running.config, compiled, own)   # raises ReloadRefused
    except ReloadRefused as refused:
        ...   # Runtime._refused: one line on stderr, egress_reloads_total{result="failure"}

Every way a reload fails is one `ReloadRefused`, with a reason code and a message that names
what refused it and where (`file:line:column` when a file did):
- the files did not read or compile: the loader's own code (`yaml_syntax`, `invalid_config`,
  `unreadable`, a secret's, ...) and place;
- the config changes what only a restart can (`needs_restart`: inspection turned on, its mode,
  CA directory or upstream bundle), naming the config file;
- a changed DNS configuration cannot be used (`dns_config`: no nameserver, or one of our own
  listeners);
- the proxy is not running (`not_running`: starting, or shutting down);
- anything else is a bug (`internal_error`), and fails closed like the rest.

Each is raised before any plane is configured, so a refused reload leaves the running policy,
resolver and config in force whole. Stopping learning or asking is not part of it: a config
that says `forbid` stops them even when the rest of its reload is refused (fail closed; see
proxy/app/runtime.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from policy import PolicyError
from policy.reasons import Reason
from policy.text import brief
from proxy.app.checks import refuse_own_nameservers
from proxy.common.errors import ProxyError
from proxy.decide.planes import Update
from proxy.net.resolver import Resolver

if TYPE_CHECKING:
    from proxy.app.inputs import Compiled
    from proxy.common.listeners import OwnListeners
    from proxy.common.settings import Config

__all__ = ["ReloadRefused", "refuse_restart", "reload_update"]

NEEDS_RESTART = "needs_restart"
NOT_RUNNING = "not_running"


class ReloadRefused(ProxyError):
    """A reload that was not applied (see the module docstring): the running policy stays."""

    @classmethod
    def of(cls, exc: BaseException, *, source: str | None = None) -> ReloadRefused:
        """`exc` as a refused reload: a ReloadRefused as it is; a loader's or a check's
        PolicyError (ProxyError) with its own reason code and place (`source` when it names
        none); anything else an internal error."""
        if isinstance(exc, ReloadRefused):
            return exc
        if isinstance(exc, PolicyError):
            return cls(
                exc.reason,
                exc.message,
                source=exc.source or source,
                line=exc.line,
                column=exc.column,
                path=exc.path,
                details=exc.details,
            )
        return cls(
            Reason.INTERNAL_ERROR,
            f"internal error {type(exc).__name__}: {brief(exc, 200)}",
            source=source,
        )


def refuse_restart(old: Config, new: Config) -> None:
    """What a reload cannot change in a running engine (mitmproxy's TLS set-up is made once,
    and whether the engine is loaded at all is decided at start): ReloadRefused naming it."""
    if old.operator.inspection_enabled != new.operator.inspection_enabled and (
        new.operator.inspection_enabled
    ):
        why = "inspection.enabled turned on needs a restart (the CA is loaded at start)"
    elif old.inspection_mode != new.inspection_mode:
        why = (
            f"inspection.mode changed from {old.inspection_mode!r} to {new.inspection_mode!r}: "
            "that needs a restart (which connections are intercepted is set at start)"
        )
    elif new.operator.inspection_enabled and (old.ca_dir, old.upstream_ca) != (
        new.ca_dir,
        new.upstream_ca,
    ):
        why = "inspection.ca_dir and inspection.upstream_ca changes need a restart"
    else:
        return
    raise ReloadRefused(NEEDS_RESTART, why, source=new.source)


def reload_update(running: Config, compiled: Compiled, own: OwnListeners) -> Update:
    """The update of a reload from the `running` config to `compiled`, every check passed:
    ReloadRefused otherwise. A new resolver only when the DNS configuration changed (the
    running one keeps its cache)."""
    new = compiled.config
    refuse_restart(running, new)
    resolver = None
    if (running.nameservers, running.dns_timeout) != (new.nameservers, new.dns_timeout):
        try:
            resolver = Resolver.from_config(new)
            refuse_own_nameservers(resolver, own)
        except Exception as exc:
            raise ReloadRefused.of(exc, source=new.source) from None
    return Update(policy=compiled.policy, resolver=resolver, config=new)
