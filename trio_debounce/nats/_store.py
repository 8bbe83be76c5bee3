"""The NATS JetStream KV implementation of :class:`~trio_debounce._kv.KvStore`.

nats-py is an asyncio library; :func:`open_nats_store` opens a private trio-asyncio
loop for it, and every store operation crosses the bridge once (:func:`_cross`: one
asyncio task, its result handed straight back to the waiting Trio task) under a
Trio-side deadline. nats-py's exceptions are
mapped at this boundary (:func:`_map_error`) onto the library's own
(:mod:`trio_debounce._errors`), so none escapes.

nats-py's connection callbacks run on the asyncio side of the bridge (in the same
thread as Trio): they only log to the ``trio_debounce.nats`` logger, set plain state
that the Trio side reads, and set Trio events (an open :class:`NatsKvWatch` is
interrupted by every disconnect and reconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import re
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import nats.errors
import nats.js.errors
import outcome
import trio
import trio_asyncio
from nats.aio.client import Client
from nats.js import api
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from .._errors import (
    BackendAuthError,
    BackendConfigError,
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
    RevisionConflict,
)
from .._kv import KvEntry, KvStore
from ._config import NatsConfig

logger = logging.getLogger("trio_debounce.nats")

T = TypeVar("T")

#: Bytes kept free under the server's max payload for the headers nats-py adds to a
#: write (``NATS/1.0``, ``Nats-Expected-Last-Subject-Sequence: <20 digits>``, about
#: 70 bytes) and a safety margin.
HEADROOM = 1024 + 128

#: JetStream's error codes for a failed ``Nats-Expected-Last-Subject-Sequence`` check.
_WRONG_LAST_SEQUENCE = (10071, 10164)

#: JetStream's error code for a message get that found nothing (``no message found``).
_NO_MESSAGE = 10037

_VALID_KEY = re.compile(r"\A[-/_=.A-Za-z0-9]+\Z")
_AUTH_MARKERS = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
)
_PERMISSION_MARKER = "permissions violation"
_URL_USERINFO = re.compile(r"(?<=://)[^/@]*@")

#: Seconds between two log lines with the same connection error message.
_LOG_REPEAT = 60.0

#: After the Trio side cancels a call, how long (seconds) the asyncio side keeps
#: re-cancelling a nats-py coroutine that swallowed the cancellation.
_CANCEL_GRACE = 1.0

#: Seconds :func:`_shutdown` waits for a socket it closed to report it closed.
_CLOSE_WAIT = 0.25
#: What nats-py raises when no stream answered a request (no responders, an empty or
#: 503 reply): the stream has no leader (an election after the loss of a node) or the
#: connection's interest has not propagated yet. Nothing was applied, so the store
#: retries it within ``op_timeout``, every :data:`_NO_STREAM_RETRY` seconds at first,
#: doubling up to :data:`_NO_STREAM_RETRY_MAX`.
_NO_STREAM = (
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
_NO_STREAM_RETRY = 0.05
_NO_STREAM_RETRY_MAX = 0.5

#: Seconds without a subscriber after which the server deletes a watch's ephemeral
#: consumer (one left behind by a watch stopped while disconnected, for instance).
WATCH_INACTIVE_THRESHOLD = 30.0


def _redact(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` without URL credentials and without any of ``secrets``."""
    text = _URL_USERINFO.sub("<hidden>@", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "<hidden>")
    return text


@dataclass
class _State:
    """What the asyncio-side callbacks tell the Trio side (same thread, plain fields)."""

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
    #: Set when the store is being closed on purpose (its disconnect is no news).
    closing: bool = False
    #: The open watches, interrupted by every disconnect and reconnect.
    watches: set[NatsKvWatch] = field(default_factory=set)
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
        message = _redact(message, self.secrets)
        now = time.monotonic()
        if now - self._last_logged.get(message, -math.inf) >= _LOG_REPEAT:
            self._last_logged[message] = now
            if len(self._last_logged) > 100:
                self._last_logged = {message: now}
            logger.log(level, "%s", message)

    # The nats-py callbacks (asyncio side): log and set state, nothing else.

    async def error_cb(self, exc: Exception) -> None:
        text = str(exc) or type(exc).__name__
        lowered = text.lower()
        if isinstance(exc, nats.errors.AuthorizationError) or any(
            marker in lowered for marker in _AUTH_MARKERS
        ):
            self.auth_failed = True
            if self.connect_scope is not None:
                self.connect_scope.cancel()
            self.log_once(logging.ERROR, f"NATS refused the credentials: {text}")
        elif _tls_refused(exc):
            assert isinstance(exc, ssl.SSLError)
            self.tls_failure = _tls_failure(exc)
            if self.connect_scope is not None:
                self.connect_scope.cancel()
            self.log_once(logging.ERROR, f"NATS TLS handshake failed: {self.tls_failure}")
        elif _PERMISSION_MARKER in lowered:
            self.permission_denied_at = time.monotonic()
            self.permission_message = _redact(text, self.secrets)
            self.log_once(logging.ERROR, f"NATS denied a permission: {text}")
        else:
            self.log_once(logging.WARNING, f"NATS connection error: {text}")

    async def disconnected_cb(self) -> None:
        self._connection_changed()
        if self.closing:
            logger.debug("disconnected from NATS while closing")
            return
        self.log_once(logging.WARNING, "disconnected from NATS; reconnecting")

    async def reconnected_cb(self) -> None:
        self._connection_changed()
        self.auth_failed = False
        self.tls_failure = ""
        self._last_logged.clear()
        logger.info("reconnected to NATS")

    async def closed_cb(self) -> None:
        logger.debug("NATS connection closed")


#: TLS errors that are a cut connection (an outage), not a refused handshake.
_TLS_CUT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


def _tls_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS handshake that failed for good: an untrusted
    certificate, a refused or missing client certificate, a protocol mismatch."""
    return isinstance(exc, ssl.SSLError) and not isinstance(exc, _TLS_CUT)


def _tls_failure(exc: ssl.SSLError) -> str:
    """What a failed TLS handshake means, for a message (never holds a secret)."""
    code: str | None = getattr(exc, "reason", None)
    reason = getattr(exc, "verify_message", None) or code or str(exc) or type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the server's certificate is not trusted (tls_ca): {reason}"
    if code == "WRONG_VERSION_NUMBER":
        return "the server did not answer in TLS (WRONG_VERSION_NUMBER)"
    if code == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return "the server requires a client certificate (tls_cert, tls_key)"
    if code is not None and "ALERT" in code:
        return f"the server refused the handshake or the client certificate: {reason}"
    return str(reason)


def _map_error(exc: BaseException, what: str, state: _State | None = None) -> BackendError:
    """The library's exception for ``exc``, raised by nats-py during ``what``.

    Args:
      exc: the exception nats-py (or the bridge) raised.
      what: the operation, for the message (never holds a secret).
      state: the connection's state, to tell a permission or authorization failure
        from a plain timeout or closed connection.

    Returns:
      :class:`~trio_debounce.RevisionConflict` for a failed compare-and-swap,
      :class:`~trio_debounce.BackendUnavailableError` when the server cannot be
      reached or did not answer, :class:`~trio_debounce.BackendAuthError` for a refused
      credential, permission or TLS handshake, :class:`~trio_debounce.BackendError`
      otherwise.
    """
    if isinstance(exc, BackendError):
        return exc
    secrets = () if state is None else state.secrets
    text = _redact(str(exc) or type(exc).__name__, secrets)
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or (
        isinstance(exc, nats.js.errors.APIError) and exc.err_code in _WRONG_LAST_SEQUENCE
    ):
        return RevisionConflict(f"{what}: the key's revision is not the expected one ({text})")
    lowered = text.lower()
    if isinstance(exc, nats.errors.AuthorizationError) or any(
        marker in lowered for marker in _AUTH_MARKERS
    ):
        return BackendAuthError(f"{what}: NATS refused the credentials ({text})")
    if _PERMISSION_MARKER in lowered or (
        isinstance(exc, nats.js.errors.APIError) and exc.code in (401, 403)
    ):
        return BackendAuthError(f"{what}: NATS denied a permission ({text})")
    if _tls_refused(exc):
        assert isinstance(exc, ssl.SSLError)
        return BackendAuthError(f"{what}: the TLS handshake failed: {_tls_failure(exc)}")
    unavailable = (
        nats.errors.NoServersError,
        nats.errors.ConnectionClosedError,
        nats.errors.TimeoutError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.StaleConnectionError,
        nats.errors.NoRespondersError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.ConnectionDrainingError,
        nats.errors.FlushTimeoutError,
        nats.js.errors.ServiceUnavailableError,
        nats.js.errors.NoStreamResponseError,
        asyncio.TimeoutError,
        TimeoutError,
        ConnectionError,
        *_TLS_CUT,
    )
    if isinstance(exc, unavailable):
        if state is not None and state.auth_failed:
            return BackendAuthError(f"{what}: NATS refused the credentials ({text})")
        if state is not None and state.tls_failure:
            return BackendAuthError(f"{what}: the TLS handshake failed: {state.tls_failure}")
        if isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError, TimeoutError)):
            text += "; it may have been applied"
        return BackendUnavailableError(f"{what}: NATS is unavailable ({text})")
    return BackendError(f"{what}: NATS failed ({type(exc).__name__}: {text})")


async def _run_cancellable(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """Await ``fn(*args, **kwargs)`` in its own asyncio task (asyncio side).

    When this coroutine is cancelled (the Trio side's deadline or cancel scope,
    forwarded by trio-asyncio), the task is cancelled, and cancelled again for up to
    :data:`_CANCEL_GRACE` seconds if nats-py swallowed the cancellation (some of its
    internals catch :exc:`asyncio.CancelledError`); then it is abandoned. So a
    cancelled call never waits for nats-py's own, longer timeouts.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(fn(*args, **kwargs))
    # Retrieve an abandoned task's exception, so asyncio does not log it.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _CANCEL_GRACE
        while not task.done() and loop.time() < give_up:
            task.cancel()
            await asyncio.wait({task}, timeout=0.05)
        raise


def _cancel_until_done(
    task: asyncio.Future[Any], give_up: float, abandon: Callable[[], None]
) -> None:
    """Cancel ``task``, and again every 0.05 s until it is done (nats-py swallows some
    cancellations); past ``give_up`` (the loop's clock), call ``abandon``. Asyncio side."""
    if task.done():
        return
    loop = task.get_loop()
    if loop.time() >= give_up:
        abandon()
        return
    task.cancel()
    loop.call_later(0.05, _cancel_until_done, task, give_up, abandon)


async def _cross(loop: asyncio.AbstractEventLoop, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Await ``fn(*args)`` on the asyncio side (Trio side): one asyncio task, whose
    done callback hands its outcome straight back to the waiting Trio task.

    A cancellation of the Trio side cancels the task, and again for up to
    :data:`_CANCEL_GRACE` seconds if nats-py swallowed the cancellation; then the task
    is abandoned (its outcome dropped) and the Trio side raises
    :exc:`trio.Cancelled`. So a cancelled call never waits for nats-py's own, longer
    timeouts.
    """
    task: asyncio.Future[T] = loop.create_task(fn(*args))  # type: ignore[arg-type]
    waiter = trio.lowlevel.current_task()
    raise_cancel: Callable[[], NoReturn] | None = None
    settled = False

    def settle(result: outcome.Outcome[T]) -> None:
        nonlocal settled
        if not settled:
            settled = True
            trio.lowlevel.reschedule(waiter, result)

    def done(finished: asyncio.Future[T]) -> None:
        if settled:
            if not finished.cancelled():
                finished.exception()  # retrieved, so asyncio does not log it
        elif raise_cancel is not None and finished.cancelled():
            settle(outcome.capture(raise_cancel))
        else:
            settle(outcome.capture(finished.result))

    def abandon() -> None:
        assert raise_cancel is not None
        settle(outcome.capture(raise_cancel))

    def abort(raise_cancel_arg: Callable[[], NoReturn]) -> trio.lowlevel.Abort:
        nonlocal raise_cancel
        raise_cancel = raise_cancel_arg
        _cancel_until_done(task, loop.time() + _CANCEL_GRACE, abandon)
        return trio.lowlevel.Abort.FAILED

    task.add_done_callback(done)
    result: T = await trio.lowlevel.wait_task_rescheduled(abort)
    return result


def _log_asyncio_error(
    secrets: tuple[str, ...], loop: asyncio.AbstractEventLoop, context: dict[str, Any]
) -> None:
    """The asyncio loop's exception handler (with ``secrets`` bound): nats-py's stray
    errors become log lines, without secrets."""
    exception = context.get("exception")
    detail = f" ({type(exception).__name__}: {exception})" if exception is not None else ""
    message = f"{context.get('message') or 'an error'}{detail}"
    logger.warning("asyncio reported: %s", _redact(message, secrets))


def _check_key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {key!r}")
    if not _VALID_KEY.match(key) or key.startswith(".") or key.endswith("."):
        raise ValueError(f"not a valid KV key: {key[:80]!r}")
    return key


class NatsKvWatch:
    """A live watch on the keys under one prefix, read from the Trio side.

    Made by :meth:`NatsKvStore.open_watch`. :meth:`receive_batch` delivers the latest
    entry of every key under the prefix as the watch opens (delete markers included),
    then one ``None`` (the end of those initial values), then every later write as the
    server stores it, in revision order. Behind it is a nats-py KV watch: an ephemeral
    ordered push consumer, with idle heartbeats and flow control.

    The watch is *interrupted* when it may have missed an update: at every disconnect
    and reconnect of the connection (a restarted server has lost the consumer), and
    when nats-py finds the consumer gone (two idle heartbeats missed, 10 s) or a
    message skipped (a slow consumer's drop). nats-py would then re-create the consumer
    after the last message it saw, silently, and miss any delete marker purged in the
    meantime; an interrupted watch instead drops what follows, and its owner should
    close it and open a new one (whose initial values are a fresh snapshot).
    """

    def __init__(self, prefix: str, loop: asyncio.AbstractEventLoop) -> None:
        self.prefix = prefix
        self._loop = loop
        self._interrupted = trio.Event()
        self._watcher: Any = None

    def __repr__(self) -> str:
        state = " interrupted" if self._interrupted.is_set() else ""
        return f"<NatsKvWatch {self.prefix!r}{state}>"

    @property
    def interrupted(self) -> bool:
        """Whether the watch may have missed an update (see the class)."""
        return self._interrupted.is_set()

    async def wait_interrupted(self) -> None:
        """Return when the watch is interrupted (at once if it is)."""
        await self._interrupted.wait()

    def _interrupt(self) -> None:
        if not self._interrupted.is_set():
            logger.debug("watch of %r interrupted", self.prefix)
        self._interrupted.set()

    async def receive_batch(self, max_entries: int = 512) -> list[KvEntry | None]:
        """Wait for the next updates and return them, oldest first.

        Returns at least one item and at most ``max_entries``: a :class:`KvEntry` per
        write (``value=None`` for a delete marker), and ``None`` for the end of the
        initial values (once per watch). Waits as long as nothing is written: bound it
        with a cancel scope; cancelling it loses nothing.

        Raises:
          BackendError: the watch was stopped.
        """
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        items: list[KvEntry | None] | None = await trio_asyncio.aio_as_trio(
            self._aio_batch, loop=self._loop
        )(max_entries)
        if items is None:
            raise BackendError(f"watch {self.prefix!r}: the watch was stopped")
        return items

    async def _aio_batch(self, max_entries: int) -> list[KvEntry | None] | None:
        queue = self._watcher._updates
        items: list[KvEntry | None] = []
        update = await queue.get()
        while True:
            if update is KeyValue.KeyWatcher.STOP_ITER:
                queue.put_nowait(update)  # every later call sees the end too
                return items or None
            if update is None:
                items.append(None)
            else:
                assert update.revision is not None
                marker = update.operation in (KV_DEL, KV_PURGE)
                value = None if marker else (update.value or b"")
                items.append(KvEntry(key=update.key, value=value, revision=update.revision))
            if len(items) >= max_entries:
                return items
            try:
                update = queue.get_nowait()
            except asyncio.QueueEmpty:
                return items


class NatsKvStore(KvStore):
    """A JetStream KV bucket with history 1, as a :class:`~trio_debounce._kv.KvStore`.

    Made by :func:`open_nats_store`, never directly. Every method is bounded by the
    config's ``op_timeout`` (seconds, Trio clock): a call that does not complete in
    time raises :class:`~trio_debounce.BackendUnavailableError` (and may still have
    been applied by the server). While the connection is down, writes fail at once
    instead of being queued for after the reconnect.
    """

    def __init__(
        self,
        *,
        config: NatsConfig,
        nc: Client,
        kv: KeyValue,
        api_prefix: str,
        max_value_bytes: int,
        created: float,
        state: _State,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._config = config
        #: The store's own trio-asyncio loop. Every call names it: a Trio task may
        #: have been spawned where another store's loop was current (the context a
        #: task inherits holds the loop opened last), and that loop may be closed.
        self._loop = loop
        self._nc = nc
        self._kv = kv
        self._stream = f"KV_{config.bucket}"
        self._subject_prefix = f"$KV.{config.bucket}."
        self._api_prefix = api_prefix
        #: For leader reads (:meth:`get_current`): each request waits a quarter of
        #: ``op_timeout``, and an unanswered one is sent again (no I/O here).
        self._leader_js = nc.jetstream(timeout=config.op_timeout / 4, prefix=api_prefix)
        self._state = state
        self.max_value_bytes = max_value_bytes
        self.created = created

    def __repr__(self) -> str:
        servers = ", ".join(_redact(url, self._state.secrets) for url in self._config.servers)
        return f"<NatsKvStore bucket={self._config.bucket!r} servers=[{servers}]>"

    async def _call(self, what: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the asyncio side, within ``op_timeout``; errors mapped.

        A request that no stream answered (:data:`_NO_STREAM`: during a JetStream leader
        election, for instance) was not applied, and is retried until ``op_timeout``.
        """
        timeout = self._config.op_timeout
        started = time.monotonic()
        unanswered: BaseException | None = None
        try:
            with trio.fail_after(timeout):
                pause = _NO_STREAM_RETRY
                while True:
                    try:
                        return await _cross(self._loop, fn, *args)
                    except _NO_STREAM as exc:
                        unanswered = exc
                    await trio.sleep(pause)
                    pause = min(2 * pause, _NO_STREAM_RETRY_MAX)
        except trio.TooSlowError:
            if self._state.permission_denied_at >= started:
                message = self._state.permission_message
                raise BackendAuthError(f"{what}: NATS denied a permission ({message})") from None
            if unanswered is not None:
                text = _redact(str(unanswered) or type(unanswered).__name__, self._state.secrets)
                raise BackendUnavailableError(
                    f"{what}: no JetStream stream answered within {timeout} s ({text})"
                ) from None
            raise BackendUnavailableError(
                f"{what}: NATS did not answer within {timeout} s; it may have been applied"
            ) from None
        except Exception as exc:
            error = _map_error(exc, what, self._state)
            if (
                isinstance(error, BackendUnavailableError)
                and self._state.permission_denied_at >= started
            ):
                error = BackendAuthError(
                    f"{what}: NATS denied a permission ({self._state.permission_message})"
                )
            raise error from exc

    @property
    def is_connected(self) -> bool:
        """Whether the connection to NATS is up right now (no I/O)."""
        return bool(self._nc.is_connected)

    async def wait_connected(self) -> None:
        """Return when the connection to NATS is up (after a checkpoint if it is).

        Waits as long as the server is away: bound it with a cancel scope.

        Raises:
          BackendUnavailableError: the connection is closed for good.
        """
        while True:
            changed = self._state.connection_changed
            if self._nc.is_closed:
                raise BackendUnavailableError("the NATS connection is closed")
            if self._nc.is_connected:
                await trio.lowlevel.checkpoint()
                return
            await changed.wait()

    @asynccontextmanager
    async def open_watch(self, prefix: str) -> AsyncIterator[NatsKvWatch]:
        """Watch the keys under ``prefix``; see :class:`NatsKvWatch`.

        Opening is bounded by ``op_timeout`` (it creates the server's consumer); the
        watch is stopped on exit, even when cancelled (shielded, at most
        ``op_timeout`` seconds).

        Raises:
          ValueError: ``prefix`` does not end with ``.``.
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        if not prefix.endswith(".") or prefix.startswith("."):
            raise ValueError(f"prefix must end with '.', got {prefix[:80]!r}")
        _check_key(prefix[:-1])
        watch = NatsKvWatch(prefix, self._loop)
        changed = self._state.connection_changed
        watch._watcher = await self._call(f"watch {prefix!r}", self._aio_watch, prefix, watch)
        self._state.watches.add(watch)
        if changed.is_set():  # the connection changed while the consumer was made
            watch._interrupt()
        try:
            yield watch
        finally:
            self._state.watches.discard(watch)
            with trio.CancelScope(shield=True), trio.move_on_after(self._config.op_timeout):
                await trio_asyncio.aio_as_trio(_stop_watcher, loop=self._loop)(watch._watcher)

    async def _aio_watch(self, prefix: str, watch: NatsKvWatch) -> Any:
        watcher = await self._kv.watch(
            prefix + ">",
            include_history=False,
            inactive_threshold=WATCH_INACTIVE_THRESHOLD,
        )
        # nats-py re-creates a lost ordered consumer after the last message it saw;
        # deletes whose markers were purged meanwhile would be missed. Interrupt the
        # watch instead (returning True drops the message that showed the gap).
        jsi = getattr(getattr(watcher._sub, "_sub", None), "_jsi", None)
        if jsi is not None:

            async def reset_ordered_consumer(sseq: int | None) -> bool:
                watch._interrupt()
                return True

            jsi.reset_ordered_consumer = reset_ordered_consumer
        return watcher

    async def get(self, key: str) -> KvEntry | None:
        """The latest entry of ``key``: a value, a delete marker (``value=None``), or
        None when the key has no entry.

        Raises:
          ValueError: ``key`` is not a valid KV key.
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        _check_key(key)
        return await self._call(f"get {key!r}", self._aio_get, key)

    async def _aio_get(self, key: str) -> KvEntry | None:
        try:
            entry = await self._kv.get(key)
        except nats.js.errors.KeyNotFoundError as exc:
            marker = exc.entry
            if marker is not None and exc.op in (KV_DEL, KV_PURGE):
                assert marker.revision is not None
                return KvEntry(key=key, value=None, revision=marker.revision)
            return None
        assert entry.revision is not None
        return KvEntry(key=key, value=entry.value or b"", revision=entry.revision)

    async def get_current(self, key: str) -> KvEntry | None:
        """:meth:`get`, answered by the stream leader (``STREAM.MSG.GET``, not a direct
        get): never a replica that lags the acknowledged writes.

        :meth:`get` is a direct get (the bucket allows them), which any replica of the
        stream may answer, with the entry it has applied so far. The protocol reads a
        process's lease through this method before it counts the process as dead.
        During a stream leader election it is retried within ``op_timeout``: a request
        that finds no responder, as every call's, and also one left unanswered for
        ``op_timeout / 4`` (one that reached a leader that has just died).

        Raises:
          ValueError: ``key`` is not a valid KV key.
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        _check_key(key)
        return await self._call(f"get {key!r} from the leader", self._aio_get_current, key)

    async def _aio_get_current(self, key: str) -> KvEntry | None:
        # A request that reached a leader that has just died is never answered, and
        # the election takes seconds: a read is safe to send again, so each request
        # waits op_timeout / 4 and an unanswered one is repeated, until the Trio
        # side's op_timeout cancels this task.
        while True:
            try:
                msg = await self._leader_js.get_msg(
                    self._stream, subject=self._subject_prefix + key, direct=False
                )
                break
            except nats.errors.TimeoutError:
                continue
            except nats.js.errors.NotFoundError as exc:
                if exc.err_code == _NO_MESSAGE:
                    return None
                raise
        assert msg.seq is not None
        if (msg.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE):
            return KvEntry(key=key, value=None, revision=msg.seq)
        return KvEntry(key=key, value=msg.data or b"", revision=msg.seq)

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        """Write ``value`` if the key's latest revision is ``last`` (0: no entry at all).

        One JetStream publish with ``Nats-Expected-Last-Subject-Sequence: <last>``, so
        ``last`` may be a delete marker's revision, and ``last=0`` fails when a marker
        exists.

        Returns:
          int: the new revision.

        Raises:
          DocumentTooLargeError: ``value`` is longer than :attr:`max_value_bytes`
            (nothing was sent).
          RevisionConflict: ``last`` is not the latest revision.
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        _check_key(key)
        value = bytes(value)
        if len(value) > self.max_value_bytes:
            raise DocumentTooLargeError(
                f"value of {len(value)} bytes for {key[:80]!r} exceeds the "
                f"{self.max_value_bytes} bytes the NATS server accepts"
            )
        if last < 0:
            raise ValueError(f"last must be >= 0, got {last!r}")
        return await self._call(f"put {key!r}", self._kv.update, key, value, last)

    async def delete(self, key: str, *, last: int) -> int:
        """Leave a delete marker on ``key`` if its latest revision is ``last``.

        Returns:
          int: the marker's revision.

        Raises:
          RevisionConflict: ``last`` is not the latest revision.
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        _check_key(key)
        if last < 0:
            raise ValueError(f"last must be >= 0, got {last!r}")
        return await self._call(f"delete {key!r}", self._aio_delete, key, last)

    async def _aio_delete(self, key: str, last: int) -> int:
        # Not kv.delete(): it returns True instead of the marker's revision.
        headers = {KV_OP: KV_DEL, api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)}
        ack = await self._kv._js.publish(self._subject_prefix + key, b"", headers=headers)
        return ack.seq

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        """Remove the delete marker ``revision`` of ``key`` if it is still the latest.

        One stream purge filtered on the key's subject, of the messages with a
        sequence below ``revision + 1``: an entry written after the marker survives.
        In a history-1 bucket such an entry has already replaced the marker, so the
        purge then removes nothing.

        Returns:
          bool: True if the marker was removed; False if the key had moved on or the
          marker was already gone.

        Raises:
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        _check_key(key)
        if revision <= 0:
            raise ValueError(f"revision must be > 0, got {revision!r}")
        purged = await self._call(f"purge marker of {key!r}", self._aio_purge, key, revision)
        return purged > 0

    async def purge(self, key: str, *, last: int) -> bool:
        """Remove ``key``'s entry if its latest revision is ``last``, leaving no marker:
        one stream purge filtered on the key's subject, of the messages with a
        sequence up to ``last`` (see :meth:`purge_marker`; in a history-1 bucket a
        later entry has replaced entry ``last``, and the purge removes nothing).

        Returns:
          bool: True if the entry was removed; False if the key had moved on or was
          gone.

        Raises:
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        _check_key(key)
        if last <= 0:
            raise ValueError(f"last must be > 0, got {last!r}")
        purged = await self._call(f"purge of {key!r}", self._aio_purge, key, last)
        return purged > 0

    async def _aio_purge(self, key: str, revision: int) -> int:
        # Not js.purge_stream(): it drops the "purged" count we need.
        request = json.dumps({"filter": self._subject_prefix + key, "seq": revision + 1})
        msg = await self._nc.request(
            f"{self._api_prefix}.STREAM.PURGE.{self._stream}",
            request.encode(),
            timeout=self._config.op_timeout,
        )
        response = json.loads(msg.data)
        if "error" in response:
            nats.js.errors.APIError.from_error(response["error"])
        purged: int = response.get("purged", 0)
        return purged

    async def entries(self, prefix: str) -> list[KvEntry]:
        """The latest entry of every key under ``prefix`` (delete markers included).

        Reads them with an ephemeral ordered consumer (a KV watch delivering the last
        message per subject) until its initial values are exhausted.

        Raises:
          ValueError: ``prefix`` does not end with ``.``.
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        if not prefix.endswith(".") or prefix.startswith("."):
            raise ValueError(f"prefix must end with '.', got {prefix[:80]!r}")
        _check_key(prefix[:-1])
        return await self._call(f"list {prefix!r}", self._aio_entries, prefix)

    async def _aio_entries(self, prefix: str) -> list[KvEntry]:
        watcher = await self._kv.watch(
            prefix + ">",
            include_history=False,
            inactive_threshold=max(5.0, 2 * self._config.op_timeout),
        )
        try:
            found: list[KvEntry] = []
            async for update in watcher:
                if update is None:  # nats-py's end of the initial values
                    break
                assert update.revision is not None
                marker = update.operation in (KV_DEL, KV_PURGE)
                value = None if marker else (update.value or b"")
                found.append(KvEntry(key=update.key, value=value, revision=update.revision))
            return found
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]


async def _stop_watcher(watcher: Any) -> None:
    """Stop a nats-py KV watcher (asyncio side); errors only logged."""
    try:
        await watcher.stop()
    except Exception as exc:
        logger.debug("stopping a NATS watch failed: %s", type(exc).__name__)


def _tls_context(config: NatsConfig) -> ssl.SSLContext | None:
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


def _secrets(config: NatsConfig) -> tuple[str, ...]:
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


def _check_credential_files(config: NatsConfig) -> None:
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


def _connect_options(config: NatsConfig, state: _State) -> dict[str, Any]:
    _check_credential_files(config)
    options: dict[str, Any] = {
        "servers": list(config.servers),
        "error_cb": state.error_cb,
        "disconnected_cb": state.disconnected_cb,
        "reconnected_cb": state.reconnected_cb,
        "closed_cb": state.closed_cb,
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
    tls = _tls_context(config)
    if tls is not None:
        options["tls"] = tls
    if config.inbox_prefix is not None:
        options["inbox_prefix"] = config.inbox_prefix
    return options


def _wants_tls(config: NatsConfig) -> bool:
    """Whether the config asks for TLS: a ``tls://`` URL, TLS files or handshake-first."""
    return (
        any(url.startswith("tls://") for url in config.servers)
        or config.tls_ca is not None
        or config.tls_cert is not None
        or config.tls_handshake_first
    )


def _uses_tls(nc: Client) -> bool:
    """Whether ``nc``'s connection runs over TLS right now (a TCP connection's socket
    is wrapped; a websocket is not checked: ``wss://`` is TLS by its scheme)."""
    writer = getattr(nc._transport, "_io_writer", None)
    if writer is None:
        return True
    return writer.get_extra_info("ssl_object") is not None


def _api_prefix(config: NatsConfig) -> str:
    if config.js_domain is not None:
        return f"$JS.{config.js_domain}.API"
    if config.js_api_prefix is not None:
        return config.js_api_prefix.rstrip(".")
    return api.DEFAULT_PREFIX


def _validate_bucket(config: NatsConfig, info: api.StreamInfo) -> None:
    stream = info.config
    bucket = config.bucket
    if stream.max_msgs_per_subject != 1:
        raise BackendConfigError(
            f"KV bucket {bucket!r} keeps history {stream.max_msgs_per_subject}; "
            "trio_debounce needs history 1"
        )
    if stream.max_age:
        raise BackendConfigError(
            f"KV bucket {bucket!r} expires entries (TTL / max age {stream.max_age} s); "
            "trio_debounce needs no TTL"
        )


#: JetStream API error codes of a cluster that is starting, electing or placing a
#: stream: ``no suitable peers for placement`` (10005: the meta leader has not heard
#: from enough peers yet), ``JetStream system temporarily unavailable`` (10008),
#: ``JetStream cluster can not handle request`` (10009: no meta leader),
#: ``JetStream cluster not assigned to this server`` (10007), ``insufficient
#: resources`` (10023), ``stream is offline`` (10118). Opening a bucket retries them.
_TRANSIENT_API_CODES = frozenset({10005, 10007, 10008, 10009, 10023, 10118})

#: ``stream name already in use with a different configuration``: another process
#: created the bucket first, with other settings (the stream info shows them).
_STREAM_NAME_IN_USE = 10058


def _transient_open_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a bucket request, may pass if the request is retried:
    no answer (timeout, no responders), a 503, or a cluster that is not ready
    (:data:`_TRANSIENT_API_CODES`)."""
    if isinstance(exc, (*_NO_STREAM, nats.errors.TimeoutError, asyncio.TimeoutError)):
        return True
    return isinstance(exc, nats.js.errors.APIError) and (
        exc.code == 503 or exc.err_code in _TRANSIENT_API_CODES
    )


async def _open_bucket(
    config: NatsConfig, nc: Client, state: _State, loop: asyncio.AbstractEventLoop
) -> tuple[KeyValue, api.StreamInfo]:
    """Bind (and create, if allowed and absent) the bucket, within ``2 * op_timeout``
    seconds (Trio clock); Trio side.

    A JetStream cluster answers a bucket request it cannot serve yet with an error
    that passes: right after start-up the meta leader may not know enough peers to
    place three replicas, a stream just created may be "not found" by a server that
    has not applied its assignment, and a stream or meta leader election leaves
    requests unanswered. Such requests (:func:`_transient_open_error`, and "stream not
    found" after a create) are retried, every :data:`_NO_STREAM_RETRY` seconds at
    first, doubling up to :data:`_NO_STREAM_RETRY_MAX`; creating is idempotent (the
    same settings again succeed), so a create whose answer was lost is sent again.
    Each request waits at most ``op_timeout / 4`` for its answer: one sent during an
    election is never answered, and the next, sent after it, may be.

    Raises:
      BackendUnavailableError: the bucket did not open within the bound (the message
        holds the last answer).
      BackendConfigError: the bucket is absent and ``create_bucket`` is False, the
        server refused to create it for good, or it has settings we cannot work with.
      BackendAuthError: a permission the open needs was denied (at once).
      BackendError: any other failure.
    """
    what = f"open bucket {config.bucket!r}"
    bound = 2 * config.op_timeout
    js = nc.jetstream(
        timeout=config.op_timeout, domain=config.js_domain, prefix=_api_prefix(config)
    )
    # A request sent while a leader is being elected is never answered: each open
    # request waits a quarter of op_timeout, so several fit in the bound.
    open_js = nc.jetstream(
        timeout=config.op_timeout / 4, domain=config.js_domain, prefix=_api_prefix(config)
    )
    stream = f"KV_{config.bucket}"
    started = time.monotonic()
    last: BaseException | None = None
    attempts = 0

    async def request(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        result: T = await trio_asyncio.aio_as_trio(_run_cancellable, loop=loop)(fn, *args, **kwargs)
        return result

    with trio.move_on_after(bound):
        pause = _NO_STREAM_RETRY
        while True:
            attempts += 1
            try:
                try:
                    info = await request(open_js.stream_info, stream)
                except nats.js.errors.NotFoundError as exc:
                    if not config.create_bucket:
                        raise BackendConfigError(
                            f"KV bucket {config.bucket!r} does not exist and create_bucket "
                            "is False: create it (history 1, no TTL) or allow the backend to"
                        ) from None
                    if attempts > 1:  # created (or being created) but not found yet
                        last = exc
                    try:
                        await request(
                            open_js.create_key_value,
                            bucket=config.bucket,
                            history=1,
                            ttl=None,
                            storage=api.StorageType.FILE,
                            replicas=config.replicas,
                            direct=True,
                        )
                    except nats.js.errors.APIError as refused:
                        if refused.err_code == _STREAM_NAME_IN_USE:
                            pass  # created by another process: the stream info tells
                        elif _transient_open_error(refused) or refused.code in (401, 403):
                            raise
                        else:  # e.g. replicas > 1 on a server that is not clustered
                            text = _redact(str(refused), state.secrets)
                            raise BackendConfigError(
                                f"{what}: NATS refused to create the bucket with "
                                f"{config.replicas} replica(s) ({text})"
                            ) from None
                    info = await request(open_js.stream_info, stream)
            except Exception as exc:
                if state.permission_denied_at >= started:
                    raise BackendAuthError(
                        f"{what}: NATS denied a permission ({state.permission_message})"
                    ) from exc
                if not (
                    _transient_open_error(exc) or isinstance(exc, nats.js.errors.NotFoundError)
                ):
                    raise _map_error(exc, what, state) from exc
                last = exc
                logger.debug(
                    "%s: retrying a transient answer (%s)",
                    what,
                    _redact(str(exc) or type(exc).__name__, state.secrets),
                )
            else:
                _validate_bucket(config, info)
                kv = KeyValue(
                    name=config.bucket,
                    stream=stream,
                    pre=f"$KV.{config.bucket}.",
                    js=js,
                    direct=bool(info.config.allow_direct),
                )
                return kv, info
            await trio.sleep(pause)
            pause = min(2 * pause, _NO_STREAM_RETRY_MAX)
    if state.permission_denied_at >= started:
        raise BackendAuthError(f"{what}: NATS denied a permission ({state.permission_message})")
    answer = (
        "no answer" if last is None else _redact(str(last) or type(last).__name__, state.secrets)
    )
    raise BackendUnavailableError(
        f"{what}: JetStream did not serve the bucket within {bound} s ({attempts} "
        f"attempt(s); last: {answer})"
    )


@asynccontextmanager
async def open_nats_store(config: NatsConfig) -> AsyncIterator[NatsKvStore]:
    """Connect to NATS and open the config's KV bucket, as a :class:`NatsKvStore`.

    Opens a private trio-asyncio loop and one nats-py connection that reconnects
    forever, creates the bucket if it is absent and ``config.create_bucket`` (history
    1, file storage, ``config.replicas``, no TTL), or binds it and checks its settings.
    On exit the connection is drained and closed, even when cancelled (shielded, for
    at most about ``2 * config.op_timeout`` seconds).

    Args:
      config (NatsConfig): servers, credentials, bucket and timeouts.

    Raises:
      BackendUnavailableError: no server answered within ``config.connect_timeout``
        seconds (Trio clock), or a bucket request timed out.
      BackendAuthError: the server refused the credentials or the TLS handshake failed
        for good (raised at once, without waiting for the timeout), TLS was asked for
        and the server did not start it, or a permission the backend needs was
        refused.
      BackendConfigError: the bucket is missing and ``create_bucket`` is False, it
        keeps history or expires entries, or a credential or TLS file is unusable.
      BackendError: any other failure of the server or client.
    """
    state = _State(secrets=_secrets(config))
    options = _connect_options(config, state)
    # trio-asyncio's loop runs its tasks in nurseries, so an exception that crosses
    # open_loop() comes out wrapped in an ExceptionGroup. Errors (ours and the ones
    # the caller's block raises) are carried across it instead and re-raised as they
    # are; Cancelled and KeyboardInterrupt still pass through (a cancel scope unwraps
    # a group of Cancelled).
    error: BaseException | None = None
    async with trio_asyncio.open_loop() as loop:
        # trio-asyncio's default handler re-raises whatever asyncio reports, which
        # would take the whole backend (and its coordinator) down for nats-py's own
        # leftovers, such as "Task was destroyed but it is pending!" for a watcher
        # subscription whose listing was cancelled. Log them instead.
        loop.set_exception_handler(functools.partial(_log_asyncio_error, state.secrets))
        nc = Client()
        try:
            with trio.move_on_after(config.connect_timeout) as scope:
                state.connect_scope = scope
                try:
                    await trio_asyncio.aio_as_trio(_run_cancellable, loop=loop)(
                        nc.connect, **options
                    )
                except Exception as exc:
                    raise _map_error(exc, "connect", state) from exc
            state.connect_scope = None
            if state.auth_failed:
                raise BackendAuthError("connect: NATS refused the credentials")
            if state.tls_failure:
                raise BackendAuthError(f"connect: the TLS handshake failed: {state.tls_failure}")
            if scope.cancelled_caught:
                servers = ", ".join(_redact(url, state.secrets) for url in config.servers)
                raise BackendUnavailableError(
                    f"connect: no NATS server answered within {config.connect_timeout} s "
                    f"(tried {servers})"
                )
            if _wants_tls(config) and not _uses_tls(nc):
                raise BackendAuthError(
                    "connect: the config asks for TLS (a tls:// URL or TLS files) but the "
                    "server did not start TLS; refusing a plaintext connection"
                )
            kv, info = await _open_bucket(config, nc, state, loop)
            limit = nc.max_payload
            max_msg_size = info.config.max_msg_size
            if max_msg_size is not None and max_msg_size > 0:
                limit = min(limit, max_msg_size)
            yield NatsKvStore(
                config=config,
                nc=nc,
                kv=kv,
                api_prefix=_api_prefix(config),
                max_value_bytes=limit - HEADROOM,
                created=info.created.timestamp() if info.created is not None else 0.0,
                state=state,
                loop=loop,
            )
        except trio.Cancelled:
            raise
        except BaseException as exc:
            error = exc
        finally:
            state.connect_scope = None
            state.closing = True
            with trio.CancelScope(shield=True), trio.move_on_after(config.op_timeout * 2):
                await trio_asyncio.aio_as_trio(_shutdown, loop=loop)(nc, config.op_timeout)
    if error is not None:
        raise error


async def _shutdown(nc: Client, seconds: float) -> None:
    """Drain (if connected) and close ``nc``, within about ``seconds``; asyncio side."""
    try:
        if nc.is_connected and not nc.is_draining:
            await asyncio.wait_for(nc.drain(), seconds)
    except Exception as exc:
        logger.debug("NATS drain failed: %s", type(exc).__name__)
    finally:
        if not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), seconds)
            except Exception as exc:
                logger.debug("NATS close failed: %s", type(exc).__name__)
        # A connect attempt cancelled inside nats-py's own cleanup (start-up timeout,
        # refused credentials) can leave the client marked closed with its socket
        # open; close the socket in any case (idempotent).
        transport = nc._transport
        if transport is not None:
            transport.close()  # type: ignore[no-untyped-call]
            # After a failed TLS upgrade the stream never reports its close (and
            # may report the wait's end as asyncio's CancelledError, not an
            # Exception): wait briefly, the socket is closed either way.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(
                    transport.wait_closed(),  # type: ignore[no-untyped-call]
                    min(seconds, _CLOSE_WAIT),
                )
