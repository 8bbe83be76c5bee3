"""Throttle, audit, batch and rate limit in memory: the coalescing (absorbing) ping of each
mode on the keyed workload, and a hot key whose every ping fires.

One item of ``bench/suite.py``, ``flow`` (:func:`item`), issue 20's bench figures:

* on the keyed workload of ``ping-keyed`` (1,000 open windows pinged in turn, each ping a
  different key than the last, no window ending during the timed loop: every interval,
  ``max_wait`` and period is an hour), the ping each mode absorbs:
  ``throttle_nowait`` (both edges: coalesced), ``throttle_nowait(leading=False)`` (an
  audit: coalesced), ``batch_nowait`` (appended), ``rate_limit_nowait`` past its limit
  (dropped); each against ``debounce_nowait`` on the same workload (``ping-keyed``, the
  nearest in-library ping), and the throttle and the audit against
  ``throttlebounce.async_throttle(trailing=True)``, one instance per key in a dict (the
  nearest external throttle: throttlebounce is not keyed and has no trailing-only
  throttle, and its absorbed call is the same for both);
* the hot key: ``rate_limit_nowait`` on one key with a limit above the pings, so that
  every ping fires (its ``Fire`` built, its handler task started with
  ``nursery.start_soon``), against ``nursery.start_soon`` of a no-op task; timed twice,
  the calls alone (the tasks run after the clock stops) and until every task has run
  and ended.

The timed functions take a fixed ``loops`` and run their own fresh event loop, as
``bench/ping_local.py``'s; run by hand, ``python bench/flow.py`` is an ordinary pyperf
script over them (calibrated: NOT how the report's figures are taken; the suite runs it
as pyperf worker processes with ``--workers``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ping_local
import trio
import trio.testing
from _harness import Context, cost_row, quantiles, ratio, row, speedup_row, timed_in_rounds
from ping_local import DELAY, WF, _keyed, _noop

import trio_debounce

SCRIPT = Path(__file__).resolve()
#: Every window's span (interval, max_wait, period): nothing ends during a sample.
SPAN = DELAY
#: A batch's ``max_items`` on the keyed workload: above the items a window takes in a
#: sample (its opening item, the warm pass's and one per pass), so none fills.
BATCH_MAX_ITEMS = 1_000_000


def _flow_keyed(loops: int, ping: Callable[[Any, str], object]) -> float:
    """The keyed workload of a flow mode: ``ping(coordinator, key)`` opens each of the
    1,000 windows, the handler tasks of any leading fires run, one untimed pass over
    the keys puts every window in its steady state, then ``loops`` pings in turn are
    timed (``loops`` a multiple of 1,000)."""
    keys, passes = _keyed(loops)

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
        ) as coordinator:
            for key in keys:
                ping(coordinator, key)
            await trio.testing.wait_all_tasks_blocked()
            for key in keys:
                ping(coordinator, key)
            t0 = time.perf_counter()
            for _ in range(passes):
                for key in keys:
                    ping(coordinator, key)
            return time.perf_counter() - t0

    return trio.run(main)


def throttle_keyed(loops: int) -> float:
    """``throttle_nowait`` (both edges) into 1,000 open throttle windows pinged in turn:
    each window opened (its leading fire run), so every timed ping is absorbed
    (``coalesce``: the latest payload kept for the trailing edge)."""

    def ping(coordinator: Any, key: str) -> object:
        return coordinator.throttle_nowait(WF, key, None, interval=SPAN)

    return _flow_keyed(loops, ping)


def audit_keyed(loops: int) -> float:
    """``throttle_nowait(leading=False)`` (an audit) into 1,000 open audit windows
    pinged in turn: every timed ping replaces its window's payload (``coalesce``)."""

    def ping(coordinator: Any, key: str) -> object:
        return coordinator.throttle_nowait(WF, key, None, interval=SPAN, leading=False)

    return _flow_keyed(loops, ping)


def batch_keyed(loops: int) -> float:
    """``batch_nowait`` into 1,000 open batches pinged in turn, ``max_bytes=None`` (no
    JSON sizing of the item): every timed ping appends ``None`` to its batch's list.
    A window holds ``loops / 1,000 + 2`` items at the end of a sample (102 with the
    suite's 100,000 pings), far below :data:`BATCH_MAX_ITEMS`: none fires."""
    if loops // 1_000 + 2 >= BATCH_MAX_ITEMS:
        raise ValueError(f"loops ({loops}) would fill a batch")

    def ping(coordinator: Any, key: str) -> object:
        return coordinator.batch_nowait(WF, key, None, max_wait=SPAN, max_items=BATCH_MAX_ITEMS)

    return _flow_keyed(loops, ping)


def rate_dropped_keyed(loops: int) -> float:
    """``rate_limit_nowait(limit=1)`` on 1,000 open rate-limit windows pinged in turn:
    each window's opening ping fired (its handler run before the clock starts), so
    every timed ping is past the limit (``dropped``, counted)."""

    def ping(coordinator: Any, key: str) -> object:
        return coordinator.rate_limit_nowait(WF, key, None, limit=1, period=SPAN)

    return _flow_keyed(loops, ping)


def throttlebounce_throttle_keyed(loops: int) -> float:
    """External baseline: ``throttlebounce.async_throttle(interval, trailing=True)``
    (PyPI; unkeyed, asyncio), one throttled coroutine function per key kept in a dict
    by ``(workflow, key)``, called in turn on a fresh loop. As for ours: each instance
    called once (its leading run done) and once more (its trailing timer armed) before
    the clock starts, so every timed call is absorbed (it replaces the pending call)."""
    from throttlebounce import async_throttle

    keys, passes = _keyed(loops)

    async def job(value: object) -> None:
        pass

    async def main() -> float:
        throttled = {(WF, key): async_throttle(SPAN, trailing=True)(job) for key in keys}
        for key in keys:
            throttled[(WF, key)](None)
        for _ in range(3):  # the leading runs' tasks end
            await asyncio.sleep(0)
        for key in keys:
            throttled[(WF, key)](None)
        t0 = time.perf_counter()
        for _ in range(passes):
            for key in keys:
                throttled[(WF, key)](None)
        elapsed = time.perf_counter() - t0
        for t in throttled.values():
            t.cancel()
        return elapsed

    return asyncio.run(main())


def _hot_key(loops: int, run: bool) -> float:
    """``rate_limit_nowait`` on one key, ``limit`` above ``loops``: every ping fires
    (``fire-immediate``: a ``Fire`` built, a run id drawn, the handler's task started
    with ``nursery.start_soon``). Timed: the ``loops`` calls, and with ``run`` also
    until every handler task has run and ended (``wait_all_tasks_blocked``); without
    it the tasks run after the clock stops. The window is opened (and its first
    handler run) before."""
    limit = loops + 1

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
        ) as coordinator:
            ping = coordinator.rate_limit_nowait
            ping(WF, "hot", None, limit=limit, period=SPAN)
            await trio.testing.wait_all_tasks_blocked()
            t0 = time.perf_counter()
            for _ in range(loops):
                ping(WF, "hot", None, limit=limit, period=SPAN)
            if run:
                await trio.testing.wait_all_tasks_blocked()
            elapsed = time.perf_counter() - t0
            await trio.testing.wait_all_tasks_blocked()
            return elapsed

    return trio.run(main)


def rate_hot_key(loops: int) -> float:
    """:func:`_hot_key`, the calls alone timed."""
    return _hot_key(loops, run=False)


def rate_hot_key_run(loops: int) -> float:
    """:func:`_hot_key`, timed until the handler tasks have run."""
    return _hot_key(loops, run=True)


def _spawn_noop(loops: int, run: bool) -> float:
    """Baseline of the hot key: ``nursery.start_soon`` of a no-op task, ``loops``
    times; timed as :func:`_hot_key` (``run``: until the tasks have run and ended)."""

    async def noop() -> None:
        pass

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            start = nursery.start_soon
            t0 = time.perf_counter()
            for _ in range(loops):
                start(noop)
            if run:
                await trio.testing.wait_all_tasks_blocked()
            elapsed = time.perf_counter() - t0
            await trio.testing.wait_all_tasks_blocked()
        return elapsed

    return trio.run(main)


def spawn_noop(loops: int) -> float:
    """:func:`_spawn_noop`, the calls alone timed."""
    return _spawn_noop(loops, run=False)


def spawn_noop_run(loops: int) -> float:
    """:func:`_spawn_noop`, timed until the tasks have run."""
    return _spawn_noop(loops, run=True)


# ----------------------------------------------------------------- the item

#: name -> time function ``(loops) -> seconds``, in pyperf registration order (the
#: worker task index is the position in this dict).
BENCHES: dict[str, Callable[[int], float]] = {
    "ping-keyed": ping_local.ping_keyed,
    "throttle-keyed": throttle_keyed,
    "audit-keyed": audit_keyed,
    "batch-keyed": batch_keyed,
    "rate-dropped-keyed": rate_dropped_keyed,
    "throttlebounce-throttle-keyed": throttlebounce_throttle_keyed,
    "rate-hot-key": rate_hot_key,
    "rate-hot-key-run": rate_hot_key_run,
    "spawn-noop": spawn_noop,
    "spawn-noop-run": spawn_noop_run,
}
#: The keyed workload's variants (``keyed_loops`` pings each); the rest are the hot
#: key's (``flow_hot_fires`` pings or tasks each).
KEYED = (
    "ping-keyed",
    "throttle-keyed",
    "audit-keyed",
    "batch-keyed",
    "rate-dropped-keyed",
    "throttlebounce-throttle-keyed",
)
HOT = ("rate-hot-key", "rate-hot-key-run", "spawn-noop", "spawn-noop-run")

_NS: dict[str, Any] = {"scale": 1e9, "unit": "ns"}
_DEBOUNCE = "debounce_nowait (ping-keyed)"


def _rate_row(name: str, ours: list[float], base: list[float], baseline: str) -> dict[str, Any]:
    """A row in pings/s from seconds per ping by round: the ratio ours / baseline per
    round (the baseline's seconds over ours)."""
    return row(
        name,
        1 / quantiles(ours)["median"],
        "pings/s",
        baseline=baseline,
        base=1 / quantiles(base)["median"],
        stats=ratio(base, ours),
        ratio_label="ours / baseline, pings/s",
    )


def rows(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The flow item's report lines from the seconds per ping of each variant."""
    debounce = values["ping-keyed"]
    tb = values["throttlebounce-throttle-keyed"]
    workload = "on 1,000 open windows pinged in turn"
    return [
        cost_row(
            f"throttle_nowait (both edges), absorbed (coalesce), {workload}, vs "
            "debounce_nowait on the same workload",
            values["throttle-keyed"],
            debounce,
            _DEBOUNCE,
            label="cost ratio (throttle / debounce)",
            **_NS,
        ),
        speedup_row(
            f"throttle_nowait (both edges), absorbed, {workload}, vs "
            "throttlebounce.async_throttle(trailing=True), one instance per key in a dict",
            values["throttle-keyed"],
            tb,
            "throttlebounce x 1,000",
            None,
            **_NS,
        ),
        cost_row(
            f"throttle_nowait(leading=False) (audit), absorbed (coalesce), {workload}, "
            "vs debounce_nowait",
            values["audit-keyed"],
            debounce,
            _DEBOUNCE,
            label="cost ratio (audit / debounce)",
            **_NS,
        ),
        speedup_row(
            f"audit, absorbed, {workload}, vs throttlebounce.async_throttle(trailing=True) "
            "absorbing (it has no trailing-only throttle; its absorbed call is the same)",
            values["audit-keyed"],
            tb,
            "throttlebounce x 1,000",
            None,
            **_NS,
        ),
        cost_row(
            f"batch_nowait appending an item (max_bytes=None; about 100 items a batch), "
            f"{workload}, vs debounce_nowait",
            values["batch-keyed"],
            debounce,
            _DEBOUNCE,
            label="cost ratio (batch / debounce)",
            **_NS,
        ),
        cost_row(
            f"rate_limit_nowait past its limit (dropped, counted), {workload}, vs debounce_nowait",
            values["rate-dropped-keyed"],
            debounce,
            _DEBOUNCE,
            label="cost ratio (rate limit / debounce)",
            **_NS,
        ),
        _rate_row(
            "hot key: rate_limit_nowait on one key, every ping firing (a Fire, a run id, "
            "its handler task started); timed: the calls, the tasks run after; vs "
            "nursery.start_soon of a no-op task",
            values["rate-hot-key"],
            values["spawn-noop"],
            "start_soon",
        ),
        _rate_row(
            "hot key: the same, timed until every handler task has run and ended, vs "
            "start_soon of no-op tasks until they have run",
            values["rate-hot-key-run"],
            values["spawn-noop-run"],
            "start_soon, run",
        ),
    ]


def item(ctx: Context) -> dict[str, Any]:
    """flow: every variant of :data:`BENCHES`, paired (one rotation for all)."""
    loops = dict.fromkeys(KEYED, ctx.params.keyed_loops)
    loops.update(dict.fromkeys(HOT, ctx.params.flow_hot_fires))
    values = timed_in_rounds(ctx, SCRIPT, BENCHES, loops, "flow-pyperf.json")
    return {
        "title": "Throttle, batch and rate limit: 1,000 open windows in turn, a hot key "
        "(in memory)",
        "rows": rows(values),
        "samples_ns": {k: [v * 1e9 for v in vs] for k, vs in values.items()},
        "loops": loops,
    }


def main() -> None:
    import pyperf

    runner = pyperf.Runner()
    runner.metadata["description"] = "trio_debounce: throttle, batch and rate limit in memory"
    for name, func in BENCHES.items():
        runner.bench_time_func(name, func)


if __name__ == "__main__":
    main()
