"""Non-persisted runs: held in one coordinator's memory, armed as they enter the
horizon, and kept as tombstones for the retention period once finished."""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from ._calls import Counters
from ._store import RunState
from ._types import RunInfo, RunOptions

logger = logging.getLogger("trio_debounce.runs")

#: How long past a local tombstone's retention the local loop wakes to purge it, seconds.
_TICK = 1e-3


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
    #: Its handler runs now (its armed task started it).
    running: bool = False


class LocalRuns:
    """One coordinator's non-persisted runs.

    Attributes:
      pending (dict[str, _LocalRun]): the runs not finished, by id (a running one
        included; a re-schedule replaces the entry).
      done (dict[str, tuple[_LocalRun, float, str]]): the tombstones, by id: the run,
        when it finished (wall seconds) and its outcome.
      scope (trio.CancelScope): cancelled when the coordinator closes, to stop
        :meth:`arm_as_due`.
    """

    def __init__(
        self,
        options: RunOptions,
        wall: Callable[[], float],
        process_id: str,
        stats: Counters,
    ) -> None:
        self._options = options
        self._wall = wall
        self._process_id = process_id
        self._stats = stats
        self.pending: dict[str, _LocalRun] = {}
        self.done: dict[str, tuple[_LocalRun, float, str]] = {}
        #: (due, arrival, run id, version): the pending runs not yet armed.
        self._heap: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self._wake = trio.Event()
        self.scope = trio.CancelScope()

    # ---------------------------------------------------------------- state

    def state(self, run: _LocalRun) -> RunState:
        """``STARTED`` while its handler runs, else ``PENDING``."""
        return RunState.STARTED if run.running else RunState.PENDING

    def info(self, run: _LocalRun, state: RunState, outcome: str | None) -> RunInfo:
        return RunInfo(
            run.run_id, run.workflow, state, self._process_id, run.scheduled_at,
            run.expires_at, run.attempt, run.version, False, outcome,
        )  # fmt: skip

    def infos(self) -> list[RunInfo]:
        """Every run held, tombstones included, in no particular order."""
        infos = [self.info(run, self.state(run), None) for run in self.pending.values()]
        for run, _, outcome in self.done.values():
            infos.append(self.info(run, RunState.DONE, outcome))
        return infos

    def waiting(self) -> int:
        """How many runs wait for their time (or for a slot)."""
        return sum(1 for run in self.pending.values() if self.state(run) is RunState.PENDING)

    def tombstone(self, run_id: str, wall: float) -> tuple[_LocalRun, float, str] | None:
        """The tombstone of ``run_id`` if it is within the retention period (an older
        one is purged now: the loop purges lazily)."""
        done = self.done.get(run_id)
        if done is not None and done[1] < wall - self._options.retention:
            del self.done[run_id]
            return None
        return done

    # ---------------------------------------------------------------- changes

    def push(self, run: _LocalRun) -> None:
        """Let :meth:`arm_as_due` arm ``run`` when it enters the horizon."""
        heapq.heappush(self._heap, (run.scheduled_at, next(self._seq), run.run_id, run.version))
        self._wake.set()

    def finish(self, run: _LocalRun, outcome: str) -> None:
        """``run`` ran (``outcome`` ``"ran"`` or ``"failed"``): it becomes a tombstone,
        unless it was re-scheduled or cancelled meanwhile."""
        if self.pending.get(run.run_id) is run:
            del self.pending[run.run_id]
            self.done[run.run_id] = (run, self._wall(), outcome)
            self._wake.set()  # the local loop purges it after the retention

    def drop(self, run: _LocalRun, wall: float, reason: str) -> None:
        """``run`` is dropped unrun (``reason`` ``"expired"`` or ``"misfired"``)."""
        self.pending.pop(run.run_id, None)
        self.done[run.run_id] = (run, wall, reason)
        self._wake.set()  # the local loop purges it after the retention

    def drop_waiting(self) -> None:
        """At exit: drop the runs that wait for their time, with a warning."""
        waiting = [run for run in self.pending.values() if self.state(run) is RunState.PENDING]
        for run in waiting:
            del self.pending[run.run_id]
        self._heap.clear()
        if waiting:
            self._stats["dropped_at_exit"] += len(waiting)
            logger.warning(
                "%d non-persisted deferred run(s) dropped at exit (persist=True keeps runs "
                "across restarts)",
                len(waiting),
            )

    # ---------------------------------------------------------------- the loop

    async def arm_as_due(self, arm: Callable[[_LocalRun], object]) -> None:
        """``arm(run)`` for each pending run as it enters the horizon (at its current
        version), and purge the tombstones past the retention, until :attr:`scope` is
        cancelled."""
        with self.scope:
            await self._arm_forever(arm)

    async def _arm_forever(self, arm: Callable[[_LocalRun], object]) -> None:
        while True:
            wall = self._wall()
            horizon_end = wall + self._options.horizon
            while self._heap and self._heap[0][0] <= horizon_end:
                _, _, run_id, version = heapq.heappop(self._heap)
                run = self.pending.get(run_id)
                if run is not None and run.version == version:
                    arm(run)
            cutoff = wall - self._options.retention
            for run_id, (_, finished, _) in list(self.done.items()):
                if finished < cutoff:  # kept for retention seconds, then gone
                    del self.done[run_id]
            # No polling: sleep until the next run enters the horizon or the next
            # tombstone expires (a replay on a virtual clock would spin otherwise).
            wait = math.inf
            if self._heap:
                wait = self._heap[0][0] - horizon_end
            if self.done:
                oldest = min(finished for _, finished, _ in self.done.values())
                # Just past the retention (a wait of 0 would spin at that instant).
                wait = min(wait, max(oldest - cutoff, 0.0) + _TICK)
            with trio.move_on_after(max(wait, 0.0)):
                await self._wake.wait()
            self._wake = trio.Event()
