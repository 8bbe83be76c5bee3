"""Hypothesis: random timelines of throttle, audit, batch and rate-limit pings (with
cancels and flushes) through the real coordinator match the flow reference model
(``tests/harness/flow_model.py``), result by result and fire by fire, ties included.

Times are drawn on a grid of 1/4 so every float sum is exact: pings land exactly on
window ends (the tie rule), and are compared to the float.

Audit and batch keys may use ``overlap="queue-latest"`` (with run timeouts), and a few
throttle and rate-limit pings ask for it (and must raise). Handlers then take time:
``run_time`` of the fire's payload, off the grid by a few 1/1024 (sums stay exact), so
a run never ends at the same instant as a ping, a cancel or a flush (the one tie the
scheduler decides, as in ``tests/local/test_properties.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio_debounce
from tests.harness.flow_model import FlowFire, FlowModel
from trio_debounce import Fire, OnExit

GRID = 0.25
KEYS = (("wf", "a"), ("wf", "b"), ("other", "a"))
KINDS = ("throttle", "audit", "throttle-leading", "batch", "rate")
#: Handler times: off the 1/4 grid by a few 1/1024 (see the module docstring).
RUN_TIMES = (1 / 1024, 0.5 + 1 / 1024, 1.75 + 1 / 1024, 4.0 + 3 / 1024)


def run_time(payload: Any) -> float:
    """How long the handler of a fire with ``payload`` runs (a batch: by its first item)."""
    first = payload[0] if isinstance(payload, list) else payload
    return RUN_TIMES[first % len(RUN_TIMES)]


@dataclass(frozen=True)
class Op:
    dt: float
    kind: str  # a KINDS member, "cancel" or "flush"
    key: int
    params: tuple[Any, ...]


def overlap(draw: st.DrawFn, kind: str) -> tuple[str, float | None]:
    """``(overlap, run_timeout)``: often queue-latest for audit and batch; rarely for
    the kinds with a leading edge (refused)."""
    if kind in ("audit", "batch"):
        if draw(st.booleans()):
            return "queue-latest", draw(st.sampled_from((None, None, 1.0, 2.5)))
        return "allow", None
    return draw(st.sampled_from(("allow",) * 7 + ("queue-latest",))), None


def params(draw: st.DrawFn, kind: str) -> tuple[Any, ...]:
    span = draw(st.integers(1, 8)) * GRID
    how, timeout = overlap(draw, kind)
    if kind == "batch":
        items = draw(st.sampled_from((None, 1, 2, 3)))
        return (span, items, draw(st.sampled_from((None, 2, 4))), how, timeout)
    if kind == "rate":
        return (span, draw(st.integers(1, 3)), how)
    return (span, how, timeout)


@st.composite
def timelines(draw: st.DrawFn) -> list[Op]:
    # Each key has its kind and parameters; a few pings use others and must raise.
    fixed = {}
    for i in range(len(KEYS)):
        kind = draw(st.sampled_from(KINDS))
        fixed[i] = (kind, params(draw, kind))
    timeline = []
    for _ in range(draw(st.integers(0, 40))):
        key = draw(st.integers(0, len(KEYS) - 1))
        kind, p = fixed[key]
        choice = draw(st.integers(0, 19))
        if choice == 0:
            kind, p = "cancel", ()
        elif choice == 1:
            kind, p = "flush", ()
        elif choice == 2:  # a clash (or, by chance, the same kind and parameters)
            kind = draw(st.sampled_from(KINDS))
            p = params(draw, kind)
        dt = draw(st.sampled_from((0.0, 0.0, 0.25, 0.5, 1.0, 1.75, 3.0)))
        timeline.append(Op(dt, kind, key, p))
    return timeline


def size(item: int) -> int:
    return len(json.dumps(item))


def model_ping(model: FlowModel, t: float, ident: tuple[str, str], op: Op, i: int) -> str:
    """The model's outcome of ping ``op`` (the ``i``-th: its payload) at ``t``.

    Raises:
      ValueError: the model refuses it (as the coordinator must).
    """
    if op.kind == "batch":
        span, items, limit, how, timeout = op.params
        if limit is not None and size(i) > limit:
            raise ValueError("too big")
        return model.batch(
            t,
            ident,
            i,
            size=size(i),
            max_wait=span,
            max_items=items,
            max_bytes=limit,
            overlap=how,
            run_timeout=timeout,
        )
    if op.kind == "rate":
        span, limit, how = op.params
        return model.rate_limit(t, ident, i, period=span, limit=limit, overlap=how)
    span, how, timeout = op.params
    return model.throttle(
        t,
        ident,
        i,
        interval=span,
        leading=op.kind != "audit",
        trailing=op.kind != "throttle-leading",
        overlap=how,
        run_timeout=timeout,
    )


async def real_ping(
    c: trio_debounce.Coordinator, workflow: str, key: str, op: Op, i: int
) -> trio_debounce.DebounceResult:
    """Ping ``op`` (the ``i``-th: its payload) through the coordinator's method."""
    if op.kind == "batch":
        span, items, limit, how, timeout = op.params
        return await c.batch(
            workflow,
            key,
            i,
            max_wait=span,
            max_items=items,
            max_bytes=limit,
            overlap=how,
            run_timeout=timeout,
        )
    if op.kind == "rate":
        span, limit, how = op.params
        return await c.rate_limit(workflow, key, i, period=span, limit=limit, overlap=how)
    span, how, timeout = op.params
    return await c.throttle(
        workflow,
        key,
        i,
        interval=span,
        leading=op.kind != "audit",
        trailing=op.kind != "throttle-leading",
        overlap=how,
        run_timeout=timeout,
    )


def run_model(timeline: list[Op], on_exit: str) -> tuple[list[Any], list[FlowFire], int]:
    model = FlowModel(run_time=run_time)
    results: list[Any] = []
    t = 0.0
    for i, op in enumerate(timeline):
        t += op.dt
        ident = KEYS[op.key]
        try:
            if op.kind == "cancel":
                results.append(model.cancel(t, ident))
            elif op.kind == "flush":
                results.append(model.flush(t, ident))
            else:
                results.append(model_ping(model, t, ident, op, i))
        except ValueError:
            results.append("ValueError")
    if on_exit == "flush":
        model.advance(t)  # the ends due by the exit fire first, with their own reasons
        before = len(model.fires)
        for ident in KEYS:
            model.flush(t, ident)
        # The model's flush says "flush"; the exit's flush says "exit".
        model.fires[before:] = [replace(f, reason="exit") for f in model.fires[before:]]
    elif on_exit == "cancel":
        for ident in KEYS:
            if model.pending(t, ident):
                model.cancel(t, ident)
    model.advance(math.inf)
    return results, model.fires, model.dropped


def run_real(timeline: list[Op], on_exit: OnExit) -> tuple[list[Any], list[FlowFire], int]:
    results: list[Any] = []
    fires: list[Fire] = []

    async def handler(fire: Fire) -> None:
        fires.append(fire)
        assert trio.current_time() - fire.fired_at < 1e-9  # it starts on time
        await trio.sleep(run_time(fire.payload))

    async def main() -> trio_debounce.CoordinatorStatistics:
        t = 0.0
        async with trio_debounce.open_coordinator(
            handlers={"wf": handler, "other": handler}, on_exit=on_exit
        ) as c:
            for i, op in enumerate(timeline):
                t += op.dt
                await trio.sleep_until(t)
                workflow, key = KEYS[op.key]
                try:
                    if op.kind == "cancel":
                        results.append(await c.cancel(workflow, key))
                        continue
                    if op.kind == "flush":
                        results.append(await c.flush(workflow, key))
                        continue
                    r = await real_ping(c, workflow, key, op, i)
                except ValueError:
                    results.append("ValueError")
                else:
                    results.append(r.outcome.value)
        return c.statistics()

    stats = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert stats.fires == len(fires)
    assert stats.pending_trailing_fires == 0
    assert stats.running_handlers == 0
    pings = [r for r in results if isinstance(r, str) and r != "ValueError"]
    assert stats.pings == len(pings) - pings.count("dropped")
    converted = [
        FlowFire(
            f.fired_at,
            (f.workflow, f.key),
            f.payload,
            f.ping_count,
            f.edge.value,
            f.reason.value,
        )
        for f in fires
    ]
    return results, converted, stats.dropped_pings


def _order(f: FlowFire) -> tuple[Any, ...]:
    return (f.fired_at, f.ident, repr(f.payload), f.edge, f.reason)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timelines(), st.sampled_from(("wait", "wait", "flush", "cancel")))
def test_coordinator_matches_the_flow_model(timeline: list[Op], on_exit: OnExit) -> None:
    expected_results, expected_fires, expected_dropped = run_model(timeline, on_exit)
    results, fires, dropped = run_real(timeline, on_exit)
    assert results == expected_results
    assert sorted(fires, key=_order) == sorted(expected_fires, key=_order)
    assert dropped == expected_dropped


@pytest.mark.parametrize("kind", KINDS)
def test_a_known_burst_of_each_kind(kind: str) -> None:
    # A sanity anchor for the property: pings at 0, 0.5, 1 (the end: a tie) and 1.25.
    p: tuple[Any, ...] = {"batch": (1.0, 3, None, "allow", None), "rate": (1.0, 2, "allow")}.get(
        kind, (1.0, "allow", None)
    )
    timeline = [Op(dt, kind, 0, p) for dt in (0.0, 0.5, 0.5, 0.25)]
    expected = run_model(timeline, "wait")
    assert run_real(timeline, "wait") == expected
    _, fires, _ = expected
    assert fires  # the anchor fires something in every kind
