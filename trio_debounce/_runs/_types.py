"""Value types of deferred runs: options, what a handler gets, what the API returns."""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .. import _validate
from .._types import RunStatistics as RunStatistics
from ._store import RunState


@dataclass(frozen=True, slots=True)
class RunFire:
    """One start of a deferred run's handler, passed to it.

    Attributes:
      workflow (str): the run's workflow.
      run_id (str): the run's id (unique per store).
      payload (Any): the run's payload. For a persisted run it is the JSON
        round-tripped value (``json.loads(json.dumps(payload))``), in every process,
        so a handler sees the same value before and after a restart.
      scheduled_at (float): the run's logical time, wall-clock epoch seconds (what
        ``at``/``after`` asked for; a late run keeps its scheduled time).
      started_at (float): a wall-clock reading taken when this attempt started, epoch
        seconds.
      attempt (int): 1 for the first start; more when the run is started again (a
        retry after a failure, or a re-run after its process died in the handler
        under at-least-once delivery).
      fencing_token (int): increases with each claim and each start of the run: a
        side-effect store that keeps the highest token it has seen per run id can
        refuse a stale owner's late write.
      persisted (bool): whether the run is kept in the run store.
    """

    workflow: str
    run_id: str
    payload: Any
    scheduled_at: float
    started_at: float
    attempt: int
    fencing_token: int
    persisted: bool


#: The type of a run handler: ``async def handler(run: RunFire) -> None``, or any callable
#: taking a :class:`RunFire` and returning an awaitable (its result is ignored).
RunHandler = Callable[[RunFire], Awaitable[object]]

#: Why a run was dropped unrun: past its ``expires_at``, or later than ``misfire_grace``.
DropReason = Literal["expired", "misfired"]

#: The type of an ``on_expired`` callback:
#: ``def on_expired(run: RunFire, reason: DropReason) -> object`` (sync; return ignored).
ExpiredCallback = Callable[[RunFire, DropReason], object]

#: What :meth:`Coordinator.schedule` did.
ScheduleOutcome = Literal["scheduled", "rescheduled", "already-ran"]


@dataclass(frozen=True, slots=True)
class ScheduledRun:
    """What :meth:`Coordinator.schedule` did (immutable).

    Attributes:
      run_id (str): the run's id (generated when none was given).
      workflow (str): the run's workflow.
      scheduled_at (float): when the run is due, wall-clock epoch seconds (for
        ``"already-ran"``, the time of the run that ran).
      outcome (str): ``"scheduled"`` (a new run), ``"rescheduled"`` (the id was pending:
        its time and payload were replaced, its version bumped, its claim kept), or
        ``"already-ran"`` (the id has a tombstone: it ran, or was dropped as expired or
        misfired, within the retention period; nothing was changed and it will not run
        again).
      version (int): the run's version after the call (1 for a new run).
      persisted (bool): whether the run is kept in the run store.
      owner (str | None): the process id that holds the run's claim.
    """

    run_id: str
    workflow: str
    scheduled_at: float
    outcome: ScheduleOutcome
    version: int
    persisted: bool
    owner: str | None


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run as :meth:`Coordinator.get_run` and :meth:`Coordinator.list_runs` see it.

    Attributes:
      run_id (str): the run's id.
      workflow (str): the run's workflow.
      state (RunState): ``"pending"``, ``"started"`` (a handler started under
        at-least-once delivery and was not recorded as finished) or ``"done"`` (a
        tombstone).
      owner (str | None): the process id holding the claim (None: unclaimed).
      scheduled_at (float): when it is due, wall-clock epoch seconds.
      expires_at (float | None): when it expires, wall-clock epoch seconds.
      attempt (int): handler starts so far.
      version (int): bumped by each re-schedule.
      persisted (bool): kept in the run store (False: held in this coordinator's
        memory only).
      outcome (str | None): for a tombstone, ``"ran"``, ``"failed"``, ``"expired"`` or
        ``"misfired"``.
    """

    run_id: str
    workflow: str
    state: RunState
    owner: str | None
    scheduled_at: float
    expires_at: float | None
    attempt: int
    version: int
    persisted: bool
    outcome: str | None = None


def _optional_duration(name: str, value: object) -> float | None:
    return None if value is None else _validate.duration(name, value)


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How a coordinator schedules, claims and runs deferred runs (immutable, validated).

    Args:
      process_id (str | None): this coordinator's id on the run store. Give a stable
        one (a service name) so a restarted process takes its runs back at once: each
        start bumps the id's epoch, fencing the previous incarnation. A uuid4 hex when
        None. Two live coordinators must never share one (the later one fences the
        earlier, which then stops claiming).
      lease (float): seconds a process's lease lasts unrenewed (default 30). Peers
        take a dead process's runs over after ``lease + max_clock_skew``.
      heartbeat_interval (float | None): seconds between lease renewals (one write
        each, whatever the number of runs); ``lease / 3`` when None. At most
        ``lease / 2``.
      max_clock_skew (float): the largest difference between two hosts' wall clocks
        that the lease arithmetic tolerates, seconds (default 1). Must be below
        ``lease - heartbeat_interval``.
      horizon (float): only runs due within this many seconds hold a task; runs
        further out wait in the store (default 60; at least twice the heartbeat
        interval, so the claim sweep arms a run before it is due).
      retention (float): seconds a finished run's tombstone is kept, so that
        scheduling the same id again does not run it again (default 86,400: 24 h).
      misfire_grace (float | None): a run that comes due more than this many seconds
        late (after a restart, say) is dropped, not run; None (the default) runs late
        runs whatever their lateness.
      max_concurrent_runs (int): run handlers that may run at once (default 100);
        runs that come due meanwhile wait, earliest due first.
      retries (int): how many times a failed handler is retried (at-least-once
        delivery only; default 0). Each retry is a new start (``attempt`` + 1).
      retry_backoff (float): seconds before the first retry, doubled for each next
        one, capped at 60 (default 1).
      op_timeout (float): seconds one run-store call may take before it counts as
        failed (default 10).
      wall_time (Callable[[], float] | None): the wall clock, epoch seconds; the run
        store's (:func:`time.time` for real stores, Trio's clock for the in-memory
        fake) when None.

    Raises:
      TypeError, ValueError: a value is of the wrong type or out of range (the message
        names it).
    """

    process_id: str | None = None
    lease: float = 30.0
    heartbeat_interval: float | None = None
    max_clock_skew: float = 1.0
    horizon: float = 60.0
    retention: float = 86_400.0
    misfire_grace: float | None = None
    max_concurrent_runs: int = 100
    retries: int = 0
    retry_backoff: float = 1.0
    op_timeout: float = 10.0
    wall_time: Callable[[], float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.process_id is not None:
            _validate.name("process_id", self.process_id)
            _validate.shareable("process_id", self.process_id)
        lease = _validate.positive_duration("lease", self.lease)
        interval = (
            lease / 3
            if self.heartbeat_interval is None
            else _validate.positive_duration("heartbeat_interval", self.heartbeat_interval)
        )
        if interval > lease / 2:
            raise ValueError(
                f"heartbeat_interval must be at most lease / 2 ({lease / 2:g} s), got "
                f"{interval!r}: one missed heartbeat must not lose the lease"
            )
        skew = _validate.duration("max_clock_skew", self.max_clock_skew)
        if skew >= lease - interval:
            raise ValueError(
                f"max_clock_skew must be below lease - heartbeat_interval "
                f"({lease - interval:g} s), got {self.max_clock_skew!r}"
            )
        horizon = _validate.positive_duration("horizon", self.horizon)
        if horizon < 2 * interval:
            raise ValueError(
                f"horizon must be at least twice the heartbeat interval ({2 * interval:g} s), "
                f"got {self.horizon!r}"
            )
        for name in ("retention", "retry_backoff", "op_timeout"):
            _validate.positive_duration(name, getattr(self, name))
        _optional_duration("misfire_grace", self.misfire_grace)
        for name, low in (("max_concurrent_runs", 1), ("retries", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.wall_time is not None and not callable(self.wall_time):
            raise TypeError(f"wall_time must be callable, not {self.wall_time!r}")
        object.__setattr__(self, "lease", lease)
        object.__setattr__(self, "heartbeat_interval", interval)
        object.__setattr__(self, "max_clock_skew", skew)
        if self.process_id is None:
            object.__setattr__(self, "process_id", uuid.uuid4().hex)


def wall_seconds(name: str, value: object) -> float:
    """A wall-clock time given as an aware :class:`~datetime.datetime` or epoch
    seconds, as epoch seconds.

    Raises:
      ValueError: a naive datetime, or a number that is NaN, infinite or too large.
      TypeError: anything else.
    """
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"{name} must be a timezone-aware datetime (naive datetimes are ambiguous), "
                f"got {value!r}"
            )
        return value.timestamp()
    return _validate.finite(name, value, "a timezone-aware datetime or epoch seconds")


def default_wall_time() -> float:
    """:func:`time.time`."""
    return time.time()


ACTIVE = frozenset({RunState.PENDING, RunState.STARTED})
