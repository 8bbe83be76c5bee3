"""The coalescing ping in memory: one open window, 1,000 windows pinged in turn, an
opening ping, and the memory and ping cost of many open windows.

Three items of ``bench/suite.py``:

* ``ping-local`` (:func:`ping_item`): ``debounce_nowait`` into an open trailing window
  against (a) a naive Trio debouncer, (b) asyncio's ``call_later`` re-armed, (c)
  ``throttlebounce``; ``debounce_nowait`` and ``await debounce()`` against a bare
  checkpoint; ``await debounce()`` through ``MemoryBackend`` (the shared protocol's
  CPU cost) against the same without a backend; and opening a window against
  spawning a task that sleeps on a deadline.
* ``ping-keyed`` (:func:`keyed_item`): 1,000 open windows (``max_delay`` set) pinged
  in turn, against asyncio ``call_later`` re-armed on 1,000 handles and against the
  least CPython can do for such a ping (its floor).
* ``scale`` (:func:`scale_item`): bytes per open window against a sleeping task
  (tracemalloc, and RSS), and the coalescing ping on random keys at 10, 1,000 and
  100,000 windows, with its memory floor.

The timed functions take a fixed ``loops`` and run their own fresh event loop. Run by
hand, ``python bench/ping_local.py`` is an ordinary pyperf script over them (it
calibrates its loop counts, so it is NOT how the report's figures are taken; the suite
runs it as pyperf worker processes with ``--workers``); ``python bench/ping_local.py
scale|tasks|memory|memory-rounds ...`` runs one step of the scale item in a process of
its own and prints JSON.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio
import trio.testing
from _harness import (
    Context,
    cost_row,
    log,
    quantiles,
    ratio,
    row,
    run_json,
    speedup_row,
    timed_in_rounds,
)

import trio_debounce

WF = "wf"
DELAY = 3600.0
SCRIPT = Path(__file__).resolve()


async def _noop(fire: trio_debounce.Fire) -> None:
    pass


# ----------------------------------------------------------------- one open window


def ping_nowait(loops: int) -> float:
    """``debounce_nowait`` into an open trailing window, ``loops`` times."""

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
        ) as coordinator:
            ping = coordinator.debounce_nowait
            ping(WF, "k", None, delay=DELAY)
            t0 = time.perf_counter()
            for _ in range(loops):
                ping(WF, "k", None, delay=DELAY)
            return time.perf_counter() - t0

    return trio.run(main)


def ping_async(loops: int) -> float:
    """``await debounce()`` into an open trailing window, ``loops`` times."""

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
        ) as coordinator:
            ping = coordinator.debounce
            await ping(WF, "k", None, delay=DELAY)
            t0 = time.perf_counter()
            for _ in range(loops):
                await ping(WF, "k", None, delay=DELAY)
            return time.perf_counter() - t0

    return trio.run(main)


def checkpoint(loops: int) -> float:
    """A bare ``await trio.lowlevel.checkpoint()``."""

    async def main() -> float:
        cp = trio.lowlevel.checkpoint
        t0 = time.perf_counter()
        for _ in range(loops):
            await cp()
        return time.perf_counter() - t0

    return trio.run(main)


def naive_trio(loops: int) -> float:
    """Baseline (a): cancel the pending timer task's cancel scope and spawn a new task
    per ping (a checkpoint per ping lets the new task start and the old one end)."""

    async def main() -> float:
        scope: list[trio.CancelScope] = []

        async def timer() -> None:
            with trio.CancelScope() as own:
                scope[:] = [own]
                await trio.sleep(DELAY)

        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            for _ in range(loops):
                if scope:
                    scope[0].cancel()
                nursery.start_soon(timer)
                await trio.lowlevel.checkpoint()
            elapsed = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
        return elapsed

    return trio.run(main)


def asyncio_call_later(loops: int) -> float:
    """Baseline (b): an asyncio ``call_later`` handle cancelled and re-armed per ping,
    on a fresh loop."""

    def fire() -> None:
        pass

    async def main() -> float:
        loop = asyncio.get_running_loop()
        later = loop.call_later
        handle = later(DELAY, fire)
        t0 = time.perf_counter()
        for _ in range(loops):
            handle.cancel()
            handle = later(DELAY, fire)
        elapsed = time.perf_counter() - t0
        handle.cancel()
        return elapsed

    return asyncio.run(main())


def throttlebounce_debounce(loops: int) -> float:
    """Baseline (c): ``throttlebounce.async_debounce`` (PyPI; unkeyed, asyncio), one
    call per ping into its open trailing window, on a fresh loop."""
    from throttlebounce import async_debounce

    async def main() -> float:
        @async_debounce(DELAY)
        async def job(value: object) -> None:
            pass

        job(None)
        t0 = time.perf_counter()
        for _ in range(loops):
            job(None)
        elapsed = time.perf_counter() - t0
        job.cancel()
        return elapsed

    return asyncio.run(main())


def shared_ping_memory(loops: int) -> float:
    """``await debounce()`` into a shared window this process owns, through
    ``MemoryBackend``: the shared protocol's own CPU cost, no network."""
    from trio_debounce.testing import MemoryBackend, MemoryStore

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, backend=MemoryBackend(MemoryStore()), on_exit="cancel"
        ) as coordinator:
            ping = coordinator.debounce
            await ping(WF, "k", None, delay=DELAY)
            t0 = time.perf_counter()
            for _ in range(loops):
                await ping(WF, "k", None, delay=DELAY)
            return time.perf_counter() - t0

    return trio.run(main)


def open_window(loops: int) -> float:
    """``debounce_nowait`` opening ``loops`` new trailing windows, until their tasks
    sleep."""
    keys = [str(i) for i in range(loops)]

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
        ) as coordinator:
            ping = coordinator.debounce_nowait
            t0 = time.perf_counter()
            for key in keys:
                ping(WF, key, None, delay=DELAY)
            await trio.testing.wait_all_tasks_blocked()
            return time.perf_counter() - t0

    return trio.run(main)


def spawn_sleeper(loops: int) -> float:
    """Baseline of :func:`open_window`: ``nursery.start_soon`` of ``loops`` tasks that
    sleep on a deadline, until they sleep."""

    async def sleeper() -> None:
        with trio.CancelScope(deadline=trio.current_time() + DELAY):
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


# ----------------------------------------------------------------- keyed ping

#: The keyed coalescing ping: this many open windows, pinged in turn.
KEYED_WINDOWS = 1_000
KEYED_MAX_DELAY = 2 * DELAY


def _keyed(loops: int) -> tuple[list[str], int]:
    """The keys of the keyed ping and how many passes over them make ``loops`` pings
    (``loops`` must be a multiple of :data:`KEYED_WINDOWS`)."""
    if loops % KEYED_WINDOWS:
        raise ValueError(f"loops ({loops}) must be a multiple of {KEYED_WINDOWS}")
    return [f"k{i}" for i in range(KEYED_WINDOWS)], loops // KEYED_WINDOWS


def ping_keyed(loops: int, hooked: bool = False, otel: bool = False) -> float:
    """``debounce_nowait`` into 1,000 open trailing windows (``max_delay`` set), pinged
    in turn, each ping a different key than the last: ``loops`` pings; ``hooked``: with
    an ``on_event`` hook that counts the events; ``otel``: with
    :class:`trio_debounce.otel.OpenTelemetryHook` and no SDK (the API's no-op
    providers, as in an application that installs the extra and configures nothing)."""
    keys, passes = _keyed(loops)
    seen = [0]

    def count(event: trio_debounce.CoordinatorEvent) -> None:
        seen[0] += 1

    # Passed only when hooked: bench/compare.py runs this against trees without it.
    hook: dict[str, Any] = {"on_event": count} if hooked else {}
    if otel:
        from trio_debounce.otel import OpenTelemetryHook

        hook = {"on_event": OpenTelemetryHook()}

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel", **hook
        ) as coordinator:
            ping = coordinator.debounce_nowait
            for key in keys:
                ping(WF, key, None, delay=DELAY, max_delay=KEYED_MAX_DELAY)
            t0 = time.perf_counter()
            for _ in range(passes):
                for key in keys:
                    ping(WF, key, None, delay=DELAY, max_delay=KEYED_MAX_DELAY)
            return time.perf_counter() - t0

    return trio.run(main)


def ping_keyed_hooked(loops: int) -> float:
    """:func:`ping_keyed` with an ``on_event`` hook (every ping then reports a
    :class:`~trio_debounce.PingAnswered` and skips the inlined hot path)."""
    return ping_keyed(loops, hooked=True)


def ping_keyed_otel(loops: int) -> float:
    """:func:`ping_keyed` with :class:`~trio_debounce.otel.OpenTelemetryHook`, no SDK."""
    return ping_keyed(loops, otel=True)


def asyncio_call_later_keyed(loops: int) -> float:
    """Baseline of the keyed ping: 1,000 asyncio ``call_later`` handles in a dict keyed
    by ``(workflow, key)``, pinged in turn; a ping cancels its key's handle and arms a
    new one (on a fresh stdlib loop)."""
    keys, passes = _keyed(loops)

    def fire() -> None:
        pass

    async def main() -> float:
        loop = asyncio.get_running_loop()
        later = loop.call_later
        handles = {(WF, key): later(DELAY, fire) for key in keys}
        t0 = time.perf_counter()
        for _ in range(passes):
            for key in keys:
                k = (WF, key)
                handles[k].cancel()
                handles[k] = later(DELAY, fire)
        elapsed = time.perf_counter() - t0
        for handle in handles.values():
            handle.cancel()
        return elapsed

    return asyncio.run(main())


class _FloorWindow:
    __slots__ = ("cap", "count", "deadline", "payload", "run_id")

    def __init__(self, run_id: str, deadline: float, cap: float) -> None:
        self.run_id = run_id
        self.deadline = deadline
        self.cap = cap
        self.payload: object = None
        self.count = 1


def floor_keyed(loops: int) -> float:
    """The floor of the keyed ping: the least CPython can do for it, inline in the
    loop: one dict lookup on the ``(workflow, key)`` tuple, three attribute writes
    (deadline, payload, count), a ``min`` against the window's cap and a result
    tuple. The clock is read once, outside the loop (a ping reads it each time)."""
    keys, passes = _keyed(loops)
    now = time.perf_counter()
    table = {(WF, key): _FloorWindow(key, now + DELAY, now + KEYED_MAX_DELAY) for key in keys}
    t0 = time.perf_counter()
    for _ in range(passes):
        for key in keys:
            w = table[(WF, key)]
            deadline = min(now + DELAY, w.cap)
            w.deadline = deadline
            w.payload = None
            w.count = count = w.count + 1
            result = (w.run_id, deadline, count)
    elapsed = time.perf_counter() - t0
    del result
    return elapsed


# ----------------------------------------------------------------- many open windows


SCALE_PINGS_KEYS = 65_536  # random key draws, cycled


def _rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    import resource

    return pages * resource.getpagesize()


def memory_per(kind: str, n: int) -> dict[str, float]:
    """Bytes per open window (``kind="window"``) or per bare sleeping Trio task
    (``"task"``: ``nursery.start_soon(trio.sleep, 3600)``), ``n`` of them, on a fresh
    loop: the growth of traced Python memory (tracemalloc) and of the RSS."""
    keys = [f"k{i}" for i in range(n)]

    async def main() -> dict[str, float]:
        async with (
            trio_debounce.open_coordinator(handlers={WF: _noop}, on_exit="cancel") as coordinator,
            trio.open_nursery() as nursery,
        ):
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            rss0 = _rss()
            traced0 = tracemalloc.get_traced_memory()[0]
            if kind == "window":
                ping = coordinator.debounce_nowait
                for key in keys:
                    ping(WF, key, None, delay=DELAY)
            else:
                for _ in keys:
                    nursery.start_soon(trio.sleep, DELAY)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0] - traced0
            rss = _rss() - rss0
            nursery.cancel_scope.cancel()
            return {"traced": traced / n, "rss": rss / n}

    tracemalloc.start()
    try:
        return trio.run(main)
    finally:
        tracemalloc.stop()


def memory_rounds(n: int, rounds: int) -> dict[str, list[float]]:
    """The scale item's memory pass, in one process: bytes per open window and per bare
    sleeping task at ``n`` of each (:func:`memory_per`'s tracemalloc figure), in
    ``rounds`` paired rounds (window, task; then task, window; ...), each measurement
    on a fresh loop, after one warm-up pair that is not kept (the first loop of a
    process also traces one-time allocations: caches, interned names)."""
    out: dict[str, list[float]] = {"window": [], "task": []}
    for r in range(-1, rounds):
        for kind in ("window", "task") if r % 2 == 0 else ("task", "window"):
            traced = memory_per(kind, n)["traced"]
            if r >= 0:
                out[kind].append(traced)
    return out


def _small(sizes: list[int]) -> int:
    """How many windows (tasks) are open before the RSS is taken: the sizes up to
    1,000 (the scale item's RSS figure is the growth per window from there to all sizes)."""
    return sum(s for s in sizes if s <= 1000)


def scale_process(
    sizes: list[int],
    loops: int,
    rounds: int,
    first: int,
    done: Callable[[dict[str, Any]], None],
    floor: bool = True,
) -> None:
    """The scale item's windows side, in a process of its own (``python bench/ping_local.py
    scale SIZES LOOPS ROUNDS FIRST``): one coordinator per size in ``sizes``, each
    holding that many open windows (opened in increasing size order), then ``rounds``
    rounds of coalescing pings, numbered from ``first`` (the rounds of earlier
    processes; it also seeds the key draws): per round, each coordinator in an order
    rotated from round to round takes ``loops`` pings on keys drawn at random among
    its windows; seconds per ping, by size and round. Also the RSS growth per window from
    :func:`_small` open windows to all of them. The collector is off while windows
    open (as for :func:`tasks_process`'s tasks) and runs a full collection before each
    RSS reading. ``done(result)`` is called inside the loop (the caller may
    ``os._exit`` there rather than tear 100,000s of windows down). ``floor=False``
    skips the floor (which reads the coordinator's private window table: the
    before/after comparison runs this against older revisions)."""
    keys = [f"k{i}" for i in range(max(sizes))]
    rng = random.Random(first)

    async def main() -> None:
        out: dict[str, Any] = {
            "ping": {str(s): [] for s in sizes},
            "floor": {str(s): [] for s in sizes},
        }
        async with AsyncExitStack() as stack:
            pings: dict[int, Callable[..., Any]] = {}
            tables: dict[int, dict[Any, Any]] = {}
            rss_small = None
            gc.disable()
            if _small(sizes) == 0:
                gc.collect()
                rss_small = _rss()
            for size in sorted(sizes):
                coordinator = await stack.enter_async_context(
                    trio_debounce.open_coordinator(handlers={WF: _noop}, on_exit="cancel")
                )
                ping = pings[size] = coordinator.debounce_nowait
                if floor:
                    tables[size] = coordinator._windows
                for key in keys[:size]:
                    ping(WF, key, None, delay=DELAY)
                await trio.testing.wait_all_tasks_blocked()
                if rss_small is None and sum(pings) == _small(sizes):
                    gc.collect()
                    rss_small = _rss()
            gc.enable()
            gc.collect()
            opened = sum(sizes) - _small(sizes)
            if rss_small is not None and opened > 0:
                out["rss_per_window"] = (_rss() - rss_small) / opened
            draws = {
                size: [keys[rng.randrange(size)] for _ in range(min(loops, SCALE_PINGS_KEYS))]
                for size in sizes
            }
            for size in sizes:  # warm-up, not timed
                ping = pings[size]
                for key in draws[size][: max(1, loops // 10)]:
                    ping(WF, key, None, delay=DELAY)
            for r in range(first, first + rounds):
                k = r % len(sizes)
                for size in sizes[k:] + sizes[:k]:
                    ping, sample = pings[size], draws[size]
                    n = len(sample)
                    t0 = time.perf_counter()
                    for i in range(loops):
                        ping(WF, sample[i % n], None, delay=DELAY)
                    out["ping"][str(size)].append((time.perf_counter() - t0) / loops)
                    if not floor:
                        continue
                    # The floor at this size: the memory a coalescing ping cannot
                    # avoid touching (the table entry, its key and its window), with
                    # nothing else: look the window up, store the payload, read the
                    # run id and count into a tuple.
                    table = tables[size]
                    t0 = time.perf_counter()
                    for i in range(loops):
                        w = table[(WF, sample[i % n])]
                        w.payload = None
                        result = (w.run_id, w.count)
                    out["floor"][str(size)].append((time.perf_counter() - t0) / loops)
                    del result
            done(out)

    trio.run(main)


def tasks_process(sizes: list[int], done: Callable[[dict[str, Any]], None]) -> None:
    """The baseline of :func:`scale_process`'s RSS figure, in a process of its own
    (``python bench/ping_local.py tasks SIZES``): the RSS growth per bare sleeping Trio
    task from :func:`_small` started tasks to ``sum(sizes)``, the collector off while
    they start (as for the windows)."""
    first, total = _small(sizes), sum(sizes)

    async def main() -> None:
        out: dict[str, Any] = {}
        async with trio.open_nursery() as nursery:
            gc.disable()
            for _ in range(first):
                nursery.start_soon(trio.sleep, DELAY)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            rss_small = _rss()
            for _ in range(total - first):
                nursery.start_soon(trio.sleep, DELAY)
            await trio.testing.wait_all_tasks_blocked()
            gc.enable()
            gc.collect()
            if total > first:
                out["rss_per_task"] = (_rss() - rss_small) / (total - first)
            done(out)
            nursery.cancel_scope.cancel()

    trio.run(main)


# ----------------------------------------------------------------- the items

#: name -> time function ``(loops) -> seconds``, in pyperf registration order (the
#: worker task index is the position in this dict).
BENCHES: dict[str, Callable[[int], float]] = {
    "ping-nowait": ping_nowait,
    "ping-async": ping_async,
    "checkpoint": checkpoint,
    "naive-trio": naive_trio,
    "asyncio-call-later": asyncio_call_later,
    "throttlebounce": throttlebounce_debounce,
    "shared-ping-memory": shared_ping_memory,
    "open-window": open_window,
    "spawn-sleeper": spawn_sleeper,
    "ping-keyed": ping_keyed,
    "ping-keyed-hooked": ping_keyed_hooked,
    "ping-keyed-otel": ping_keyed_otel,
    "asyncio-call-later-keyed": asyncio_call_later_keyed,
    "floor-keyed": floor_keyed,
}
#: The keyed ping and its baselines.
KEYED = (
    "ping-keyed",
    "ping-keyed-hooked",
    "ping-keyed-otel",
    "asyncio-call-later-keyed",
    "floor-keyed",
)


def ping_rows(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The ping-local report lines from the seconds per ping of each variant, by round."""
    ours = values["ping-nowait"]
    rows = [
        speedup_row(
            "debounce_nowait vs (b) asyncio call_later re-arm",
            ours,
            values["asyncio-call-later"],
            "call_later",
            3.0,
        ),
        speedup_row(
            "debounce_nowait vs (c) throttlebounce.async_debounce",
            ours,
            values["throttlebounce"],
            "throttlebounce",
            4.0,
        ),
        speedup_row(
            "debounce_nowait vs (a) naive Trio (cancel scope + task per ping)",
            ours,
            values["naive-trio"],
            "naive Trio",
            None,
        ),
    ]
    for name, label in (("ping-async", "await debounce()"), ("ping-nowait", "debounce_nowait")):
        rows.append(
            row(
                f"{label} vs a bare checkpoint (the ratio: its cost in checkpoints)",
                quantiles(values[name])["median"] * 1e6,
                "µs",
                baseline="checkpoint",
                base=quantiles(values["checkpoint"])["median"] * 1e6,
                stats=ratio(values[name], values["checkpoint"]),
                ratio_label="ours / baseline",
            )
        )
    rows.append(
        cost_row(
            "await debounce() through MemoryBackend (a shared window this process owns) "
            "vs without a backend: the shared protocol's CPU cost",
            values["shared-ping-memory"],
            values["ping-async"],
            "local await debounce()",
        )
    )
    rows.append(
        cost_row(
            "debounce_nowait opening a window, until its task sleeps, vs nursery.start_soon "
            "of a task sleeping on a deadline",
            values["open-window"],
            values["spawn-sleeper"],
            "spawn a sleeper",
        )
    )
    return rows


def keyed_rows(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The keyed ping's report lines from the seconds per ping of each variant."""
    ours = values["ping-keyed"]
    floor = values["floor-keyed"]
    return [
        speedup_row(
            "debounce_nowait on 1,000 open windows pinged in turn (max_delay set) "
            "vs asyncio call_later re-armed on 1,000 handles",
            ours,
            values["asyncio-call-later-keyed"],
            "call_later x 1,000",
            3.0,
            scale=1e9,
            unit="ns",
        ),
        cost_row(
            "the same pings vs their floor (a dict lookup on (workflow, key), three "
            "attribute writes, min against the cap, a result tuple, inline in the loop)",
            ours,
            floor,
            "floor",
            target=1.8,
            scale=1e9,
            unit="ns",
            label="cost ratio (ours / floor)",
        ),
        cost_row(
            "the same pings with an on_event hook (a counter: every ping reports a "
            "PingAnswered and skips the inlined path) vs without a hook",
            values["ping-keyed-hooked"],
            ours,
            "no hook",
            scale=1e9,
            unit="ns",
            label="cost ratio (hooked / no hook)",
        ),
        cost_row(
            "the same pings with trio_debounce.otel.OpenTelemetryHook and no SDK "
            "configured (the API's no-op meters) vs without a hook",
            values["ping-keyed-otel"],
            ours,
            "no hook",
            scale=1e9,
            unit="ns",
            label="cost ratio (otel hook / no hook)",
        ),
    ]


def ping_item(ctx: Context) -> dict[str, Any]:
    """ping-local: every variant of :data:`BENCHES` but the keyed ones, paired."""
    loops = ctx.params.ping_loops
    values = timed_in_rounds(ctx, SCRIPT, BENCHES, loops, "ping-local-pyperf.json")
    return {
        "title": "Coalescing ping, one open window (in memory)",
        "rows": ping_rows(values),
        "samples_us": {k: [v * 1e6 for v in vs] for k, vs in values.items()},
        "loops": loops,
    }


def keyed_item(ctx: Context) -> dict[str, Any]:
    """ping-keyed: the keyed ping and its two baselines, paired."""
    loops = dict.fromkeys(KEYED, ctx.params.keyed_loops)
    values = timed_in_rounds(ctx, SCRIPT, BENCHES, loops, "ping-keyed-pyperf.json")
    return {
        "title": "Coalescing ping, 1,000 open windows pinged in turn (in memory)",
        "rows": keyed_rows(values),
        "samples_ns": {k: [v * 1e9 for v in vs] for k, vs in values.items()},
        "loops": loops,
    }


def scale_item(ctx: Context) -> dict[str, Any]:
    """Three passes, so that every figure gets its paired rounds without building
    100,000 windows per round: the tracemalloc memory pass (one process, a fresh loop
    per measurement), then ``scale_procs`` pairs of processes, a windows process
    (:func:`scale_process`: one coordinator per size, the ping rounds reuse
    the windows) and a tasks process (the RSS baseline), in alternating order."""
    sizes = list(ctx.params.scale_sizes) + ([ctx.params.huge_size] if ctx.huge else [])
    rounds = ctx.params.rounds
    script = str(SCRIPT)
    log("scale: memory (tracemalloc)")
    memory = run_json([script, "memory-rounds", "1000", str(rounds)], timeout=3600)
    procs = max(1, min(ctx.params.scale_procs, rounds))
    per_proc = -(-rounds // procs)  # the ping rounds of each windows process
    windows: list[dict[str, Any]] = []
    tasks: list[dict[str, Any]] = []
    for p in range(procs):
        log(f"scale: {sum(sizes):,} windows and tasks, process pair {p + 1} of {procs}")
        for what in ("windows", "tasks") if p % 2 == 0 else ("tasks", "windows"):
            if what == "windows":
                args = [
                    script,
                    "scale",
                    ",".join(map(str, sizes)),
                    str(ctx.params.scale_loops),
                    str(per_proc),
                    str(p * per_proc),
                ]
                windows.append(run_json(args, timeout=3600))
            else:
                args = [script, "tasks", ",".join(map(str, sizes))]
                tasks.append(run_json(args, timeout=3600))
    ping = {s: [v for w in windows for v in w["ping"][str(s)]] for s in sizes}
    floor = {s: [v for w in windows for v in w.get("floor", {}).get(str(s), [])] for s in sizes}
    rows = []
    traced, traced_t = memory["window"], memory["task"]
    ours_traced = quantiles(traced)["median"]
    rows.append(
        row(
            "bytes per open window at 1,000 (tracemalloc) vs bare sleeping task",
            ours_traced,
            "B",
            baseline="sleeping task",
            base=quantiles(traced_t)["median"],
            stats=ratio(traced, traced_t),
            ratio_label="ours / baseline",
            target="<= 3,584 B (3.5 KB)",
            met=ours_traced <= 3584,
            gap="" if ours_traced <= 3584 else f"{ours_traced - 3584:.0f} B over",
        )
    )
    small = _small(sizes)
    if all(w.get("rss_per_window", 0) > 0 for w in windows) and all(
        t.get("rss_per_task", 0) > 0 for t in tasks
    ):
        rss = [w["rss_per_window"] for w in windows]
        rss_t = [t["rss_per_task"] for t in tasks]
        med = quantiles(rss)["median"]
        rows.append(
            row(
                f"RSS per open window, {small:,} -> {sum(sizes):,} open, vs bare sleeping "
                f"task (one figure per process; {procs} of each)",
                med,
                "B",
                baseline="sleeping task",
                base=quantiles(rss_t)["median"],
                stats=ratio(rss, rss_t),
                ratio_label="ours / baseline",
                target="<= 3,584 B (3.5 KB)",
                met=med <= 3584,
                gap="" if med <= 3584 else f"{med - 3584:.0f} B over",
            )
        )
    first = sizes[0]
    for size in sizes[1:]:
        stats = ratio(ping[size], ping[first])
        rows.append(
            row(
                f"coalescing ping on random keys at {size:,} windows vs at {first}",
                quantiles(ping[size])["median"] * 1e6,
                "µs",
                baseline=f"{first} windows",
                base=quantiles(ping[first])["median"] * 1e6,
                stats=stats,
                ratio_label=f"ours at size / ours at {first}",
                target="<= 1.5x",
                met=stats["median"] <= 1.5,
                gap="" if stats["median"] <= 1.5 else f"{stats['median'] / 1.5:.2f}x over",
            )
        )
        if floor[size] and floor[first]:
            # Why the 1.5x target cannot be met at large sizes: the same growth for a
            # lookup-and-store on the same windows, and what a ping adds above it.
            fstats = ratio(floor[size], floor[first])
            rows.append(
                row(
                    f"memory floor (window lookup + payload store, same windows) at "
                    f"{size:,} vs at {first}",
                    quantiles(floor[size])["median"] * 1e6,
                    "µs",
                    baseline=f"{first} windows",
                    base=quantiles(floor[first])["median"] * 1e6,
                    stats=fstats,
                    ratio_label=f"floor at size / floor at {first}",
                )
            )
            above = [p - f for p, f in zip(ping[size], floor[size], strict=True)]
            above_first = [p - f for p, f in zip(ping[first], floor[first], strict=True)]
            rows.append(
                row(
                    f"coalescing ping minus its floor at {size:,} windows vs at {first}",
                    quantiles(above)["median"] * 1e6,
                    "µs",
                    baseline=f"{first} windows",
                    base=quantiles(above_first)["median"] * 1e6,
                    stats=ratio(above, above_first),
                    ratio_label=f"(ping - floor) at size / at {first}",
                )
            )
    return {
        "title": "Memory and ping cost by open windows (in memory)",
        "rows": rows,
        "rounds": len(ping[first]),
        "processes": procs,
        "sizes": sizes,
        "ping_us": {str(s): [v * 1e6 for v in ping[s]] for s in sizes},
        "floor_us": {str(s): [v * 1e6 for v in floor[s]] for s in sizes},
        "traced_per_window": traced,
        "traced_per_task": traced_t,
    }


def _print_and_exit(result: dict[str, Any]) -> None:
    """Print ``result`` and end the process at once: tearing 100,000s of windows or
    tasks down would take longer than building them."""
    import os

    print(json.dumps(result), flush=True)
    os._exit(0)


def main(argv: list[str]) -> None:
    command = argv[1] if len(argv) > 1 else ""
    if command == "scale":
        scale_process(
            [int(x) for x in argv[2].split(",")],
            int(argv[3]),
            int(argv[4]),
            int(argv[5]),
            _print_and_exit,
        )
    elif command == "tasks":
        tasks_process([int(x) for x in argv[2].split(",")], _print_and_exit)
    elif command == "memory":
        print(json.dumps(memory_per(argv[2], int(argv[3]))))
    elif command == "memory-rounds":
        print(json.dumps(memory_rounds(int(argv[2]), int(argv[3]))))
    else:  # a pyperf script (and its worker processes)
        import pyperf

        runner = pyperf.Runner()
        runner.metadata["description"] = "trio_debounce: the coalescing ping in memory"
        for name, func in BENCHES.items():
            runner.bench_time_func(name, func)


if __name__ == "__main__":
    main(sys.argv)
