"""An in-memory, pure-Trio stand-in for a shared backend, with fault injection."""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from .._errors import (
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
    RevisionConflict,
)
from .._kv import KvEntry, KvStore, KvWatch
from .._payload import PayloadSerializer
from .._protocol import KvDebounceBackend
from .._runs._kv_store import KvRunStore

T = TypeVar("T")

#: Wall-clock epoch seconds that MemoryStore's clock reads when Trio's clock reads 0.
DEFAULT_EPOCH = 1_700_000_000.0


class _MemoryWatch(KvWatch):
    """A watch of a :class:`MemoryStore` (see :meth:`MemoryStore.open_watch`)."""

    def __init__(self, prefix: str, initial: list[KvEntry]) -> None:
        self.prefix = prefix
        initial = sorted(initial, key=lambda entry: entry.revision)
        self._queue: collections.deque[KvEntry | None] = collections.deque([*initial, None])
        self._lot = trio.lowlevel.ParkingLot()
        self._interrupted = trio.Event()
        self._stopped = False

    def __repr__(self) -> str:
        return f"<memory watch {self.prefix!r}>"

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    async def wait_interrupted(self) -> None:
        await self._interrupted.wait()

    def _push(self, entry: KvEntry) -> None:
        if entry.key.startswith(self.prefix) and not self.interrupted and not self._stopped:
            self._queue.append(entry)
            self._lot.unpark_all()

    def _interrupt(self) -> None:
        self._interrupted.set()
        self._queue.clear()

    def _stop(self) -> None:
        self._stopped = True
        self._lot.unpark_all()

    async def receive_batch(self, max_entries: int = 512) -> list[KvEntry | None]:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        await trio.lowlevel.checkpoint()
        while not self._queue:
            if self._stopped:
                raise BackendError(f"watch {self.prefix!r}: the watch was stopped")
            await self._lot.park()
        return [self._queue.popleft() for _ in range(min(max_entries, len(self._queue)))]


class MemoryStore(KvStore):
    """A revisioned key-value store in memory, with JetStream KV (history 1) semantics.

    One store stands for one server: give each :class:`MemoryBackend` the same store
    and the coordinators that use them behave as separate processes sharing a bucket,
    inside one ``trio.run``. Revisions grow with every write to the store, deletes
    leave markers, writes are compare-and-swap. Each call is a Trio checkpoint.

    Args:
      max_value_bytes (int): the largest value accepted (the NATS default payload
        limit, 1 MiB, less 1 KiB of headers).
      epoch (float): the wall-clock reading, in epoch seconds, when Trio's clock reads
        0; the wall clock of every :class:`MemoryBackend` is Trio's clock plus this
        (plus its own skew), so :class:`trio.testing.MockClock` drives it.
      created (float | None): when the store counts as created, epoch seconds
        (``epoch`` when None): the high part of fencing tokens. A store made later (a
        re-created bucket) must be given a later ``created``.

    Attributes:
      down (bool): set True to make every call of every client fail with
        :class:`~trio_debounce.BackendUnavailableError` (a server outage).
      requests (collections.Counter[str]): calls answered, by operation name.
    """

    def __init__(
        self,
        *,
        max_value_bytes: int = 1024 * 1024 - 1024,
        epoch: float = DEFAULT_EPOCH,
        created: float | None = None,
    ) -> None:
        self.max_value_bytes: int = max_value_bytes
        self.epoch: float = epoch
        self.created: float = epoch if created is None else created
        self.down: bool = False
        self.requests: collections.Counter[str] = collections.Counter()
        self._data: dict[str, KvEntry] = {}
        self._sequence = 0
        #: Writes that land later (see StoreFaults.stall_next): (Trio time, order,
        #: operation, key, argument, last revision), applied before any later call.
        self._late: list[tuple[float, int, str, str, bytes | None, int]] = []
        self._late_order = itertools.count()
        self._watches: set[_MemoryWatch] = set()

    def __repr__(self) -> str:
        return f"<MemoryStore {len(self._data)} keys, revision {self._sequence}>"

    def land_later(self, at: float, op: str, key: str, value: bytes | None, last: int) -> None:
        """Apply write ``op`` (``"put"``, ``"delete"``, ``"purge"`` or
        ``"purge_marker"``; ``last``: the revision it names) at Trio time ``at``, as a
        request queued at a stalled server whose client gave up; its answer is lost.
        It lands before any call made at or after ``at`` (a conflict: not at all)."""
        heapq.heappush(self._late, (at, next(self._late_order), op, key, value, last))

    def _land_due(self) -> None:
        late = self._late
        while late and late[0][0] <= trio.current_time():
            _, _, op, key, value, last = heapq.heappop(late)
            entry = self._data.get(key)
            current = 0 if entry is None else entry.revision
            if op in ("put", "delete"):
                if current == last:
                    self._write(key, value)
            elif entry is not None and current == last and (op == "purge" or entry.value is None):
                del self._data[key]

    def _enter(self, op: str) -> None:
        self._land_due()
        if self.down:
            raise BackendUnavailableError("the memory store is down")
        self.requests[op] += 1

    def _check(self, key: str, last: int) -> None:
        entry = self._data.get(key)
        current = 0 if entry is None else entry.revision
        if current != last:
            raise RevisionConflict(f"wrong last revision for {key}: expected {last}, is {current}")

    def _write(self, key: str, value: bytes | None) -> int:
        self._sequence += 1
        entry = self._data[key] = KvEntry(key, value, self._sequence)
        for watch in self._watches:
            watch._push(entry)
        return self._sequence

    async def get(self, key: str) -> KvEntry | None:
        await trio.lowlevel.checkpoint()
        self._enter("get")
        return self._data.get(key)

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        await trio.lowlevel.checkpoint()
        if len(value) > self.max_value_bytes:
            raise DocumentTooLargeError(
                f"a value of {len(value)} bytes for {key} exceeds {self.max_value_bytes}"
            )
        self._enter("put")
        self._check(key, last)
        return self._write(key, bytes(value))

    async def delete(self, key: str, *, last: int) -> int:
        await trio.lowlevel.checkpoint()
        self._enter("delete")
        self._check(key, last)
        return self._write(key, None)

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        await trio.lowlevel.checkpoint()
        self._enter("purge_marker")
        entry = self._data.get(key)
        if entry is None or entry.revision != revision or entry.value is not None:
            return False
        del self._data[key]
        return True

    async def purge(self, key: str, *, last: int) -> bool:
        await trio.lowlevel.checkpoint()
        self._enter("purge")
        entry = self._data.get(key)
        if entry is None or entry.revision != last:
            return False
        del self._data[key]
        return True

    async def entries(self, prefix: str) -> list[KvEntry]:
        await trio.lowlevel.checkpoint()
        self._enter("entries")
        return [entry for key, entry in self._data.items() if key.startswith(prefix)]

    @asynccontextmanager
    async def open_watch(self, prefix: str) -> AsyncIterator[KvWatch]:
        """Watch the keys under ``prefix`` (ending with ``.``; ``""``: every key), as a
        NATS KV watch does: the latest entry of each key first (delete markers
        included), then ``None``, then every write and delete, in revision order.
        Purges are not seen (JetStream's stream purges are not either). The watch
        is interrupted by :meth:`interrupt_watches` only.

        Raises:
          ValueError: ``prefix`` is not ``""`` and does not end with ``.``.
          BackendUnavailableError: the store is ``down``.
        """
        if prefix and not prefix.endswith("."):
            raise ValueError(f"prefix must end with '.', got {prefix[:80]!r}")
        await trio.lowlevel.checkpoint()
        self._enter("watch")
        watch = _MemoryWatch(
            prefix, [entry for key, entry in self._data.items() if key.startswith(prefix)]
        )
        self._watches.add(watch)
        try:
            yield watch
        finally:
            self._watches.discard(watch)
            watch._stop()

    def interrupt_watches(self) -> None:
        """Interrupt every open watch, as a NATS disconnect would: each delivers
        nothing more, and its owner opens a new one (no checkpoint)."""
        for watch in self._watches:
            watch._interrupt()

    def raw_put(self, key: str, value: bytes | None) -> int:
        """Write ``value`` (``None``: a delete marker) with no revision check and no
        checkpoint: for tests that plant corrupt or foreign records."""
        return self._write(key, value)

    def raw_get(self, key: str) -> KvEntry | None:
        """The latest entry of ``key``, without a checkpoint or a fault."""
        self._land_due()
        return self._data.get(key)


@dataclass(frozen=True, slots=True)
class _Fault:
    kind: str
    seconds: float
    ops: frozenset[str]
    error: type[BackendError]
    #: A stall's request timeout: the call fails then, and a write still lands later.
    fail_after: float | None = None


class StoreFaults:
    """Faults to inject into one :class:`MemoryBackend`'s calls to its store.

    Each ``*_next`` method arms a fault for the next ``n`` matching calls; they are
    consumed in the order armed. Use ``partitioned`` for an open-ended outage of this
    one process.

    Attributes:
      partitioned (bool): while True, every call fails with
        :class:`~trio_debounce.BackendUnavailableError` without reaching the store.
    """

    def __init__(self) -> None:
        self.partitioned = False
        #: Armed faults, each with how many more calls it applies to.
        self._queue: collections.deque[list[Any]] = collections.deque()
        #: Keys that reads show as they were when lag() was called (None: absent).
        self._lagging: dict[str, KvEntry | None] = {}
        #: The store of the backend these faults belong to (set by that backend).
        self._store: MemoryStore | None = None

    def lag(self, *keys: str) -> None:
        """From now on, :meth:`~trio_debounce.abc.KvStore.get` and
        :meth:`~trio_debounce.abc.KvStore.entries` show ``keys`` as they are now, as a
        replica that stopped applying their writes would (JetStream answers a direct
        get, and a consumer's listing, from any replica of the stream):
        :meth:`~trio_debounce.abc.KvStore.get_current` (the stream leader's read) and
        every write see the store itself. Until :meth:`catch_up`.

        Raises:
          RuntimeError: these faults belong to no :class:`MemoryBackend`.
          TypeError: a key is not a str.
        """
        if self._store is None:
            raise RuntimeError("these StoreFaults belong to no MemoryBackend")
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"keys must be str, got {key!r}")
            self._lagging[key] = self._store.raw_get(key)

    def catch_up(self) -> None:
        """Reads show every key as the store holds it again (undoes :meth:`lag`)."""
        self._lagging.clear()

    def fail_next(
        self,
        n: int = 1,
        *,
        ops: tuple[str, ...] = (),
        error: type[BackendError] = BackendUnavailableError,
    ) -> None:
        """The next ``n`` calls (of ``ops``, default any) raise ``error`` (default
        :class:`~trio_debounce.BackendUnavailableError`) without being applied; pass
        :class:`~trio_debounce.BackendAuthError` to simulate revoked permissions."""
        if not (isinstance(error, type) and issubclass(error, BackendError)):
            raise TypeError(f"error must be a BackendError subclass, not {error!r}")
        self._arm("fail", n, 0.0, ops, error)

    def apply_then_fail_next(self, n: int = 1, *, ops: tuple[str, ...] = ("put", "delete")) -> None:
        """The next ``n`` calls (writes by default) are applied, then raise
        :class:`~trio_debounce.BackendUnavailableError`: a write that timed out but
        landed."""
        self._arm("apply_then_fail", n, 0.0, ops)

    def conflict_next(self, n: int = 1) -> None:
        """The next ``n`` writes raise :class:`~trio_debounce.RevisionConflict` without
        being applied, as if another process had written first."""
        self._arm("conflict", n, 0.0, ("put", "delete"))

    def delay_next(self, seconds: float, n: int = 1, *, ops: tuple[str, ...] = ()) -> None:
        """The next ``n`` calls are applied at once and answered ``seconds`` later (on
        Trio's clock): if the caller gives up meanwhile, the call has still landed."""
        if not 0 <= seconds < math.inf:
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        self._arm("delay", n, seconds, ops)

    def stall_next(
        self,
        seconds: float,
        n: int = 1,
        *,
        ops: tuple[str, ...] = (),
        fail_after: float | None = None,
    ) -> None:
        """The next ``n`` calls (of ``ops``, default any) reach the store only
        ``seconds`` later (on Trio's clock), as requests queued at a stalled server (a
        leader election, a SIGSTOP): the call is applied and answered then. If its
        caller gives up meanwhile, a write still lands then (its answer is lost, and a
        read made meanwhile sees the old value); a read has no effect. With
        ``fail_after`` (seconds, less than ``seconds``), the call itself gives up then,
        raising :class:`~trio_debounce.BackendUnavailableError` (a request timeout),
        and a write still lands at ``seconds``.

        Raises:
          ValueError: ``seconds`` is negative or not finite, ``fail_after`` is not in
            [0, ``seconds``), or ``n`` is not an int >= 1.
        """
        if not 0 <= seconds < math.inf:
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        if fail_after is not None and not 0 <= fail_after < seconds:
            raise ValueError(f"fail_after must be >= 0 and below {seconds!r}, got {fail_after!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        self._queue.append(
            [_Fault("stall", seconds, frozenset(ops), BackendUnavailableError, fail_after), n]
        )

    def clear(self) -> None:
        """Disarm every fault not yet consumed (``partitioned`` and :meth:`lag` are
        left as they are)."""
        self._queue.clear()

    def _arm(
        self,
        kind: str,
        n: int,
        seconds: float,
        ops: tuple[str, ...],
        error: type[BackendError] = BackendUnavailableError,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        # One entry with a count, not n entries: a huge n must not hang or fill memory.
        self._queue.append([_Fault(kind, seconds, frozenset(ops), error), n])

    def _take(self, op: str) -> _Fault | None:
        for i, armed in enumerate(self._queue):
            fault: _Fault = armed[0]
            if not fault.ops or op in fault.ops:
                armed[1] -= 1
                if armed[1] == 0:
                    del self._queue[i]
                return fault
        return None


def _wall_offset(store: MemoryStore, clock_skew: object) -> float:
    """What one simulated process adds to Trio's clock to read its wall clock: the
    store's epoch plus the process's ``clock_skew`` (seconds).

    Raises:
      ValueError: ``clock_skew`` is not a finite number.
    """
    if (
        isinstance(clock_skew, bool)
        or not isinstance(clock_skew, (int, float))
        or not math.isfinite(clock_skew)
    ):
        raise ValueError(f"clock_skew must be a finite number of seconds, got {clock_skew!r}")
    return store.epoch + float(clock_skew)


class _FaultyStore(KvStore):
    """One client's view of a MemoryStore, through its StoreFaults."""

    def __init__(self, store: MemoryStore, faults: StoreFaults) -> None:
        self._store = store
        self._faults = faults
        faults._store = store
        self.max_value_bytes = store.max_value_bytes
        self.created = store.created

    def __repr__(self) -> str:
        return repr(self._store)

    async def _run(self, op: str, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        if self._faults.partitioned:
            await trio.lowlevel.checkpoint()
            raise BackendUnavailableError("this process is partitioned from the memory store")
        fault = self._faults._take(op)
        if fault is None:
            return await fn(*args, **kwargs)
        if fault.kind == "fail":
            await trio.lowlevel.checkpoint()
            raise fault.error(f"injected failure of {op}")
        if fault.kind == "conflict":
            await trio.lowlevel.checkpoint()
            raise RevisionConflict(f"injected revision conflict on {op}")
        if fault.kind == "stall":
            until = trio.current_time() + fault.seconds

            def land_later() -> None:
                if op in ("put", "delete", "purge", "purge_marker"):
                    key = args[0]
                    value = bytes(args[1]) if op == "put" else None
                    last = kwargs["revision"] if op == "purge_marker" else kwargs["last"]
                    self._store.land_later(until, op, key, value, last)

            try:
                if fault.fail_after is not None:
                    await trio.sleep(fault.fail_after)
                    land_later()
                    raise BackendUnavailableError(
                        f"injected request timeout of {op} (it reaches the store later)"
                    )
                await trio.sleep_until(until)
            except trio.Cancelled:
                land_later()
                raise
            return await fn(*args, **kwargs)
        result = await fn(*args, **kwargs)
        if fault.kind == "apply_then_fail":
            raise BackendUnavailableError(f"injected failure after {op} was applied")
        await trio.sleep(fault.seconds)
        return result

    async def get(self, key: str) -> KvEntry | None:
        if key in self._faults._lagging:
            return await self._run("get", self._lagging_get, key)
        return await self.get_current(key)

    async def _lagging_get(self, key: str) -> KvEntry | None:
        await trio.lowlevel.checkpoint()
        return self._faults._lagging[key]

    async def get_current(self, key: str) -> KvEntry | None:
        return await self._run("get", self._store.get, key)

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        return await self._run("put", self._store.put, key, value, last=last)

    async def delete(self, key: str, *, last: int) -> int:
        return await self._run("delete", self._store.delete, key, last=last)

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        return await self._run("purge_marker", self._store.purge_marker, key, revision=revision)

    async def purge(self, key: str, *, last: int) -> bool:
        return await self._run("purge", self._store.purge, key, last=last)

    async def entries(self, prefix: str) -> list[KvEntry]:
        found = await self._run("entries", self._store.entries, prefix)
        lagging = self._faults._lagging
        if not lagging:
            return found
        shown = [lagging.get(e.key, e) for e in found]
        listed = {e.key for e in found}
        shown += [e for k, e in lagging.items() if k.startswith(prefix) and k not in listed]
        return [e for e in shown if e is not None]

    @asynccontextmanager
    async def open_watch(self, prefix: str) -> AsyncIterator[KvWatch]:
        if self._faults.partitioned:
            await trio.lowlevel.checkpoint()
            raise BackendUnavailableError("this process is partitioned from the memory store")
        fault = self._faults._take("watch")
        if fault is not None and fault.kind == "fail":
            await trio.lowlevel.checkpoint()
            raise fault.error("injected failure of watch")
        async with self._store.open_watch(prefix) as watch:
            yield watch


class MemoryBackend(KvDebounceBackend):
    """A debounce backend on a shared :class:`MemoryStore`: one per simulated process.

    Runs the same protocol code as the NATS backend, so tests of your own code under
    :class:`trio.testing.MockClock` see the real cross-process behaviour::

        store = MemoryStore()
        async with open_coordinator(backend=MemoryBackend(store), ...) as a, \\
                   open_coordinator(backend=MemoryBackend(store), ...) as b:
            ...

    Args:
      store (MemoryStore): the shared store.
      process_id (str | None): the simulated process's id (uuid4 hex when None).
      clock_skew (float): seconds this process's wall clock runs ahead of the store's
        (negative: behind).
      process_lease (float): seconds this process's lease lasts unrenewed.
      op_timeout (float): seconds a register or finalize may take, retries included.
      max_clock_skew (float): seconds of wall-clock skew between processes that the
        lease arithmetic tolerates.
      serializer (PayloadSerializer | None): how payloads are stored (JSON when None).

    Attributes:
      faults (StoreFaults): faults to inject into this process's calls.
    """

    def __init__(
        self,
        store: MemoryStore,
        *,
        process_id: str | None = None,
        clock_skew: float = 0.0,
        process_lease: float = 60.0,
        op_timeout: float = 2.0,
        max_clock_skew: float = 1.0,
        serializer: PayloadSerializer | None = None,
    ) -> None:
        if not isinstance(store, MemoryStore):
            raise TypeError(f"store must be a MemoryStore, not {store!r}")
        self.faults: StoreFaults = StoreFaults()
        offset = _wall_offset(store, clock_skew)
        super().__init__(
            _FaultyStore(store, self.faults),
            process_id=process_id,
            process_lease=process_lease,
            op_timeout=op_timeout,
            max_clock_skew=max_clock_skew,
            wall_time=lambda: trio.current_time() + offset,
            serializer=serializer,
        )


class MemoryRunStore(KvRunStore):
    """A deferred-run store on a shared :class:`MemoryStore`: one per simulated process.

    The same run-store code as the NATS run store, with fault injection, for tests
    under :class:`trio.testing.MockClock`::

        shared = MemoryStore()
        async with open_coordinator(run_store=MemoryRunStore(shared), ...) as a, \\
                   open_coordinator(run_store=MemoryRunStore(shared), ...) as b:
            ...

    Args:
      store (MemoryStore | None): the shared store (a fresh one when None).
      clock_skew (float): seconds this process's wall clock runs ahead of the store's
        (negative: behind).

    Attributes:
      store (MemoryStore): the shared store.
      faults (StoreFaults): faults to inject into this process's calls.
    """

    def __init__(self, store: MemoryStore | None = None, *, clock_skew: float = 0.0) -> None:
        if store is None:
            store = MemoryStore()
        if not isinstance(store, MemoryStore):
            raise TypeError(f"store must be a MemoryStore, not {store!r}")
        self.store: MemoryStore = store
        self.faults: StoreFaults = StoreFaults()
        self._offset = _wall_offset(store, clock_skew)
        super().__init__(_FaultyStore(store, self.faults))

    def wall_time(self) -> float:
        """Trio's clock plus the store's epoch plus this process's skew."""
        return trio.current_time() + self._offset
