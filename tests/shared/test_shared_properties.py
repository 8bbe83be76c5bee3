"""Random timelines through 2 to 4 coordinators that share one store, against the
reference model (``tests/harness/model.py``).

The pings come from owners and peers, one after the other or several at once from
one process (merged by group commit), on a grid of 0.25 s with many exact ties: a
ping at a window's deadline, at its cap, at the instant its ``max_count`` was
reached. The store's epoch is 0, so wall and Trio times convert exactly and a tie is
the same float on both clocks. Every fire (time, run id, edge, payload, count, first
ping) must be the model's, which knows nothing of processes: the time rules hold
across processes exactly as in one.

The backends' retry backoff is made zero-length (a checkpoint, no time passes): a
ping that loses a compare-and-swap still retries, but lands at its own instant. With
the jitter, a ping whose write lands after a peer committed the window it was early
enough to join goes to the next window: pings of several processes land when they
land, which no model of one process describes (and a ping made after it, late, would
be off the grid).
"""

from __future__ import annotations

import math
import random
from contextlib import AsyncExitStack
from typing import Any

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.harness.model import Model, Options
from trio_debounce import Fire, ModeName, open_coordinator
from trio_debounce.testing import MemoryBackend, MemoryStore

MODES: tuple[ModeName, ...] = ("trailing", "leading", "both")
GRID = 0.25
KEY = ("wf", "k")

#: One step of a timeline: (gap to the previous instant, 0 for the same one; the
#: process that pings; its delay; how many pings it makes at once, merged).
Step = tuple[float, int, float, int]


@st.composite
def timelines(draw: st.DrawFn) -> tuple[int, ModeName, int | None, float | None, list[Step]]:
    processes = draw(st.integers(2, 4))
    mode = draw(st.sampled_from(MODES))
    max_count = draw(st.sampled_from([None, None, 1, 2, 3]))
    max_delay = draw(st.sampled_from([None, 1.0, 2.0]))
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.0, 0.0, GRID, 2 * GRID, 1.0, 2.0]),
                st.integers(0, processes - 1),
                st.sampled_from([0.0, GRID, 1.0, 1.0, 2.0]),
                st.sampled_from([1, 1, 1, 2, 3]),
            ),
            min_size=1,
            max_size=12,
        )
    )
    return processes, mode, max_count, max_delay, steps


class _NoJitter(random.Random):
    """A backoff of 0 s (``uniform`` returns its lower bound)."""

    def uniform(self, a: float, b: float) -> float:
        return a


def _fire_row(fire: Fire) -> tuple[float, str, str, Any, int, float]:
    return (
        fire.fired_at,
        fire.run_id,
        fire.edge.value,
        fire.payload,
        fire.ping_count,
        fire.first_ping_at,
    )


async def _run(
    processes: int,
    mode: ModeName,
    max_count: int | None,
    max_delay: float | None,
    steps: list[Step],
) -> tuple[list[Fire], list[tuple[float, int, float]]]:
    """Drive the timeline; returns the fires and the pings (time, payload, delay) in the
    order they were made."""
    store = MemoryStore(epoch=0.0)
    fires: list[Fire] = []

    async def handler(fire: Fire) -> None:
        fires.append(fire)

    pings: list[tuple[float, int, float]] = []
    options: dict[str, Any] = {} if max_count is None else {"max_count": max_count}

    backends = [
        MemoryBackend(store, process_id=f"p{i}", process_lease=60.0) for i in range(processes)
    ]
    for backend in backends:
        backend._view._rng = _NoJitter()
    async with AsyncExitStack() as stack:
        coordinators = [
            await stack.enter_async_context(
                open_coordinator(handlers={"wf": handler}, backend=backend)
            )
            for backend in backends
        ]

        async def ping(process: int, delay: float) -> None:
            n = len(pings)
            # No checkpoint between the record and the ping's arrival at the backend.
            pings.append((trio.current_time(), n, delay))
            await coordinators[process].debounce(
                *KEY,
                n,
                delay=delay,
                max_delay=max_delay,
                mode=mode,
                run_id=f"r{n}",
                **options,
            )

        planned = 1.0
        for gap, process, delay, at_once in steps:
            planned += gap
            if trio.current_time() < planned:
                await trio.sleep_until(planned)
            if max_delay is not None:
                delay = min(delay, max_delay)
            if at_once == 1:
                await ping(process, delay)
            else:
                async with trio.open_nursery() as nursery:
                    for _ in range(at_once):
                        nursery.start_soon(ping, process, delay)
        await trio.sleep(10.0)  # every window fires (the longest lasts 2 s)
        assert all(c.statistics().unconfirmed_fires == 0 for c in coordinators)
    # every ping was made at its planned instant, on the grid
    assert all(t / GRID == int(t / GRID) for t, _, _ in pings)
    return fires, pings


def _model(
    mode: str,
    max_count: int | None,
    max_delay: float | None,
    pings: list[tuple[float, int, float]],
) -> list[tuple[float, str, str, Any, int, float]]:
    model = Model()
    for t, n, delay in pings:
        model.ping(t, KEY, n, delay, max_delay, mode, f"r{n}", Options(max_count=max_count))
    model.finish(math.inf)
    return sorted(
        (f.fired_at, f.run_id, f.edge, f.payload, f.ping_count, f.first_ping_at)
        for f in model.fires
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timelines())
def test_shared_fires_match_the_model(
    case: tuple[int, ModeName, int | None, float | None, list[Step]],
) -> None:
    processes, mode, max_count, max_delay, steps = case
    fires, pings = trio.run(
        _run,
        processes,
        mode,
        max_count,
        max_delay,
        steps,
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    got = sorted(_fire_row(f) for f in fires)
    expected = _model(mode, max_count, max_delay, pings)
    # Times convert exactly on the grid; a ping that followed a lost compare-and-swap's
    # backoff is off it, where a conversion may cost an ulp.
    assert [row[1:] for row in got] == [row[1:] for row in expected], (pings, got, expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert math.isclose(mine[0], theirs[0], abs_tol=1e-9), (mine, theirs)
        assert math.isclose(mine[5], theirs[5], abs_tol=1e-9), (mine, theirs)
