"""Following a store's windows as they change (:meth:`KvDebounceBackend.open_window_watch`,
``trio-debounce windows --follow``; see :doc:`/cli`, "Following a bucket").

The follower keeps what a listing (:func:`._inspect.list_windows`) reads: the window
documents, the fire records and the process leases, fed by one watch of the whole
store (:meth:`KvStore.open_watch` with the prefix ``""``), so that they arrive in one
order, the store's. After each entry it derives the windows that entry may have
changed and reports each difference from what it reported before, as a
:class:`~trio_debounce.WindowChange`:

* The watch's initial values make a snapshot, reported as ``listed`` changes.
* When the watch is interrupted (a NATS disconnect or reconnect, a lost consumer),
  every :data:`RESYNC_INTERVAL` seconds in any case (the bound on a delete marker that
  a sweeper purged before the watch delivered it), and after a watch that stopped, a
  new watch is opened and its snapshot replaces the old; then only the differences
  from what was reported are reported: nothing repeated, and the picture whole again,
  though what happened meanwhile comes as its net difference only. A watch that
  cannot be opened is retried with exponential backoff (:data:`RETRY_MIN` to
  :data:`RETRY_MAX` seconds) and logged as a warning, except the first, whose error is
  raised.
* A fire record is removed by a purge, which no watch sees: while the follower holds
  any fire record, it lists the fire records every :data:`RECORD_POLL` seconds.
* Leases come from the same watch: a renewal changes no window (the lease's time left
  is a reading, as of each change), but a lease can change a ``queue-latest`` window
  from ``waiting`` to ``due``.
* Time changes states too: a window still unfired :data:`DUE_GRACE` seconds (plus the
  skew margin) after its due time is reported ``due`` then, and a ``waiting`` one
  ``due`` when its run times out or its process's lease lapses. A window that fires
  on time goes from ``open`` to ``fired``.
* A write that changes nothing shown (the owner's wake time, a revision alone) is not
  a change; the next change carries the latest revision and fencing token.

Reads only: a watch, and listings of fire records. The follower keeps, per window of
the filter, its document without its payload; per fire record, three strings; per
lease, its decoded form.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import logging
import math
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace

import trio

from .._backend import WindowChange, WindowChangeKind, WindowInfo
from .._errors import BackendError, BackendUnavailableError
from .._keys import (
    PROCESS_PREFIX,
    parse_prefixed_key,
    parse_window_key,
    process_key,
    window_prefix,
)
from .._kv import KvEntry, KvWatch
from ._documents import FIRE_PREFIX, LEASE_PREFIX, FireRecord, Lease, WindowDoc, decode_lease
from ._inspect import fire_committed, payload_size, window_info
from ._view import StoreView

logger = logging.getLogger("trio_debounce.backend")

#: Seconds between two listings of the fire records while the follower holds any.
RECORD_POLL = 1.0
#: Seconds between two fresh snapshots when nothing interrupted the watch.
RESYNC_INTERVAL = 300.0
#: Seconds before the first retry of a watch that could not be opened; doubled up to
#: :data:`RETRY_MAX`.
RETRY_MIN = 0.5
RETRY_MAX = 15.0
#: Seconds past its due time (and the skew margin) that an unfired window stays
#: ``open`` for the follower.
DUE_GRACE = 1.0
#: Seconds added to the times at which a state changes by time alone, so that the
#: follower wakes after them, not on them.
_AFTER = 0.001
#: Updates taken from the watch at once.
_BATCH = 512
#: The prefix of every window's key.
_WINDOW_PREFIX = window_prefix(None)

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class _Held:
    """A window document as the follower keeps it: without its payload."""

    doc: WindowDoc
    revision: int
    payload_bytes: int


class _Snapshot:
    """The windows, fire records and leases the watch has shown (the windows and
    records of the filter only)."""

    def __init__(self, workflow: str | None, key_prefix: str | None) -> None:
        self._workflow = workflow
        self._key_prefix = key_prefix
        self.windows: dict[Key, _Held] = {}
        #: Fire record key -> the record, without its payload.
        self.records: dict[str, FireRecord] = {}
        #: Window -> the keys of its fire records.
        self._records_of: dict[Key, set[str]] = {}
        self.leases: dict[str, Lease] = {}
        #: Process -> the windows whose queue-latest run it runs.
        self._running_of: dict[str, set[Key]] = {}

    def _wanted(self, workflow: str, key: str) -> bool:
        if self._workflow is not None and workflow != self._workflow:
            return False
        return self._key_prefix is None or key.startswith(self._key_prefix)

    def firing(self, window: Key, doc: WindowDoc) -> bool:
        """Does a record of a committed fire of ``doc``'s run exist?"""
        return any(
            record.run_id == doc.run_id and fire_committed(doc, record)
            for record in (self.records[k] for k in self._records_of.get(window, ()))
        )

    def apply(self, entry: KvEntry) -> set[Key]:
        """Apply one entry of the store; returns the windows it may have changed."""
        if entry.key.startswith(_WINDOW_PREFIX):
            return self._apply_window(entry)
        if entry.key.startswith(FIRE_PREFIX):
            return self._apply_record(entry)
        if entry.key.startswith(LEASE_PREFIX):
            return self._apply_lease(entry)
        return set()

    def _apply_window(self, entry: KvEntry) -> set[Key]:
        try:
            window = parse_window_key(entry.key)
        except ValueError:
            return set()
        if not self._wanted(*window):
            return set()
        doc = None
        if entry.value is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError, UnicodeDecodeError):
                doc = WindowDoc.decode(entry.value)
        before = self.windows.pop(window, None)
        if before is not None and before.doc.running is not None:
            waiting = self._running_of[before.doc.running.process]
            waiting.discard(window)
            if not waiting:
                del self._running_of[before.doc.running.process]
        if doc is not None:
            light = replace(doc, payload=None, ranks=())
            self.windows[window] = _Held(light, entry.revision, payload_size(doc))
            if doc.running is not None:
                self._running_of.setdefault(doc.running.process, set()).add(window)
        return {window}

    def _apply_record(self, entry: KvEntry) -> set[Key]:
        touched = self.drop_record(entry.key)
        record = None
        if entry.value is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError, UnicodeDecodeError):
                record = FireRecord.decode(entry.value)
        if record is not None and self._wanted(record.workflow, record.key):
            window = (record.workflow, record.key)
            self.records[entry.key] = replace(record, payload=None)
            self._records_of.setdefault(window, set()).add(entry.key)
            touched.add(window)
        return touched

    def drop_record(self, fire_key: str) -> set[Key]:
        """Forget fire record ``fire_key``; returns the window it named (if held)."""
        record = self.records.pop(fire_key, None)
        if record is None:
            return set()
        window = (record.workflow, record.key)
        keys = self._records_of[window]
        keys.discard(fire_key)
        if not keys:
            del self._records_of[window]
        return {window}

    def _apply_lease(self, entry: KvEntry) -> set[Key]:
        try:
            process = parse_prefixed_key(PROCESS_PREFIX, entry.key)
        except ValueError:
            return set()
        lease = None
        if entry.value is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError, UnicodeDecodeError):
                lease = decode_lease(entry.value)
        if lease is not None and entry.key != process_key(lease.process):
            return set()  # under another process's key: evidence of neither
        if lease is None:
            self.leases.pop(process, None)
        else:
            self.leases[process] = lease
        # Only a queue-latest window's state depends on a lease (its run's process).
        return set(self._running_of.get(process, ()))


def _significant(info: WindowInfo) -> WindowInfo:
    """What of ``info`` is a change when it changes: all but readings and revisions."""
    return info._replace(owner_lease_left=None, revision=0, fencing_token=0)


class WindowFollower:
    """The async iterator of :meth:`KvDebounceBackend.open_window_watch`: see the
    module. Made and opened by it; not safe to iterate from two tasks at once.

    Args:
      view: the store.
      workflow, key_prefix: the filter (checked by the backend).
      wall: the wall clock, epoch seconds.
      skew: the skew margin of the lease arithmetic, seconds.
      op_timeout: seconds a batch of a new watch's initial values may take.
    """

    def __init__(
        self,
        view: StoreView,
        *,
        workflow: str | None,
        key_prefix: str | None,
        wall: Callable[[], float],
        skew: float,
        op_timeout: float,
    ) -> None:
        self._view = view
        self._workflow = workflow
        self._key_prefix = key_prefix
        self._wall = wall
        self._skew = skew
        self._grace = skew + DUE_GRACE
        self._op_timeout = op_timeout
        self._snapshot = _Snapshot(workflow, key_prefix)
        self._reported: dict[Key, WindowInfo] = {}
        #: (wall time, window): when a reported window's state changes by time alone.
        self._wakes: list[tuple[float, Key]] = []
        self._pending: collections.deque[WindowChange] = collections.deque()
        self._stack: AsyncExitStack | None = None
        self._watch: KvWatch | None = None
        self._stopped = False
        self._resync_at = math.inf
        self._poll_at = math.inf
        #: Snapshots loaded so far (1 after opening).
        self.snapshots = 0

    def __aiter__(self) -> WindowFollower:
        return self

    async def __anext__(self) -> WindowChange:
        await trio.lowlevel.checkpoint()
        while not self._pending:
            await self._advance()
        return self._pending.popleft()

    async def open(self) -> None:
        """Open the first watch and load its snapshot (its changes are ``listed``).

        Raises:
          BackendError: the store could not be watched.
        """
        await self._renew(first=True)

    async def aclose(self) -> None:
        """Stop the watch (shielded where the store needs it)."""
        stack, self._stack, self._watch = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    # ------------------------------------------------------------------ input

    async def _advance(self) -> None:
        """Wait for the next input (updates, a record listing, a time that changes a
        state, an interruption) and queue the changes it makes."""
        watch = self._watch
        if (
            watch is None
            or watch.interrupted
            or self._stopped
            or trio.current_time() >= self._resync_at
        ):
            if watch is not None and (watch.interrupted or self._stopped):
                logger.info("the watch of the windows was interrupted; listing them again")
            await self._renew(first=False)
            return
        wake = self._next_wake()
        deadline = min(self._resync_at, self._poll_at)
        if wake < math.inf:
            deadline = min(deadline, trio.current_time() + max(wake - self._wall(), _AFTER))
        batch = await self._receive(watch, deadline)
        now = self._wall()
        for item in batch:
            if item is not None:
                self._diff(self._snapshot.apply(item), now)
        if trio.current_time() >= self._poll_at:
            await self._poll_records()
        now = self._wall()
        self._diff(self._due(now), now)
        self._arm_poll()

    async def _receive(self, watch: KvWatch, deadline: float) -> list[KvEntry | None]:
        """The next batch of ``watch``; empty at ``deadline`` (Trio clock) or when the
        watch is interrupted or stops."""
        got: list[KvEntry | None] = []
        async with trio.open_nursery() as nursery:
            nursery.cancel_scope.deadline = deadline

            async def until_interrupted() -> None:
                await watch.wait_interrupted()
                nursery.cancel_scope.cancel()

            async def receive() -> None:
                try:
                    got.extend(await watch.receive_batch(_BATCH))
                except BackendError as exc:
                    logger.debug("the watch of the windows stopped: %s", exc)
                    self._stopped = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_interrupted)
            nursery.start_soon(receive)
        return got

    async def _renew(self, *, first: bool) -> None:
        """Open a new watch, load its snapshot in place of the old one, and queue the
        differences (``listed`` ones if ``first``)."""
        await self.aclose()
        retry = RETRY_MIN
        while True:
            stack = AsyncExitStack()
            try:
                watch = await stack.enter_async_context(self._view.open_watch(""))
                snapshot = await self._load(watch)
            except BackendUnavailableError as exc:
                await stack.aclose()
                if first:
                    raise
                logger.warning(
                    "the watch of the windows could not be opened again (%s); retrying in %.1f s",
                    exc,
                    retry,
                )
                await trio.sleep(retry)
                retry = min(2 * retry, RETRY_MAX)
                continue
            except BaseException:
                await stack.aclose()
                raise
            break
        self._stack, self._watch, self._snapshot = stack, watch, snapshot
        self._stopped = False
        self.snapshots += 1
        self._resync_at = trio.current_time() + RESYNC_INTERVAL
        self._poll_at = math.inf
        self._arm_poll()
        self._diff(set(self._reported) | set(snapshot.windows), self._wall(), listed=first)

    async def _load(self, watch: KvWatch) -> _Snapshot:
        """``watch``'s initial values, as a fresh snapshot (each batch within
        ``op_timeout``)."""
        snapshot = _Snapshot(self._workflow, self._key_prefix)
        while True:
            if watch.interrupted:
                raise BackendUnavailableError("the watch was interrupted while listing")
            with trio.move_on_after(self._op_timeout) as scope:
                batch = await watch.receive_batch(_BATCH)
            if scope.cancelled_caught:
                raise BackendUnavailableError(
                    f"the store sent nothing for {self._op_timeout} s while listing"
                )
            for item in batch:
                # Values after the end of the initial ones are applied as changes.
                if item is None:
                    return snapshot
                snapshot.apply(item)

    async def _poll_records(self) -> None:
        """List the fire records, and forget the held ones that are gone (purged)."""
        try:
            listing = await self._view.entries(FIRE_PREFIX)
        except BackendUnavailableError as exc:
            logger.debug("could not list the fire records: %s", exc)
            self._poll_at = trio.current_time() + RECORD_POLL
            return
        present = {entry.key for entry in listing if entry.value is not None}
        now = self._wall()
        self._poll_at = math.inf
        for fire_key in [key for key in self._snapshot.records if key not in present]:
            self._diff(self._snapshot.drop_record(fire_key), now)

    def _arm_poll(self) -> None:
        if self._snapshot.records and self._poll_at == math.inf:
            self._poll_at = trio.current_time() + RECORD_POLL

    # ------------------------------------------------------------------ output

    def _wake(self, window: Key, info: WindowInfo) -> float:
        """When ``info``'s state changes by time alone (wall clock), or ``inf``."""
        if info.state == "open":
            return info.due_at + self._grace + _AFTER
        if info.state != "waiting":
            return math.inf
        held = self._snapshot.windows.get(window)
        marker = None if held is None else held.doc.running
        if marker is None:
            return math.inf
        times = [] if marker.until is None else [marker.until]
        lease = self._snapshot.leases.get(marker.process)
        if lease is not None:
            times.append(lease.expires + self._skew)
        return min(times, default=math.inf) + _AFTER

    def _next_wake(self) -> float:
        """The earliest time (wall clock) at which a reported window's state changes by
        time alone, or ``inf``. The heap holds stale entries too (a window reported
        again since): each is checked against the window's latest report."""
        wakes = self._wakes
        while wakes:
            at, window = wakes[0]
            info = self._reported.get(window)
            if info is not None and self._wake(window, info) == at:
                return at
            heapq.heappop(wakes)
        return math.inf

    def _due(self, now: float) -> set[Key]:
        """The windows whose state may have changed by time alone at ``now``."""
        due: set[Key] = set()
        while self._next_wake() <= now:
            due.add(heapq.heappop(self._wakes)[1])
        return due

    def _note_wake(self, window: Key, info: WindowInfo) -> None:
        at = self._wake(window, info)
        if at == math.inf:
            return
        if len(self._wakes) > 4 * len(self._reported) + 64:
            # Mostly stale: rebuilt from the latest reports.
            self._wakes = [
                (when, key)
                for key, reported in self._reported.items()
                if (when := self._wake(key, reported)) < math.inf
            ]
            heapq.heapify(self._wakes)
        heapq.heappush(self._wakes, (at, window))

    def _info(self, window: Key, now: float) -> WindowInfo | None:
        held = self._snapshot.windows.get(window)
        if held is None:
            return None
        doc = held.doc
        return window_info(
            window[0],
            window[1],
            doc,
            held.revision,
            self._view.token(held.revision),
            held.payload_bytes,
            firing=self._snapshot.firing(window, doc),
            now=now,
            leases=self._snapshot.leases,
            skew=self._skew,
            due_grace=self._grace,
        )

    def _diff(self, windows: Iterable[Key], now: float, *, listed: bool = False) -> None:
        """Queue the changes of ``windows`` since they were last reported."""
        for window in sorted(windows):
            info = self._info(window, now)
            before = self._reported.get(window)
            if info is None:
                if before is not None:
                    del self._reported[window]
                    self._emit("closed", window, before.run_id, None, now)
                continue
            self._reported[window] = info
            self._note_wake(window, info)
            if before is not None and before.run_id != info.run_id:
                self._emit("closed", window, before.run_id, None, now)
                before = None
            if before is None:
                self._emit("listed" if listed else "opened", window, info.run_id, info, now)
            elif info.state == "firing" and before.state != "firing":
                self._emit("fired", window, info.run_id, info, now)
            elif _significant(info) != _significant(before):
                self._emit("updated", window, info.run_id, info, now)

    def _emit(
        self,
        change: WindowChangeKind,
        window: Key,
        run_id: str,
        info: WindowInfo | None,
        now: float,
    ) -> None:
        self._pending.append(WindowChange(change, window[0], window[1], run_id, info, now))
