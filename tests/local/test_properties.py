"""Hypothesis: random timelines through the real coordinator match the reference model.

Times and durations are drawn on a grid of 1/4 so every float sum is exact, and the
comparison is to the float: every result of every ping, cancel and flush, and every
fire (time, key, payload, ping count, edge, run id, first ping time).

The second property adds the window options (max_count, payload policies with bounds
and reducers, overlap="queue-latest" with run timeouts, order keys and drop_stale).
There, handlers of runs take 1/1024 s off the grid (sums stay exact), so a run never
ends at the same instant as a ping, a cancel or a flush: the one tie the scheduler
decides (the handler's return and a ping are both events, not deadlines).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio_debounce
from tests.harness.model import DEFAULT as DEFAULT_OPTIONS
from tests.harness.model import Model, ModelFire, Options
from trio_debounce import Fire, ModeName, OnExit

GRID = 0.25
MODES: tuple[ModeName, ...] = ("trailing", "leading", "both")
KEYS = (("wf", "a"), ("wf", "b"), ("other", "a"))


def grid(max_steps: int) -> st.SearchStrategy[float]:
    return st.integers(0, max_steps).map(lambda n: n * GRID)


@dataclass(frozen=True)
class Op:
    dt: float
    kind: str  # "ping" | "cancel" | "flush"
    key: int
    mode: ModeName
    delay: float
    max_delay: float | None
    handler_time: float
    opts: Options = DEFAULT_OPTIONS
    order: int | None = None
    drop_stale: bool = False


def _sum(acc: int, new: int) -> int:
    return acc + new


def _append(acc: list[int], new: int) -> list[int]:
    acc.append(new)  # mutates: a shared initial list would leak between windows
    return acc


#: The reducers both the model and the coordinator know: one with a fresh mutable
#: initial per window, one with an immutable initial, one without an initial.
REDUCERS: dict[str, tuple[Any, Any]] = {
    "sum": (_sum, int),
    "tail": (_append, list),
    "max": (max, None),
}


@st.composite
def ops(draw: st.DrawFn) -> Op:
    kind = draw(st.sampled_from(("ping",) * 8 + ("cancel", "flush")))
    delay = draw(grid(12))
    max_delay = draw(st.none() | grid(12).map(lambda extra: delay + extra))
    return Op(
        dt=draw(st.sampled_from((0.0, 0.0, 0.25, 0.5, 1.0, 1.75, 3.0, 5.0))),
        kind=kind,
        key=draw(st.integers(0, len(KEYS) - 1)),
        mode=draw(st.sampled_from(MODES)),
        delay=delay,
        max_delay=max_delay,
        handler_time=draw(st.sampled_from((0.0, 0.0, 0.5, 4.0))),
    )


@st.composite
def timelines(draw: st.DrawFn) -> tuple[dict[int, ModeName], list[Op]]:
    # Each key has a usual mode; a few pings use another one and must raise.
    key_modes = {i: draw(st.sampled_from(MODES)) for i in range(len(KEYS))}
    timeline = draw(st.lists(ops(), max_size=40))
    clash = draw(st.lists(st.booleans(), min_size=len(timeline), max_size=len(timeline)))
    fixed = [
        op if c and op.kind == "ping" else Op(**{**op.__dict__, "mode": key_modes[op.key]})
        for op, c in zip(timeline, clash, strict=True)
    ]
    return key_modes, fixed


def run_model(timeline: list[Op], on_exit: str = "wait") -> tuple[list[Any], list[ModelFire]]:
    model = Model(
        reducers=dict(REDUCERS),
        run_times={f"run-{i}": op.handler_time for i, op in enumerate(timeline)},
    )
    results: list[Any] = []
    t = 0.0
    for i, op in enumerate(timeline):
        t += op.dt
        ident = KEYS[op.key]
        if op.kind == "ping":
            try:
                results.append(
                    model.ping(
                        t,
                        ident,
                        i,
                        op.delay,
                        op.max_delay,
                        op.mode,
                        f"run-{i}",
                        op.opts,
                        op.order,
                        op.drop_stale,
                    )
                )
            except ValueError:
                results.append("ValueError")
        elif op.kind == "cancel":
            results.append(model.cancel(t, ident))
        else:
            results.append(model.flush(t, ident))
    model.finish(t, on_exit)
    return results, model.fires


def run_real(
    timeline: list[Op], on_exit: OnExit = "wait", hooked: bool = False
) -> tuple[list[Any], list[ModelFire]]:
    """The coordinator's results and fires for ``timeline``; ``hooked``: with an
    ``on_event`` hook, whose events must account for every ping and fire (and which
    must change nothing: every ping then skips the inlined hot path)."""
    results: list[Any] = []
    events: list[trio_debounce.CoordinatorEvent] = []
    fires: list[Fire] = []
    late: list[float] = []
    handler_times = {f"run-{i}": op.handler_time for i, op in enumerate(timeline)}

    async def handler(fire: Fire) -> None:
        fires.append(fire)
        # fired_at is logical, and a fire also starts then: its task wakes on time (an
        # autojumping MockClock may land a few ulps past the target).
        late.append(trio.current_time() - fire.fired_at)
        # Handlers that take time must not change anything: a ping during a run
        # opens a new window.
        await trio.sleep(handler_times[fire.run_id])

    async def main() -> None:
        t = 0.0
        async with trio_debounce.open_coordinator(
            handlers={"wf": handler, "other": handler},
            on_exit=on_exit,
            on_event=events.append if hooked else None,
        ) as coordinator:
            for name, (fn, initial) in REDUCERS.items():
                coordinator.set_reducer(name, fn, initial=initial)
            for i, op in enumerate(timeline):
                t += op.dt
                await trio.sleep_until(t)
                workflow, key = KEYS[op.key]
                if op.kind == "ping":
                    try:
                        r = await coordinator.debounce(
                            workflow,
                            key,
                            i,
                            delay=op.delay,
                            max_delay=op.max_delay,
                            mode=op.mode,
                            run_id=f"run-{i}",
                            max_count=op.opts.max_count,
                            payload_policy=op.opts.payload_policy,
                            max_items=op.opts.max_items,
                            overflow=op.opts.overflow,  # type: ignore[arg-type]
                            overlap=op.opts.overlap,  # type: ignore[arg-type]
                            run_timeout=op.opts.run_timeout,
                            order_key=op.order,
                            drop_stale=op.drop_stale,
                        )
                    except ValueError:
                        results.append("ValueError")
                    else:
                        assert r.ping_count >= 1 or r.outcome.value == "stale"
                        results.append(
                            (r.outcome.value, r.active_run_id, r.scheduled_at, r.ping_count)
                        )
                elif op.kind == "cancel":
                    results.append(await coordinator.cancel(workflow, key))
                else:
                    results.append(await coordinator.flush(workflow, key))
        stats = coordinator.statistics()
        assert stats.fires == len(fires)
        assert stats.pending_trailing_fires == 0
        assert stats.running_handlers == 0
        assert stats.pings == sum(1 for r in results if isinstance(r, tuple) and r[0] != "stale")
        assert stats.coalesced == sum(
            1 for r in results if isinstance(r, tuple) and r[0] == "coalesce"
        )
        assert stats.stale_pings == sum(
            1 for r in results if isinstance(r, tuple) and r[0] == "stale"
        )

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(0 <= d < 1e-9 for d in late), late
    if hooked:
        kinds = [type(event).__name__ for event in events]
        assert kinds.count("PingAnswered") == sum(1 for r in results if isinstance(r, tuple))
        assert kinds.count("PingRejected") == results.count("ValueError")
        assert kinds.count("FireStarted") == kinds.count("FireFinished") == len(fires)
    converted = [
        ModelFire(
            f.fired_at,
            (f.workflow, f.key),
            f.payload,
            f.ping_count,
            f.edge.value,
            f.run_id,
            f.first_ping_at,
        )
        for f in fires
    ]
    return results, converted


def _order(f: ModelFire) -> tuple[Any, ...]:
    return (f.fired_at, f.key, f.run_id, f.edge)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(timelines(), st.sampled_from(("wait", "wait", "flush", "cancel")), st.booleans())
def test_coordinator_matches_model(
    case: tuple[dict[int, ModeName], list[Op]], on_exit: OnExit, hooked: bool
) -> None:
    _, timeline = case
    expected_results, expected_fires = run_model(timeline, on_exit)
    results, fires = run_real(timeline, on_exit, hooked)
    assert results == expected_results
    assert sorted(fires, key=_order) == sorted(expected_fires, key=_order)


@pytest.mark.parametrize("mode", MODES)
def test_model_and_coordinator_agree_on_a_known_burst(mode: ModeName) -> None:
    # A fixed timeline as a sanity anchor for the property above: 3 pings 1s apart,
    # delay 2, then silence.
    timeline = [
        Op(0.0, "ping", 0, mode, 2.0, None, 0.0),
        Op(1.0, "ping", 0, mode, 2.0, None, 0.0),
        Op(1.0, "ping", 0, mode, 2.0, None, 0.0),
    ]
    expected_results, expected_fires = run_model(timeline)
    results, fires = run_real(timeline)
    assert results == expected_results
    assert sorted(fires, key=_order) == sorted(expected_fires, key=_order)
    edges = sorted(f.edge for f in fires)
    assert (
        edges
        == {"trailing": ["trailing"], "leading": ["leading"], "both": ["leading", "trailing"]}[mode]
    )
    trailing = [f for f in fires if f.edge == "trailing"]
    for f in trailing:
        assert (f.fired_at, f.payload, f.ping_count) == (4.0, 2, 3)


# ------------------------------------------------------------------ window options

#: Handler times of runs: off the 1/4 grid by a few 1/1024 (see the module docstring).
RUN_TIMES = (1 / 1024, 0.5 + 1 / 1024, 1.75 + 1 / 1024, 4.0 + 3 / 1024)


@st.composite
def options(draw: st.DrawFn, mode: str) -> tuple[Options, bool]:
    """A valid set of window options for ``mode``, and whether pings carry order keys."""
    policy = draw(st.sampled_from(("last", "last", "first", "collect", "sum", "tail", "max")))
    accumulates = policy not in ("last", "first")
    max_items = draw(st.none() | st.integers(1, 3)) if accumulates else None
    overflows: tuple[str | None, ...] = (None, "fire-early")
    if policy == "collect":
        overflows += ("drop-oldest",)
    overflow = draw(st.sampled_from(overflows)) if accumulates else None
    overlap = "allow"
    run_timeout = None
    if mode == "trailing" and draw(st.integers(0, 2)) > 0:
        overlap = "queue-latest"
        run_timeout = draw(st.sampled_from((None, None, 1.0, 2.5)))
    ordered = policy in ("last", "first", "collect") and draw(st.booleans())
    opts = Options(
        max_count=draw(st.sampled_from((None, None, 1, 2, 3, 5))),
        payload_policy=policy,
        max_items=max_items,
        overflow=overflow,
        overlap=overlap,
        run_timeout=run_timeout,
    )
    return opts, ordered


@st.composite
def option_timelines(draw: st.DrawFn) -> list[Op]:
    # Each key has usual options; a few pings use others (a clash while a window is
    # open: ValueError; else they open a window with them).
    profiles = {}
    for i in range(len(KEYS)):
        mode = draw(st.sampled_from(("trailing", *MODES)))
        profiles[i] = (mode, *draw(options(mode)))
    timeline = []
    for _ in range(draw(st.integers(0, 40))):
        kind = draw(st.sampled_from(("ping",) * 8 + ("cancel", "flush")))
        key = draw(st.integers(0, len(KEYS) - 1))
        mode, opts, ordered = profiles[key]
        if kind == "ping" and draw(st.integers(0, 9)) == 0:
            mode = draw(st.sampled_from(MODES))
            opts, ordered = draw(options(mode))
        delay = draw(grid(16))
        order = draw(st.integers(0, 4)) if ordered else None
        timeline.append(
            Op(
                dt=draw(st.sampled_from((0.0, 0.0, 0.25, 0.25, 0.5, 1.0, 1.75, 3.0, 5.0))),
                kind=kind,
                key=key,
                mode=mode,
                delay=delay,
                max_delay=draw(st.none() | grid(12).map(functools.partial(operator.add, delay))),
                handler_time=draw(st.sampled_from(RUN_TIMES)),
                opts=opts,
                order=order,
                drop_stale=ordered and draw(st.booleans()),
            )
        )
    return timeline


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(option_timelines(), st.sampled_from(("wait", "wait", "flush", "cancel")), st.booleans())
def test_coordinator_with_options_matches_model(
    timeline: list[Op], on_exit: OnExit, hooked: bool
) -> None:
    expected_results, expected_fires = run_model(timeline, on_exit)
    results, fires = run_real(timeline, on_exit, hooked)
    assert results == expected_results
    assert sorted(fires, key=_order) == sorted(expected_fires, key=_order)
