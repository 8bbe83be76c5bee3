"""Hypothesis: deferred runs through real coordinators against tests/runs/runs_model.py.

Single process: random timelines of schedule / re-schedule / cancel_run / drain_runs on
a MemoryRunStore under MockClock, compared to the model exactly (every ScheduledRun,
every cancel and drain result, every RunFire with its start time on the mock clock,
every drop passed to on_expired, and the final list_runs() view).

Times: operations fall at odd multiples of 1/8 s, due times (``after`` an odd multiple
of 1/8, or ``at`` a multiple of 1/4) and handler durations on multiples of 1/4, the
sweeps on whole seconds, so an operation rarely shares an instant with a run's event;
the model rejects the timelines where one does (their order would be arbitrary).

Several processes: random schedules from any process, crashes (the process's scope is
cancelled from outside and it is cut off from the store: its lease is not released),
restarts (same or new process id) and clean exits; checked against invariants.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing
from hypothesis import (
    HealthCheck,
    assume,
    currently_in_test_context,
    event,
    example,
    given,
    settings,
)
from hypothesis import strategies as st

from trio_debounce import RunFire, RunOptions, open_coordinator
from trio_debounce.testing import MemoryRunStore, MemoryStore

from .runs_model import EPOCH, Ambiguous, Cancel, Drain, Model, Op, Sched

LEASE = 3.0  # heartbeat and sweep every second
HORIZON = 2.0
WORKFLOWS = ("w1", "w2")
DURATIONS = {"z": 0.0, "s": 0.5, "l": 1.5}
PERSISTED_IDS = ("p1", "p2", "p3")
LOCAL_IDS = ("l1", "l2")
#: Task steps at one instant of the mock clock beyond which a run counts as spinning
#: (a livelock: virtual time can never advance).
SPIN_LIMIT = 50_000
EXAMPLES_SINGLE = 60
EXAMPLES_MULTI = 80


# ------------------------------------------------------------------- strategies


@st.composite
def single_timelines(draw: st.DrawFn, ids: tuple[str, ...]) -> tuple[list[Op], float]:
    home = {run_id: draw(st.sampled_from(WORKFLOWS)) for run_id in ids}
    ops: list[Op] = []
    t = 0.125
    for i in range(draw(st.integers(1, 24))):
        if i:
            t += draw(st.sampled_from((0.25, 0.5, 0.75, 1.0, 2.0, 3.0, 6.0)))
        kind = draw(st.sampled_from(("sched",) * 6 + ("cancel", "cancel", "cancel", "drain")))
        run_id = draw(st.sampled_from(ids))
        if kind == "cancel":
            ops.append(Cancel(t, run_id))
            continue
        if kind == "drain":
            ops.append(Drain(t))
            continue
        workflow = draw(st.sampled_from((home[run_id],) * 5 + WORKFLOWS))
        by_at = draw(st.booleans())
        if by_at:
            # a multiple of 1/4, from 4 s in the past to 8 s ahead
            base = math.floor(t * 4) / 4
            offsets = (-16, -8, -3, -1, 1, 2, 3, 6, 10, 20, 30)
            due = max(0.0, base + draw(st.sampled_from(offsets)) * 0.25)
        else:
            afters = (0.0, 0.125, 0.375, 0.875, 1.375, 2.125, 3.125, 4.625, 7.125)
            after = draw(st.sampled_from(afters))
            due = t + after
        extra = draw(st.none() | st.sampled_from((0.25, 0.5, 1.0, 2.0)))
        expires = None if extra is None else due + extra
        tag = draw(st.sampled_from(("z", "z", "z", "s", "l")))
        payload = {"tag": tag, "n": i, "t": (i, "x")}
        ops.append(
            Sched(t, run_id, workflow, payload, due, expires, run_id in PERSISTED_IDS, by_at)
        )
    return ops, t + 3.0625


@dataclass
class SingleConfig:
    delivery: str
    retention: float
    misfire_grace: float | None


configs = st.builds(
    SingleConfig,
    delivery=st.sampled_from(("at-least-once", "at-most-once")),
    retention=st.sampled_from((3.0, 6.0)),
    misfire_grace=st.sampled_from((None, None, 0.5, 2.0)),
)


# ------------------------------------------------------------------- helpers


class SpinGuard(trio.abc.Instrument):
    """Notices a run that takes more than ``SPIN_LIMIT`` task steps at one instant of
    the mock clock (a task spinning on a zero timeout: virtual time can never advance,
    the test would hang) and jumps the clock an hour ahead to end it; the test then
    fails on ``tripped``."""

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self.clock = clock
        self.at: float | None = None
        self.steps = 0
        self.tripped: float | None = None

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        now = self.clock.current_time()
        if now != self.at:
            self.at, self.steps = now, 0
        self.steps += 1
        if self.steps > SPIN_LIMIT:
            if self.tripped is None:
                self.tripped = now
            self.steps = 0
            self.clock.jump(3600.0)


def guarded_run(main: Callable[[], Any]) -> float | None:
    """``trio.run(main)`` on an autojumping MockClock; the mock time of a spin, if any."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    guard = SpinGuard(clock)
    try:
        trio.run(main, clock=clock, instruments=[guard])
    except BaseException:
        if guard.tripped is None:
            raise
    return guard.tripped


def run_model(config: SingleConfig, ops: list[Op], end: float) -> Model:
    model = Model(
        delivery=config.delivery,
        horizon=HORIZON,
        retention=config.retention,
        misfire_grace=config.misfire_grace,
        owner="solo",
        durations=DURATIONS,
    )
    try:
        model.run(ops, end)
        model.view()
    except Ambiguous:
        assume(False)
    return model


@dataclass
class Observed:
    results: list[Any] = field(default_factory=list)
    fires: list[tuple[Any, ...]] = field(default_factory=list)
    drops: list[tuple[Any, ...]] = field(default_factory=list)
    view: list[tuple[Any, ...]] = field(default_factory=list)
    spin: float | None = None


def run_real(config: SingleConfig, ops: list[Op], end: float) -> Observed:
    seen = Observed()

    async def handler(run: RunFire) -> None:
        now = trio.current_time()
        assert run.started_at == EPOCH + now
        seen.fires.append(
            (run.run_id, run.workflow, run.payload, run.scheduled_at, run.started_at,
             run.persisted, run.attempt)
        )  # fmt: skip
        await trio.sleep(DURATIONS[run.payload["tag"]])

    def on_expired(run: RunFire, reason: str) -> None:
        seen.drops.append(
            (run.run_id, reason, run.workflow, run.payload, run.scheduled_at, run.persisted)
        )

    async def main() -> None:
        options = RunOptions(
            process_id="solo",
            lease=LEASE,
            horizon=HORIZON,
            retention=config.retention,
            misfire_grace=config.misfire_grace,
        )
        async with open_coordinator(
            run_handlers={w: handler for w in WORKFLOWS},
            run_store=MemoryRunStore(),
            run_options=options,
            on_expired=on_expired,
            delivery=config.delivery,  # type: ignore[arg-type]
        ) as c:
            for op in ops:
                await trio.sleep_until(op.t)
                assert trio.current_time() == op.t
                if isinstance(op, Sched):
                    when: dict[str, Any] = (
                        {"at": EPOCH + op.due} if op.by_at else {"after": op.due - op.t}
                    )
                    expires = None if op.expires is None else EPOCH + op.expires
                    try:
                        r = await c.schedule(
                            op.workflow, op.run_id, op.payload, persist=op.persist,
                            expires_at=expires, **when,
                        )  # fmt: skip
                    except ValueError:
                        seen.results.append("ValueError")
                    else:
                        seen.results.append(
                            (r.run_id, r.workflow, r.scheduled_at, r.outcome, r.version,
                             r.persisted, r.owner)
                        )  # fmt: skip
                elif isinstance(op, Cancel):
                    seen.results.append(await c.cancel_run(op.run_id))
                else:
                    seen.results.append(await c.drain_runs())
            await trio.sleep_until(end)
            seen.view = [
                (i.scheduled_at, i.run_id, i.workflow, str(i.state), i.owner, i.expires_at,
                 i.attempt, i.version, i.persisted, i.outcome)
                for i in await c.list_runs()
            ]  # fmt: skip

    seen.spin = guarded_run(main)
    return seen


def _expected_fires(model: Model) -> list[tuple[Any, ...]]:
    return [
        (run_id, wf, payload, EPOCH + due, EPOCH + when, persist, 1)
        for run_id, wf, payload, due, when, persist in model.fires
    ]


def _key(item: tuple[Any, ...]) -> str:
    return json.dumps(item, default=repr)


def label(model: Model) -> None:
    """Hypothesis events: what a timeline exercised."""
    for result in model.results:
        if isinstance(result, tuple):
            event(f"schedule {'persisted' if result[5] else 'local'}: {result[3]}")
        else:
            event(f"cancel/drain result: {result!r}")
    for drop in model.drops:
        event(f"dropped: {drop[1]}")
    event(f"fires: {min(len(model.fires), 10)}")


def check_single(config: SingleConfig, ops: list[Op], end: float) -> None:
    model = run_model(config, ops, end)
    if currently_in_test_context():
        label(model)
    seen = run_real(config, ops, end)
    assert seen.spin is None, f"livelock: the run spun at mock time {seen.spin}"
    assert seen.results == model.results
    assert sorted(seen.fires, key=_key) == sorted(_expected_fires(model), key=_key)
    expected_drops = [
        (run_id, reason, wf, payload, EPOCH + due, persist)
        for run_id, reason, wf, payload, due, persist in model.drops
    ]
    assert sorted(seen.drops, key=_key) == sorted(expected_drops, key=_key)
    assert seen.view == model.view()


SETTINGS = settings(
    max_examples=EXAMPLES_SINGLE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

_P = {"tag": "z", "n": 0, "t": (0, "x")}
_LONG = {"tag": "l", "n": 0, "t": (0, "x")}  # a 1.5 s handler
_PLAIN = SingleConfig("at-least-once", 3.0, None)

# Regression anchors: counterexamples found by these tests, each wrong in an earlier
# version of _runs.py.
#: cancel_run of a pending persisted run (delete_run was called with a positional
#: revision: a TypeError).
CANCEL_PENDING = (
    [Sched(0.125, "p1", "w1", _P, 4.0, None, True, True), Cancel(0.375, "p1")],
    3.4375,
)
#: the purge of the sweep at t=10 finds the tombstone (finished 0.125 < 10 - 3) and
#: deletes it (the same TypeError killed the coordinator).
PURGE = ([Sched(0.125, "p1", "w1", _P, 0.125, None, True, False)], 10.1875)
#: a non-persisted run due beyond the horizon (the local loop spun at due - horizon).
LOCAL_BEYOND_HORIZON = ([Sched(0.125, "l1", "w1", _P, 4.25, None, False, True)], 3.1875)
#: a local tombstone ends with its retention: l1 ran at 0.125, retention 3, so at
#: 4.125 scheduling it again runs it again (the loop was not woken to purge it, and
#: the id stayed "already-ran").
LOCAL_RETENTION = (
    [
        Sched(0.125, "l1", "w1", _P, 0.125, None, False, False),
        Sched(4.125, "l1", "w1", _P, 6.0, None, False, True),
    ],
    4.1875,
)
#: the local loop is awake (l2 is beyond the horizon) when l1's tombstone reaches
#: finished + retention (3.125) (it spun there: `finished < cutoff` False, wait 0).
LOCAL_TOMBSTONE_SPIN = (
    [
        Sched(0.125, "l1", "w1", _P, 0.125, None, False, False),
        Sched(1.125, "l2", "w1", _P, 5.125, None, False, False),
    ],
    6.1875,
)
#: cancel_run of a running local run returns False and the run keeps its tombstone:
#: scheduling the id again says "already-ran" (cancel_run dropped the run, so it
#: left no tombstone and ran again).
LOCAL_CANCEL_RUNNING = (
    [
        Sched(0.125, "l1", "w1", _LONG, 0.125, None, False, False),
        Cancel(0.625, "l1"),
        Sched(2.125, "l1", "w1", _LONG, 3.0, None, False, True),
    ],
    2.1875,
)
#: re-scheduled while its handler runs, then cancelled: the pending version 2 is
#: removed (True) and never fires (cancel_run returned False, and version 2 fired).
LOCAL_CANCEL_RESCHEDULED = (
    [
        Sched(0.125, "l1", "w1", _LONG, 0.125, None, False, False),
        Sched(0.375, "l1", "w1", _P, 4.0, None, False, True),
        Cancel(0.625, "l1"),
    ],
    5.1875,
)
#: the same for a persisted run under at-least-once (the pending record of version 2
#: was left in the store and fired at 4.0).
PERSISTED_CANCEL_RESCHEDULED = (
    [
        Sched(0.125, "p1", "w1", _LONG, 0.125, None, True, False),
        Sched(0.375, "p1", "w1", _P, 4.0, None, True, True),
        Cancel(0.625, "p1"),
    ],
    5.1875,
)
#: a local tombstone is kept for exactly the retention: l1 ran at 2.125 (retention 3),
#: so scheduling it again at 5.125 still says "already-ran" (the local loop purged it
#: at the boundary, and the id ran again).
LOCAL_RETENTION_BOUNDARY = (
    [
        Cancel(0.125, "p1"),
        Sched(2.125, "l1", "w1", _P, 2.125, None, False, False),
        Sched(5.125, "l1", "w1", _P, 5.125, None, False, False),
    ],
    8.1875,
)
_RET6 = SingleConfig("at-least-once", 6.0, None)


@SETTINGS
@given(configs, single_timelines(PERSISTED_IDS))
@example(_PLAIN, CANCEL_PENDING)
@example(_PLAIN, PURGE)
@example(_RET6, PERSISTED_CANCEL_RESCHEDULED)
def test_persisted_runs_match_the_model(config: SingleConfig, case: tuple[list[Op], float]) -> None:
    check_single(config, *case)


@SETTINGS
@given(configs, single_timelines(PERSISTED_IDS + LOCAL_IDS))
@example(_PLAIN, LOCAL_BEYOND_HORIZON)
@example(_PLAIN, LOCAL_RETENTION)
@example(_PLAIN, LOCAL_TOMBSTONE_SPIN)
@example(_PLAIN, LOCAL_RETENTION_BOUNDARY)
@example(_RET6, LOCAL_CANCEL_RUNNING)
@example(_PLAIN, LOCAL_CANCEL_RESCHEDULED)
@example(_RET6, PERSISTED_CANCEL_RESCHEDULED)
def test_persisted_and_local_runs_match_the_model(
    config: SingleConfig, case: tuple[list[Op], float]
) -> None:
    check_single(config, *case)


# ------------------------------------------------------------------- several processes

M_LEASE = 3.0
M_BEAT = 1.0
M_SKEW = 0.5
#: The longest an orphaned run waits past max(due, crash): the lease lapses, the
#: tolerated skew passes, and a survivor's next sweep claims it (plus a margin).
M_FAILOVER = M_LEASE + M_SKEW + M_BEAT + 0.25


@dataclass(frozen=True)
class MOp:
    dt: float
    kind: str  # schedule | crash | exit | start
    proc: int  # index into the live processes (schedule, crash, exit)
    persist: bool = True
    after: float = 0.0
    duration: float = 0.0
    same_id: bool = False  # start: reuse the id of a dead process


m_ops = st.builds(
    MOp,
    dt=st.sampled_from((0.25, 0.5, 1.0, 2.0, 3.0, 5.0)),
    kind=st.sampled_from(("schedule",) * 5 + ("crash", "crash", "exit", "start")),
    proc=st.integers(0, 2),
    persist=st.sampled_from((True, True, True, False)),
    after=st.sampled_from((0.0, 0.5, 1.5, 3.0, 6.0, 12.0)),
    duration=st.sampled_from((0.0, 0.0, 0.5, 2.0, 4.0)),
    same_id=st.booleans(),
)


@dataclass
class Incarnation:
    name: str
    started: float
    store: MemoryRunStore
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    leave: trio.Event = field(default_factory=trio.Event)
    coord: Any = None
    ended: float | None = None
    crashed: bool = False


@dataclass
class MFire:
    inc: int
    run_id: str
    at: float  # Trio time
    scheduled_at: float
    started_at: float
    attempt: int
    token: int
    persisted: bool


def run_processes(delivery: str, n_start: int, timeline: list[MOp]) -> None:
    shared = MemoryStore()
    incs: list[Incarnation] = []
    fires: list[MFire] = []
    scheduled: dict[str, tuple[int, float, float, bool]] = {}  # id -> inc, t, due, persist
    disruptions: list[float] = []
    names = iter(f"p{i}" for i in range(100))

    def handler_for(index: int) -> Callable[[RunFire], Any]:
        async def handler(run: RunFire) -> None:
            now = trio.current_time()
            fires.append(
                MFire(index, run.run_id, now, run.scheduled_at, run.started_at, run.attempt,
                      run.fencing_token, run.persisted)
            )  # fmt: skip
            await trio.sleep(run.payload["d"])

        return handler

    async def process(index: int, *, task_status: trio.TaskStatus[None]) -> None:
        inc = incs[index]
        options = RunOptions(
            process_id=inc.name, lease=M_LEASE, heartbeat_interval=M_BEAT,
            max_clock_skew=M_SKEW, horizon=2 * M_BEAT,
        )  # fmt: skip
        with inc.scope:
            async with open_coordinator(
                run_handlers={"w": handler_for(index)},
                run_store=inc.store,
                run_options=options,
                delivery=delivery,  # type: ignore[arg-type]
            ) as coord:
                inc.coord = coord
                task_status.started()
                await inc.leave.wait()
        if inc.ended is None:
            inc.ended = trio.current_time()

    def live() -> list[int]:
        return [i for i, inc in enumerate(incs) if inc.ended is None and not inc.leave.is_set()]

    async def start(nursery: trio.Nursery, name: str) -> None:
        incs.append(Incarnation(name, trio.current_time(), MemoryRunStore(shared)))
        await nursery.start(process, len(incs) - 1)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(n_start):
                await start(nursery, next(names))
            t = 0.0
            for n, op in enumerate(timeline):
                t += op.dt
                await trio.sleep_until(t)
                alive = live()
                index = alive[op.proc % len(alive)]
                inc = incs[index]
                if op.kind == "schedule":
                    run_id = f"r{n}"
                    after = op.after
                    r = await inc.coord.schedule(
                        "w", run_id, {"d": op.duration}, after=after, persist=op.persist
                    )
                    assert r.outcome == "scheduled"
                    assert r.owner == inc.name
                    scheduled[run_id] = (index, t, t + after, op.persist)
                elif op.kind == "start":
                    dead = [i.name for i in incs if i.crashed]
                    fresh = not (op.same_id and dead) or any(
                        i.name == dead[-1] for i in (incs[j] for j in alive)
                    )
                    await start(nursery, next(names) if fresh else dead[-1])
                    # A restart under a dead process's id whose lease is still live
                    # waits up to a heartbeat interval plus the skew (the twin check):
                    # the timeline goes on from when the start returned.
                    t = max(t, trio.current_time())
                elif len(alive) > 1:  # keep one process alive
                    disruptions.append(t)
                    if op.kind == "crash":
                        inc.store.faults.partitioned = True
                        inc.crashed = True
                        inc.ended = t
                        inc.scope.cancel()
                    else:
                        inc.leave.set()
                        inc.ended = t
            last_due = max((due for _, _, due, _ in scheduled.values()), default=t)
            await trio.sleep_until(max(t, last_due) + M_FAILOVER + 3.0)
            for i in live():
                incs[i].leave.set()

    spin = guarded_run(main)
    assert spin is None, f"livelock: the run spun at mock time {spin}"

    by_run: dict[str, list[MFire]] = {}
    for fire in fires:
        by_run.setdefault(fire.run_id, []).append(fire)
    event(f"crashes: {sum(i.crashed for i in incs)}")
    event(f"restarts under a dead id: {len(incs) - len({i.name for i in incs})}")
    if any(len(f) > 1 for f in by_run.values()):
        event("a run started again (attempt > 1)")
    if any(fires[0].inc != scheduled[r][0] for r, fires in by_run.items()):
        event("a run fired on another process than the one that scheduled it")
    for run_id, (index, t, due, persist) in scheduled.items():
        runs = by_run.get(run_id, [])
        owner = incs[index]
        for fire in runs:
            # never before its time, and on a process that was alive
            assert fire.scheduled_at == EPOCH + due
            # (Trio times off the 1/4 grid read the wall clock rounded to 2**-22 s)
            assert fire.at >= due - 1e-6, (run_id, fire)
            assert fire.started_at >= fire.scheduled_at, (run_id, fire)
            inc = incs[fire.inc]
            assert inc.started <= fire.at + 1e-6, (run_id, fire)
            assert inc.ended is None or fire.at <= inc.ended + 1e-6, (run_id, fire, inc.ended)
        if not persist:
            # held by its coordinator's memory only: fires there, never after it ended
            assert all(f.inc == index for f in runs), (run_id, runs)
            if owner.ended is not None:
                assert all(f.at <= owner.ended for f in runs), (run_id, runs)
            if owner.ended is None or owner.ended > due:
                assert len(runs) == 1, (run_id, runs)
            continue
        if delivery == "at-most-once":
            assert len(runs) == 1, (run_id, runs)
        else:
            assert len(runs) >= 1, (run_id, runs)
            assert [f.attempt for f in runs] == sorted({f.attempt for f in runs}), (run_id, runs)
        tokens = [f.token for f in runs]
        assert tokens == sorted(set(tokens)), (run_id, runs)
        # on time, or within the failover bound after each disruption before it fired
        bound = max(due, t)
        for e in sorted(disruptions):
            if e <= bound:
                bound = max(bound, e + M_FAILOVER)
        assert runs[0].at <= bound + 1e-6, (run_id, runs[0], bound, disruptions)


@settings(
    max_examples=EXAMPLES_MULTI,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.sampled_from(("at-least-once", "at-most-once")),
    st.integers(2, 3),
    st.lists(m_ops, min_size=1, max_size=20),
)
# the owner dies in a 4 s handler: at-least-once runs it again elsewhere (attempt 2),
# at-most-once does not
@example("at-least-once", 2, [MOp(0.25, "schedule", 0, True, 0.0, 4.0), MOp(1.0, "crash", 0)])
@example("at-most-once", 2, [MOp(0.25, "schedule", 0, True, 0.0, 4.0), MOp(1.0, "crash", 0)])
# the owner of runs due now and beyond the horizon dies and comes back under its id
# (a new epoch fences the old claims); a local run of the dead process never fires
@example(
    "at-least-once",
    2,
    [
        MOp(0.25, "schedule", 0, True, 6.0),
        MOp(0.25, "schedule", 0, True, 1.5, 2.0),
        MOp(0.25, "schedule", 0, False, 1.5),
        MOp(0.5, "crash", 0),
        MOp(0.5, "start", 0, same_id=True),
    ],
)
# a clean exit releases the lease: a peer takes the runs over at its next sweep
@example(
    "at-most-once",
    3,
    [
        MOp(0.25, "schedule", 1, True, 3.0),
        MOp(0.25, "schedule", 1, True, 12.0),
        MOp(1.0, "exit", 1),
    ],
)
def test_several_processes_keep_the_run_invariants(
    delivery: str, n_start: int, timeline: list[MOp]
) -> None:
    run_processes(delivery, n_start, timeline)
