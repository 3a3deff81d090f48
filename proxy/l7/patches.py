"""Every place the engine goes beyond mitmproxy's extension points (addons, hooks, custom modes),
in one module, each checked against the mitmproxy source it was written for.

mitmproxy 12.3.1 offers no way to dial an upstream connection other than its own
`asyncio.open_connection(address)`: no connect timeout, no second address, no way to hand it a
connected socket. And an upstream failure reaches the client only as mitmproxy's own HTML error
page, which an addon cannot replace. So two subclasses, used for our connections only (nothing
of mitmproxy is modified in place; no other user of it in the process is affected):

- `DialingHandler` (a ProxyConnectionHandler): `open_connection` is mitmproxy's, step for step
  and hook for hook, except the dial: the checked addresses that the `server_connect` hook
  allowed (`Ledger.allow_dial`), in answer order, each with `limits.connect_timeout`, falling
  back to the next (`proxy.net.dialing.dial_checked`). A connection no hook allowed is refused.
- `AnsweringHttpLayer` (an HttpLayer): when a request's upstream connection failed, the answer
  an addon put in `flow.metadata[ANSWER]` (in the `error` hook) goes to the client instead of
  mitmproxy's error page: our 502/504 with X-Egress-Error, for HTTP/1.1 and HTTP/2 alike.

`GUARDED` holds the sha256 of each mitmproxy function these rely on, as reviewed against
12.3.1. `changed()` names those whose source differs; the engine refuses to start then
(`verify`), and tests/test_patches.py fails, so that a new mitmproxy is reviewed before it runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mitmproxy import http
from mitmproxy.connection import ConnectionState, Server
from mitmproxy.proxy import events, layer, mode_servers, server, server_hooks
from mitmproxy.proxy.layers import http as http_layers

from policy.reasons import Reason
from proxy.errors import ProxyError
from proxy.net.dialing import UpstreamError, dial_checked

if TYPE_CHECKING:
    from mitmproxy.proxy import commands

    from proxy.l7.state import Dial

# The key under which an addon leaves the response for a request whose upstream failed.
ANSWER = "egress-proxy.answer"

GUARDED: dict[str, tuple[Callable[..., Any], str]] = {
    # DialingHandler.open_connection is this method with our dial in place of mitmproxy's.
    "mitmproxy.proxy.server.ConnectionHandler.open_connection": (
        server.ConnectionHandler.open_connection,
        "5e0b3cbaf7a4030a0a044c9ca36296c2c53a874e47cd861e5d7f70a88beff951",
    ),
    # InterceptInstance.serve (modes.py) is this method without its transparent-mode branch.
    "mitmproxy.proxy.mode_servers.ServerInstance.handle_stream": (
        mode_servers.ServerInstance.handle_stream,
        "21eea06f208c752e68bb82b2003211f126c84c45c31cdfc9632c049c20845381",
    ),
    # AnsweringHttpLayer relies on SendHttp(ResponseProtocolError) reaching the client's
    # connection layer through event_to_child, while the stream is still in `streams` ...
    "mitmproxy.proxy.layers.http.HttpLayer.event_to_child": (
        http_layers.HttpLayer.event_to_child,
        "1095f6e1581d1780afd5e87446b11eee0b12fb196c9be559f0fe15055436c8d7",
    ),
    # ... and on the `error` hook running before that ResponseProtocolError is sent.
    "mitmproxy.proxy.layers.http.HttpStream.handle_protocol_error": (
        http_layers.HttpStream.handle_protocol_error,
        "59fc3b2eeeabf63a64d4cce98b4fe4cab5193ebefbd9c32ae186e65c7d25bfe2",
    ),
}


def source_digest(function: Callable[..., Any]) -> str | None:
    """sha256 of a function's source as installed, or None when it cannot be read."""
    try:
        text = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def changed() -> list[str]:
    """The guarded mitmproxy functions whose source is not the one these patches were written
    against (or cannot be read)."""
    return [
        name for name, (function, digest) in GUARDED.items() if source_digest(function) != digest
    ]


def verify() -> None:
    """Raises ProxyError('mitmproxy_changed') unless every guarded function is as reviewed."""
    names = changed()
    if names:
        import mitmproxy.version

        raise ProxyError(
            "mitmproxy_changed",
            f"mitmproxy {mitmproxy.version.VERSION} changed what the interception engine "
            f"builds on ({', '.join(names)}); install the mitmproxy release this egress-proxy "
            "was reviewed with (12.3.1)",
        )


async def _open(address: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # An IP literal: the loop connects it without asking any resolver.
    return await asyncio.open_connection(address, port)


class DialingHandler(mode_servers.ProxyConnectionHandler):
    """mitmproxy's connection handler, dialling only what `server_connect` allowed."""

    def __init__(
        self,
        master: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        options: Any,
        mode: Any,
        take_dial: Callable[[Server], Dial | None],
    ) -> None:
        super().__init__(master, reader, writer, options, mode)
        self._take_dial = take_dial

    async def open_connection(self, command: commands.OpenConnection) -> None:
        connection = command.connection
        assert isinstance(connection, Server)
        hook_data = server_hooks.ServerConnectionHookData(client=self.client, server=connection)
        if connection.address:
            await self.handle_hook(server_hooks.ServerConnectHook(hook_data))
        dial = self._take_dial(connection)
        if dial is None or connection.error or not connection.address:
            # Refused by a hook, or never allowed by one: nothing is dialled (fail closed).
            connection.error = connection.error or (
                f"egress-proxy: {Reason.NOT_VETTED}: server connection not vetted by policy"
            )
            self.log(f"server connection refused before connect: {connection.error}")
            await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
            await self.server_event(events.OpenConnectionCompleted(command, connection.error))
            return
        async with self.max_conns[connection.address]:
            try:
                connection.timestamp_start = time.time()
                reader, writer = await dial_checked(
                    dial.name,
                    dial.addresses,
                    dial.port,
                    _open,
                    timeout=dial.timeout,
                    metrics=dial.metrics,
                )
            except (UpstreamError, asyncio.CancelledError) as exc:
                connection.error = str(exc) or "connection cancelled"
                self.log(f"error establishing server connection: {connection.error}")
                await self.handle_hook(server_hooks.ServerConnectErrorHook(hook_data))
                await self.server_event(events.OpenConnectionCompleted(command, connection.error))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            await self._serve_upstream(command, hook_data, reader, writer)

    async def _serve_upstream(
        self,
        command: commands.OpenConnection,
        hook_data: server_hooks.ServerConnectionHookData,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """What mitmproxy does with a connected upstream: its state, its hooks, its reads."""
        connection = hook_data.server
        connection.timestamp_tcp_setup = time.time()
        connection.state = ConnectionState.OPEN
        connection.peername = writer.get_extra_info("peername")
        connection.sockname = writer.get_extra_info("sockname")
        self.transports[connection] = server.ConnectionIO(
            handler=asyncio.current_task(), reader=reader, writer=writer
        )
        self.log(f"server connect {connection.address} ({connection.peername})")
        await self.handle_hook(server_hooks.ServerConnectedHook(hook_data))
        await self.server_event(events.OpenConnectionCompleted(command, None))
        try:
            await self.handle_connection(connection)
        finally:
            self.log(f"server disconnect {connection.address}")
            connection.timestamp_end = time.time()
            await self.handle_hook(server_hooks.ServerDisconnectedHook(hook_data))


class AnsweringHttpLayer(http_layers.HttpLayer):
    """mitmproxy's HTTP layer, answering a failed upstream with the response an addon left."""

    def event_to_child(
        self, child: layer.Layer | http_layers.HttpStream, event: events.Event
    ) -> layer.CommandGenerator[None]:
        if (
            isinstance(event, http_layers.ResponseProtocolError)
            and event.code == http_layers.ErrorCode.CONNECT_FAILED
            and child is self.connections.get(self.context.client)
        ):
            answer = self._answer(event.stream_id)
            if answer is not None:
                yield from self._send(child, event.stream_id, answer)
                return
        yield from super().event_to_child(child, event)

    def _answer(self, stream_id: int) -> http.Response | None:
        stream = self.streams.get(stream_id)
        flow = getattr(stream, "flow", None)
        if flow is None:
            return None
        answer = flow.metadata.pop(ANSWER, None)
        if isinstance(answer, http.Response):
            flow.response = answer  # what the client got, for the addons that look
            return answer
        return None

    def _send(
        self, child: layer.Layer | http_layers.HttpStream, stream_id: int, answer: http.Response
    ) -> layer.CommandGenerator[None]:
        body = answer.raw_content or b""
        yield from super().event_to_child(
            child, http_layers.ResponseHeaders(stream_id, answer, end_stream=not body)
        )
        if body:
            yield from super().event_to_child(child, http_layers.ResponseData(stream_id, body))
        yield from super().event_to_child(child, http_layers.ResponseEndOfMessage(stream_id))
