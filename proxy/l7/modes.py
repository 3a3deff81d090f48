"""The engine's own proxy mode, registered in mitmproxy's mode registry: connections the front
door hands over, served from the TLS layer on with the destination already decided.

    instance = mode_servers.ServerInstance.make(InterceptMode.type_name, proxyserver)
    await instance.serve(master, reader, writer, connection, ledger)

mitmproxy finds a mode by its class (ProxyMode and ServerInstance register their subclasses
themselves); this one never listens. Each connection gets one fixed stack, built here, not asked
of a `next_layer` hook: our CA's TLS to the client, HTTP inside (each request decided by the
addons), and per upstream connection a verified TLS connection to a checked address. mitmproxy
never chooses raw TCP, passthrough or another protocol for these connections.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from mitmproxy.proxy import commands, events, layer, mode_servers, mode_specs, tunnel
from mitmproxy.proxy.layers import ClientTLSLayer, ServerTLSLayer
from mitmproxy.proxy.layers.http import HTTPMode

from proxy.common.errors import ProxyError
from proxy.l7.patches import AnsweringHttpLayer, DialingHandler

if TYPE_CHECKING:
    from mitmproxy.master import Master
    from mitmproxy.proxy.context import Context

    from proxy.l7.state import Intercepted, Ledger


class InterceptMode(mode_specs.ProxyMode):
    """TLS connections decided by the front door (`egressintercept`; it takes no data)."""

    description = "egress-proxy interception"
    transport_protocol = mode_specs.TCP

    @property
    def default_port(self) -> int | None:
        return None  # never listens

    def __post_init__(self) -> None:
        if self.data or self.custom_listen_host is not None or self.custom_listen_port:
            raise ValueError("the egress-proxy interception mode takes no data and no address")


class InterceptInstance(mode_servers.ServerInstance[InterceptMode]):
    """The server of InterceptMode: it has no listener; `serve` is its way in."""

    @property
    def is_running(self) -> bool:
        return False

    @property
    def listen_addrs(self) -> tuple[Any, ...]:
        return ()

    async def _start(self) -> None:
        pass

    async def _stop(self) -> None:
        pass

    def make_top_layer(self, context: Context) -> layer.Layer:
        raise ProxyError("engine_mode", "an intercepted connection needs its destination")

    async def handle_stream(self, reader: Any, writer: Any = None) -> None:
        # mitmproxy's own entry would serve the stream with its own dial: never for ours.
        if writer is not None:
            writer.close()
        raise ProxyError("engine_mode", "intercepted connections come through serve()")

    async def serve(
        self,
        master: Master,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        connection: Intercepted,
        ledger: Ledger,
    ) -> None:
        """Serve one handed-over connection until it ends (ServerInstance.handle_stream, with
        our handler and our stack)."""
        handler = DialingHandler(
            master,
            reader,
            writer,
            master.options,
            self.mode,
            lambda server: ledger.take_dial(server.id),
            lambda refused, text: ledger.fail(client_id, refused, text),
        )
        handler.layer = interception_stack(handler.layer.context, connection)
        client_id = handler.client.id
        ledger.add(client_id, connection)
        try:
            with self.manager.register_connection(client_id, handler):
                await handler.handle_client()
        finally:
            ledger.remove(connection)


def interception_stack(context: Context, connection: Intercepted) -> layer.Layer:
    """The layers of one intercepted connection: mitmproxy's own stack for TLS it terminates
    (server TLS over client TLS), with HTTP inside. The upstream is named, never an address:
    its certificate is verified against the name, and the dial goes to checked addresses."""
    destination = connection.destination
    context.server.address = (destination.host, destination.port)
    context.server.sni = destination.host
    stack = tunnel.LayerStack()
    stack /= ServerTLSLayer(context)
    stack /= ClientTLSLayer(context)
    stack /= AnsweringHttpLayer(context, HTTPMode.transparent)
    return stack[0]


class CloseClient(layer.Layer):
    """Closes the client connection at once; nothing is relayed, nothing dialled."""

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self._closed = False

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if not self._closed:
            self._closed = True
            yield commands.CloseConnection(self.context.client)
