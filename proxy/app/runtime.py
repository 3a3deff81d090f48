"""`egress-proxy run`: the components put together into one running session proxy.

    inputs = read_inputs(manifest, ceiling=..., config=...)   # fails closed, nothing listens yet
    code = run(inputs, compile_inputs(inputs), listen=[Listener("http", "127.0.0.1", 3128)],
               admin=("127.0.0.1", 9901))

Start-up order: read and compile everything (a PolicyError here is reported by the CLI with the
same exit codes as `check`), open the audit log; when the session can need TLS interception
(`proxy.decide.interception.engine_needed`: inspection enabled, and URL-prefix rules or
`inspection.mode: all`), load the interception engine and its CA (created on first start), and
otherwise never import mitmproxy; bind the admin listener, the DNS listeners (`dns_listen`: our
own UDP and TCP server, proxy/dns_responder/server.py), then the front door's listeners
(proxy/dataplane/frontdoor.py: every connection is the front door's; only the TLS connections
it intercepts are handed to the engine, loaded then if not yet), refuse a nameserver that is one
of those listeners (the proxy would ask itself), then mark the proxy ready. A CA problem exits
before anything listens; a bind failure stops whatever was already started and exits 2.

Signals (handled on the event loop):
- SIGTERM / SIGINT: `/readyz` turns 503 at once (draining), the proxy listener stops accepting,
  live connections get up to the drain timeout to finish, then the engine and the admin listener
  stop and the process exits 0. A second signal skips the rest of the drain.
- SIGHUP: re-reads the ceiling and the operator config files and recompiles the policy (the
  manifest is immutable for an agent version: its bytes are the ones read at start-up). What
  changed is one `Update` (proxy/decide/planes.py), checked whole first (proxy/app/reload.py)
  and then given to every running plane the same way, `plane.configure(update)`: the front
  door, the engine, the DNS listeners. Any failure is one `ReloadRefused`, before any plane is
  touched: the old policy stays, one line on stderr says why (its reason code, file:line:column)
  and a failed reload is counted. The new policy applies to every later decision, and live
  client connections (CONNECT tunnels, keep-alive plain HTTP, intercepted ones) with a
  destination it denies are closed (their close lines say `policy_reload`); the DNS listeners
  answer with the new policy and resolver; `tls.ech` applies to the tunnels whose ClientHello is
  read after the reload. `limits` apply from start-up only; a changed DNS configuration takes
  effect with a new resolver (refused, keeping the old one, when a nameserver is one of our own
  listeners). Turning inspection on, changing `inspection.mode`, its CA directory or its
  upstream bundle needs a restart (the reload is refused and says so); turning it off closes
  the intercepted connections.

Learning mode (`learn=True`, `run --learn`): every Vetter lets through the refusals only a
manifest entry could lift (policy/learning.py), audited as `would_deny`; said on stderr at
start, on `/readyz` (`learn: true`) and in `egress_learn_mode`. It never starts where the
operator config says `learn: forbid`. A SIGHUP reload whose config says `learn: forbid` stops
learning for good (fail closed: the session goes on enforcing, and the live connections only
learning let through are closed: an `Update` of its own), even when the rest of that reload is
refused; a later `learn: allow` does not turn it back on.

Asking mode (`ask_token=FILE`, `run --ask --ask-token FILE`): every Vetter holds the refusals a
person may be asked about (policy/asking.py) until someone answers on the admin listener with
the token in FILE (proxy/app/ask_token.py: read, or created before anything listens); one
`Asks` (proxy/decide/asks.py) is shared by every plane, and its grants outlive reloads. A
reload re-decides the pending asks under the new policy (`Asks.reconsider`); one whose config
says `ask: forbid` stops asking for good, as `learn: forbid` stops learning: the held
connections are refused and the grants no longer apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from policy import Policy
from policy.dimensions import Plane
from proxy import __version__
from proxy.app.ask_token import read_or_create_token
from proxy.app.checks import refuse_own_nameservers
from proxy.app.inputs import Compiled, Inputs, compile_inputs, refuse_forbidden
from proxy.app.messages import LEARNING, PrintableFormatter, asking, listening, try_it
from proxy.app.open_files import raise_open_files_limit
from proxy.app.reload import NOT_RUNNING, ReloadRefused, reload_update
from proxy.common.errors import ProxyError
from proxy.common.listeners import Listener, OwnListeners, format_listen
from proxy.common.settings import FORBID, Config, Limits
from proxy.common.terminal import printable
from proxy.dataplane.frontdoor import FrontDoor
from proxy.decide.asks import AskLimits, Asks
from proxy.decide.attribution import Attribution
from proxy.decide.interception import engine_needed
from proxy.decide.planes import Configurable, Update
from proxy.decide.resolving import Resolves
from proxy.decide.vetting import Vetter
from proxy.dns_responder.responder import DnsResponder
from proxy.dns_responder.server import DnsServer, ServerLimits
from proxy.net.resolver import Resolver
from proxy.ops.admin import AdminServer
from proxy.ops.audit import AuditLog
from proxy.ops.denials import Denials
from proxy.ops.metrics import Metrics
from proxy.ops.readiness import Readiness

if TYPE_CHECKING:
    from proxy.l7.engine import Engine
    from proxy.tls.bundle import TrustFiles
    from proxy.tls.ca import CertificateAuthority

# Upper bound of the SIGTERM drain: live connections get min(this, limits.idle_timeout).
MAX_DRAIN_SECONDS = 5.0


class Runtime:
    """One running proxy: engine, admin listener, audit log, signals."""

    def __init__(
        self,
        inputs: Inputs,
        compiled: Compiled,
        *,
        listen: Sequence[Listener],
        admin: tuple[str, int],
        session_id: str | None = None,
        audit_log: str | None = None,
        err: TextIO | None = None,
        dns_listen: Sequence[Listener] = (),
        learn: bool = False,
        ask_token: str | None = None,
    ) -> None:
        self.inputs = inputs
        self.learning = learn
        self.ask_token = ask_token  # the token file: asking mode
        self.asks: Asks | None = None
        self.compiled = compiled
        self.listen = listen
        self.dns_listen = dns_listen
        self.admin_address = admin
        self.session_id = session_id
        self.audit_path = audit_log
        self._err = err
        self._log_handler: logging.Handler | None = None
        self.metrics = Metrics()
        # The recent denials `/denials` serves; the audit log feeds it, so every plane's
        # denials reach it through the Vetters' audit sink without knowing it exists.
        self.denials = Denials()
        self.readiness = Readiness()
        # Which addresses the session's DNS answered for which names: the DNS responder writes,
        # the front door reads (connections that carry no name of their own).
        self.attribution = Attribution(compiled.config.attribution_grace)
        self.engine: Engine | None = None
        self.trust: TrustFiles | None = None  # published once the CA is loaded
        self.front: FrontDoor | None = None
        self.dns: DnsServer | None = None
        self.resolver: Resolves | None = None
        self._engine_lock = asyncio.Lock()
        self.admin: AdminServer | None = None
        self.audit: AuditLog | None = None
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Every listener as bound (admin and DNS too), shared by every Vetter: the loop guard.
        self.own = OwnListeners()

    # -- output --------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        err = self._err or sys.stderr
        with contextlib.suppress(Exception):
            err.write(printable(f"egress-proxy: {text}") + "\n")
            err.flush()

    def _log_to_stderr(self) -> logging.Handler:
        """Our modules' log records (a hook that failed and denied, with its traceback) on
        stderr: mitmproxy's Master routes the root logger into its own event log, which no
        addon here prints."""
        handler = logging.StreamHandler(self._err or sys.stderr)
        handler.setFormatter(
            PrintableFormatter("egress-proxy: %(levelname)s %(name)s: %(message)s")
        )
        handler.setLevel(logging.WARNING)
        logger = logging.getLogger("proxy")
        logger.addHandler(handler)
        logger.propagate = False
        return handler

    def warn_findings(self, policy: Policy) -> None:
        # Deploy-time ceiling findings: a lowered ceiling narrows the session, it does not stop it.
        for f in policy.findings:
            self.say(f"warning: {f.path}: {f.reason}: {f.message}")

    # -- life cycle ----------------------------------------------------------------------------

    async def run(self) -> int:
        config = self.compiled.config
        if self.learning:
            # Before anything is opened or bound: a forbidden learning session never starts.
            refuse_forbidden(config, "learn")
        token = None
        if self.ask_token is not None:
            refuse_forbidden(config, "ask")
            # Before the admin listener: `/readyz` never answers before the token exists.
            token = read_or_create_token(self.ask_token)
        self._log_handler = self._log_to_stderr()
        self._raise_open_files(config.limits.max_connections)
        self.metrics.set_build_info(__version__, platform.python_version())
        self.readiness.set("policy_compiled", True)
        self.readiness.learning = self.learning
        self.metrics.learn_mode(self.learning)
        self.warn_findings(self.compiled.policy)
        resolver = Resolver.from_config(config)
        try:
            self.audit = AuditLog(
                self.audit_path, session=self.session_id, metrics=self.metrics, denials=self.denials
            )
        except OSError as exc:
            raise ProxyError(
                "unreadable",
                f"cannot open the audit log {self.audit_path}: {exc.strerror or exc}",
            ) from None
        self.resolver = resolver
        self.readiness.asking = token is not None
        if token is not None:
            self.asks = _asks(config.limits, self.audit, self.metrics)
        try:
            ca = None
            if engine_needed(self.compiled.policy, config):
                # Load it now, with its CA, so any problem stops start-up before anything
                # listens.
                ca = self._new_engine().prepare()
            elif config.trust_dir is not None:
                # A published trust directory is mounted by the agent before any request:
                # its files must exist even if nothing is intercepted yet.
                from proxy.tls.ca import ensure_ca

                ca = ensure_ca(config.ca_dir)
            trust = self._publish_trust(ca) if ca is not None else None
            self.admin = AdminServer(
                self.readiness,
                self.metrics.render,
                denials=self.denials,
                asks=self.asks,
                token=token,
            )
            admin_host, admin_port = await self.admin.start(*self.admin_address)
            dns_bound = await self._start_dns(resolver)
            # Ours before the front door accepts anything: a tunnel or a request to /metrics
            # through the proxy itself is refused; the DNS listeners listen on TCP too.
            self.own.claim((*dns_bound, Listener("admin", admin_host, admin_port)))
            if self.engine is not None:
                await self.engine_for_intercept()
            self.front = FrontDoor(
                self._vetter(Plane.L4, resolver),
                config,
                self.metrics,
                self.audit,
                engine=self.engine_for_intercept,
                attribution=self.attribution,
            )
            listeners = (*await self.front.start(self.listen), *dns_bound)
            refuse_own_nameservers(resolver, self.own)
            self.readiness.set("listeners_bound", True)
            # Set here because nothing in this process can verify the sandbox boundary (that the
            # agent cannot bypass this proxy); the sandbox shapes (issue 5) verify it and will
            # set this condition from their own check.
            self.readiness.set("boundary_verified", True)
            self._install_signals()
            if self.learning:
                self.say(LEARNING)
            if self.ask_token is not None:
                self.say(asking(format_listen(admin_host, admin_port), self.ask_token))
            self.say(
                f"listening on {listening(listeners)} "
                f"(admin http://{format_listen(admin_host, admin_port)}/readyz /metrics); "
                f"try: {try_it(listeners[0])}"
            )
            if ca is not None and trust is not None:
                self.say(ca.trust_hint())
                self.say(trust.hint())
            await self._stop.wait()
            await self._drain()
            return 0
        finally:
            await self._shutdown()

    def _raise_open_files(self, max_connections: int) -> None:
        # Before anything listens: a soft limit of 1024 would fail tunnels at about 500.
        limits = raise_open_files_limit(max_connections)
        self.metrics.open_files_limit(limits.limit)
        warning = limits.warning()
        if warning is not None:
            self.say(warning)

    def _vetter(self, plane: Plane, resolver: Resolves) -> Vetter:
        """A plane's own Vetter (`l4`: the front door's and the DNS responder's; `l7`: the
        engine's), with the session's policy and modes as they are now; a reload changes them
        through the planes (`_configure`)."""
        return Vetter(
            self.compiled.policy,
            resolver,
            self.metrics,
            self.audit,
            plane=plane,
            learn=self.learning,
            asks=self.asks,
            own=self.own,
        )

    # -- the DNS listeners ----------------------------------------------------------------------

    async def _start_dns(self, resolver: Resolver) -> tuple[Listener, ...]:
        if not self.dns_listen:
            return ()
        limits = self.compiled.config.limits
        self.dns = DnsServer(
            DnsResponder(self._vetter(Plane.L4, resolver), self.metrics, self.attribution),
            ServerLimits(header_timeout=limits.header_timeout, idle_timeout=limits.idle_timeout),
        )
        return await self.dns.start(self.dns_listen)

    # -- the engine, loaded when first needed --------------------------------------------------

    def _new_engine(self) -> Engine:
        # Imported here: mitmproxy costs ~10 MB and a second of start-up, which a
        # passthrough-only session never pays.
        from proxy.l7.engine import Engine

        assert self.resolver is not None
        self.engine = Engine(
            self._vetter(Plane.L7, self.resolver), self.compiled.config, self.metrics, self.audit
        )
        return self.engine

    async def engine_for_intercept(self) -> Engine:
        """The running engine, started on first use (one start even for concurrent callers;
        the CA is prepared then if it was not at start)."""
        async with self._engine_lock:
            engine = self.engine if self.engine is not None else self._new_engine()
            if engine.master is None:
                # A reload's policy may need the engine a start-up one did not. Made or not
                # yet, it took every reload since (`_configure`): nothing to catch up on.
                await engine.start()
                self.metrics.engine_loaded(True)
                if self.trust is None and engine.ca is not None:
                    # The CA was first loaded now: publish it, and say so, as a start does.
                    try:
                        trust = self._publish_trust(engine.ca)
                    except ProxyError as exc:
                        self.say(f"warning: {exc.message}")
                    else:
                        self.say(engine.ca.trust_hint())
                        self.say(trust.hint())
            return engine

    def _publish_trust(self, ca: CertificateAuthority) -> TrustFiles:
        """The trust bundle and CA certificate, in `inspection.trust_dir` or beside the CA."""
        from proxy.tls.bundle import publish

        self.trust = publish(ca, self.compiled.config.trust_dir)
        return self.trust

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    def request_stop(self) -> None:
        if self._stop.is_set():
            self._hurry.set()  # a second signal: no more draining
        self._stop.set()
        self.readiness.set("draining", True, "shutting down")

    def request_reload(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        timeout = min(MAX_DRAIN_SECONDS, self.compiled.config.limits.idle_timeout)
        front = self.front
        if front is None:
            return
        # Every connection, intercepted or not, is the front door's, and counts as live there.
        if front.live:
            self.say(f"draining {front.live} live connection(s) for up to {timeout:g}s")
        drained = asyncio.ensure_future(front.drain(timeout))
        hurry = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait({drained, hurry}, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if not drained.done():
            drained.cancel()

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.front is not None:
            with contextlib.suppress(Exception):
                await self.front.drain(0)
        if self.dns is not None:
            with contextlib.suppress(Exception):
                await self.dns.stop()
        if self.engine is not None:
            with contextlib.suppress(Exception):
                await self.engine.stop()
        if self.asks is not None:
            self.asks.close()
        if self.admin is not None:
            with contextlib.suppress(Exception):
                await self.admin.stop()
        if self.audit is not None:
            self.audit.close()
        if self._log_handler is not None:
            logger = logging.getLogger("proxy")
            logger.removeHandler(self._log_handler)
            logger.propagate = True

    # -- reload --------------------------------------------------------------------------------

    async def reload(self) -> bool:
        """Recompile from the ceiling and config files, and give every plane the one update
        (proxy/decide/planes.py), or refuse the reload whole (proxy/app/reload.py): True when
        applied."""
        async with self._reload_lock:
            try:
                compiled = await self._recompiled()
                # Before the checks: a config that forbids learning or asking stops it even when
                # the rest of its reload is refused (fail closed).
                self._forbid(compiled.config)
                update = reload_update(self.compiled.config, compiled, self.own)
            except ReloadRefused as refused:
                self._refused(refused)
                return False
            closed = self._configure(update)
            if update.resolver is not None:
                self.resolver = update.resolver
            if self.asks is not None and self.front is not None:
                # Held connections are decided under the new policy where it says otherwise.
                self.asks.reconsider(self.front.vetter.still_asked)
            self.compiled = compiled
            self.metrics.reload(ok=True)
            self.warn_findings(compiled.policy)
            self.say(
                f"reloaded: {len(compiled.policy.rules_json())} rule(s) in force, "
                f"{len(closed)} live connection(s) closed"
            )
            return True

    async def _recompiled(self) -> Compiled:
        """The files read and compiled again, for a running proxy: ReloadRefused otherwise."""
        try:
            compiled = await asyncio.to_thread(compile_inputs, self.inputs)
        except Exception as exc:  # fail closed on the old policy, never crash the proxy
            raise ReloadRefused.of(exc) from None
        if self.front is None or self._stop.is_set():
            raise ReloadRefused(NOT_RUNNING, "the proxy is starting or shutting down")
        return compiled

    def _refused(self, refused: ReloadRefused) -> None:
        """The one report of a refused reload: counted, and one line on stderr with its reason
        code and what refused it, where."""
        self.metrics.reload(ok=False)
        self.say(f"reload failed ({refused.reason}), keeping the previous policy: {refused}")

    def _planes(self) -> list[Configurable]:
        planes: list[Configurable | None] = [self.front, self.engine, self.dns]
        return [plane for plane in planes if plane is not None]

    def _configure(self, update: Update) -> list[str]:
        """Every running plane takes `update`, the same way: the ids of the live connections
        they closed."""
        closed: list[str] = []
        for plane in self._planes():
            closed += plane.configure(update)
        return closed

    def _forbid(self, config: Config) -> None:
        """Learning or asking off for good where a reloaded config says `forbid`."""
        if self.learning and config.learn == FORBID:
            self._stop_learning(config.source)
        if self.asks is not None and config.ask == FORBID:
            self._stop_asking(config.source)

    def _stop_asking(self, source: str | None) -> None:
        """Asking off in every plane, for the rest of the session: the held connections are
        refused, and the live ones only a person's answer let through are closed."""
        asks, self.asks = self.asks, None
        self.readiness.asking = False
        closed = self._configure(Update(stop_asking=True))
        if asks is not None:
            # The planes no longer ask it: the connections it held decide again, refused.
            asks.reconsider(lambda target: False)
            asks.close()
        self.say(
            f"ASKING STOPPED: the config ({source or 'reloaded'}) now says 'ask: forbid'; "
            f"nothing is held for a person from now on and the session's grants no longer "
            f"apply ({len(closed)} live connection(s) only a person's answer let through closed)"
        )

    def _stop_learning(self, source: str | None) -> None:
        """Learning off in every plane, for the rest of the session, and the live connections
        only learning let through closed (re-decided on the running policy, now without it)."""
        self.learning = False
        self.readiness.learning = False
        self.metrics.learn_mode(False)
        closed = self._configure(Update(stop_learning=True))
        self.say(
            f"LEARNING STOPPED: the config ({source or 'reloaded'}) now says 'learn: forbid'; "
            f"the policy is enforced in full from now on ({len(closed)} live connection(s) "
            "that only learning let through closed)"
        )


def run(
    inputs: Inputs,
    compiled: Compiled,
    *,
    listen: Sequence[Listener],
    admin: tuple[str, int],
    session_id: str | None = None,
    audit_log: str | None = None,
    err: TextIO | None = None,
    dns_listen: Sequence[Listener] = (),
    learn: bool = False,
    ask_token: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean drain. Raises ProxyError on bind failures.
    `dns_listen`: the DNS responder's listeners (Listener("dns", host, port)), UDP and TCP.
    `learn`: learning mode (ProxyError 'learn_forbidden' where the config forbids it).
    `ask_token`: asking mode, answered with the token in this file (ProxyError
    'ask_forbidden' where the config forbids it, 'ask_token' for a file that cannot be used)."""

    async def main() -> int:
        runtime = Runtime(
            inputs,
            compiled,
            listen=listen,
            admin=admin,
            session_id=session_id,
            audit_log=audit_log,
            err=err,
            dns_listen=dns_listen,
            learn=learn,
            ask_token=ask_token,
        )
        if loop_note is not None:
            runtime.say(loop_note)
        return await runtime.run()

    factory, loop_note = event_loop_factory()
    return asyncio.run(main(), loop_factory=factory)


def _asks(limits: Limits, audit: AuditLog | None, metrics: Metrics) -> Asks:
    return Asks(
        AskLimits.of(limits),
        audit=audit.write if audit is not None else None,
        count=metrics.ask,
    )


def event_loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop], str | None]:
    """uvloop's event loop (it spends far less CPU per connection than asyncio's own:
    docs/performance.md), or asyncio's where uvloop cannot be imported, with the line that
    says so."""
    try:
        import uvloop
    except ImportError as exc:
        note = (
            f"uvloop is not available ({exc}); running on asyncio's own event loop, which "
            "costs more CPU per connection"
        )
        return asyncio.new_event_loop, note
    return uvloop.new_event_loop, None
