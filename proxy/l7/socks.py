"""SOCKS5 in the engine: mitmproxy's SOCKS5 layer, with the policy decision between the
client's CONNECT request and mitmproxy's reply.

mitmproxy's own layer replies "succeeded" at once under the lazy connection strategy, before
anything is decided, and "host unreachable" for every failure. Ours asks the addon first (the
`egress_socks_connect` hook: name stage, DNS once, address stage), then dials the checked
address, and only then replies: 0 when both worked, 2 ("not allowed by ruleset") for a denial,
4 ("host unreachable") for DNS failures and connect timeouts, 5 ("connection refused") when
every checked address refused. Nothing is relayed before that reply, and what follows it goes
through the same SNI gate as a CONNECT tunnel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes

from proxy.reasons import UPSTREAM_REFUSED

SUCCEEDED = 0
GENERAL_FAILURE = 1
NOT_ALLOWED = 2
HOST_UNREACHABLE = 4
CONNECTION_REFUSED = 5


@dataclass
class SocksRequest:
    """What the hook decides on (`context.server.address`) and what it answers."""

    context: Context
    reply: int = SUCCEEDED
    message: str = ""


@dataclass
class EgressSocksConnectHook(commands.StartHook):
    """Decide a SOCKS5 CONNECT request before it is answered (addon method
    `egress_socks_connect(request)`, which may be async)."""

    request: SocksRequest


def reply_for_dial_error(error: str) -> int:
    return CONNECTION_REFUSED if UPSTREAM_REFUSED in error else HOST_UNREACHABLE


class EgressSocks5(modes.Socks5Proxy):
    """mitmproxy's Socks5Proxy with the decision and the dial before its reply."""

    _reply: int = SUCCEEDED

    def finish_start(self) -> layer.CommandGenerator[str | None]:
        request = SocksRequest(self.context)
        yield EgressSocksConnectHook(request)
        if request.reply == SUCCEEDED:
            # Dial now (the checked address, via server_connect), so a failure is the reply.
            error = yield commands.OpenConnection(self.context.server)
            if error:
                request.reply = reply_for_dial_error(str(error))
                request.message = str(error)
        if request.reply != SUCCEEDED:
            self._reply = request.reply
            self._handle_event = self.done  # type: ignore[method-assign]
            return request.message or "refused"
        self._handle_event = self.child_layer.handle_event  # type: ignore[method-assign]
        yield from self.child_layer.handle_event(events.Start())
        return None

    def state_connect(self) -> layer.CommandGenerator[None]:
        # mitmproxy's state_connect answers every failed start with reply 4: pass its commands
        # through, with our reply code in that answer.
        inner = super().state_connect()
        try:
            command: Any = next(inner)
            while True:
                if (
                    self._reply != SUCCEEDED
                    and isinstance(command, commands.SendData)
                    and command.connection is self.context.client
                    and command.data[:2] == b"\x05\x04"
                ):
                    command = commands.SendData(
                        self.context.client, bytes([5, self._reply]) + command.data[2:]
                    )
                command = inner.send((yield command))
        except StopIteration:
            return
