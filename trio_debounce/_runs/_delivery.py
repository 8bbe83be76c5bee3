"""The task of each armed run: it sleeps until the run's time, waits for a free slot
(earliest due first), drops the run if it came too late, starts it by
compare-and-swap, calls its handler (retrying failures under at-least-once delivery)
and records how it ended."""

from __future__ import annotations

import heapq
import itertools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from .._backend import Delivery
from .._errors import BackendError, BackendUnavailableError
from .._invoke import invoke
from .._wallclock import wall_to_trio
from ._calls import Counters, StoreCalls
from ._lease import RunLease
from ._local import LocalRuns, _LocalRun
from ._store import RunState, StoredRun
from ._types import DropReason, ExpiredCallback, RunFire, RunHandler, RunOptions

logger = logging.getLogger("trio_debounce.runs")

#: Longest wait between two retries of a failed store step, seconds.
MAX_STEP_RETRY = 5.0


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


class ArmedRuns:
    """The runs that hold a task, persisted and not, and those tasks.

    Every step that decides a persisted run (start, finish, drop) is a
    compare-and-swap against the record as armed: a run re-scheduled, cancelled or
    claimed elsewhere meanwhile is re-read, re-armed or dropped, never run stale.

    Attributes:
      entries (dict[str, _Armed]): the armed runs by id (read-only outside this class).
      nursery (trio.Nursery | None): where the tasks run (None: not started yet).
      closing (bool): no run gets a task any more.
      closed (bool): the running handlers finished too.
      running (int): handlers running now.
    """

    def __init__(
        self,
        *,
        call: StoreCalls | None,
        lease: RunLease | None,
        local: LocalRuns,
        handlers: Mapping[str, RunHandler],
        options: RunOptions,
        delivery: Delivery,
        on_expired: ExpiredCallback | None,
        wall: Callable[[], float],
        stats: Counters,
    ) -> None:
        self._call = call
        self._lease = lease
        self._local = local
        self._handlers = handlers
        self._options = options
        self._delivery = delivery
        self._on_expired = on_expired
        self._wall = wall
        self._stats = stats
        self.entries: dict[str, _Armed] = {}
        self.nursery: trio.Nursery | None = None
        self.closing = False
        self.closed = False
        self.running = 0
        self._gate = _DueOrderGate(options.max_concurrent_runs)
        self._idle_lot = trio.lowlevel.ParkingLot()
        self._tokens = itertools.count(1)
        self._sweeps = 0

    # ---------------------------------------------------------------- arming

    def in_horizon(self, due: float) -> bool:
        return due <= self._wall() + self._options.horizon

    def arm_record(self, record: StoredRun, *, drain: bool = False) -> _Armed | None:
        return self._arm(record.run_id, record.scheduled_at, record, None, drain)

    def arm_local(self, run: _LocalRun, *, drain: bool = False) -> _Armed | None:
        return self._arm(run.run_id, run.scheduled_at, None, run, drain)

    def arm_local_unless_armed(self, run: _LocalRun) -> None:
        """:meth:`arm_local`, unless the run id holds a task already."""
        if run.run_id not in self.entries:
            self.arm_local(run)

    def arm_listed(self, run: StoredRun) -> None:
        """One of our own runs as a sweep listed it: armed, unless it holds a task for
        this revision already (or its handler runs)."""
        entry = self.entries.get(run.run_id)
        if entry is None or (
            not entry.started and entry.record is not None and entry.record.revision != run.revision
        ):
            self.arm_record(run)

    def _arm(
        self,
        run_id: str,
        due: float,
        record: StoredRun | None,
        local: _LocalRun | None,
        drain: bool,
    ) -> _Armed | None:
        """Give the run a task (replacing a waiting one); None if it cannot have one."""
        if self.closing or self.nursery is None:
            return None
        old = self.entries.get(run_id)
        if old is not None:
            if old.started:
                return None  # its finish re-reads the record and re-arms it
            old.scope.cancel()
        entry = _Armed(run_id, due, record, local, drain=drain, sweep=self._sweeps)
        self.entries[run_id] = entry
        self.nursery.start_soon(self._run_task, entry)
        return entry

    def begin_sweep(self) -> int:
        """Count a claim sweep; returns its number (runs armed from now on carry it)."""
        self._sweeps += 1
        return self._sweeps

    def disarm(self, run_id: str) -> None:
        """Stop the task of ``run_id`` if it waits (a started one runs on)."""
        entry = self.entries.get(run_id)
        if entry is not None and not entry.started:
            entry.scope.cancel()
            del self.entries[run_id]

    def disarm_unlisted(self, listed: set[str], sweep: int) -> None:
        """Stop the waiting persisted runs armed before sweep ``sweep`` that it did not
        list: they left the horizon (or the store) since."""
        for run_id, entry in list(self.entries.items()):
            if (
                entry.record is not None
                and not entry.started
                and not entry.drain
                and entry.sweep < sweep
                and run_id not in listed
            ):
                entry.scope.cancel()
                del self.entries[run_id]

    def drop_waiting_persisted(self) -> None:
        """Fenced: the persisted runs that wait for their time are left to their new
        owner."""
        for entry in list(self.entries.values()):
            if not entry.started and entry.record is not None:
                entry.scope.cancel()

    def waiting_persisted(self) -> int:
        return sum(1 for e in self.entries.values() if e.record is not None and not e.started)

    async def close(self) -> None:
        """No run gets a task any more and the waiting ones stop; then wait for the
        running handlers (which may still schedule and cancel until they finish)."""
        self.closing = True
        for entry in list(self.entries.values()):
            if not entry.started:
                entry.scope.cancel()
        while self.running:
            await self._idle_lot.park()
        self.closed = True

    def abort(self) -> None:
        """The scheduler's task ended (its nursery cancelled every task)."""
        self.closing = self.closed = True

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
            if entry.local is not None:
                entry.local.running = True
            self.running += 1
            try:
                await self._start(entry)
            except BackendError as exc:
                # Not an outage (those are retried): a refusal such as revoked
                # permissions. The run stays in the store as it is; the next sweep
                # re-arms it if it is still ours and pending.
                logger.error("run %r: the store refused a step: %s", entry.run_id, exc)
            finally:
                self.running -= 1
                if self.running == 0:
                    self._idle_lot.unpark_all()
        finally:
            if acquired:
                self._gate.release()
            if self.entries.get(entry.run_id) is entry:
                del self.entries[entry.run_id]
            if entry.local is not None:
                if entry.started:
                    entry.local.running = False
                # Re-scheduled while its handler ran: the new run waits for its time.
                newer = self._local.pending.get(entry.run_id)
                if newer is not None and newer is not entry.local and not self.closed:
                    self._local.push(newer)
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
            self._local.drop(entry.local, wall, reason)
        self._stats[reason] += 1
        logger.warning(
            "deferred run %r (%s) dropped: %s (due %.3f, now %.3f)",
            entry.run_id,
            _workflow_of(entry),
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

    async def _step(self, entry: _Armed, new: StoredRun) -> bool:
        """Write ``new`` over the armed record by compare-and-swap, retrying store
        failures; True if it was written (``entry.record`` becomes it). False when the
        record changed (re-armed if it is still ours and pending) or is gone."""
        call = self._call
        assert call is not None
        store = call.store
        delay = 0.1
        expected = new
        # Past the lease the claim may be a peer's: leave the run to the store then.
        give_up = trio.current_time() + self._options.lease
        while True:
            try:
                written = await call("update_run", store.update_run, expected)
                if written is not None:
                    entry.record = written
                    return True
                current = await call("get_run", store.get_run_current, entry.run_id)
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
                    current = await call("get_run", store.get_run_current, entry.run_id)
                except BackendUnavailableError:
                    continue
            if current is not None and _same_write(current, new):
                entry.record = current  # our write landed; its answer was lost
                return True
            if current is not None and current.revision == new.revision:
                continue  # unchanged: the failed write did not land, so write again
            self._rearm_changed(entry, current)
            return False

    def _rearm_changed(self, entry: _Armed, current: StoredRun | None) -> None:
        """The record changed since ``entry`` was armed: re-arm its current version if
        it is still ours and pending (and due within the horizon, or being drained)."""
        self._stats["stale"] += 1
        logger.info("run %r changed since it was armed; not run from the old record", entry.run_id)
        lease = self._lease
        if (
            current is not None
            and current.state is RunState.PENDING
            and lease is not None
            and lease.owns(current)
        ):
            if self.entries.get(entry.run_id) is entry:
                del self.entries[entry.run_id]
            if self.in_horizon(current.scheduled_at) or entry.drain:
                self.arm_record(current, drain=entry.drain)

    def _retries(self) -> int:
        return self._options.retries if self._delivery == "at-least-once" else 0

    async def _start(self, entry: _Armed) -> None:
        if entry.record is None:
            await self._start_local(entry)
            return
        record = entry.record
        handler = self._handlers.get(record.workflow)
        retries = self._retries()
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
            ok = await _call_handler(handler, fire)
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
        if self._local.pending.get(run.run_id) is not run:
            self._stats["stale"] += 1
            return
        handler = self._handlers.get(run.workflow)
        retries = self._retries()
        ok = False
        for retry in itertools.count():
            run.attempt += 1
            fire = self._fire_of(entry, run.payload, run.attempt, next(self._tokens))
            ok = await _call_handler(handler, fire)
            if ok or retry >= retries:
                break
            self._stats["retried"] += 1
            await trio.sleep(self._retry_delay(retry))
        self._local.finish(run, "ran" if ok else "failed")
        self._stats["completed" if ok else "failed"] += 1


def _workflow_of(entry: _Armed) -> str:
    if entry.record is not None:
        return entry.record.workflow
    assert entry.local is not None
    return entry.local.workflow


async def _call_handler(handler: RunHandler | None, fire: RunFire) -> bool:
    """Run ``handler(fire)``; False (logged) if there is none or it raised."""
    if handler is None:
        logger.error("deferred run %r: no run handler for workflow %r", fire.run_id, fire.workflow)
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


def _tombstone(record: StoredRun, wall: float, outcome: str) -> StoredRun:
    """``record`` as a tombstone finished at ``wall``. Its payload is no longer kept,
    unless the run failed: ``trio-debounce runs retry`` may make it pending again."""
    payload = record.payload if outcome == "failed" else "null"
    return record.replace(state=RunState.DONE, finished_at=wall, outcome=outcome, payload=payload)


def _same_write(current: StoredRun, new: StoredRun) -> bool:
    """Whether ``current`` is ``new`` as written (a write whose answer was lost)."""
    return current.replace(revision=0) == new.replace(revision=0)
