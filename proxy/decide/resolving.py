"""What the decision steps need of a resolver, as protocols: the session's resolver
(proxy/net/resolver.py) is one, and a test's stand-in can be another. A module of its own so
that what a reload hands the planes (proxy/decide/planes.py) and the Vetter that uses it
(proxy/decide/vetting.py) both name it without importing each other."""

from __future__ import annotations

import typing
from collections.abc import Sequence

__all__ = ["Answer", "Resolves"]


class Answer(typing.Protocol):
    """A checked-for-nothing DNS answer, as the resolver gives it."""

    @property
    def addresses(self) -> Sequence[str]: ...

    @property
    def cname_chain(self) -> Sequence[str]: ...


class Resolves(typing.Protocol):
    """What the Vetter needs of the resolver (proxy.net.resolver.Resolver): one answer per
    name, or ProxyError with a DNS reason code."""

    async def resolve(self, host: str) -> Answer: ...
