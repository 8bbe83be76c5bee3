"""A reference model of deferred runs on one coordinator (tests/runs/test_runs_properties.py).

Times are Trio clock readings (the wall clock is ``EPOCH`` + them, on the in-memory
store). The model is a small discrete-event simulation of what a coordinator with a
run store and ``RunOptions(lease=3)`` (heartbeat and claim sweep every second, from
time 0) promises:

* a run starts at ``max(due, ready)``, where ``ready`` is when it was (re)scheduled,
  or when the handler of the same id that was running then finished; runs due beyond
  the horizon are armed by a sweep before their time, so they too start at their due
  time exactly;
* at its start a run is dropped as ``"expired"`` if the wall clock is past its
  ``expires_at``, else as ``"misfired"`` if it is more than ``misfire_grace`` late
  (never for a drain);
* at-least-once: a start marks the record ``started`` (attempt + 1), the finish turns
  it into a ``done`` tombstone unless it was re-scheduled or cancelled meanwhile;
  at-most-once: a start turns it into a ``done`` tombstone at once;
* scheduling an id with a tombstone returns ``"already-ran"`` (nothing changes);
  a persisted tombstone is removed by the purge of the sweeps numbered 1, 11, 21, ...
  (at times 0, 10, 20, ...) once it finished more than ``retention`` before; a
  non-persisted one is gone once it finished more than ``retention`` ago;
* ``cancel_run`` removes a pending run (True); a started, finished or unknown one
  gives False;
* ``drain_runs`` starts every pending run that is not blocked behind a running
  handler of its id, now, and returns their number.

Operations are assumed never to fall at the same instant as a run's event (the test's
time lattice and :class:`Ambiguous` keep them apart), so the order is well defined.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from trio_debounce.testing._memory import DEFAULT_EPOCH

EPOCH = DEFAULT_EPOCH
SWEEP_INTERVAL = 1.0
PURGE_PERIOD = 10.0  # sweeps 1, 11, 21, ... purge; one sweep a second from time 0


class Ambiguous(Exception):
    """The timeline puts an operation at the same instant as a run's event (or makes
    the driver late for an operation): its outcome is order-dependent; reject it."""


@dataclass(frozen=True)
class Sched:
    t: float
    run_id: str
    workflow: str
    payload: Any
    due: float  # Trio time
    expires: float | None  # Trio time
    persist: bool
    by_at: bool  # given as at= (else after=)


@dataclass(frozen=True)
class Cancel:
    t: float
    run_id: str


@dataclass(frozen=True)
class Drain:
    t: float


Op = Sched | Cancel | Drain


@dataclass
class Run:
    run_id: str
    workflow: str
    payload: Any  # as the handler sees it
    due: float
    expires: float | None
    persist: bool
    version: int
    ready: float  # not started before this
    state: str = "pending"  # pending | started | done
    attempt: int = 0
    finished: float | None = None
    outcome: str | None = None
    gen: int = 0  # bumped by every schedule of the id


@dataclass
class Running:
    run: Run
    gen: int
    finish: float


@dataclass
class Model:
    delivery: str
    horizon: float
    retention: float
    misfire_grace: float | None
    owner: str
    durations: dict[str, float]  # duration of a handler, by payload tag
    runs: dict[str, Run] = field(default_factory=dict)  # persisted records + local pending
    local_done: dict[str, Run] = field(default_factory=dict)
    running: dict[str, Running] = field(default_factory=dict)
    fires: list[tuple[Any, ...]] = field(default_factory=list)
    drops: list[tuple[Any, ...]] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    now: float = 0.0
    busy_until: float = 0.0  # the driver is blocked (in a drain) until then
    gens: dict[str, int] = field(default_factory=dict)

    # ---------------------------------------------------------------- events

    def _next_event(self) -> tuple[float, int, str] | None:
        best: tuple[float, int, str] | None = None
        for run_id, r in self.running.items():
            cand = (r.finish, 0, run_id)
            best = cand if best is None or cand < best else best
        for run_id, run in self.runs.items():
            if run.state != "pending" or run_id in self.running:
                continue
            cand = (max(run.due, run.ready), 1, run_id)
            best = cand if best is None or cand < best else best
        return best

    def advance(self, to: float, *, op_time: bool = True) -> None:
        """Run every event before ``to``; an event at ``to`` itself is ambiguous."""
        if op_time and to <= self.busy_until:
            raise Ambiguous(f"the driver is busy until {self.busy_until} at {to}")
        while True:
            event = self._next_event()
            if event is None or event[0] > to:
                break
            if event[0] == to and op_time:
                raise Ambiguous(f"an event of run {event[2]} at operation time {to}")
            if event[0] == to:
                break
            self._do(event)
        self.now = to
        # local tombstones go once they finished more than retention ago
        for run_id, tomb in list(self.local_done.items()):
            assert tomb.finished is not None
            if tomb.finished < to - self.retention:
                del self.local_done[run_id]

    def _do(self, event: tuple[float, int, str]) -> None:
        when, kind, run_id = event
        self.now = when
        if kind == 0:
            self._finish(run_id, when)
        else:
            self._start(self.runs[run_id], when, drain=False)

    def _start(self, run: Run, when: float, *, drain: bool) -> None:
        reason = None
        if run.expires is not None and when > run.expires:
            reason = "expired"
        elif not drain and self.misfire_grace is not None and when - run.due > self.misfire_grace:
            reason = "misfired"
        if reason is not None:
            self.drops.append((run.run_id, reason, run.workflow, run.payload, run.due, run.persist))
            if run.persist:
                run.state, run.finished, run.outcome = "done", when, reason
            else:
                del self.runs[run.run_id]
                run.state, run.finished, run.outcome = "done", when, reason
                self.local_done[run.run_id] = run
            return
        run.attempt += 1
        self.fires.append((run.run_id, run.workflow, run.payload, run.due, when, run.persist))
        duration = self.durations[run.payload["tag"]]
        self.running[run.run_id] = Running(run, run.gen, when + duration)
        if run.persist:
            if self.delivery == "at-least-once":
                run.state = "started"
            else:
                run.state, run.finished, run.outcome = "done", when, "ran"
        else:
            run.state = "started"

    def _finish(self, run_id: str, when: float) -> None:
        ran = self.running.pop(run_id)
        current = self.runs.get(run_id)
        if current is ran.run and current.gen == ran.gen:
            if current.persist and self.delivery == "at-most-once":
                return
            current.state, current.finished, current.outcome = "done", when, "ran"
            if not current.persist:
                del self.runs[run_id]
                self.local_done[run_id] = current
        elif current is not None and current.state == "pending":
            current.ready = max(current.ready, when)

    # ---------------------------------------------------------------- operations

    def _purged(self, tomb: Run, t: float) -> bool:
        """Whether a sweep's purge before ``t`` removed the persisted tombstone."""
        assert tomb.finished is not None
        last_purge = math.floor(t / PURGE_PERIOD) * PURGE_PERIOD
        if last_purge == t:
            raise Ambiguous(f"an operation at a purge time {t}")
        return tomb.finished < last_purge - self.retention

    def schedule(self, op: Sched) -> None:
        self.advance(op.t)
        wall_due = EPOCH + op.due
        payload = json.loads(json.dumps(op.payload)) if op.persist else op.payload
        current = self.runs.get(op.run_id)
        if (
            current is not None
            and current.persist
            and current.state == "done"
            and self._purged(current, op.t)
        ):
            del self.runs[op.run_id]
            current = None
        tomb = None if op.persist else self.local_done.get(op.run_id)
        if current is not None and current.state == "done":
            tomb = current
        if tomb is not None:
            owner = self.owner
            self.results.append(
                (op.run_id, tomb.workflow, EPOCH + tomb.due, "already-ran", tomb.version,
                 op.persist, owner)
            )  # fmt: skip
            return
        if current is not None and current.workflow != op.workflow:
            self.results.append("ValueError")
            return
        if current is not None and current.persist != op.persist:
            raise Ambiguous("the test keeps each id to one persist value")
        gen = self.gens.get(op.run_id, 0) + 1
        self.gens[op.run_id] = gen
        blocked = self.running.get(op.run_id)
        ready = op.t if blocked is None else max(op.t, blocked.finish)
        if current is None:
            run = Run(op.run_id, op.workflow, payload, op.due, op.expires, op.persist, 1, ready)
            outcome = "scheduled"
        else:
            run = Run(
                op.run_id, op.workflow, payload, op.due, op.expires, op.persist,
                current.version + 1, ready,
            )  # fmt: skip
            if op.persist and current.state == "pending":
                run.attempt = current.attempt
            outcome = "rescheduled"
        run.gen = gen
        self.runs[op.run_id] = run
        self.results.append(
            (op.run_id, op.workflow, wall_due, outcome, run.version, op.persist, self.owner)
        )
        # A run due now (or in the past) starts at once, after the call returned.
        if blocked is None and run.due <= op.t:
            self._start(run, op.t, drain=False)

    def cancel(self, op: Cancel) -> None:
        self.advance(op.t)
        run = self.runs.get(op.run_id)
        if run is None or run.state != "pending":
            self.results.append(False)
            return
        del self.runs[op.run_id]
        self.gens[op.run_id] = self.gens.get(op.run_id, 0) + 1
        self.results.append(True)

    def drain(self, op: Drain) -> None:
        self.advance(op.t)
        chosen = [
            run
            for run_id, run in sorted(self.runs.items())
            if run.state == "pending" and run_id not in self.running
        ]
        for run in chosen:
            self._start(run, op.t, drain=True)
        self.results.append(len(chosen))
        ends = [r.finish for r in self.running.values() if any(r.run is c for c in chosen)]
        self.busy_until = max([op.t, *ends])

    def run(self, ops: list[Op], end: float) -> None:
        for op in ops:
            if isinstance(op, Sched):
                self.schedule(op)
            elif isinstance(op, Cancel):
                self.cancel(op)
            else:
                self.drain(op)
        self.advance(end)

    def view(self) -> list[tuple[Any, ...]]:
        """``list_runs()`` at the end: the store's records, and this coordinator's
        non-persisted runs (pending, started) and tombstones."""
        out = []
        runs = [*self.runs.values(), *self.local_done.values()]
        for run in runs:
            if run.persist and run.state == "done" and self._purged(run, self.now):
                continue
            out.append(
                (EPOCH + run.due, run.run_id, run.workflow, run.state, self.owner,
                 None if run.expires is None else EPOCH + run.expires, run.attempt,
                 run.version, run.persist, run.outcome)
            )  # fmt: skip
        return sorted(out)
