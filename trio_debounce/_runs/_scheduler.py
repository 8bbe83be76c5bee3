"""The deferred-run scheduler: timers, claims, heartbeat and delivery of runs.

One :class:`RunScheduler` belongs to one coordinator and runs as a task in its nursery.
It holds a task per run due within the horizon (sleeping on Trio's clock until the
run's wall-clock time, re-checking the wall clock when it wakes), one heartbeat task
(one lease write per interval, whatever the number of runs) and one claim sweep
(listing the runs due within the horizon, arming this process's, claiming those of
dead, fenced or released processes by compare-and-swap). Every step that decides a
run (start, delete, finish) is a compare-and-swap against the record armed, so a run
re-scheduled, cancelled or claimed elsewhere meanwhile is re-read, re-armed or dropped,
never run stale. See :doc:`/runs`.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio

from .. import _validate
from .._backend import Delivery
from .._errors import (
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
    ProcessIdTakenError,
)
from .._invoke import invoke
from .._wallclock import WallClock, wall_to_trio
from ._store import ANY, Lease, RunState, RunStore, StoredRun, _Any
from ._types import (
    ACTIVE,
    DropReason,
    ExpiredCallback,
    RunFire,
    RunHandler,
    RunInfo,
    RunOptions,
    RunStatistics,
    ScheduledRun,
    default_wall_time,
    wall_seconds,
)

logger = logging.getLogger("trio_debounce.runs")

T = TypeVar("T")

#: Sweeps between two purges of old tombstones and dead leases.
PURGE_EVERY = 10
#: Tombstones and leases removed per purge, at most.
PURGE_BATCH = 500
#: Claims one sweep makes at once.
CLAIM_CONCURRENCY = 16
#: How long past a local tombstone's retention the local loop wakes to purge it, seconds.
_TICK = 1e-3
#: Longest wait between two retries of a failed store step, seconds.
MAX_STEP_RETRY = 5.0
#: Looks at a live lease of our process id while it is watched for a renewal at start,
#: besides the first (a run store has no watch to wait on).
_TWIN_LOOKS = 4


@dataclass(slots=True)
class _LocalRun:
    """A non-persisted run, held in this coordinator's memory only."""

    run_id: str
    workflow: str
    payload: Any
    scheduled_at: float
    expires_at: float | None
    version: int
    created_at: float
    attempt: int = 0


@dataclass(slots=True, eq=False)
class _Armed:
    """A run that holds a task: due within the horizon, or being drained."""

    run_id: str
    due: float
    record: StoredRun | None  # persisted: the record as armed
    local: _LocalRun | None  # non-persisted
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    started: bool = False
    drain: bool = False
    sweep: int = 0  # the sweep count when armed
    done: trio.Event = field(default_factory=trio.Event)


class _DueOrderGate:
    """A semaphore whose waiters are served earliest due first (then arrival).

    Every acquire queues, and a free slot is handed out one checkpoint later, so runs
    that come due at the same instant (a backlog after a restart, a drain) are all
    queued before the first is served, whatever order Trio runs their tasks in.
    """

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: list[tuple[float, int, trio.Event, list[bool]]] = []
        self._seq = itertools.count()

    async def acquire(self, due: float) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        event = trio.Event()
        state = [False, False]  # granted, abandoned
        heapq.heappush(self._waiters, (due, next(self._seq), event, state))
        try:
            if self._free > 0:
                await trio.lowlevel.cancel_shielded_checkpoint()
                self._dispatch()
            if not state[0]:
                await event.wait()
        except BaseException:
            if state[0]:
                self.release()  # granted while being cancelled: pass it on
            else:
                state[1] = True
            raise

    def _dispatch(self) -> None:
        while self._free > 0 and self._waiters:
            _, _, event, state = heapq.heappop(self._waiters)
            if state[1]:
                continue
            state[0] = True
            self._free -= 1
            event.set()

    def release(self) -> None:
        self._free += 1
        self._dispatch()


def _encode_payload(run_id: str, payload: Any) -> str:
    try:
        return json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(
            f"run {run_id!r}: a persisted payload must be JSON-serializable ({exc})"
        ) from None


class RunScheduler:
    """The deferred runs of one coordinator; see the module docstring."""

    def __init__(
        self,
        *,
        store: RunStore | None,
        handlers: Mapping[str, RunHandler],
        options: RunOptions,
        delivery: Delivery,
        on_expired: ExpiredCallback | None,
    ) -> None:
        self._store = store
        self._handlers: dict[str, RunHandler] = dict(handlers)
        self._options = options
        self._delivery = delivery
        self._on_expired = on_expired
        self._wall = _wall_clock(options, store)
        assert options.process_id is not None
        self.process_id: str = options.process_id
        self._lease: Lease | None = None
        #: The process id's lease was watched for a live twin (see _watch_live_lease).
        self._id_checked = False
        self._fenced = False
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._closing = False
        self._gate = _DueOrderGate(options.max_concurrent_runs)
        self._armed: dict[str, _Armed] = {}
        self._local: dict[str, _LocalRun] = {}
        self._local_heap: list[tuple[float, int, str, int]] = []
        self._local_done: dict[str, tuple[_LocalRun, float, str]] = {}
        self._local_wake = trio.Event()
        self._sweep_wake = trio.Event()
        self._sweeps = 0
        self._tokens = itertools.count(1)
        self._running = 0
        self._idle_lot = trio.lowlevel.ParkingLot()
        self._loops = trio.CancelScope()
        self._sweep_scope = trio.CancelScope()
        self._local_scope = trio.CancelScope()
        self._heap_seq = itertools.count()
        self._stats: dict[str, int] = dict.fromkeys(RunStatistics.__slots__, 0)

    # ---------------------------------------------------------------- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler's life, as a task of the coordinator's nursery."""
        if self._store is not None:
            await self._open_lease()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                with self._loops:
                    if self._store is not None:
                        nursery.start_soon(self._heartbeat_loop)
                        nursery.start_soon(self._sweep_loop)
                    nursery.start_soon(self._local_loop)
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            self._closing = self._closed = True
            self._drop_waiting_local()  # after an abort: nothing else accounts for them
            if self._lease is not None and self._store is not None and not self._fenced:
                with trio.CancelScope(shield=True):
                    await self._release()

    async def close(self) -> None:
        """The coordinator exits normally: stop timers and sweeps, drop non-persisted
        pending runs (with a warning), wait for running handlers, release the lease."""
        if self._closing:
            return
        # Closing: no run gets a task any more, but running handlers may still
        # schedule (a successor, say) and cancel until they finish.
        self._closing = True
        self._loops.cancel()
        self._sweep_scope.cancel()
        self._local_scope.cancel()
        for entry in list(self._armed.values()):
            if not entry.started:
                entry.scope.cancel()
        # The heartbeat keeps running while handlers finish, so their claims hold.
        while self._running:
            await self._idle_lot.park()
        self._closed = True
        self._drop_waiting_local()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _drop_waiting_local(self) -> None:
        """Drop the non-persisted runs that wait for their time, with a warning."""
        waiting = [
            run for run in self._local.values() if self._local_state(run) is RunState.PENDING
        ]
        for run in waiting:
            del self._local[run.run_id]
        self._local_heap.clear()
        if waiting:
            self._stats["dropped_at_exit"] += len(waiting)
            logger.warning(
                "%d non-persisted deferred run(s) dropped at exit (persist=True keeps runs "
                "across restarts)",
                len(waiting),
            )

    async def _call(
        self, what: str, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T:
        """One store call, bounded by ``op_timeout``; failures counted and re-raised."""
        try:
            with trio.fail_after(self._options.op_timeout):
                return await fn(*args, **kwargs)
        except trio.TooSlowError:
            self._stats["store_errors"] += 1
            raise BackendUnavailableError(
                f"the run store did not answer {what} within {self._options.op_timeout:g} s"
            ) from None
        except BackendError:
            self._stats["store_errors"] += 1
            raise

    async def _open_lease(self) -> None:
        assert self._store is not None
        store = self._store
        interval = self._options.heartbeat_interval
        assert interval is not None
        await self.wait_process_id_free()
        for _ in range(20):
            old = await self._call("get_lease", store.get_lease, self.process_id)
            lease = Lease(
                self.process_id,
                (old.epoch + 1) if old is not None else 1,
                self._wall() + self._options.lease,
                revision=old.revision if old is not None else 0,
                heartbeat_interval=interval,
            )
            written = await self._call("put_lease", store.put_lease, lease)
            if written is not None:
                self._lease = written
                logger.debug("process %r opened epoch %d", self.process_id, written.epoch)
                return
        raise BackendError(f"could not open the lease of process {self.process_id!r}: contention")

    async def wait_process_id_free(self) -> None:
        """Before :meth:`run`: if the store holds a live lease of our process id, watch
        it for a renewal (see :meth:`_watch_live_lease`). Once per scheduler; nothing to
        do without a store.

        Raises:
          ProcessIdTakenError: a live coordinator holds the process id.
          BackendError: the store failed a read.
        """
        if self._store is not None and not self._id_checked:
            await self._watch_live_lease()
            self._id_checked = True
        await trio.lowlevel.checkpoint()

    async def _watch_live_lease(self) -> Lease | None:
        """Before the first lease write: if a live lease of our process id (an earlier
        epoch) is in the store, watch it for a renewal, for its holder's heartbeat
        interval (ours if it did not record one, capped at our lease) plus the skew
        margin. Returns the lease as last read (the epoch to bump).

        Raises:
          ProcessIdTakenError: it was renewed (its revision moved, or another epoch
            replaced it): a live coordinator holds the process id. Nothing written.
          BackendError: the store failed a read.
        """
        assert self._store is not None
        store = self._store
        options = self._options
        assert options.heartbeat_interval is not None
        skew = options.max_clock_skew
        old = await self._call("get_lease", store.get_lease, self.process_id)
        wall, now = self._wall(), trio.current_time()
        if old is None or old.released or old.expires_at + skew < wall:
            return old
        # A live twin, or a predecessor that crashed (or stalls) before its lease
        # lapsed: only a renewal tells them apart.
        beat = old.heartbeat_interval
        if not (isinstance(beat, float | int) and 0 < beat < math.inf):
            beat = options.heartbeat_interval  # not recorded (or no usable value)
        until = min(
            now + min(beat, options.lease) + skew,
            wall_to_trio(old.expires_at + skew, wall_now=wall, trio_now=now),
        )
        step = max((until - now) / _TWIN_LOOKS, 1e-3)
        logger.info(
            "process id %r: the run lease of epoch %d is live; watching it for %.3g s for a "
            "renewal before this coordinator starts",
            self.process_id,
            old.epoch,
            until - now,
        )
        while True:
            await trio.sleep_until(min(until, trio.current_time() + step))
            current = await self._call("get_lease", store.get_lease, self.process_id)
            if current is None or current.released:
                return current  # left meanwhile: free
            if current.revision != old.revision:
                logger.error(
                    "process id %r is held by a live coordinator (run lease epoch %d was "
                    "renewed): this one is refused; two live coordinators must never share "
                    "a process id",
                    self.process_id,
                    current.epoch,
                )
                raise ProcessIdTakenError(
                    f"process id {self.process_id!r} is held by a live coordinator (run "
                    f"lease epoch {current.epoch}, renewed while this one watched it); this "
                    f"one is refused and wrote nothing: two live coordinators must never "
                    f"share a process id"
                )
            if trio.current_time() >= until:
                logger.warning(
                    "process id %r: the run lease of epoch %d was not renewed for %.3g s; "
                    "taking the process id over (that coordinator crashed or stalls; if it "
                    "resumes, it is fenced at its next heartbeat)",
                    self.process_id,
                    current.epoch,
                    until - now,
                )
                return current

    async def _release(self) -> None:
        assert self._store is not None
        assert self._lease is not None
        lease = self._lease
        try:
            with trio.move_on_after(self._options.op_timeout):
                if await self._store.put_lease(lease.replace(released=True)) is None:
                    current = await self._store.get_lease(self.process_id)
                    if current is not None and current.epoch == lease.epoch:
                        await self._store.put_lease(current.replace(released=True))
        except BackendError as exc:
            logger.warning(
                "could not release the lease of %r (%s): peers take its runs over when it lapses",
                self.process_id,
                exc,
            )

    # ---------------------------------------------------------------- heartbeat

    async def _heartbeat_loop(self) -> None:
        assert self._store is not None
        interval = self._options.heartbeat_interval
        assert interval is not None
        while True:
            await trio.sleep(interval)
            try:
                await self._heartbeat()
            except BackendError as exc:
                logger.warning("heartbeat of %r failed: %s", self.process_id, exc)
            except Exception:
                # A store implementation's bug must not take the coordinator down.
                self._stats["store_errors"] += 1
                logger.exception("heartbeat of %r failed", self.process_id)
            if self._fenced:
                return

    async def _heartbeat(self) -> None:
        assert self._store is not None
        assert self._lease is not None
        lease = self._lease
        renewed = lease.replace(expires_at=self._wall() + self._options.lease)
        written = await self._call("put_lease", self._store.put_lease, renewed)
        if written is None:
            current = await self._call("get_lease", self._store.get_lease, self.process_id)
            if current is not None and current.epoch == lease.epoch and not current.released:
                # Our last write landed but its answer was lost: adopt its revision.
                written = await self._call(
                    "put_lease",
                    self._store.put_lease,
                    renewed.replace(revision=current.revision),
                )
            if written is None:
                self._fence(current)
                return
        self._lease = written
        self._stats["heartbeats"] += 1

    def _fence(self, current: Lease | None) -> None:
        logger.error(
            "process id %r was taken by another coordinator (lease now %r): this one stops "
            "claiming runs",
            self.process_id,
            current,
        )
        self._fenced = True
        for entry in list(self._armed.values()):
            if not entry.started and entry.record is not None:
                entry.scope.cancel()

    # ---------------------------------------------------------------- claim sweep

    async def _sweep_loop(self) -> None:
        interval = self._options.heartbeat_interval
        assert interval is not None
        with self._sweep_scope:
            await self._sweep_forever(interval)

    async def _sweep_forever(self, interval: float) -> None:
        while not self._fenced:
            wait = interval
            try:
                wait = min(wait, await self._sweep())
            except BackendError as exc:
                logger.warning("claim sweep of %r failed: %s", self.process_id, exc)
            except Exception:
                self._stats["store_errors"] += 1
                logger.exception("claim sweep of %r failed", self.process_id)
            with trio.move_on_after(max(wait, 0.0)):
                await self._sweep_wake.wait()
            self._sweep_wake = trio.Event()

    def _owns(self, run: StoredRun) -> bool:
        lease = self._lease
        return lease is not None and run.owner == self.process_id and run.epoch == lease.epoch

    def _claimable(self, run: StoredRun, leases: Mapping[str, Lease], wall: float) -> bool:
        if run.owner is None:
            return True
        lease = leases.get(run.owner)
        if lease is None or lease.released or lease.epoch > run.epoch:
            return True
        return lease.expires_at + self._options.max_clock_skew < wall

    async def _sweep(self) -> float:
        """One claim sweep; returns the seconds until the next one is needed."""
        assert self._store is not None
        store = self._store
        self._sweeps += 1
        sweep = self._sweeps
        wall = self._wall()
        leases = {
            lease.process_id: lease for lease in await self._call("list_leases", store.list_leases)
        }
        runs = await self._call(
            "list_runs",
            lambda: store.list_runs(states=ACTIVE, due_before=wall + self._options.horizon),
        )
        listed: set[str] = set()
        claimable: list[StoredRun] = []
        for run in runs:
            listed.add(run.run_id)
            if self._closing or self._fenced:
                break
            if self._owns(run):
                entry = self._armed.get(run.run_id)
                if entry is None or (
                    not entry.started
                    and entry.record is not None
                    and entry.record.revision != run.revision
                ):
                    # Our own runs need no store call: armed at once, not after the
                    # claims (a long list of claims must not hold them up).
                    self._arm_record(run)
            elif run.workflow in self._handlers and self._claimable(run, leases, wall):
                claimable.append(run)
        if claimable:
            # The lease listing may come from an index fed by a watch that lags (a
            # slow consumer): a lease that looks expired or missing there may have
            # been renewed since. Each such owner's lease is read again before its
            # runs are claimed (one read per owner, not per run), so a live owner's
            # started run is never claimed and run twice.
            owners = {run.owner for run in claimable if run.owner is not None}
            for owner in owners:
                fresh = await self._call("get_lease", store.get_lease, owner)
                if fresh is None:
                    leases.pop(owner, None)
                else:
                    leases[owner] = fresh
            claimable = [run for run in claimable if self._claimable(run, leases, wall)]
        # Claims go CLAIM_CONCURRENCY at a time, earliest due first, and each batch is
        # armed (in due order) as soon as it is claimed: one round trip after the
        # other, a dead process's backlog held the sweep, and every run behind it,
        # for seconds.
        for start in range(0, len(claimable), CLAIM_CONCURRENCY):
            if self._closing or self._fenced:
                break
            batch = claimable[start : start + CLAIM_CONCURRENCY]
            results: list[StoredRun | None] = [None] * len(batch)
            failed: list[BackendError] = []
            async with trio.open_nursery() as claims:
                for i, run in enumerate(batch):
                    claims.start_soon(self._claim_into, run, results, i, failed)
            for claimed in results:
                if claimed is not None:
                    self._arm_record(claimed)
            if failed:
                raise failed[0]
        # Armed runs that left the horizon (or the store) since they were armed.
        for run_id, entry in list(self._armed.items()):
            if (
                entry.record is not None
                and not entry.started
                and not entry.drain
                and entry.sweep < sweep
                and run_id not in listed
            ):
                entry.scope.cancel()
                del self._armed[run_id]
        if sweep % PURGE_EVERY == 1:
            await self._purge(leases, wall)
        # Wake when the next live peer's lease lapses (its runs become claimable).
        expiries = [
            lease.expires_at + self._options.max_clock_skew - wall
            for lease in leases.values()
            if lease.process_id != self.process_id and not lease.released
        ]
        upcoming = [e for e in expiries if e > 0]
        return min(upcoming, default=math.inf) + 0.01

    async def _claim_into(
        self,
        run: StoredRun,
        results: list[StoredRun | None],
        i: int,
        failed: list[BackendError],
    ) -> None:
        """:meth:`_claim` as a task of a batch: the claimed record goes to
        ``results[i]``, a store failure to ``failed``."""
        try:
            results[i] = await self._claim(run)
        except BackendError as exc:
            failed.append(exc)

    async def _claim(self, run: StoredRun) -> StoredRun | None:
        assert self._store is not None
        assert self._lease is not None
        claimed = await self._call(
            "update_run",
            self._store.update_run,
            run.replace(owner=self.process_id, epoch=self._lease.epoch, token=run.token + 1),
        )
        if claimed is None:
            return None  # another process claimed or changed it first
        self._stats["taken_over"] += 1
        logger.info("process %r took over run %r from %r", self.process_id, run.run_id, run.owner)
        return claimed

    async def _purge(self, leases: Mapping[str, Lease], wall: float) -> None:
        assert self._store is not None
        store = self._store
        old = await self._call(
            "list_runs",
            lambda: store.list_runs(
                states={RunState.DONE},
                finished_before=wall - self._options.retention,
                limit=PURGE_BATCH,
            ),
        )
        for run in old:
            await self._call("delete_run", store.delete_run, run.run_id, revision=run.revision)
        for lease in leases.values():
            if (
                lease.process_id != self.process_id
                and lease.expires_at + self._options.retention < wall
            ):
                await self._call(
                    "delete_lease",
                    store.delete_lease,
                    lease.process_id,
                    revision=lease.revision,
                )

    # ---------------------------------------------------------------- arming

    def _in_horizon(self, due: float) -> bool:
        return due <= self._wall() + self._options.horizon

    def _arm_record(self, record: StoredRun, *, drain: bool = False) -> _Armed | None:
        return self._arm(record.run_id, record.scheduled_at, record, None, drain)

    def _arm_local(self, run: _LocalRun, *, drain: bool = False) -> _Armed | None:
        return self._arm(run.run_id, run.scheduled_at, None, run, drain)

    def _arm(
        self,
        run_id: str,
        due: float,
        record: StoredRun | None,
        local: _LocalRun | None,
        drain: bool,
    ) -> _Armed | None:
        """Give the run a task (replacing a waiting one); None if it cannot have one."""
        if self._closing or self._nursery is None:
            return None
        old = self._armed.get(run_id)
        if old is not None:
            if old.started:
                return None  # its finish re-reads the record and re-arms it
            old.scope.cancel()
        entry = _Armed(run_id, due, record, local, drain=drain, sweep=self._sweeps)
        self._armed[run_id] = entry
        self._nursery.start_soon(self._run_task, entry)
        return entry

    def _push_local(self, run: _LocalRun) -> None:
        heapq.heappush(
            self._local_heap, (run.scheduled_at, next(self._heap_seq), run.run_id, run.version)
        )
        self._local_wake.set()

    async def _local_loop(self) -> None:
        """Arms non-persisted runs as they enter the horizon; purges local tombstones."""
        with self._local_scope:
            await self._local_forever()

    async def _local_forever(self) -> None:
        while True:
            wall = self._wall()
            horizon_end = wall + self._options.horizon
            while self._local_heap and self._local_heap[0][0] <= horizon_end:
                _, _, run_id, version = heapq.heappop(self._local_heap)
                run = self._local.get(run_id)
                if run is not None and run.version == version and run_id not in self._armed:
                    self._arm_local(run)
            cutoff = wall - self._options.retention
            for run_id, (_, finished, _) in list(self._local_done.items()):
                if finished < cutoff:  # kept for retention seconds, then gone
                    del self._local_done[run_id]
            # No polling: sleep until the next run enters the horizon or the next
            # tombstone expires (a replay on a virtual clock would spin otherwise).
            wait = math.inf
            if self._local_heap:
                wait = self._local_heap[0][0] - horizon_end
            if self._local_done:
                oldest = min(finished for _, finished, _ in self._local_done.values())
                # Just past the retention (a wait of 0 would spin at that instant).
                wait = min(wait, max(oldest - cutoff, 0.0) + _TICK)
            with trio.move_on_after(max(wait, 0.0)):
                await self._local_wake.wait()
            self._local_wake = trio.Event()

    # ---------------------------------------------------------------- one run

    async def _sleep_until_wall(self, due: float) -> None:
        # Sleep on Trio's clock, then re-check the wall clock: a clock slewed or a host
        # suspended meanwhile never fires a run early.
        while True:
            wall = self._wall()
            if wall >= due:
                return
            await trio.sleep_until(wall_to_trio(due, wall_now=wall, trio_now=trio.current_time()))

    async def _run_task(self, entry: _Armed) -> None:
        acquired = False
        try:
            with entry.scope:
                if not entry.drain:
                    await self._sleep_until_wall(entry.due)
                await self._gate.acquire(entry.due)
                acquired = True
            if not acquired:
                return
            # Checked once a slot is free: a run that waited behind max_concurrent_runs
            # past its expiry (or its misfire grace) is dropped too.
            try:
                if await self._dropped_late(entry):
                    return
            except BackendError as exc:
                logger.error("run %r: the store refused the drop step: %s", entry.run_id, exc)
                return
            entry.started = True
            self._running += 1
            try:
                await self._start(entry)
            except BackendError as exc:
                # Not an outage (those are retried): a refusal such as revoked
                # permissions. The run stays in the store as it is; the next sweep
                # re-arms it if it is still ours and pending.
                logger.error("run %r: the store refused a step: %s", entry.run_id, exc)
            finally:
                self._running -= 1
                if self._running == 0:
                    self._idle_lot.unpark_all()
        finally:
            if acquired:
                self._gate.release()
            if self._armed.get(entry.run_id) is entry:
                del self._armed[entry.run_id]
            if entry.local is not None:
                # Re-scheduled while its handler ran: the new run waits for its time.
                newer = self._local.get(entry.run_id)
                if newer is not None and newer is not entry.local and not self._closed:
                    self._push_local(newer)
            entry.done.set()

    def _fire_of(self, entry: _Armed, payload: Any, attempt: int, token: int) -> RunFire:
        if entry.record is not None:
            workflow, scheduled_at = entry.record.workflow, entry.record.scheduled_at
        else:
            assert entry.local is not None
            workflow, scheduled_at = entry.local.workflow, entry.local.scheduled_at
        return RunFire(
            workflow=workflow,
            run_id=entry.run_id,
            payload=payload,
            scheduled_at=scheduled_at,
            started_at=self._wall(),
            attempt=attempt,
            fencing_token=token,
            persisted=entry.record is not None,
        )

    async def _dropped_late(self, entry: _Armed) -> bool:
        """Drop a run that came due past ``expires_at`` or ``misfire_grace``."""
        wall = self._wall()
        payload: Any
        if entry.record is not None:
            expires_at, payload = entry.record.expires_at, entry.record.payload
        else:
            assert entry.local is not None
            expires_at, payload = entry.local.expires_at, entry.local.payload
        reason: DropReason
        if expires_at is not None and wall > expires_at:
            reason = "expired"
        elif (
            not entry.drain
            and self._options.misfire_grace is not None
            and wall - entry.due > self._options.misfire_grace
        ):
            reason = "misfired"
        else:
            return False
        if entry.record is not None:
            record = entry.record
            try:
                payload = json.loads(payload)
            except (ValueError, RecursionError):
                payload = None
            if not await self._step(entry, _tombstone(record, wall, reason)):
                return True
        else:
            assert entry.local is not None
            self._local.pop(entry.run_id, None)
            self._local_done[entry.run_id] = (entry.local, wall, reason)
            self._local_wake.set()  # the local loop purges it after the retention
        self._stats[reason] += 1
        logger.warning(
            "deferred run %r (%s) dropped: %s (due %.3f, now %.3f)",
            entry.run_id,
            self._workflow_of(entry),
            reason,
            entry.due,
            wall,
        )
        if self._on_expired is not None:
            fire = self._fire_of(entry, payload, 0, 0)
            try:
                self._on_expired(fire, reason)
            except Exception:
                logger.exception("on_expired raised for run %r", entry.run_id)
        return True

    def _workflow_of(self, entry: _Armed) -> str:
        if entry.record is not None:
            return entry.record.workflow
        assert entry.local is not None
        return entry.local.workflow

    async def _step(self, entry: _Armed, new: StoredRun) -> bool:
        """Write ``new`` over the armed record by compare-and-swap, retrying store
        failures; True if it was written (``entry.record`` becomes it). False when the
        record changed (re-armed if it is still ours and pending) or is gone."""
        assert self._store is not None
        delay = 0.1
        expected = new
        # Past the lease the claim may be a peer's: leave the run to the store then.
        give_up = trio.current_time() + self._options.lease
        while True:
            try:
                written = await self._call("update_run", self._store.update_run, expected)
                if written is not None:
                    entry.record = written
                    return True
                current = await self._call("get_run", self._store.get_run, entry.run_id)
            except BackendUnavailableError as exc:
                if trio.current_time() >= give_up:
                    logger.warning(
                        "run %r: the store has been unreachable for longer than the lease; "
                        "the run is left in the store for whoever holds its claim",
                        entry.run_id,
                    )
                    return False
                logger.warning("run %r: store step failed (%s); retrying", entry.run_id, exc)
                await trio.sleep(delay)
                delay = min(delay * 2, MAX_STEP_RETRY)
                try:
                    current = await self._call("get_run", self._store.get_run, entry.run_id)
                except BackendUnavailableError:
                    continue
            if current is not None and _same_write(current, new):
                entry.record = current  # our write landed; its answer was lost
                return True
            if current is not None and current.revision == new.revision:
                continue  # unchanged: the failed write did not land, so write again
            self._stale(entry, current)
            return False

    def _stale(self, entry: _Armed, current: StoredRun | None) -> None:
        self._stats["stale"] += 1
        logger.info("run %r changed since it was armed; not run from the old record", entry.run_id)
        if current is not None and current.state is RunState.PENDING and self._owns(current):
            if self._armed.get(entry.run_id) is entry:
                del self._armed[entry.run_id]
            if self._in_horizon(current.scheduled_at) or entry.drain:
                self._arm_record(current, drain=entry.drain)

    async def _start(self, entry: _Armed) -> None:
        if entry.record is None:
            await self._start_local(entry)
            return
        record = entry.record
        handler = self._handlers.get(record.workflow)
        retries = self._options.retries if self._delivery == "at-least-once" else 0
        ok = False
        for retry in itertools.count():
            record = entry.record
            wall = self._wall()
            if self._delivery == "at-least-once":
                begin = record.replace(
                    state=RunState.STARTED,
                    attempt=record.attempt + 1,
                    token=record.token + 1,
                    started_at=wall,
                )
            else:
                begin = _tombstone(record, wall, "ran").replace(
                    attempt=record.attempt + 1, token=record.token + 1, started_at=wall
                )
            if not await self._step(entry, begin):
                return
            try:
                payload = json.loads(record.payload)
            except (ValueError, RecursionError) as exc:
                logger.error("run %r: its stored payload is not JSON (%s)", entry.run_id, exc)
                ok = False
                break
            fire = self._fire_of(entry, payload, begin.attempt, begin.token)
            ok = await self._call_handler(handler, fire)
            if ok or retry >= retries:
                break
            self._stats["retried"] += 1
            await trio.sleep(self._retry_delay(retry))
        self._stats["completed" if ok else "failed"] += 1
        if self._delivery == "at-least-once":
            record = entry.record
            wall = self._wall()
            if not await self._step(entry, _tombstone(record, wall, "ran" if ok else "failed")):
                logger.info(
                    "run %r changed while its handler ran (re-scheduled, cancelled or taken "
                    "over); its record was left as it is",
                    entry.run_id,
                )

    def _retry_delay(self, retry: int) -> float:
        """Seconds before retry ``retry + 1``: ``retry_backoff`` doubled each time,
        capped at 60 (the exponent too, so that it cannot overflow)."""
        return min(self._options.retry_backoff * 2.0 ** min(retry, 16), 60.0)

    async def _start_local(self, entry: _Armed) -> None:
        run = entry.local
        assert run is not None
        if self._local.get(run.run_id) is not run:
            self._stats["stale"] += 1
            return
        handler = self._handlers.get(run.workflow)
        retries = self._options.retries if self._delivery == "at-least-once" else 0
        ok = False
        for retry in itertools.count():
            run.attempt += 1
            fire = self._fire_of(entry, run.payload, run.attempt, next(self._tokens))
            ok = await self._call_handler(handler, fire)
            if ok or retry >= retries:
                break
            self._stats["retried"] += 1
            await trio.sleep(self._retry_delay(retry))
        if self._local.get(run.run_id) is run:
            del self._local[run.run_id]
            self._local_done[run.run_id] = (run, self._wall(), "ran" if ok else "failed")
            self._local_wake.set()  # the local loop purges it after the retention
        self._stats["completed" if ok else "failed"] += 1

    async def _call_handler(self, handler: RunHandler | None, fire: RunFire) -> bool:
        if handler is None:
            logger.error(
                "deferred run %r: no run handler for workflow %r", fire.run_id, fire.workflow
            )
            return False
        try:
            await invoke(handler, fire)
        except Exception:
            logger.exception(
                "run handler for %r (run %r, attempt %d) raised",
                fire.workflow,
                fire.run_id,
                fire.attempt,
            )
            return False
        return True

    # ---------------------------------------------------------------- public API

    def set_handler(self, workflow: str, handler: RunHandler | None) -> None:
        _validate.name("workflow", workflow)
        _validate.shareable("workflow", workflow)  # run records leave the process
        if handler is None:
            self._handlers.pop(workflow, None)
            return
        _validate.handler(f"the run handler of {workflow!r}", handler)
        self._handlers[workflow] = handler
        if self._store is not None and self._nursery is not None:
            self._sweep_wake.set()  # claim runs of the newly handled workflow

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the coordinator is closed")

    async def schedule(
        self,
        workflow: str,
        run_id: str | None,
        payload: Any,
        *,
        at: object,
        after: object,
        persist: bool,
        expires_at: object,
    ) -> ScheduledRun:
        self._check_open()
        _validate.name("workflow", workflow)
        if workflow not in self._handlers:
            raise LookupError(
                f"no run handler for workflow {workflow!r}: register one with "
                "set_run_handler() or open_coordinator(run_handlers=...)"
            )
        if run_id is None:
            run_id = uuid.uuid4().hex
        else:
            _validate.name("run_id", run_id)
        if (at is None) == (after is None):
            raise TypeError(
                f"schedule() takes exactly one of at= and after=, got at={at!r}, after={after!r}"
            )
        if not isinstance(persist, bool):
            raise TypeError(f"persist must be a bool, not {persist!r}")
        wall = self._wall()
        if at is not None:
            due = wall_seconds("at", at)
        else:
            due = wall + _validate.duration("after", after)
        expiry = None
        if expires_at is not None:
            expiry = wall_seconds("expires_at", expires_at)
            if not expiry > due:
                raise ValueError(
                    f"run {run_id!r}: expires_at ({expiry!r}) must be after the run's time "
                    f"({due!r})"
                )
        if persist:
            return await self._schedule_persisted(workflow, run_id, payload, due, expiry, wall)
        return self._schedule_local(workflow, run_id, payload, due, expiry, wall)

    def _schedule_local(
        self,
        workflow: str,
        run_id: str,
        payload: Any,
        due: float,
        expiry: float | None,
        wall: float,
    ) -> ScheduledRun:
        done = self._local_done.get(run_id)
        if done is not None and done[1] < wall - self._options.retention:
            del self._local_done[run_id]  # past its retention (the loop purges lazily)
            done = None
        if done is not None:
            old_run = done[0]
            return ScheduledRun(
                run_id, old_run.workflow, old_run.scheduled_at, "already-ran", old_run.version,
                False, self.process_id,
            )  # fmt: skip
        entry = self._armed.get(run_id)
        if entry is not None and entry.record is not None:
            raise ValueError(
                f"run {run_id!r} is a persisted run held by this coordinator; schedule it "
                "with persist=True to re-schedule it"
            )
        old = self._local.get(run_id)
        if old is not None and old.workflow != workflow:
            raise _other_workflow(run_id, old.workflow, workflow)
        version = 1 if old is None else old.version + 1
        run = _LocalRun(run_id, workflow, payload, due, expiry, version, wall)
        self._local[run_id] = run
        if entry is not None and not entry.started:
            entry.scope.cancel()
            del self._armed[run_id]
        if self._in_horizon(due) and (entry is None or not entry.started):
            self._arm_local(run)
        else:
            self._push_local(run)
        self._stats["scheduled"] += 1
        return ScheduledRun(
            run_id, workflow, due, "scheduled" if old is None else "rescheduled", version, False,
            self.process_id,
        )  # fmt: skip

    async def _schedule_persisted(
        self,
        workflow: str,
        run_id: str,
        payload: Any,
        due: float,
        expiry: float | None,
        wall: float,
    ) -> ScheduledRun:
        store = self._store
        if store is None:
            raise ValueError(
                f"run {run_id!r}: persist=True needs a run store (open_coordinator(run_store=...))"
            )
        if run_id in self._local:
            raise ValueError(
                f"run {run_id!r} is a non-persisted run of this coordinator; schedule it "
                "with persist=False to re-schedule it"
            )
        # The workflow has a run handler, so its name was checked when that was set.
        _validate.shareable("run_id", run_id)
        text = _encode_payload(run_id, payload)
        size = len(text.encode("utf-8"))
        if size > store.max_payload_bytes:
            raise DocumentTooLargeError(
                f"run {run_id!r}: its payload is {size} bytes of JSON, more than the run "
                f"store's limit of {store.max_payload_bytes}"
            )
        if self._fenced or self._lease is None:
            raise BackendError(
                f"process id {self.process_id!r} is held by another coordinator; this one "
                "cannot claim runs"
            )
        epoch = self._lease.epoch
        # A new id first (one store call); an existing one is read and replaced.
        fresh = True
        for _ in range(50):
            current = None if fresh else await self._call("get_run", store.get_run, run_id)
            fresh = False
            if current is None:
                new = StoredRun(
                    run_id=run_id,
                    workflow=workflow,
                    payload=text,
                    scheduled_at=due,
                    expires_at=expiry,
                    owner=self.process_id,
                    epoch=epoch,
                    token=1,
                    created_at=wall,
                )
                written = await self._call("create_run", store.create_run, new)
                outcome = "scheduled"
            elif current.state is RunState.DONE:
                return ScheduledRun(
                    run_id, current.workflow, current.scheduled_at, "already-ran",
                    current.version, True, current.owner,
                )  # fmt: skip
            elif current.workflow != workflow:
                raise _other_workflow(run_id, current.workflow, workflow)
            else:
                new = current.replace(
                    payload=text,
                    scheduled_at=due,
                    expires_at=expiry,
                    version=current.version + 1,
                    state=RunState.PENDING,
                    attempt=0 if current.state is RunState.STARTED else current.attempt,
                )
                written = await self._call("update_run", store.update_run, new)
                outcome = "rescheduled"
            if written is None:
                continue  # lost a race: read again
            self._stats["scheduled"] += 1
            if self._owns(written) and self._in_horizon(due):
                self._arm_record(written)
            elif self._owns(written):
                entry = self._armed.get(run_id)
                if entry is not None and not entry.started:
                    entry.scope.cancel()
                    del self._armed[run_id]
            elif written.owner is not None:
                # A peer holds it: it re-reads the record at its next sweep or step.
                pass
            return ScheduledRun(
                run_id, workflow, due, outcome, written.version, True,  # type: ignore[arg-type]
                written.owner,
            )  # fmt: skip
        raise BackendUnavailableError(f"run {run_id!r}: could not be scheduled under contention")

    async def cancel_run(self, run_id: str) -> bool:
        self._check_open()
        _validate.name("run_id", run_id)
        entry = self._armed.get(run_id)
        if entry is not None and not entry.started:
            entry.scope.cancel()
            del self._armed[run_id]
        local = self._local.get(run_id)
        if local is not None:
            if entry is not None and entry.started and entry.local is local:
                return False  # its handler runs: not stopped, and it keeps its tombstone
            # Pending (possibly a re-schedule made while an older version runs).
            del self._local[run_id]
            return True
        if self._store is None:
            return False
        store = self._store
        for _ in range(50):
            current = await self._call("get_run", store.get_run, run_id)
            if current is None or current.state is not RunState.PENDING:
                return False
            if await self._call("delete_run", store.delete_run, run_id, revision=current.revision):
                return True
        raise BackendUnavailableError(f"run {run_id!r}: could not be cancelled under contention")

    def has_run(self, run_id: str) -> bool:
        local = self._local.get(run_id)
        if local is not None:
            return self._local_state(local) is RunState.PENDING
        entry = self._armed.get(run_id)
        return entry is not None and not entry.started

    def _local_info(self, run: _LocalRun, state: RunState, outcome: str | None) -> RunInfo:
        return RunInfo(
            run.run_id, run.workflow, state, self.process_id, run.scheduled_at, run.expires_at,
            run.attempt, run.version, False, outcome,
        )  # fmt: skip

    def _local_state(self, run: _LocalRun) -> RunState:
        entry = self._armed.get(run.run_id)
        started = entry is not None and entry.started and entry.local is run
        return RunState.STARTED if started else RunState.PENDING

    async def get_run(self, run_id: str) -> RunInfo | None:
        _validate.name("run_id", run_id)
        local = self._local.get(run_id)
        if local is not None:
            return self._local_info(local, self._local_state(local), None)
        done = self._local_done.get(run_id)
        if done is not None:
            return self._local_info(done[0], RunState.DONE, done[2])
        if self._store is None:
            return None
        record = await self._call("get_run", self._store.get_run, run_id)
        return None if record is None else _info(record)

    async def list_runs(
        self,
        *,
        workflow: str | None,
        state: RunState | str | None,
        owner: str | _Any | None,
        limit: int | None,
    ) -> list[RunInfo]:
        if workflow is not None:
            _validate.name("workflow", workflow)
        if owner is not None and owner is not ANY:
            _validate.name("owner", owner)
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            raise ValueError(f"limit must be an int >= 0 or None, got {limit!r}")
        try:
            states = None if state is None else {RunState(state)}
        except ValueError:
            raise ValueError(
                f"state must be one of 'pending', 'started', 'done' or None, got {state!r}"
            ) from None
        infos: list[RunInfo] = []
        local = [
            self._local_info(run, self._local_state(run), None) for run in self._local.values()
        ]
        local.extend(
            self._local_info(run, RunState.DONE, outcome)
            for run, _, outcome in self._local_done.values()
        )
        for info in local:
            if (
                (workflow is None or info.workflow == workflow)
                and owner in (ANY, self.process_id)
                and (states is None or info.state in states)
            ):
                infos.append(info)
        if self._store is not None:
            store = self._store
            records = await self._call(
                "list_runs",
                lambda: store.list_runs(states=states, owner=owner, workflow=workflow, limit=limit),
            )
            infos.extend(_info(record) for record in records)
        infos.sort(key=lambda i: (i.scheduled_at, i.run_id))
        return infos if limit is None else infos[:limit]

    async def drain(self) -> int:
        self._check_open()
        entries: list[_Armed] = []
        for run in list(self._local.values()):
            entry = self._armed.get(run.run_id)
            if entry is not None and entry.started:
                continue
            made = self._arm_local(run, drain=True)
            if made is not None:
                entries.append(made)
        if self._store is not None and self._lease is not None:
            store = self._store
            mine = await self._call(
                "list_runs",
                lambda: store.list_runs(states={RunState.PENDING}, owner=self.process_id),
            )
            for record in mine:
                if not self._owns(record):
                    continue
                entry = self._armed.get(record.run_id)
                if entry is not None and entry.started:
                    continue
                made = self._arm_record(record, drain=True)
                if made is not None:
                    entries.append(made)
        for entry in entries:
            # A run re-armed meanwhile (a re-schedule, another drain) is waited for too.
            while True:
                await entry.done.wait()
                newer = self._armed.get(entry.run_id)
                if newer is None or newer is entry:
                    break
                entry = newer
        return len(entries)

    def statistics(self) -> RunStatistics:
        held = sum(1 for r in self._local.values() if self._local_state(r) is RunState.PENDING)
        held += sum(1 for e in self._armed.values() if e.record is not None and not e.started)
        figures = dict(self._stats, held=held, running=self._running)
        return RunStatistics(**figures)


def _wall_clock(options: RunOptions, store: RunStore | None) -> Callable[[], float]:
    """The scheduler's wall clock: ``RunOptions.wall_time``, else the run store's.

    Without a run store no time leaves the process, so it is Trio's clock, as epoch
    seconds from the wall-clock time read now (inside the Trio run): whatever the
    clock (a :class:`trio.testing.MockClock` too), non-persisted runs are timed on it.
    """
    if options.wall_time is not None:
        return options.wall_time
    if store is not None:
        return store.wall_time
    offset = WallClock.now(default_wall_time)
    return lambda: offset.from_trio(trio.current_time())


def _other_workflow(run_id: str, scheduled: str, asked: str) -> ValueError:
    return ValueError(
        f"run {run_id!r} is already scheduled for workflow {scheduled!r}, not {asked!r} "
        "(run ids are unique across workflows)"
    )


def _tombstone(record: StoredRun, wall: float, outcome: str) -> StoredRun:
    """``record`` as a tombstone finished at ``wall`` (its payload no longer kept)."""
    return record.replace(state=RunState.DONE, finished_at=wall, outcome=outcome, payload="null")


def _same_write(current: StoredRun, new: StoredRun) -> bool:
    """Whether ``current`` is ``new`` as written (a write whose answer was lost)."""
    return current.replace(revision=0) == new.replace(revision=0)


def _info(record: StoredRun) -> RunInfo:
    return RunInfo(
        record.run_id, record.workflow, record.state, record.owner, record.scheduled_at,
        record.expires_at, record.attempt, record.version, True, record.outcome,
    )  # fmt: skip
