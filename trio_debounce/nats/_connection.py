"""The nats-py connection: its state callbacks turned into Trio-side state and events,
TLS, credential files, and connecting."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from nats.aio.client import Client, Srv
from nats.aio.transport import TcpTransport

from .._errors import BackendAuthError, BackendConfigError, BackendUnavailableError
from ._bridge import Host, callback, cross
from ._config import NatsConfig
from ._errors import PERMISSION_MARKER, is_auth_failure, map_error, redact, tls_failure
from ._errors import tls_refused as _tls_refused

logger = logging.getLogger("trio_debounce.nats")


class Interruptible(Protocol):
    """A watch the connection interrupts at every disconnect and reconnect
    (``_store.NatsKvWatch``)."""

    def _interrupt(self) -> None: ...


class NatsClient(Client):
    """nats-py's client, closing the socket of a failed reconnect attempt.

    nats-py (2.15 and 2.16 at least) keeps one ``TcpTransport`` across reconnect
    attempts and opens each attempt's stream into it. An attempt whose TCP connect
    succeeds but whose handshake fails (a server that accepts connections and does
    not answer: stopped by ``SIGSTOP``, or overloaded) leaves its stream open when the
    next attempt replaces it: a socket leaked per attempt for as long as the server
    is unresponsive, each reported as a :exc:`ResourceWarning` when it is collected.
    Here the transport is closed before each connect attempt (idempotent: on every
    other path nats-py has closed it already).
    """

    async def _connect_to_server(self, s: Srv) -> None:
        transport = self._transport
        if isinstance(transport, TcpTransport):
            transport.close()  # type: ignore[no-untyped-call]
        await super()._connect_to_server(s)


#: Seconds between two log lines with the same connection error message.
_LOG_REPEAT = 60.0


@dataclass
class State:
    """What the connection's callbacks tell the store; Trio side only (the bridge
    hands every nats-py callback over to Trio's side before it runs here)."""

    secrets: tuple[str, ...]
    #: The server refused the credentials (set by the error callback, cleared by a
    #: reconnect).
    auth_failed: bool = False
    #: Why the last TLS handshake failed ("" when it did not; cleared by a reconnect).
    tls_failure: str = ""
    #: ``time.monotonic()`` of the last permissions violation the server reported.
    permission_denied_at: float = -math.inf
    permission_message: str = ""
    #: Cancelled by the error callback on an authorization violation during start-up.
    connect_scope: trio.CancelScope | None = None
    #: Set by the error callback when a connection is cut during start-up (a TLS
    #: refusal can look like one: see :func:`probe_tls`); replaced once acted on.
    cut_while_connecting: trio.Event = field(default_factory=trio.Event)
    #: Set when the store is being closed on purpose (its disconnect is no news).
    closing: bool = False
    #: The open watches, interrupted by every disconnect and reconnect.
    watches: set[Interruptible] = field(default_factory=set)
    #: Set, and replaced by a fresh event, at every disconnect and reconnect.
    connection_changed: trio.Event = field(default_factory=trio.Event)
    _last_logged: dict[str, float] = field(default_factory=dict)

    def _connection_changed(self) -> None:
        for watch in list(self.watches):
            watch._interrupt()
        self.connection_changed.set()
        self.connection_changed = trio.Event()

    def log_once(self, level: int, message: str) -> None:
        """Log ``message`` unless the same one was logged in the last minute."""
        message = redact(message, self.secrets)
        now = time.monotonic()
        if now - self._last_logged.get(message, -math.inf) >= _LOG_REPEAT:
            self._last_logged[message] = now
            if len(self._last_logged) > 100:
                self._last_logged = {message: now}
            logger.log(level, "%s", message)

    # The connection's callbacks, on Trio's side: log and set state, nothing else.

    def on_error(self, exc: Exception) -> None:
        text = str(exc) or type(exc).__name__
        if is_auth_failure(exc, text):
            self.auth_failed = True
            if self.connect_scope is not None:
                self.connect_scope.cancel()
            self.log_once(logging.ERROR, f"NATS refused the credentials: {text}")
        elif _tls_refused(exc):
            assert isinstance(exc, ssl.SSLError)
            self.refuse_tls(tls_failure(exc))
        elif PERMISSION_MARKER in text.lower():
            self.permission_denied_at = time.monotonic()
            self.permission_message = redact(text, self.secrets)
            self.log_once(logging.ERROR, f"NATS denied a permission: {text}")
        else:
            # A cut (an OSError; the TLS errors that are cuts are OSErrors too) while
            # connecting may hide a TLS refusal: see probe_tls.
            if self.connect_scope is not None and isinstance(exc, OSError):
                self.cut_while_connecting.set()
            self.log_once(logging.WARNING, f"NATS connection error: {text}")

    def refuse_tls(self, failure: str) -> None:
        """The TLS handshake was refused for good (``failure`` says why): record it,
        end a connect in progress at once, and log it."""
        self.tls_failure = failure
        if self.connect_scope is not None:
            self.connect_scope.cancel()
        self.log_once(logging.ERROR, f"NATS TLS handshake failed: {failure}")

    def on_disconnected(self) -> None:
        self._connection_changed()
        if self.closing:
            logger.debug("disconnected from NATS while closing")
            return
        self.log_once(logging.WARNING, "disconnected from NATS; reconnecting")

    def on_reconnected(self) -> None:
        self._connection_changed()
        self.auth_failed = False
        self.tls_failure = ""
        self._last_logged.clear()
        logger.info("reconnected to NATS")

    def on_closed(self) -> None:
        logger.debug("NATS connection closed")

    # As coroutine functions, in the shape nats-py calls them.

    async def error_cb(self, exc: Exception) -> None:
        self.on_error(exc)

    async def disconnected_cb(self) -> None:
        self.on_disconnected()

    async def reconnected_cb(self) -> None:
        self.on_reconnected()

    async def closed_cb(self) -> None:
        self.on_closed()


def tls_context(config: NatsConfig) -> ssl.SSLContext | None:
    if config.tls_ca is None and config.tls_cert is None:
        return None
    try:
        context = ssl.create_default_context(cafile=config.tls_ca)
        if config.tls_cert is not None and config.tls_key is not None:
            context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise BackendConfigError(
            f"cannot load the TLS files (tls_ca, tls_cert, tls_key): {exc.strerror or exc}"
        ) from None
    return context


#: A line of an nkey seed or creds file that is a secret: a seed (``S`` and a key-type
#: letter, base32) or the user JWT (three base64url parts).
_SECRET_LINE = re.compile(r"\AS[A-Z][A-Z2-7]{40,}\Z|\A[\w-]{8,}\.[\w-]{8,}\.[\w-]{8,}\Z")


def secrets_of(config: NatsConfig) -> tuple[str, ...]:
    """The strings never to show in a message: the token, the password, the
    passwords and tokens of the server URLs, and the seeds and JWT of the nkey seed
    or creds file (read here only for that; nats-py reads them to connect)."""
    found = [config.token, config.password]
    for url in config.servers:
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError:
            continue
        # nats://<token>@host: a lone user name is a token
        found.append(parts.password if parts.password is not None else parts.username)
    for path in (config.nkey_seed, config.creds_file):
        if path is None or not os.path.isfile(path):  # never open a FIFO (it blocks)
            continue
        try:
            with open(path, encoding="ascii", errors="replace") as file:
                lines = file.read(1 << 16).split()
        except OSError:
            continue
        found += [line for line in lines if _SECRET_LINE.match(line)]
    return tuple(sorted({s for s in found if s}, key=len, reverse=True))


def _valid_seed(text: str) -> bool:
    """Whether ``text`` is an nkey seed that nats-py's ``nkeys`` accepts."""
    try:
        import nkeys  # here: like nats-py, only for nkey and creds authentication
    except ImportError:
        raise BackendConfigError(
            "nkey_seed and creds_file need the nkeys package (pip install 'nats-py[nkeys]')"
        ) from None
    try:
        nkeys.from_seed(bytearray(text.encode()))
    except Exception:
        return False
    return True


def check_credential_files(config: NatsConfig) -> None:
    """Refuse a missing or malformed nkey seed or creds file before connecting.

    nats-py reads them only while connecting, and a creds file without its JWT
    block makes its reader loop forever (in the event loop's thread: a hang no
    deadline can end). Messages name the field, never the path or the content.
    """
    for name in ("creds_file", "nkey_seed"):
        path = getattr(config, name)
        if path is None:
            continue
        try:
            if not os.path.isfile(path):  # missing, or a FIFO that would block
                raise OSError
            with open(path, encoding="ascii", errors="replace") as file:
                text = file.read(1 << 16)
        except OSError:
            # the path of an nkey seed is treated as a secret: not echoed
            raise BackendConfigError(f"{name} does not name a readable file") from None
        if name == "nkey_seed" and not _valid_seed(text.strip()):
            raise BackendConfigError("nkey_seed does not hold an nkey seed (one line, S...)")
        if name == "creds_file":
            lines = text.splitlines()
            found: dict[str, str] = {}
            for marker in ("BEGIN NATS USER JWT", "BEGIN USER NKEY SEED"):
                at = next((i for i, line in enumerate(lines) if marker in line), None)
                if at is not None and at + 1 < len(lines):
                    found[marker] = lines[at + 1].strip()
            jwt = found.get("BEGIN NATS USER JWT", "")
            seed = found.get("BEGIN USER NKEY SEED", "")
            if jwt.count(".") != 2 or not _valid_seed(seed):
                raise BackendConfigError(
                    "creds_file is not a creds file (a user JWT and its nkey seed, "
                    "each after its BEGIN line, as nsc writes them)"
                )


def connect_options(config: NatsConfig, state: State, host: Host) -> dict[str, Any]:
    """nats-py's ``connect`` keyword arguments; its callbacks reach ``state`` on
    Trio's side through ``host``.

    Raises:
      BackendConfigError: a credential or TLS file is unusable.
    """
    check_credential_files(config)
    options: dict[str, Any] = {
        "servers": list(config.servers),
        "error_cb": callback(host, state.on_error),
        "disconnected_cb": callback(host, state.on_disconnected),
        "reconnected_cb": callback(host, state.on_reconnected),
        "closed_cb": callback(host, state.on_closed),
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 1,
        # No buffer while disconnected: a publish then fails at once
        # (OutboundBufferLimitError) instead of being sent after the reconnect.
        "pending_size": 0,
        "ping_interval": config.ping_interval,
        "max_outstanding_pings": 2,
        "connect_timeout": config.connect_timeout,
        "drain_timeout": config.op_timeout,
        "flush_timeout": config.op_timeout,
        "tls_handshake_first": config.tls_handshake_first,
        "token": config.token,
        "user": config.user,
        "password": config.password,
        "user_credentials": config.creds_file,
        "nkeys_seed": config.nkey_seed,
    }
    tls = tls_context(config)
    if tls is not None:
        options["tls"] = tls
    if config.inbox_prefix is not None:
        options["inbox_prefix"] = config.inbox_prefix
    return options


#: Seconds one TLS probe of one server may take (:func:`probe_tls`).
_PROBE_TIMEOUT = 2.0


async def probe_tls(config: NatsConfig, context: ssl.SSLContext) -> str:
    """Why the servers refuse this client's TLS handshake, or "" if none does.

    Under TLS 1.3 a server checks the client certificate after the client's side of
    the handshake is done, then sends its alert and closes. nats-py writes CONNECT
    at that moment, and whether it reads the alert (an :class:`ssl.SSLError`
    naming the refusal) or meets the closed socket first (a broken pipe, which
    looks like an outage) is a race. This probe does the same handshake with
    Trio's :class:`trio.SSLStream` and reads before it writes, so the alert is
    what it meets. Each server (``nats://`` and ``tls://`` only) gets at most
    :data:`_PROBE_TIMEOUT` seconds; one that cannot be reached is skipped.
    """
    for url in config.servers:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("nats", "tls"):
            continue
        hostname = parts.hostname or "localhost"
        with trio.move_on_after(_PROBE_TIMEOUT):
            try:
                stream = await trio.open_tcp_stream(hostname, parts.port or 4222)
            except (OSError, ValueError):  # unreachable, or no valid port
                continue
            async with stream:
                try:
                    if not config.tls_handshake_first:
                        info = b""  # the server's plaintext INFO line comes first
                        while b"\n" not in info and len(info) < 1 << 20:
                            chunk = await stream.receive_some(1 << 16)
                            if not chunk:
                                break
                            info += chunk
                    tls = trio.SSLStream(stream, context, server_hostname=hostname)
                    await tls.do_handshake()
                    await tls.receive_some(1)
                except OSError:
                    continue
                except trio.BrokenResourceError as exc:
                    cause = exc.__cause__
                    if isinstance(cause, ssl.SSLError) and _tls_refused(cause):
                        return tls_failure(cause)
    return ""


async def _diagnose_cuts(config: NatsConfig, state: State, context: ssl.SSLContext) -> None:
    """While connecting: after each cut connection, probe for a TLS refusal (see
    :func:`probe_tls`); on one, refuse the handshake (:meth:`State.refuse_tls`)."""
    while True:
        await state.cut_while_connecting.wait()
        state.cut_while_connecting = trio.Event()
        failure = await probe_tls(config, context)
        if failure:
            state.refuse_tls(failure)
            return


def wants_tls(config: NatsConfig) -> bool:
    """Whether the config asks for TLS: a ``tls://`` URL, TLS files or handshake-first."""
    return (
        any(url.startswith("tls://") for url in config.servers)
        or config.tls_ca is not None
        or config.tls_cert is not None
        or config.tls_handshake_first
    )


def uses_tls(nc: Client) -> bool:
    """Whether ``nc``'s connection runs over TLS right now (a TCP connection's socket
    is wrapped; a websocket is not checked: ``wss://`` is TLS by its scheme)."""
    writer = getattr(nc._transport, "_io_writer", None)
    if writer is None:
        return True
    return writer.get_extra_info("ssl_object") is not None


async def connect(config: NatsConfig, state: State, host: Host, nc: Client) -> None:
    """Connect ``nc`` within ``config.connect_timeout`` seconds (Trio clock); Trio side.

    Raises:
      BackendUnavailableError: no server answered in time.
      BackendAuthError: the credentials or the TLS handshake were refused (at once),
        or TLS was asked for and the server did not start it.
      BackendConfigError: a credential or TLS file is unusable.
      BackendError: any other failure.
    """
    options = connect_options(config, state, host)
    failed: Exception | None = None
    # The nursery's body raises nothing (it would come out in an ExceptionGroup), and
    # it cancels the probe only once out of ``scope`` (a cancelled parent would take
    # over the catch of ``scope``'s own cancel, and hide the timeout).
    try:
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(config.connect_timeout) as scope:
                state.connect_scope = scope
                context = options.get("tls")
                if isinstance(context, ssl.SSLContext):
                    nursery.start_soon(_diagnose_cuts, config, state, context)
                try:
                    await cross(host, functools.partial(nc.connect, **options))
                except Exception as exc:
                    failed = exc
            nursery.cancel_scope.cancel()
    finally:
        state.connect_scope = None
    if failed is not None:
        raise map_error(failed, "connect", state) from failed
    if state.auth_failed:
        raise BackendAuthError("connect: NATS refused the credentials")
    if state.tls_failure:
        raise BackendAuthError(f"connect: the TLS handshake failed: {state.tls_failure}")
    if scope.cancelled_caught:
        servers = ", ".join(redact(url, state.secrets) for url in config.servers)
        raise BackendUnavailableError(
            f"connect: no NATS server answered within {config.connect_timeout} s (tried {servers})"
        )
    if wants_tls(config) and not uses_tls(nc):
        raise BackendAuthError(
            "connect: the config asks for TLS (a tls:// URL or TLS files) but the "
            "server did not start TLS; refusing a plaintext connection"
        )
