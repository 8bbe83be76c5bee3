"""``open_nats_run_store``: deferred runs on a NATS JetStream KV bucket.

:class:`NatsKvRunStore` is a :class:`~trio_debounce._run_kv.KvRunStore` over a
:class:`~trio_debounce.nats._store.NatsKvStore`: runs are documents at ``r.<id>``,
process leases at ``rl.<id>``, in the bucket of the debounce windows
(``config.bucket``; windows use ``w.``, ``f.`` and ``p.``, so the kinds never collide).
Every write is the KvRunStore's compare-and-swap on the key's revision (one JetStream
publish with ``Nats-Expected-Last-Subject-Sequence``).

The index
---------

Listing a bucket costs an ephemeral consumer and one message per key, so no call
lists it: :meth:`~NatsKvRunStore.list_runs` and :meth:`~NatsKvRunStore.list_leases`
are served from an in-memory index of the ``r.`` and ``rl.`` entries (one per prefix),
without I/O. Each index is fed by a KV watch (:meth:`NatsKvStore.open_watch
<trio_debounce.nats._store.NatsKvStore.open_watch>`: an ordered push consumer
delivering the latest entry of every key, then every later write), kept by a
background task of the store's nursery for the life of the store:

* **Revision order.** Every update is applied by revision: an entry replaces the
  index's only if its revision is higher (a delete at the same revision wins), so a
  late or duplicated message never overwrites a newer record. A deleted key keeps a
  small tombstone for :data:`TOMBSTONE_TTL` seconds so that a late message cannot
  resurrect it.
* **Read your writes.** The store's own successful writes and deletes, and every
  record it reads (:meth:`get_run`, :meth:`get_lease`), are applied at once, by the
  same rule.
* **Rebuilds.** A watch is *interrupted* by every disconnect and reconnect of the
  connection (a restarted server has lost its consumer) and when nats-py finds its
  consumer gone (two idle heartbeats missed: 10 s) or a message skipped. The index
  then stops answering (lists wait up to ``op_timeout`` for it, then raise
  :exc:`~trio_debounce.BackendUnavailableError`), and the task opens a new watch once
  connected and loads its snapshot into a fresh index, which replaces the old one
  (the store's own writes made meanwhile are applied to both). A watch that fails
  (a request that times out, the server refusing it) is logged as a warning and
  retried with exponential backoff (:data:`RETRY_MIN` to :data:`RETRY_MAX` seconds).
* **Lost deletes.** A delete marker that another process purges before the watch
  delivers it (a consumer lagging behind a burst) would leave a stale record in the
  index. A compare-and-swap of this store that loses against an index entry of the
  revision it named re-reads the key and repairs the entry, and the whole index is
  rebuilt every ``resync_interval`` seconds (:data:`RESYNC_INTERVAL`) in any case;
  during that rebuild the old index keeps answering, without others' writes until
  the new snapshot is loaded.

Staleness bound: the store's own writes, none. Others' writes: the server's push
latency (milliseconds) while the watch is live. When the connection drops, lists fail
as soon as the client notices (at once for a closed socket; up to two client pings,
``2 * config.ping_interval`` seconds, for a server that stopped answering); a consumer
lost without a disconnect goes unnoticed for up to 10 s. Lost deletes: until a
compare-and-swap trips on them, at most ``resync_interval``.

Memory: per run, one index slot holding the decoded :class:`StoredRun` (its payload
included): about the size of its document plus 1 KB of Python objects; per lease,
about 500 bytes; per deleted key, a tombstone of about 200 bytes for
:data:`TOMBSTONE_TTL` seconds. A list costs O(n log n) in the runs held, no I/O.

The index is a view, never an authority: every decision a scheduler takes from a
listing (claim, start, take over, clean up) is a compare-and-swap against the revision
it listed, which fails if the record changed, so a stale index costs a lost write,
never a wrong one.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from .._errors import BackendError, BackendUnavailableError, RevisionConflict
from .._keys import RUN_LEASE_PREFIX, RUN_PREFIX, parse_prefixed_key
from .._kv import KvEntry, KvStore
from .._runs._kv_store import KvRunStore, decode_lease, decode_run, matches
from .._runs._store import ANY, Lease, RunState, StoredRun, _Any
from ._config import NatsConfig
from ._store import NatsKvStore, NatsKvWatch, open_nats_store

logger = logging.getLogger("trio_debounce.nats")

#: Seconds between two full rebuilds of the index (the bound on a lost delete).
RESYNC_INTERVAL = 300.0

#: Seconds a deleted key keeps its tombstone in the index.
TOMBSTONE_TTL = 60.0

#: Seconds before the first retry of a failed watch; doubled up to :data:`RETRY_MAX`.
RETRY_MIN = 0.5
RETRY_MAX = 15.0

#: Updates taken across the asyncio bridge at once.
_BATCH = 512


@dataclass(frozen=True, slots=True)
class NatsRunStoreStatistics:
    """What :meth:`NatsKvRunStore.statistics` returns.

    Attributes:
      runs (int): runs in the index (tombstones of finished runs included).
      leases (int): leases in the index.
      in_sync (bool): both indexes follow a live watch.
      rebuilds (int): snapshots loaded so far, both indexes (2 after opening).
    """

    runs: int
    leases: int
    in_sync: bool
    rebuilds: int


@dataclass(slots=True)
class _Slot:
    """One key's latest known entry: a record, or a delete (``record=None``)."""

    revision: int
    deleted: bool
    record: StoredRun | Lease | None

    def newer_than(self, other: _Slot) -> bool:
        return (self.revision, self.deleted) > (other.revision, other.deleted)


class _Index:
    """The records under one key prefix, fed by a watch (Trio side, plain data)."""

    def __init__(self, token: str, decode: Callable[[bytes, int, str], StoredRun | Lease]) -> None:
        self.token = token
        self.prefix = token + "."
        self._decode = decode
        self.slots: dict[str, _Slot] = {}
        self._staging: dict[str, _Slot] | None = None
        self._dead: collections.deque[tuple[float, str, _Slot]] = collections.deque()
        #: The watch the index follows (None: not built, or lost).
        self.watch: NatsKvWatch | None = None
        self.rebuilds = 0
        self._rebuilt = trio.Event()

    @property
    def in_sync(self) -> bool:
        return self.watch is not None and not self.watch.interrupted

    async def wait_rebuilt(self) -> None:
        await self._rebuilt.wait()

    def records(self) -> list[StoredRun | Lease]:
        self._prune(trio.current_time())
        return [slot.record for slot in self.slots.values() if slot.record is not None]

    def apply(self, key: str, revision: int, value: bytes | None) -> None:
        """Apply the entry ``revision`` of ``key`` (``value=None``: a delete) to the
        index, and to the one being built if any."""
        slot = self._slot(key, revision, value)
        if slot is not None:
            self._put(key, slot, (self.slots, self._staging))

    def load(self, key: str, revision: int, value: bytes | None) -> None:
        """Apply an entry of a new watch's snapshot: to the index being built only."""
        slot = self._slot(key, revision, value)
        if slot is not None:
            self._put(key, slot, (self._staging,))

    def forget(self, key: str, seen: _Slot) -> None:
        """``key`` has no entry any more: drop ``seen`` if the index still holds it."""
        if self.slots.get(key) is seen:
            self._put(key, _Slot(seen.revision, True, None), (self.slots, self._staging))

    def _slot(self, key: str, revision: int, value: bytes | None) -> _Slot | None:
        try:
            parse_prefixed_key(self.token, key)
        except ValueError:
            return None
        if value is None:
            return _Slot(revision, True, None)
        try:
            record = self._decode(value, revision, key)
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring the document at %s: %s", key[:80], exc)
            return _Slot(revision, False, None)
        return _Slot(revision, False, record)

    def _put(self, key: str, slot: _Slot, targets: tuple[dict[str, _Slot] | None, ...]) -> None:
        now = trio.current_time()
        self._prune(now)
        for target in targets:
            if target is None:
                continue
            current = target.get(key)
            if current is None or slot.newer_than(current):
                target[key] = slot
        if slot.deleted:
            self._dead.append((now + TOMBSTONE_TTL, key, slot))

    def _prune(self, now: float) -> None:
        while self._dead and self._dead[0][0] <= now:
            _, key, slot = self._dead.popleft()
            for target in (self.slots, self._staging):
                if target is not None and target.get(key) is slot:
                    del target[key]

    def begin_rebuild(self) -> None:
        self._staging = {}

    def finish_rebuild(self, watch: NatsKvWatch) -> None:
        assert self._staging is not None
        self.slots, self._staging = self._staging, None
        self.watch = watch
        self.rebuilds += 1
        self._rebuilt.set()
        self._rebuilt = trio.Event()

    def abort_rebuild(self) -> None:
        self._staging = None


def _decode_run(value: bytes, revision: int, key: str) -> StoredRun:
    return decode_run(value, revision, key)


def _decode_lease(value: bytes, revision: int, key: str) -> Lease:
    return decode_lease(value, revision, key)


class _IndexedKv(KvStore):
    """The bucket as :class:`KvRunStore` sees it: every entry read or written through
    it also feeds the store's index, and a lost compare-and-swap against an index
    entry of the revision it named repairs that entry."""

    def __init__(self, nats: NatsKvStore, owner: NatsKvRunStore) -> None:
        self._nats = nats
        self._owner = owner
        self.max_value_bytes = nats.max_value_bytes
        self.created = nats.created

    def __repr__(self) -> str:
        return repr(self._nats)

    def _index(self, key: str) -> _Index | None:
        return self._owner._indexes.get(key.split(".", 1)[0])

    def _feed(self, key: str, revision: int, value: bytes | None) -> None:
        index = self._index(key)
        if index is not None:
            index.apply(key, revision, value)

    async def get(self, key: str) -> KvEntry | None:
        self._owner._check_open()
        entry = await self._nats.get(key)
        if entry is not None:
            self._feed(key, entry.revision, entry.value)
        return entry

    async def get_current(self, key: str) -> KvEntry | None:
        self._owner._check_open()
        entry = await self._nats.get_current(key)
        if entry is not None:
            self._feed(key, entry.revision, entry.value)
        return entry

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        self._owner._check_open()
        try:
            revision = await self._nats.put(key, value, last=last)
        except RevisionConflict:
            await self._repair(key, last)
            raise
        self._feed(key, revision, value)
        return revision

    async def delete(self, key: str, *, last: int) -> int:
        self._owner._check_open()
        try:
            marker = await self._nats.delete(key, last=last)
        except RevisionConflict:
            await self._repair(key, last)
            raise
        self._feed(key, marker, None)
        return marker

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        self._owner._check_open()
        return await self._nats.purge_marker(key, revision=revision)

    async def entries(self, prefix: str) -> list[KvEntry]:
        self._owner._check_open()
        return await self._nats.entries(prefix)

    async def _repair(self, key: str, last: int) -> None:
        """After a lost compare-and-swap against ``last``: if the index holds exactly
        that revision, it is behind (or holds a delete it never saw): re-read."""
        index = self._index(key)
        seen = None if index is None else index.slots.get(key)
        if index is None or seen is None or seen.deleted or seen.revision != last:
            return
        try:
            entry = await self._nats.get(key)
        except BackendError as exc:
            logger.debug("could not re-read %s after a lost write: %s", key[:80], exc)
            return
        if entry is None:
            index.forget(key, seen)
        else:
            index.apply(key, entry.revision, entry.value)


class NatsKvRunStore(KvRunStore):
    """A :class:`~trio_debounce.abc.RunStore` on a NATS JetStream KV bucket.

    Made by :func:`open_nats_run_store`, never directly; see the module for the index
    that serves :meth:`list_runs` and :meth:`list_leases`. After the
    ``open_nats_run_store`` block exits (or :meth:`aclose`), every method raises
    :exc:`trio.ClosedResourceError`.

    :attr:`max_payload_bytes` is the server's max payload (or the bucket's max message
    size, if smaller), less the headers of a write, less
    :data:`~trio_debounce._run_kv.DOCUMENT_ALLOWANCE` for the document's own fields;
    a document larger than the server accepts is refused before sending
    (:exc:`~trio_debounce.DocumentTooLargeError`, naming the run id).
    """

    def __init__(self, nats: NatsKvStore, config: NatsConfig, *, resync_interval: float) -> None:
        self._nats = nats
        self._config = config
        self._resync_interval = resync_interval
        self._runs = _Index(RUN_PREFIX, _decode_run)
        self._leases = _Index(RUN_LEASE_PREFIX, _decode_lease)
        self._indexes = {RUN_PREFIX: self._runs, RUN_LEASE_PREFIX: self._leases}
        self._closed = False
        self._cancel_scope: trio.CancelScope | None = None
        super().__init__(_IndexedKv(nats, self))

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the NATS run store is closed")

    def statistics(self) -> NatsRunStoreStatistics:
        """The index's size and state (no I/O)."""
        return NatsRunStoreStatistics(
            runs=sum(1 for s in self._runs.slots.values() if s.record is not None),
            leases=sum(1 for s in self._leases.slots.values() if s.record is not None),
            in_sync=self._runs.in_sync and self._leases.in_sync and self._nats.is_connected,
            rebuilds=self._runs.rebuilds + self._leases.rebuilds,
        )

    async def _wait_in_sync(self, index: _Index, what: str) -> None:
        """Return when ``index`` follows a live watch; wait at most ``op_timeout``."""
        await trio.lowlevel.checkpoint()
        self._check_open()
        if not index.in_sync:
            with trio.move_on_after(self._config.op_timeout):
                while not index.in_sync:
                    await index.wait_rebuilt()
            self._check_open()
        if not (index.in_sync and self._nats.is_connected):
            raise BackendUnavailableError(
                f"{what}: the index of {index.prefix!r} keys is not in sync with NATS "
                "(disconnected, or its watch is being re-opened)"
            )

    async def list_runs(
        self,
        *,
        states: Collection[RunState] | None = None,
        owner: str | _Any | None = ANY,
        workflow: str | None = None,
        due_before: float | None = None,
        finished_before: float | None = None,
        limit: int | None = None,
    ) -> list[StoredRun]:
        """See :meth:`RunStore.list_runs`; served from the index (no I/O).

        Raises:
          BackendUnavailableError: the index is not in sync (the connection is down,
            or its watch is being re-opened) and did not get back in sync within
            ``config.op_timeout`` seconds.
          trio.ClosedResourceError: the store is closed.
        """
        await self._wait_in_sync(self._runs, "list runs")
        found = [
            run
            for run in self._runs.records()
            if isinstance(run, StoredRun)
            and matches(
                run,
                states=states,
                owner=owner,
                workflow=workflow,
                due_before=due_before,
                finished_before=finished_before,
            )
        ]
        found.sort(key=lambda r: (r.scheduled_at, r.run_id))
        return found if limit is None else found[:limit]

    async def list_leases(self) -> list[Lease]:
        """See :meth:`RunStore.list_leases`; served from the index (no I/O).

        Raises:
          BackendUnavailableError: as :meth:`list_runs`.
          trio.ClosedResourceError: the store is closed.
        """
        await self._wait_in_sync(self._leases, "list leases")
        return [lease for lease in self._leases.records() if isinstance(lease, Lease)]

    async def _scan(self, prefix: str) -> list[KvEntry]:
        """Not used: the lists are served from the index. Lists the bucket."""
        return await self._kv.entries(prefix)  # pragma: no cover

    async def aclose(self) -> None:
        """Close the store: stop the watches; later calls raise
        :exc:`trio.ClosedResourceError`. The connection closes when the
        :func:`open_nats_run_store` block exits. Idempotent."""
        self._closed = True
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()
        await trio.lowlevel.checkpoint()

    # The index's tasks.

    async def _maintain(
        self, index: _Index, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep ``index`` following a watch, for the life of the store.

        The first snapshot is loaded before ``task_status.started()``, so its errors
        come out of ``nursery.start()``.
        """
        retry = RETRY_MIN
        while True:
            built = index.rebuilds > 0
            try:
                if built:
                    await self._nats.wait_connected()
                await self._follow(index, None if built else task_status)
            except BackendError as exc:
                if index.rebuilds == 0:
                    raise
                index.watch = None
                logger.warning(
                    "the run store's watch of %r keys failed (%s); retrying in %.1f s",
                    index.prefix,
                    exc,
                    retry,
                )
                await trio.sleep(retry)
                retry = min(2 * retry, RETRY_MAX)
            else:
                retry = RETRY_MIN

    async def _follow(self, index: _Index, task_status: trio.TaskStatus[None] | None) -> None:
        """Open a watch, load its snapshot into a fresh index, then apply its updates
        until it is interrupted or the periodic resync is due."""
        async with self._nats.open_watch(index.prefix) as watch:
            await self._load(index, watch)
            if task_status is not None:
                task_status.started()
            await self._receive(index, watch)

    async def _load(self, index: _Index, watch: NatsKvWatch) -> None:
        """Load the watch's initial values into a fresh index (each batch within
        ``op_timeout``), then swap it in."""
        timeout = self._config.op_timeout
        index.begin_rebuild()
        try:
            loaded = False
            while not loaded:
                if watch.interrupted:
                    raise BackendUnavailableError(
                        f"watch {index.prefix!r}: interrupted while loading"
                    )
                with trio.move_on_after(timeout) as scope:
                    batch = await watch.receive_batch(_BATCH)
                if scope.cancelled_caught:
                    raise BackendUnavailableError(
                        f"watch {index.prefix!r}: NATS sent nothing for {timeout} s "
                        "while loading the keys"
                    )
                for item in batch:
                    if item is None:
                        loaded = True
                    else:
                        index.load(item.key, item.revision, item.value)
        except BaseException:
            index.abort_rebuild()
            raise
        index.finish_rebuild(watch)
        logger.debug("indexed %d %r keys", len(index.slots), index.prefix)

    async def _receive(self, index: _Index, watch: NatsKvWatch) -> None:
        """Apply the watch's updates until it is interrupted or the resync is due.

        Raises:
          BackendError: the watch stopped.
        """
        failure: BackendError | None = None
        async with trio.open_nursery() as nursery:
            nursery.cancel_scope.deadline = trio.current_time() + self._resync_interval

            async def until_interrupted() -> None:
                await watch.wait_interrupted()
                nursery.cancel_scope.cancel()

            async def receive() -> None:
                nonlocal failure
                try:
                    while True:
                        for item in await watch.receive_batch(_BATCH):
                            if item is not None:
                                index.apply(item.key, item.revision, item.value)
                except BackendError as exc:
                    failure = exc
                    nursery.cancel_scope.cancel()

            nursery.start_soon(until_interrupted)
            nursery.start_soon(receive)
        if failure is not None:
            raise failure


@asynccontextmanager
async def open_nats_run_store(
    config: NatsConfig | None = None, *, resync_interval: float = RESYNC_INTERVAL
) -> AsyncIterator[NatsKvRunStore]:
    """Connect to NATS and yield a run store on the config's KV bucket.

    ::

        async with open_nats_run_store(NatsConfig.from_env()) as store:
            ...

    Opens its own asyncio loop (on ``config.asyncio_host``) and nats-py connection (as
    :func:`~trio_debounce.nats.open_nats_backend` does: the same bucket, created if
    absent), and a nursery whose tasks keep the index of runs and leases (see the
    module), loaded before the block starts. On exit the watches stop and the
    connection is drained and closed, even when cancelled.

    Args:
      config (NatsConfig | None): servers, credentials, bucket and deadlines
        (``NatsConfig()`` when None).
      resync_interval (float): seconds between two full rebuilds of the index, which
        bound how long a delete the watch missed can linger (> 0; ``math.inf``:
        never).

    Raises:
      trio_debounce.BackendUnavailableError: no server answered within
        ``config.connect_timeout`` seconds, or loading the index stalled for
        ``config.op_timeout`` seconds.
      trio_debounce.BackendAuthError: the server refused the credentials, the TLS
        handshake (as for :func:`open_nats_backend`) or a permission (the watches
        need ``$JS.API.CONSUMER.CREATE.KV_<bucket>.>`` and
        ``$JS.API.CONSUMER.INFO.KV_<bucket>.>``, as listing does).
      trio_debounce.BackendConfigError: the bucket is missing (``create_bucket=False``)
        or has settings the store cannot work with.
      ValueError, TypeError: ``config`` is not a NatsConfig, or ``resync_interval`` is
        not a positive number of seconds.
    """
    if config is None:
        config = NatsConfig()
    if not isinstance(config, NatsConfig):
        raise TypeError(f"config must be a NatsConfig, not {config!r}")
    if isinstance(resync_interval, bool) or not isinstance(resync_interval, (int, float)):
        raise TypeError(f"resync_interval must be seconds (float), not {resync_interval!r}")
    if math.isnan(resync_interval) or resync_interval <= 0:
        raise ValueError(f"resync_interval must be > 0, got {resync_interval!r}")
    # As in open_nats_store: errors are carried out of the nursery, not wrapped in an
    # ExceptionGroup; Cancelled passes through (the cancel scope unwraps it).
    error: BaseException | None = None
    async with open_nats_store(config) as nats:
        store = NatsKvRunStore(nats, config, resync_interval=float(resync_interval))
        async with trio.open_nursery() as nursery:
            store._cancel_scope = nursery.cancel_scope
            try:
                for index in (store._runs, store._leases):
                    await nursery.start(store._maintain, index)
            except BackendError as exc:
                error = exc
            else:
                try:
                    yield store
                except trio.Cancelled:
                    raise
                except BaseException as exc:
                    error = exc
            finally:
                store._closed = True
                nursery.cancel_scope.cancel()
    if error is not None:
        raise error
