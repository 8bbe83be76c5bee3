"""Hypothesis: random timelines of throttle, audit, batch and rate-limit pings, each
made by one of 2 to 4 processes that share a ``MemoryBackend`` store, match the flow
reference model (``tests/harness/flow_model.py``) of one process: the same results,
and the same fires (times within the wall clock's rounding), ties included. Whoever
pings, a key has one window (see docs/protocol.rst, "Flow-control windows").

The timelines are those of ``tests/local/test_flow_properties.py`` without its cancels
and flushes (steering across processes is tested by name in ``test_flow_shared.py``),
``overlap="queue-latest"`` and its handler times included: a queue-latest run blocks
its key in every process, through the shared document.
"""

from __future__ import annotations

import math
from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness.fires import Fires
from tests.harness.flow_model import FlowFire, FlowModel
from tests.harness.memory import processes
from tests.local.test_flow_properties import KEYS, Op, model_ping, real_ping, run_time, timelines
from trio_debounce import Fire
from trio_debounce.testing import MemoryStore

#: The store's wall-clock epoch (Trio's clock at 0).
EPOCH = 1_000.0
#: Added to every run's time: across processes a ping lands a few ms after its call (a
#: compare-and-swap it lost, then a backoff), so no run may end within ms of a ping on
#: the grid, or the ping could land on the other side of the run's end than the model
#: puts it (runs then end 75/1024 s, about 73 ms, or more off the 1/4 grid).
MARGIN = 74 / 1024


def shared_run_time(payload: Any) -> float:
    return run_time(payload) + MARGIN


def run_model(timeline: list[Op], times: list[float]) -> tuple[list[Any], list[FlowFire], int]:
    """The model's results and fires for ``timeline``, each op at its time in ``times``
    (as the shared run made it: a ping that follows pings of the same instant may come a
    little later, after their writes; wall clock, as the backend decides)."""
    model = FlowModel(run_time=shared_run_time)
    results: list[Any] = []
    for i, (op, t) in enumerate(zip(timeline, times, strict=True)):
        try:
            results.append(model_ping(model, t, KEYS[op.key], op, i))
        except ValueError:
            results.append("ValueError")
    model.advance(math.inf)
    return results, model.fires, model.dropped


def run_shared(
    timeline: list[Op], who: list[int]
) -> tuple[list[Any], list[FlowFire], int, list[float]]:
    results: list[Any] = []
    times: list[float] = []
    fires = Fires()

    async def main() -> int:
        store = MemoryStore(epoch=EPOCH)
        names = "ABCD"[: max(who) + 1]
        async with processes(store, fires, list(names)) as coordinators:
            for name, c in zip(names, coordinators, strict=True):
                record = fires.handler(name)

                async def handler(fire: Fire, record: Any = record) -> None:
                    await record(fire)
                    # A run ends its time after its logical fire time, as in the model
                    # (its handler starts after the commit's round trip).
                    await trio.sleep_until(fire.fired_at + shared_run_time(fire.payload))

                c.set_handler("wf", handler)
                c.set_handler("other", handler)
            t0 = trio.current_time()
            t = 0.0
            for i, op in enumerate(timeline):
                t += op.dt
                await trio.sleep_until(t0 + t)
                c = coordinators[who[i % len(who)]]
                # The ping's time as the backend reads it: the model then decides ties
                # on the same floats (wall clock, the store's epoch on Trio's clock).
                times.append(EPOCH + trio.current_time())
                workflow, key = KEYS[op.key]
                try:
                    r = await real_ping(c, workflow, key, op, i)
                except ValueError:
                    results.append("ValueError")
                else:
                    results.append(r.outcome.value)
            await trio.sleep(100.0)  # every window's end (spans are at most 2 s)
            for c in coordinators:
                assert c.statistics().pending_trailing_fires == 0
            return sum(c.statistics().dropped_pings for c in coordinators)

    dropped = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    converted = [
        FlowFire(
            EPOCH + f.fired_at,
            (f.workflow, f.key),
            f.payload,
            f.ping_count,
            f.edge.value,
            f.reason.value,
        )
        for _, f in fires.log
    ]
    return results, converted, dropped, times


def _key(f: FlowFire) -> tuple[Any, ...]:
    # Fire times come back through the wall clock to Trio's and back: within 1e-6.
    return (round(f.fired_at, 6), f.ident, repr(f.payload), f.ping_count, f.edge, f.reason)


@st.composite
def pingers(draw: st.DrawFn) -> list[int]:
    """Which of 2 to 4 processes makes each ping (cycled over the timeline)."""
    n = draw(st.integers(2, 4))
    return draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=8)) + list(range(n))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    timelines().map(lambda ops: [op for op in ops if op.kind not in ("cancel", "flush")]),
    pingers(),
)
def test_processes_match_the_flow_model_of_one(timeline: list[Op], who: list[int]) -> None:
    results, fires, dropped, times = run_shared(timeline, who)
    expected_results, expected_fires, expected_dropped = run_model(timeline, times)
    assert results == expected_results
    assert [_key(f) for f in sorted(fires, key=_key)] == [
        _key(f) for f in sorted(expected_fires, key=_key)
    ]
    assert dropped == expected_dropped
