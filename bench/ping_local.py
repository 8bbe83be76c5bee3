"""Issue 6, items 1-4: the in-memory coordinator against its baselines.

Item 1's timed micro-benchmarks are pyperf time functions, registered by
``bench/pyperf_local.py``; each takes a fixed ``loops`` and runs its own fresh event
loop. The rest (item 2's memory and ping cost, item 3's fire lateness, item 4's
replays) are plain functions returning their figure, run in fresh loops or processes
by ``bench/suite.py``; ``python bench/ping_local.py
scale|tasks|memory|memory-rounds|naive-replay|generate ...`` runs one of them in a
process of its own and prints JSON.
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

import trio_debounce

WF = "wf"
DELAY = 3600.0


async def _noop(fire: trio_debounce.Fire) -> None:
    pass


# ----------------------------------------------------------------- item 1


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


def ping_keyed(loops: int) -> float:
    """``debounce_nowait`` into 1,000 open trailing windows (``max_delay`` set), pinged
    in turn, each ping a different key than the last: ``loops`` pings."""
    keys, passes = _keyed(loops)

    async def main() -> float:
        async with trio_debounce.open_coordinator(
            handlers={WF: _noop}, on_exit="cancel"
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


# ----------------------------------------------------------------- item 2


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
    """Item 2's memory pass, in one process: bytes per open window and per bare
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
    1,000 (item 2's RSS figure is the growth per window from there to all sizes)."""
    return sum(s for s in sizes if s <= 1000)


def scale_process(
    sizes: list[int],
    loops: int,
    rounds: int,
    first: int,
    done: Callable[[dict[str, Any]], None],
    floor: bool = True,
) -> None:
    """Item 2's windows side, in a process of its own (``python bench/ping_local.py
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


# ----------------------------------------------------------------- item 3


def _due_times(n: int, spread: float, lead: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return sorted(lead + rng.uniform(0.0, spread) for _ in range(n))


def default_lead(n: int) -> float:
    """Seconds from a fire-accuracy run's start to its first due time for ``n``
    timers: 0.3 s + 0.1 s per 1,000, about twice the set-up of 10,000 windows on an
    idle 2-core machine (a run whose set-up takes longer is run again with a longer
    lead, see ``bench/suite.py``)."""
    return 0.3 + 1e-4 * n


def fire_lateness(
    kind: str, n: int, spread: float, seed: int = 3, lead: float | None = None
) -> tuple[list[float], float]:
    """Seconds late of each of ``n`` timers due uniformly over ``spread`` seconds on the
    real clock, the first ``lead`` seconds (:func:`default_lead` when None) after the
    run starts: windows of the coordinator (``kind="windows"``; lateness from
    the due time to the handler's start) or bare ``trio.sleep_until`` tasks
    (``"sleep_until"``), set in random order. Also returns the set-up time: from the
    start until every window's or task's task is blocked; a set-up longer than ``lead``
    makes the lateness meaningless (the caller retries with a longer lead)."""
    if lead is None:
        lead = default_lead(n)
    offsets = _due_times(n, spread, lead, seed)
    late: list[float] = []
    all_fired = trio.Event()
    setup = 0.0

    async def handler(fire: trio_debounce.Fire) -> None:
        late.append(trio.current_time() - fire.payload)
        if len(late) == n:
            all_fired.set()

    async def sleeper(due: float) -> None:
        await trio.sleep_until(due)
        late.append(trio.current_time() - due)

    async def main() -> None:
        nonlocal setup
        t0 = trio.current_time()
        dues = [t0 + off for off in offsets]
        order = list(range(n))
        random.Random(seed + 1).shuffle(order)  # set in random order, not due order
        if kind == "windows":
            async with trio_debounce.open_coordinator(
                handlers={WF: handler}, on_exit="cancel"
            ) as coordinator:
                for i in order:
                    due = dues[i]
                    # A window set after its due time (a slow machine) is due at once.
                    delay = max(0.0, due - trio.current_time())
                    coordinator.debounce_nowait(WF, f"k{i}", due, delay=delay)
                await trio.testing.wait_all_tasks_blocked()
                setup = trio.current_time() - t0
                with trio.fail_after(lead + spread + 60):
                    await all_fired.wait()
        else:
            async with trio.open_nursery() as nursery:
                for i in order:
                    nursery.start_soon(sleeper, dues[i])
                await trio.testing.wait_all_tasks_blocked()
                setup = trio.current_time() - t0

    trio.run(main)
    if len(late) != n:
        raise RuntimeError(f"{len(late)} of {n} timers fired")
    return late, setup


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {
        "p50": ordered[n // 2],
        "p99": ordered[min(n - 1, int(0.99 * n))],
        "max": ordered[-1],
    }


# ----------------------------------------------------------------- item 4

REPLAY_DELAY = 1.0
REPLAY_MAX_DELAY = 10.0


def generate(path: Path, events: int, keys: int, seed: int = 6) -> None:
    """A JSON-lines log of ``events`` events over ``keys`` keys (``events // keys``
    each), deterministic: each key's events start at a uniform random time over
    ``events / 1000`` seconds and follow at exponential intervals of mean 0.25 s
    (bursts, which ``delay=1``, ``max_delay=10`` coalesce); sorted by time."""
    rng = random.Random(seed)
    per = events // keys
    span = events / 1000.0
    rows: list[tuple[float, int]] = []
    for k in range(keys):
        t = rng.uniform(0.0, span)
        for _ in range(per):
            rows.append((round(t, 4), k))
            t += rng.expovariate(4.0)
    rows.sort()
    with open(path, "w") as out:
        out.writelines(f'{{"ts": {t}, "key": "k{k:06d}"}}\n' for t, k in rows)


def cli_replay_args(path: Path) -> list[str]:
    return [
        "-m",
        "trio_debounce",
        "replay",
        str(path),
        "--delay",
        str(REPLAY_DELAY),
        "--max-delay",
        str(REPLAY_MAX_DELAY),
        "--format",
        "summary",
    ]


def naive_replay(path: Path) -> dict[str, Any]:
    """The naive replay: the same log through a coordinator on a MockClock
    (autojump), jumping the clock once per event with ``trio.sleep_until``."""
    t0 = time.perf_counter()
    lines = path.read_bytes().splitlines()
    fires = 0

    async def handler(fire: trio_debounce.Fire) -> None:
        nonlocal fires
        fires += 1

    async def main() -> None:
        async with trio_debounce.open_coordinator(handlers={WF: handler}) as coordinator:
            for line in lines:
                event = json.loads(line)
                await trio.sleep_until(float(event["ts"]))
                coordinator.debounce_nowait(
                    WF, event["key"], event, delay=REPLAY_DELAY, max_delay=REPLAY_MAX_DELAY
                )

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return {"events": len(lines), "fires": fires, "seconds": time.perf_counter() - t0}


def _print_and_exit(result: dict[str, Any]) -> None:
    """Print ``result`` and end the process at once: tearing 100,000s of windows or
    tasks down would take longer than building them."""
    import os

    print(json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "scale":
        scale_process(
            [int(x) for x in sys.argv[2].split(",")],
            int(sys.argv[3]),
            int(sys.argv[4]),
            int(sys.argv[5]),
            _print_and_exit,
        )
    elif command == "tasks":
        tasks_process([int(x) for x in sys.argv[2].split(",")], _print_and_exit)
    elif command == "memory":
        print(json.dumps(memory_per(sys.argv[2], int(sys.argv[3]))))
    elif command == "memory-rounds":
        print(json.dumps(memory_rounds(int(sys.argv[2]), int(sys.argv[3]))))
    elif command == "naive-replay":
        print(json.dumps(naive_replay(Path(sys.argv[2]))))
    elif command == "generate":
        generate(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown command {command!r}")
