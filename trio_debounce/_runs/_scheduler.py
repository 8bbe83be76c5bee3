"""The deferred-run scheduler: what the coordinator calls.

One :class:`RunScheduler` belongs to one coordinator and runs as a task in its nursery.
It composes the parts, each in its module: the lease with its heartbeat (``_lease``),
the claim sweep (``_claims``), the task of each run due within the horizon
(``_delivery``) and the non-persisted runs (``_local``). See :doc:`/runs`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import trio

from .. import _validate
from .._backend import Delivery
from .._errors import BackendError, BackendUnavailableError, DocumentTooLargeError
from .._wallclock import WallClock
from ._calls import Counters, StoreCalls
from ._claims import ClaimSweep
from ._delivery import ArmedRuns, _Armed
from ._lease import RunLease
from ._local import LocalRuns, _LocalRun
from ._store import ANY, RunState, RunStateName, RunStore, StoredRun, _Any
from ._types import (
    ExpiredCallback,
    RunHandler,
    RunInfo,
    RunOptions,
    RunStatistics,
    ScheduledRun,
    default_wall_time,
    wall_seconds,
)


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
        self._options = options
        self._handlers: dict[str, RunHandler] = dict(handlers)
        self._wall = _wall_clock(options, store)
        assert options.process_id is not None
        self.process_id: str = options.process_id
        self._stats: Counters = dict.fromkeys(RunStatistics.__slots__, 0)
        self._call = None if store is None else StoreCalls(store, options.op_timeout, self._stats)
        self._lease = (
            None if self._call is None else RunLease(self._call, options, self._wall, self._stats)
        )
        self._local = LocalRuns(options, self._wall, self.process_id, self._stats)
        self._armed_runs = ArmedRuns(
            call=self._call,
            lease=self._lease,
            local=self._local,
            handlers=self._handlers,
            options=options,
            delivery=delivery,
            on_expired=on_expired,
            wall=self._wall,
            stats=self._stats,
        )
        #: The runs holding a task, by id: read here, armed and disarmed by ArmedRuns.
        self._armed: Mapping[str, _Armed] = self._armed_runs.entries
        self._sweep: ClaimSweep | None = None
        if self._call is not None and self._lease is not None:
            self._sweep = ClaimSweep(
                call=self._call,
                lease=self._lease,
                armed=self._armed_runs,
                handlers=self._handlers,
                options=options,
                wall=self._wall,
                stats=self._stats,
            )
        self._nursery: trio.Nursery | None = None
        self._loops = trio.CancelScope()

    # ---------------------------------------------------------------- lifecycle

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The scheduler's life, as a task of the coordinator's nursery."""
        if self._lease is not None:
            await self._lease.open()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = self._armed_runs.nursery = nursery
                with self._loops:
                    if self._sweep is not None:
                        nursery.start_soon(self._keep_lease)
                        nursery.start_soon(self._sweep.run)
                    nursery.start_soon(
                        self._local.arm_as_due, self._armed_runs.arm_local_unless_armed
                    )
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            self._armed_runs.abort()
            self._local.drop_waiting()  # after an abort: nothing else accounts for them
            if self._lease is not None:
                with trio.CancelScope(shield=True):
                    await self._lease.release()

    async def _keep_lease(self) -> None:
        """The heartbeat; once fenced, the persisted runs waiting for their time are
        left to the process id's new holder."""
        assert self._lease is not None
        await self._lease.keep_alive()
        self._armed_runs.drop_waiting_persisted()

    async def close(self) -> None:
        """The coordinator exits normally: stop timers and sweeps, drop non-persisted
        pending runs (with a warning), wait for running handlers, release the lease."""
        if self._armed_runs.closing:
            return
        # Closing: no run gets a task any more, but running handlers may still
        # schedule (a successor, say) and cancel until they finish.
        self._loops.cancel()
        if self._sweep is not None:
            self._sweep.scope.cancel()
        self._local.scope.cancel()
        if self._lease is not None:
            # No run starts here any more: peers may claim the pending ones now, and
            # run them on time, while the running handlers finish.
            await self._lease.mark_draining()
        # The heartbeat keeps running while handlers finish, so their claims hold.
        await self._armed_runs.close()
        self._local.drop_waiting()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def wait_process_id_free(self) -> None:
        """Before :meth:`run`: if the store holds a live lease of our process id, watch
        it for a renewal (see :class:`RunLease`). Once per scheduler; nothing to do
        without a store.

        Raises:
          ProcessIdTakenError: a live coordinator holds the process id.
          BackendError: the store failed a read.
        """
        if self._lease is not None:
            await self._lease.wait_process_id_free()
        else:
            await trio.lowlevel.checkpoint()

    # ---------------------------------------------------------------- public API

    def set_handler(self, workflow: str, handler: RunHandler | None) -> None:
        _validate.name("workflow", workflow)
        _validate.shareable("workflow", workflow)  # run records leave the process
        if handler is None:
            self._handlers.pop(workflow, None)
            return
        _validate.handler(f"the run handler of {workflow!r}", handler)
        self._handlers[workflow] = handler
        if self._sweep is not None and self._nursery is not None:
            self._sweep.wake()  # claim runs of the newly handled workflow

    def _check_open(self) -> None:
        if self._armed_runs.closed:
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
        due, expiry = _run_times(run_id, at, after, expires_at, wall)
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
        """Schedule (or re-schedule) a non-persisted run: held in memory, armed now if
        it is due within the horizon, else pushed for the local loop to arm."""
        done = self._local.tombstone(run_id, wall)
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
        old = self._local.pending.get(run_id)
        if old is not None and old.workflow != workflow:
            raise _other_workflow(run_id, old.workflow, workflow)
        version = 1 if old is None else old.version + 1
        run = _LocalRun(run_id, workflow, payload, due, expiry, version, wall)
        self._local.pending[run_id] = run
        self._armed_runs.disarm(run_id)  # the waiting task of the version replaced
        if self._armed_runs.in_horizon(due) and (entry is None or not entry.started):
            self._armed_runs.arm_local(run)
        else:
            self._local.push(run)
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
        """Schedule (or re-schedule) a persisted run: create its record claimed by this
        process, or replace the pending one by compare-and-swap (its claim kept), then
        arm it if it is ours and due within the horizon. A tombstone is left as it is
        (``"already-ran"``)."""
        call = self._call
        if call is None:
            raise ValueError(
                f"run {run_id!r}: persist=True needs a run store (open_coordinator(run_store=...))"
            )
        store = call.store
        if run_id in self._local.pending:
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
        lease = self._lease
        if lease is None or lease.fenced or lease.lease is None:
            raise BackendError(
                f"process id {self.process_id!r} is held by another coordinator; this one "
                "cannot claim runs"
            )
        epoch = lease.lease.epoch
        # A new id first (one store call); an existing one is read and replaced.
        fresh = True
        for _ in range(50):
            current = None if fresh else await call("get_run", store.get_run, run_id)
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
                written = await call("create_run", store.create_run, new)
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
                written = await call("update_run", store.update_run, new)
                outcome = "rescheduled"
            if written is None:
                continue  # lost a race: read again
            self._stats["scheduled"] += 1
            if lease.owns(written) and self._armed_runs.in_horizon(due):
                self._armed_runs.arm_record(written)
            elif lease.owns(written):
                self._armed_runs.disarm(run_id)  # due beyond the horizon now
            # Otherwise a peer holds it: it re-reads the record at its next sweep or step.
            return ScheduledRun(
                run_id, workflow, due, outcome, written.version, True,  # type: ignore[arg-type]
                written.owner,
            )  # fmt: skip
        raise BackendUnavailableError(f"run {run_id!r}: could not be scheduled under contention")

    async def cancel_run(self, run_id: str) -> bool:
        self._check_open()
        _validate.name("run_id", run_id)
        entry = self._armed.get(run_id)
        self._armed_runs.disarm(run_id)
        local = self._local.pending.get(run_id)
        if local is not None:
            if entry is not None and entry.started and entry.local is local:
                return False  # its handler runs: not stopped, and it keeps its tombstone
            # Pending (possibly a re-schedule made while an older version runs).
            del self._local.pending[run_id]
            return True
        call = self._call
        if call is None:
            return False
        store = call.store
        for _ in range(50):
            current = await call("get_run", store.get_run, run_id)
            if current is None or current.state is not RunState.PENDING:
                return False
            if await call("delete_run", store.delete_run, run_id, revision=current.revision):
                return True
        raise BackendUnavailableError(f"run {run_id!r}: could not be cancelled under contention")

    def has_run(self, run_id: str) -> bool:
        local = self._local.pending.get(run_id)
        if local is not None:
            return self._local.state(local) is RunState.PENDING
        entry = self._armed.get(run_id)
        return entry is not None and not entry.started

    async def get_run(self, run_id: str) -> RunInfo | None:
        _validate.name("run_id", run_id)
        local = self._local.pending.get(run_id)
        if local is not None:
            return self._local.info(local, self._local.state(local), None)
        done = self._local.done.get(run_id)
        if done is not None:
            return self._local.info(done[0], RunState.DONE, done[2])
        if self._call is None:
            return None
        record = await self._call("get_run", self._call.store.get_run, run_id)
        return None if record is None else _info(record)

    async def list_runs(
        self,
        *,
        workflow: str | None,
        state: RunState | RunStateName | None,
        owner: str | _Any | None,
        limit: int | None,
    ) -> list[RunInfo]:
        states = _list_filters(workflow, state, owner, limit)
        infos = [
            info
            for info in self._local.infos()
            if (workflow is None or info.workflow == workflow)
            and owner in (ANY, self.process_id)
            and (states is None or info.state in states)
        ]
        if self._call is not None:
            store = self._call.store
            records = await self._call(
                "list_runs",
                lambda: store.list_runs(states=states, owner=owner, workflow=workflow, limit=limit),
            )
            infos.extend(_info(record) for record in records)
        infos.sort(key=lambda i: (i.scheduled_at, i.run_id))
        return infos if limit is None else infos[:limit]

    async def drain(self) -> int:
        """Run every run held now (the non-persisted ones, and the persisted ones this
        process owns), whatever their time; returns how many were armed."""
        self._check_open()
        entries: list[_Armed] = []
        for run in list(self._local.pending.values()):
            entry = self._armed.get(run.run_id)
            if entry is not None and entry.started:
                continue
            made = self._armed_runs.arm_local(run, drain=True)
            if made is not None:
                entries.append(made)
        lease = self._lease
        if self._call is not None and lease is not None and lease.lease is not None:
            store = self._call.store
            mine = await self._call(
                "list_runs",
                lambda: store.list_runs(states={RunState.PENDING}, owner=self.process_id),
            )
            for record in mine:
                if not lease.owns(record):
                    continue
                entry = self._armed.get(record.run_id)
                if entry is not None and entry.started:
                    continue
                made = self._armed_runs.arm_record(record, drain=True)
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
        held = self._local.waiting() + self._armed_runs.waiting_persisted()
        figures = dict(self._stats, held=held, running=self._armed_runs.running)
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


def _run_times(
    run_id: str, at: object, after: object, expires_at: object, wall: float
) -> tuple[float, float | None]:
    """A run's due time and expiry, wall-clock epoch seconds, from ``schedule()``'s
    arguments (exactly one of ``at`` and ``after`` given), at wall time ``wall``.

    Raises:
      TypeError, ValueError: a time of the wrong type or out of range, or an expiry
        not after the due time.
    """
    due = wall_seconds("at", at) if at is not None else wall + _validate.duration("after", after)
    expiry = None
    if expires_at is not None:
        expiry = wall_seconds("expires_at", expires_at)
        if not expiry > due:
            raise ValueError(
                f"run {run_id!r}: expires_at ({expiry!r}) must be after the run's time ({due!r})"
            )
    return due, expiry


def _list_filters(
    workflow: str | None,
    state: RunState | RunStateName | None,
    owner: str | _Any | None,
    limit: int | None,
) -> set[RunState] | None:
    """Check ``list_runs()``'s filters; returns the states to list (None: all).

    Raises:
      TypeError, ValueError: a filter of the wrong type or out of range.
    """
    if workflow is not None:
        _validate.name("workflow", workflow)
    if owner is not None and owner is not ANY:
        _validate.name("owner", owner)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be an int >= 0 or None, got {limit!r}")
    try:
        return None if state is None else {RunState(state)}
    except ValueError:
        raise ValueError(
            f"state must be one of 'pending', 'started', 'done' or None, got {state!r}"
        ) from None


def _encode_payload(run_id: str, payload: Any) -> str:
    try:
        return json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(
            f"run {run_id!r}: a persisted payload must be JSON-serializable ({exc})"
        ) from None


def _other_workflow(run_id: str, scheduled: str, asked: str) -> ValueError:
    return ValueError(
        f"run {run_id!r} is already scheduled for workflow {scheduled!r}, not {asked!r} "
        "(run ids are unique across workflows)"
    )


def _info(record: StoredRun) -> RunInfo:
    return RunInfo(
        record.run_id, record.workflow, record.state, record.owner, record.scheduled_at,
        record.expires_at, record.attempt, record.version, True, record.outcome,
    )  # fmt: skip
