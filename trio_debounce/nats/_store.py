"""The NATS JetStream KV implementation of :class:`~trio_debounce._kv.KvStore`.

nats-py is an asyncio library; :func:`open_nats_store` starts a private asyncio loop
for it on a host (``_bridge``: a thread of its own, or trio-asyncio), connects
(``_connection``) and opens the bucket (``_bucket``). Every store operation crosses
the bridge once (:func:`~trio_debounce.nats._bridge.cross`) under a Trio-side
deadline, and nats-py's exceptions are mapped at this boundary
(:func:`~trio_debounce.nats._errors.map_error`) onto the library's own
(:mod:`trio_debounce._errors`), so none escapes.

nats-py's connection callbacks are handed over to Trio's side, where they only log to
the ``trio_debounce.nats`` logger, set plain state that the store reads, and set Trio
events (an open :class:`NatsKvWatch` is interrupted by every disconnect and reconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import trio
from nats.aio.client import Client
from nats.js import api
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from .._errors import (
    BackendAuthError,
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
)
from .._kv import KvEntry, KvStore, KvWatch
from ._bridge import Host, cross, log_asyncio_error, shutdown, stop_watcher
from ._bucket import api_prefix, open_bucket
from ._config import NatsConfig
from ._connection import NatsClient, State, connect, secrets_of
from ._errors import (
    NO_MESSAGE,
    NO_STREAM,
    NO_STREAM_RETRY,
    NO_STREAM_RETRY_MAX,
    map_error,
    redact,
)
from ._hosts import open_host

logger = logging.getLogger("trio_debounce.nats")

T = TypeVar("T")

#: Bytes kept free under the server's max payload for the headers nats-py adds to a
#: write (``NATS/1.0``, ``Nats-Expected-Last-Subject-Sequence: <20 digits>``, about
#: 70 bytes) and a safety margin.
HEADROOM = 1024 + 128

_VALID_KEY = re.compile(r"\A[-/_=.A-Za-z0-9]+\Z")

#: Seconds without a subscriber after which the server deletes a watch's ephemeral
#: consumer (one left behind by a watch stopped while disconnected, for instance).
WATCH_INACTIVE_THRESHOLD = 30.0


def _check_key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {key!r}")
    if not _VALID_KEY.match(key) or key.startswith(".") or key.endswith("."):
        raise ValueError(f"not a valid KV key: {key[:80]!r}")
    return key


class NatsKvWatch(KvWatch):
    """A live watch on the keys under one prefix (``""``: every key), read from the
    Trio side: the NATS :class:`~trio_debounce.abc.KvWatch`.

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

    def __init__(self, prefix: str, host: Host) -> None:
        self.prefix = prefix
        self._host = host
        self._interrupted = trio.Event()
        self._watcher: Any = None
        #: Values to deliver before the end of the initial ones, when nats-py marked
        #: that end too early (see NatsKvStore._aio_watch); None otherwise.
        self._initial_left: int | None = None
        self._end_due = False

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
        items = await cross(self._host, self._aio_batch, max_entries)
        if items is None:
            raise BackendError(f"watch {self.prefix!r}: the watch was stopped")
        return items

    async def _aio_batch(self, max_entries: int) -> list[KvEntry | None] | None:
        if self._end_due:
            self._end_due = False
            return [None]
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
                if self._initial_left is not None:
                    self._initial_left -= 1
                    if self._initial_left == 0:
                        self._initial_left = None
                        if len(items) >= max_entries:
                            self._end_due = True
                            return items
                        items.append(None)
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
        state: State,
        host: Host,
    ) -> None:
        self._config = config
        #: The store's own asyncio host. Every call names it: a Trio task may have
        #: been spawned where another store's loop was current (with trio-asyncio, the
        #: context a task inherits holds the loop opened last), and that loop may be
        #: closed.
        self._host = host
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
        servers = ", ".join(redact(url, self._state.secrets) for url in self._config.servers)
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
                pause = NO_STREAM_RETRY
                while True:
                    try:
                        return await cross(self._host, fn, *args)
                    except NO_STREAM as exc:
                        unanswered = exc
                    await trio.sleep(pause)
                    pause = min(2 * pause, NO_STREAM_RETRY_MAX)
        except trio.TooSlowError:
            if self._state.permission_denied_at >= started:
                message = self._state.permission_message
                raise BackendAuthError(f"{what}: NATS denied a permission ({message})") from None
            if unanswered is not None:
                text = redact(str(unanswered) or type(unanswered).__name__, self._state.secrets)
                raise BackendUnavailableError(
                    f"{what}: no JetStream stream answered within {timeout} s ({text})"
                ) from None
            raise BackendUnavailableError(
                f"{what}: NATS did not answer within {timeout} s; it may have been applied"
            ) from None
        except Exception as exc:
            error = map_error(exc, what, self._state)
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
        """Watch the keys under ``prefix`` (``""``: every key of the bucket); see
        :class:`NatsKvWatch`.

        Opening is bounded by ``op_timeout`` (it creates the server's consumer); the
        watch is stopped on exit, even when cancelled (shielded, at most
        ``op_timeout`` seconds).

        Raises:
          ValueError: ``prefix`` is not ``""`` and does not end with ``.``.
          BackendUnavailableError, BackendAuthError, BackendError: see the module.
        """
        if prefix:
            if not prefix.endswith(".") or prefix.startswith("."):
                raise ValueError(f"prefix must end with '.', got {prefix[:80]!r}")
            _check_key(prefix[:-1])
        watch = NatsKvWatch(prefix, self._host)
        changed = self._state.connection_changed
        watch._watcher = await self._call(f"watch {prefix!r}", self._aio_watch, prefix, watch)
        self._state.watches.add(watch)
        if changed.is_set():  # the connection changed while the consumer was made
            watch._interrupt()
        try:
            yield watch
        finally:
            self._state.watches.discard(watch)
            await stop_watcher(self._host, watch._watcher, self._config.op_timeout)

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
                self._host.to_trio(watch._interrupt)
                return True

            jsi.reset_ordered_consumer = reset_ordered_consumer
        if watcher._init_done:
            # nats-py ended the initial values before any came (nothing can have come
            # since: its handler waits for the watch's set-up): the consumer's info
            # showed nothing pending and nothing received, which is also the case while
            # the initial values are in flight to this client (a loaded machine). The
            # end is put back after as many values as the server says it delivered.
            subscription = watcher._sub
            assert subscription is not None  # set by watch()
            try:
                info = await subscription.consumer_info()
            except BaseException:
                await watcher.stop()  # type: ignore[no-untyped-call]
                raise
            if info.delivered.consumer_seq:
                assert watcher._updates.get_nowait() is None
                watch._initial_left = info.delivered.consumer_seq
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
                if exc.err_code == NO_MESSAGE:
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
            found: dict[str, KvEntry] = {}

            def add(update: Any) -> None:
                assert update.revision is not None
                marker = update.operation in (KV_DEL, KV_PURGE)
                value = None if marker else (update.value or b"")
                known = found.get(update.key)
                if known is None or known.revision < update.revision:
                    found[update.key] = KvEntry(update.key, value, update.revision)

            async for update in watcher:
                if update is None:  # nats-py's end of the initial values
                    break
                add(update)
            if not found:
                # nats-py marks the end before any value when the consumer's info shows
                # nothing pending and nothing received, which is also the case while
                # the initial values are in flight to this client (a loaded machine):
                # read as many values as the server says it has delivered.
                subscription = watcher._sub
                assert subscription is not None  # set by watch()
                info = await subscription.consumer_info()
                values = 0
                while values < info.delivered.consumer_seq:
                    update = await watcher.updates(  # type: ignore[no-untyped-call]
                        timeout=self._config.op_timeout
                    )
                    if update is not None:
                        values += 1
                        add(update)
            return list(found.values())
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]


@asynccontextmanager
async def open_nats_store(config: NatsConfig) -> AsyncIterator[NatsKvStore]:
    """Connect to NATS and open the config's KV bucket, as a :class:`NatsKvStore`.

    Starts a private asyncio loop on the host ``config.asyncio_host`` names (see
    :doc:`/nats`, *The asyncio host*) and one nats-py connection that reconnects
    forever, creates the bucket if it is absent and ``config.create_bucket`` (history
    1, file storage, ``config.replicas``, no TTL), or binds it and checks its settings.
    On exit the connection is drained and closed, even when cancelled (shielded, for
    at most about ``2 * config.op_timeout`` seconds), and the loop is stopped (its
    thread, if any, joined).

    Args:
      config (NatsConfig): servers, credentials, bucket, timeouts and host.

    Raises:
      BackendUnavailableError: no server answered within ``config.connect_timeout``
        seconds (Trio clock), or a bucket request timed out.
      BackendAuthError: the server refused the credentials or the TLS handshake failed
        for good (raised at once, without waiting for the timeout), TLS was asked for
        and the server did not start it, or a permission the backend needs was
        refused.
      BackendConfigError: the bucket is missing and ``create_bucket`` is False, it
        keeps history or expires entries, a credential or TLS file is unusable, or
        ``asyncio_host="trio-asyncio"`` and trio-asyncio cannot be imported.
      BackendError: any other failure of the server or client.
    """
    state = State(secrets=secrets_of(config))
    # trio-asyncio's loop runs its tasks in nurseries, so an exception that crosses
    # its host comes out wrapped in an ExceptionGroup. Errors (ours and the ones the
    # caller's block raises) are carried across it instead and re-raised as they are;
    # Cancelled and KeyboardInterrupt still pass through (a cancel scope unwraps a
    # group of Cancelled).
    error: BaseException | None = None
    async with open_host(config.asyncio_host, state.secrets) as host:
        nc = NatsClient()
        try:
            await connect(config, state, host, nc)
            kv, info = await open_bucket(config, nc, state, host)
            limit = nc.max_payload
            max_msg_size = info.config.max_msg_size
            if max_msg_size is not None and max_msg_size > 0:
                limit = min(limit, max_msg_size)
            yield NatsKvStore(
                config=config,
                nc=nc,
                kv=kv,
                api_prefix=api_prefix(config),
                max_value_bytes=limit - HEADROOM,
                created=info.created.timestamp() if info.created is not None else 0.0,
                state=state,
                host=host,
            )
        except trio.Cancelled:
            raise
        except BaseException as exc:
            error = exc
        finally:
            state.connect_scope = None
            state.closing = True
            await shutdown(host, nc, config.op_timeout)
    if error is not None:
        raise error


# The private names the tests import from this module (they predate the split).
_State = State
_map_error = map_error
_redact = redact
_secrets = secrets_of
_log_asyncio_error = log_asyncio_error
