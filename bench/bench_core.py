"""Core costs of the in-memory coordinator, each against a baseline in the same run.

Run with ``nox -s bench`` (or ``python bench/bench_core.py -o results.json``). Uses
pyperf: every figure is the mean of several worker processes, with its spread.

* ``coalescing-ping``: ``debounce_nowait`` into an open trailing window.
  Baseline ``checkpoint``: a bare ``await trio.lowlevel.checkpoint()``.
  Baseline ``naive-rearm``: the naive Trio debouncer, which cancels a cancel scope and
  spawns a new sleeping task on every ping.
* ``open-window``: ``debounce_nowait`` opening a new trailing window, until its task
  sleeps. Baseline ``spawn-sleeper``: ``nursery.start_soon`` of a task that sleeps on a
  deadline, until it sleeps.
* ``replay-reference``: replaying ``../shared/data/nats-py-commits.jsonl`` (1,321 events,
  trailing, delay 3600, max delay 7200) through the coordinator on a virtual clock, per
  event. Baseline ``parse-reference``: parsing the same lines, per event.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyperf
import trio
import trio.testing

import trio_debounce
from trio_debounce._events import parse_event
from trio_debounce._replay import replay

REFERENCE = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "nats-py-commits.jsonl"
)

WF = "wf"


async def _noop(fire: trio_debounce.Fire) -> None:
    pass


def coalescing_ping(loops: int) -> float:
    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
        ) as coordinator:
            ping = coordinator.debounce_nowait
            ping(WF, "k", None, delay=3600.0)
            t0 = time.perf_counter()
            for _ in range(loops):
                ping(WF, "k", None, delay=3600.0)
            return time.perf_counter() - t0

    return trio.run(main)


def checkpoint(loops: int) -> float:
    async def main() -> float:
        cp = trio.lowlevel.checkpoint
        t0 = time.perf_counter()
        for _ in range(loops):
            await cp()
        return time.perf_counter() - t0

    return trio.run(main)


def naive_rearm(loops: int) -> float:
    """The naive debouncer: cancel the pending timer task and spawn a new one per ping."""

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            state: dict[str, Any] = {}

            async def timer(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                with trio.CancelScope() as scope:
                    state["scope"] = scope
                    await trio.sleep(3600.0)

            def ping() -> None:
                scope = state.get("scope")
                if scope is not None:
                    scope.cancel()
                nursery.start_soon(timer)

            t0 = time.perf_counter()
            for _ in range(loops):
                ping()
                await trio.lowlevel.checkpoint()  # let the new task start and the old die
            elapsed = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
        return elapsed

    return trio.run(main)


def open_window(loops: int) -> float:
    keys = [str(i) for i in range(loops)]

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
        ) as coordinator:
            ping = coordinator.debounce_nowait
            t0 = time.perf_counter()
            for key in keys:
                ping(WF, key, None, delay=3600.0)
            await trio.testing.wait_all_tasks_blocked()
            return time.perf_counter() - t0

    return trio.run(main)


def spawn_sleeper(loops: int) -> float:
    async def sleeper() -> None:
        with trio.CancelScope(deadline=trio.current_time() + 3600.0):
            await trio.sleep_forever()

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            for _ in range(loops):
                nursery.start_soon(sleeper)
            await trio.testing.wait_all_tasks_blocked()
            elapsed = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
        return elapsed

    return trio.run(main)


def _reference_lines() -> list[str]:
    return REFERENCE.read_text().splitlines()


def replay_reference(loops: int) -> float:
    lines = _reference_lines()
    t0 = time.perf_counter()
    for _ in range(loops):
        events = (parse_event(t, n, key_field="key", time_field="ts") for n, t in enumerate(lines))
        replay(events, delay=3600.0, max_delay=7200.0)
    return time.perf_counter() - t0


def parse_reference(loops: int) -> float:
    lines = _reference_lines()
    t0 = time.perf_counter()
    for _ in range(loops):
        for n, text in enumerate(lines):
            parse_event(text, n, key_field="key", time_field="ts")
    return time.perf_counter() - t0


if __name__ == "__main__":
    runner = pyperf.Runner()
    runner.metadata["description"] = __doc__.splitlines()[0]
    runner.bench_time_func("coalescing-ping", coalescing_ping)
    runner.bench_time_func("checkpoint", checkpoint)
    runner.bench_time_func("naive-rearm", naive_rearm)
    runner.bench_time_func("open-window", open_window)
    runner.bench_time_func("spawn-sleeper", spawn_sleeper)
    if REFERENCE.exists():
        # per event: pyperf divides by loops and by inner_loops
        events = len(_reference_lines())
        runner.bench_time_func("replay-reference", replay_reference, inner_loops=events)
        runner.bench_time_func("parse-reference", parse_reference, inner_loops=events)
