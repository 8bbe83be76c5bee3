"""Scheduling and heartbeat throughput of each deferred-run store, against baselines in
the same run.

Run with ``nox -s bench`` (or ``python bench/bench_runs.py -o bench-runs.json``). The
stores: ``memory`` (``MemoryRunStore``, the in-process fake), ``sqlite``
(``open_sqlite_run_store`` on a temporary file) and ``nats`` (``open_nats_run_store``
on a real ``nats-server -js``, started on a free loopback port with a temporary store,
as ``bench_shared.py`` does, unless ``--nats-url`` names one).

Not pyperf: the heartbeat figures need a store holding 100,000 runs, which pyperf's
worker processes would each have to build again. Instead each figure is timed in
several rounds inside one process, its baseline timed in the rounds between (A B A B
...), and reported as the median per call with the min and max of the rounds, the
ratio of the medians, and the load average when it was taken.

* ``schedule``: ``await coordinator.schedule(wf, id, payload, after=3600,
  persist=True)`` for new ids, one coordinator, sequential calls. Baselines:
  ``create`` (the store write it needs: ``store.create_run(StoredRun(...))`` on the
  same store) and ``get+create`` (the two calls it makes: ``get_run`` then
  ``create_run``). ``schedule-x10``/``create-x10``: the same from 10 concurrent tasks
  (throughput; each call's latency is 10 times the per-call figure).
* ``heartbeat`` with 0 and with many runs pending far in the future (100,000; NATS
  10,000 unless ``--nats-pending``), created through the store in bulk: a coordinator
  (lease 3 s, heartbeat interval 1 s) is watched over several intervals through a
  counting wrapper of its store: store calls and writes per interval, and the time of
  each. Then, on the bare store: one ``put_lease`` (a heartbeat), one claim sweep's
  reads (``list_leases`` and ``list_runs(states=active, due_before=now+60)``) with
  nothing due in the horizon, and the same ``list_runs`` with 1,000 runs due in it.
* ``fire`` (memory and SQLite, both deliveries): 1,000 persisted runs of one
  coordinator (heartbeat interval 1 s), written in bulk through the store, due at the
  same instant 3 s later (its claim sweep arms them), a handler that returns at once,
  ``max_concurrent_runs=100``: runs/s from their due time until the last handler
  started, and how late the first one started.

The JSON (``-o``) holds every figure with its load average and the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

import trio_debounce
from trio_debounce._runs._sqlite import open_sqlite_run_store
from trio_debounce._runs._sqlite_rows import _INSERT_RUN, _run_values
from trio_debounce._runs._store import ANY, Lease, RunState, RunStore, StoredRun, _Any
from trio_debounce._runs._types import ACTIVE, RunFire, RunOptions
from trio_debounce.testing import MemoryRunStore, MemoryStore

WF = "wf"
PAYLOAD = {"repo": "trio-debounce", "ref": "refs/heads/main", "n": 1}
PAYLOAD_TEXT = json.dumps(PAYLOAD)
HORIZON = 60.0
URL: list[str] = []

# ----------------------------------------------------------------- helpers


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "trio": trio.__version__,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def _figure(per_call: list[float], calls: int) -> dict[str, Any]:
    """Rounds of seconds per call -> the median, min and max in µs, and calls/s."""
    median = statistics.median(per_call)
    return {
        "us_per_call": round(median * 1e6, 1),
        "min_us": round(min(per_call) * 1e6, 1),
        "max_us": round(max(per_call) * 1e6, 1),
        "per_s": round(1 / median) if median > 0 else math.inf,
        "rounds": len(per_call),
        "calls": calls,
        "load": _load(),
        "values_s": per_call,
    }


async def _paired(
    variants: dict[str, Callable[[int], Awaitable[float]]], rounds: int, batch: int
) -> dict[str, dict[str, Any]]:
    """Time ``variants`` (each: seconds for ``batch`` calls, round index given) in
    ``rounds`` interleaved rounds; a warm-up round first, not counted."""
    per_call: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds + 1):
        # Rotated each round: no variant always runs after the same one.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds = await variants[name](r)
            if r > 0:
                per_call[name].append(seconds / batch)
    return {name: _figure(values, rounds * batch) for name, values in per_call.items()}


def _new_run(run_id: str, at: float, owner: str | None, epoch: int, now: float) -> StoredRun:
    return StoredRun(
        run_id=run_id,
        workflow=WF,
        payload=PAYLOAD_TEXT,
        scheduled_at=at,
        owner=owner,
        epoch=epoch,
        token=1,
        created_at=now,
    )


async def _noop(run: RunFire) -> None:
    pass


# ----------------------------------------------------------------- stores


@asynccontextmanager
async def open_store(kind: str, tmp: str) -> AsyncIterator[RunStore]:
    """A fresh, empty store of ``kind``."""
    if kind == "memory":
        yield MemoryRunStore(MemoryStore())
    elif kind == "sqlite":
        path = os.path.join(tmp, f"runs-{uuid.uuid4().hex[:8]}.db")
        async with open_sqlite_run_store(path) as store:
            yield store
    else:
        from trio_debounce.nats import NatsConfig
        from trio_debounce.nats._runs import open_nats_run_store

        config = NatsConfig(
            servers=(URL[0],), bucket=f"bench-runs-{uuid.uuid4().hex[:8]}", op_timeout=30.0
        )
        async with open_nats_run_store(config) as store:
            yield store


class CountingRunStore(RunStore):
    """A run store that forwards every call to ``inner`` and counts and times it."""

    WRITES = frozenset({"create_run", "update_run", "delete_run", "put_lease", "delete_lease"})

    def __init__(self, inner: RunStore) -> None:
        self.inner = inner
        self.max_payload_bytes = inner.max_payload_bytes
        self.calls: Counter[str] = Counter()
        self.seconds: dict[str, list[float]] = {}
        self.starts: dict[str, list[float]] = {}

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()
        self.starts.clear()

    def wall_time(self) -> float:
        return self.inner.wall_time()

    async def _timed(self, name: str, call: Awaitable[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return await call
        finally:
            self.calls[name] += 1
            self.seconds.setdefault(name, []).append(time.perf_counter() - t0)
            self.starts.setdefault(name, []).append(t0)

    async def get_run(self, run_id: str) -> StoredRun | None:
        return await self._timed("get_run", self.inner.get_run(run_id))  # type: ignore[no-any-return]

    async def create_run(self, run: StoredRun) -> StoredRun | None:
        return await self._timed("create_run", self.inner.create_run(run))  # type: ignore[no-any-return]

    async def update_run(self, run: StoredRun) -> StoredRun | None:
        return await self._timed("update_run", self.inner.update_run(run))  # type: ignore[no-any-return]

    async def delete_run(self, run_id: str, *, revision: int) -> bool:
        return await self._timed(  # type: ignore[no-any-return]
            "delete_run", self.inner.delete_run(run_id, revision=revision)
        )

    async def list_runs(
        self,
        *,
        states: Collection[RunState] | None = None,
        owner: str | _Any | None = ANY,
        workflow: str | None = None,
        due_before: float | None = None,
        finished_before: float | None = None,
        limit: int | None = None,
    ) -> list[StoredRun]:
        call = self.inner.list_runs(
            states=states,
            owner=owner,
            workflow=workflow,
            due_before=due_before,
            finished_before=finished_before,
            limit=limit,
        )
        return await self._timed("list_runs", call)  # type: ignore[no-any-return]

    async def get_lease(self, process_id: str) -> Lease | None:
        return await self._timed("get_lease", self.inner.get_lease(process_id))  # type: ignore[no-any-return]

    async def put_lease(self, lease: Lease) -> Lease | None:
        return await self._timed("put_lease", self.inner.put_lease(lease))  # type: ignore[no-any-return]

    async def delete_lease(self, process_id: str, *, revision: int) -> bool:
        return await self._timed(  # type: ignore[no-any-return]
            "delete_lease", self.inner.delete_lease(process_id, revision=revision)
        )

    async def list_leases(self) -> list[Lease]:
        return await self._timed("list_leases", self.inner.list_leases())  # type: ignore[no-any-return]


async def bulk_create(store: RunStore, runs: list[StoredRun]) -> float:
    """Write ``runs`` (new ids) into ``store`` as fast as it takes them; seconds taken.

    SQLite: one transaction on a second connection to the same file (the store's own
    ``create_run`` commits each run with an fsync). NATS: ``create_run`` from 64
    concurrent tasks. Memory: ``create_run``, sequential.
    """
    t0 = time.perf_counter()
    if hasattr(store, "path"):  # SqliteRunStore
        path: str = store.path
        limit: int = store.max_payload_bytes

        def insert() -> None:
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                last = conn.execute("SELECT last FROM revision_sequence WHERE id = 1").fetchone()
                first = last[0] + 1
                conn.executemany(
                    _INSERT_RUN,
                    ((*_run_values(run, limit), first + i) for i, run in enumerate(runs)),
                )
                conn.execute(
                    "UPDATE revision_sequence SET last = ? WHERE id = 1", (first + len(runs) - 1,)
                )
                conn.execute("COMMIT")
            finally:
                conn.close()

        await trio.to_thread.run_sync(insert)
    elif isinstance(store, MemoryRunStore):
        for run in runs:
            assert await store.create_run(run) is not None
    else:
        it = iter(runs)

        async def worker() -> None:
            for run in it:
                assert await store.create_run(run) is not None

        async with trio.open_nursery() as nursery:
            for _ in range(64):
                nursery.start_soon(worker)
    return time.perf_counter() - t0


# ----------------------------------------------------------------- 1. schedule


async def bench_schedule(
    kind: str,
    tmp: str,
    rounds: int,
    batch: int,
    extra: dict[str, Callable[[int], Awaitable[float]]] | None = None,
) -> dict[str, Any]:
    """The ``schedule`` figures of ``kind``'s store; ``extra`` variants (seconds for
    ``batch`` calls, given the round index) run in the same rotation."""
    async with open_store(kind, tmp) as store:
        options = RunOptions(process_id=f"bench-{kind}")
        async with trio_debounce.open_coordinator(
            run_handlers={WF: _noop}, run_store=store, run_options=options
        ) as coordinator:
            lease = await store.get_lease(f"bench-{kind}")
            assert lease is not None
            epoch = lease.epoch
            prefix = uuid.uuid4().hex[:8]

            def ids(tag: str, r: int) -> list[str]:
                return [f"{prefix}-{tag}-{r}-{i}" for i in range(batch)]

            async def schedule(r: int) -> float:
                names = ids("s", r)
                t0 = time.perf_counter()
                for run_id in names:
                    await coordinator.schedule(WF, run_id, PAYLOAD, after=3600, persist=True)
                return time.perf_counter() - t0

            async def create(r: int) -> float:
                now = store.wall_time()
                runs = [_new_run(i, now + 3600, f"bench-{kind}", epoch, now) for i in ids("c", r)]
                t0 = time.perf_counter()
                for run in runs:
                    await store.create_run(run)
                return time.perf_counter() - t0

            async def get_create(r: int) -> float:
                now = store.wall_time()
                runs = [_new_run(i, now + 3600, f"bench-{kind}", epoch, now) for i in ids("g", r)]
                t0 = time.perf_counter()
                for run in runs:
                    await store.get_run(run.run_id)
                    await store.create_run(run)
                return time.perf_counter() - t0

            async def concurrently(
                per_task: Callable[[list[str]], Awaitable[None]], tag: str, r: int
            ) -> float:
                names = ids(tag, r)
                t0 = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for k in range(10):
                        nursery.start_soon(per_task, names[k::10])
                return time.perf_counter() - t0

            async def schedule_task(names: list[str]) -> None:
                for run_id in names:
                    await coordinator.schedule(WF, run_id, PAYLOAD, after=3600, persist=True)

            async def create_task(names: list[str]) -> None:
                now = store.wall_time()
                for run_id in names:
                    await store.create_run(
                        _new_run(run_id, now + 3600, f"bench-{kind}", epoch, now)
                    )

            result = await _paired(
                {
                    "schedule": schedule,
                    "create": create,
                    "get+create": get_create,
                    "schedule-x10": lambda r: concurrently(schedule_task, "sx", r),
                    "create-x10": lambda r: concurrently(create_task, "cx", r),
                    **(extra or {}),
                },
                rounds,
                batch,
            )
    return result


# ----------------------------------------------------------------- 2. heartbeat


#: Seconds :func:`_time_calls` spends on one figure (bench/issue6.py lowers it).
TIME_CALLS_BUDGET = 4.0


async def _time_calls(
    fn: Callable[[], Awaitable[Any]], budget: float | None = None
) -> dict[str, Any]:
    """Time ``fn`` after a warm-up call: as many calls as fit in ``budget`` seconds
    (:data:`TIME_CALLS_BUDGET` when None; 2 to 50 calls)."""
    if budget is None:
        budget = TIME_CALLS_BUDGET
    t0 = time.perf_counter()
    await fn()  # warm-up
    n = max(2, min(50, int(budget / max(time.perf_counter() - t0, 1e-6))))
    per_call = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        per_call.append(time.perf_counter() - t0)
    return _figure(per_call, n)


async def bench_heartbeat(
    kind: str, tmp: str, pending: int, intervals: int, due: int = 1000
) -> dict[str, Any]:
    out: dict[str, Any] = {"pending": pending}
    async with open_store(kind, tmp) as store:
        pid = f"bench-hb-{uuid.uuid4().hex[:6]}"
        now = store.wall_time()
        far = [_new_run(f"far-{i:06d}", now + 86_400 + i, pid, 1, now) for i in range(pending)]
        if pending:
            seconds = await bulk_create(store, far)
            out["bulk_create"] = {
                "runs": pending,
                "seconds": round(seconds, 2),
                "per_s": round(pending / seconds),
                "load": _load(),
            }
        del far
        # A coordinator on the store, watched through a counting wrapper.
        counting = CountingRunStore(store)
        options = RunOptions(process_id=pid, lease=3.0, heartbeat_interval=1.0, horizon=HORIZON)
        async with trio_debounce.open_coordinator(
            run_handlers={WF: _noop}, run_store=counting, run_options=options
        ):
            await trio.sleep(1.5)  # the first sweep (and its purge) is done
            counting.reset()
            t0 = time.perf_counter()
            await trio.sleep(intervals * 1.0)
            end = time.perf_counter()
            elapsed = end - t0
            beats = [t0, *counting.starts.get("put_lease", []), end]
            max_gap = max(b - a for a, b in itertools.pairwise(beats))
            calls = dict(counting.calls)
            times = {k: list(v) for k, v in counting.seconds.items()}
        n_int = elapsed / 1.0
        writes = sum(v for k, v in calls.items() if k in CountingRunStore.WRITES)
        out["coordinator"] = {
            "intervals": round(n_int, 2),
            "calls_per_interval": {k: round(v / n_int, 2) for k, v in sorted(calls.items())},
            "writes_per_interval": round(writes / n_int, 2),
            # The longest time without a lease renewal starting (lease: 3 s).
            "max_heartbeat_gap_s": round(max_gap, 2),
            "median_ms": {
                k: round(statistics.median(v) * 1e3, 3) for k, v in sorted(times.items())
            },
            "load": _load(),
        }
        # The bare store: a heartbeat, a sweep's reads.
        lease = await store.get_lease(pid)
        assert lease is not None
        state = {"lease": lease}

        async def heartbeat() -> None:
            current = state["lease"]
            renewed = Lease(pid, current.epoch, store.wall_time() + 3.0, revision=current.revision)
            written = await store.put_lease(renewed)
            assert written is not None
            state["lease"] = written

        async def sweep_runs() -> None:
            await store.list_runs(states=ACTIVE, due_before=store.wall_time() + HORIZON)

        out["put_lease"] = await _time_calls(heartbeat)
        out["list_leases"] = await _time_calls(store.list_leases)
        out["sweep_list_runs_0_due"] = await _time_calls(sweep_runs)
        now = store.wall_time()
        soon = [_new_run(f"soon-{i:05d}", now + 30 + i * 1e-3, pid, 1, now) for i in range(due)]
        await bulk_create(store, soon)
        found = await store.list_runs(states=ACTIVE, due_before=store.wall_time() + HORIZON)
        assert len(found) == due, (len(found), due)
        out[f"sweep_list_runs_{due}_due"] = await _time_calls(sweep_runs)
    return out


# ----------------------------------------------------------------- 3. fire


async def bench_fire(kind: str, tmp: str, delivery: str, n: int) -> dict[str, Any]:
    """``n`` runs of this coordinator's, written in bulk due 3 s ahead; its claim sweep
    (every 1 s) arms them."""
    async with open_store(kind, tmp) as store:
        finished: list[float] = []
        done = trio.Event()

        async def handler(run: RunFire) -> None:
            finished.append(time.perf_counter())
            if len(finished) == n:
                done.set()

        pid = f"bench-fire-{uuid.uuid4().hex[:6]}"
        options = RunOptions(
            process_id=pid, lease=3.0, heartbeat_interval=1.0, max_concurrent_runs=100
        )
        async with trio_debounce.open_coordinator(
            run_handlers={WF: handler},
            run_store=store,
            run_options=options,
            delivery=delivery,  # type: ignore[arg-type]
        ) as coordinator:
            lease = await store.get_lease(pid)
            assert lease is not None
            now = store.wall_time()
            at = now + 3.0
            runs = [_new_run(f"fire-{i:05d}", at, pid, lease.epoch, now) for i in range(n)]
            await bulk_create(store, runs)
            lead = at - store.wall_time()
            assert lead > 1.2, f"writing {n} runs took too long ({lead:.2f} s left)"
            t_due = time.perf_counter() + lead
            with trio.fail_after(lead + 120):
                await done.wait()
            seconds = finished[-1] - t_due
            await coordinator.drain_runs()
    return {
        "runs": n,
        "seconds": round(seconds, 3),
        "per_s": round(n / seconds),
        "first_start_ms": round((finished[0] - t_due) * 1e3, 1),
        "load": _load(),
    }


# ----------------------------------------------------------------- report


def _print_table(results: dict[str, Any]) -> None:
    m = results["machine"]
    print(f"machine: {m['cores']} cores, {m['cpu']}; python {m['python']}, sqlite {m['sqlite']}")
    print(f"load average at start: {m['loadavg_start']}")
    print("\n1. schedule(persist=True), new ids, after=3600  (µs per call, median; range)")
    print(f"{'store':<7} {'variant':<13} {'µs/call':>9} {'range':>19} {'calls/s':>8} {'load':>5}")
    for kind, figures in results["schedule"].items():
        for name, f in figures.items():
            rng = f"{f['min_us']:.0f}-{f['max_us']:.0f}"
            print(
                f"{kind:<7} {name:<13} {f['us_per_call']:>9.1f} {rng:>19} "
                f"{f['per_s']:>8} {f['load']:>5}"
            )
        base = figures["create"]["us_per_call"]
        print(
            f"{kind:<7} ratios: schedule/create {figures['schedule']['us_per_call'] / base:.2f}x, "
            f"schedule/get+create "
            f"{figures['schedule']['us_per_call'] / figures['get+create']['us_per_call']:.2f}x, "
            f"schedule-x10/create-x10 "
            f"{figures['schedule-x10']['us_per_call'] / figures['create-x10']['us_per_call']:.2f}x"
        )
    print("\n2. heartbeat interval (1 s) with runs pending far in the future")
    for kind, by_pending in results["heartbeat"].items():
        for pending, h in by_pending.items():
            c = h["coordinator"]
            bulk = h.get("bulk_create")
            made = f", created in bulk at {bulk['per_s']}/s" if bulk else ""
            print(f"{kind} with {int(pending):,} pending{made}:")
            print(
                f"  per interval: {c['writes_per_interval']} writes (longest gap between "
                f"lease renewals {c['max_heartbeat_gap_s']} s, lease 3 s); calls "
                f"{c['calls_per_interval']}; median ms {c['median_ms']} (load {c['load']})"
            )
            for name in ("put_lease", "list_leases", "sweep_list_runs_0_due"):
                f = h[name]
                print(f"  {name:<24} {f['us_per_call']:>11.1f} µs  (load {f['load']})")
            key = next(
                k
                for k in h
                if k.startswith("sweep_list_runs_")
                and k.endswith("_due")
                and k != "sweep_list_runs_0_due"
            )
            f = h[key]
            print(f"  {key:<24} {f['us_per_call']:>11.1f} µs  (load {f['load']})")
        pendings = list(by_pending)
        if len(pendings) == 2:
            base, big = (by_pending[p] for p in pendings)
            for name in ("put_lease", "list_leases", "sweep_list_runs_0_due"):
                ratio = big[name]["us_per_call"] / base[name]["us_per_call"]
                print(f"  {name} {int(pendings[1]):,} / 0 pending: {ratio:.2f}x")
    if results.get("fire"):
        print("\n3. fire: 1,000 persisted runs due at one instant, no-op handler, 100 at once")
        for key, f in results["fire"].items():
            print(
                f"  {key:<26} {f['per_s']:>7} runs/s  ({f['seconds']} s, first start "
                f"{f['first_start_ms']} ms after due; load {f['load']})"
            )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": _machine(), "schedule": {}, "heartbeat": {}, "fire": {}}
    kinds = [k for k in ("memory", "sqlite", "nats") if k in args.stores]
    batches = {"memory": 1000, "sqlite": 100, "nats": 200}
    rounds = {"memory": 5, "sqlite": 9, "nats": 7}
    pendings = {"memory": args.pending, "sqlite": args.pending, "nats": args.nats_pending}
    with tempfile.TemporaryDirectory(prefix="trio-debounce-bench-runs-") as tmp:
        for kind in kinds:
            print(f"[{time.strftime('%H:%M:%S')}] schedule {kind}", file=sys.stderr)
            results["schedule"][kind] = await bench_schedule(kind, tmp, rounds[kind], batches[kind])
        for kind in kinds:
            results["heartbeat"][kind] = {}
            for pending in (0, pendings[kind]):
                print(f"[{time.strftime('%H:%M:%S')}] heartbeat {kind} {pending}", file=sys.stderr)
                results["heartbeat"][kind][str(pending)] = await bench_heartbeat(
                    kind, tmp, pending, args.intervals
                )
        if not args.no_fire:
            for kind in ("memory", "sqlite"):
                if kind not in kinds:
                    continue
                for delivery in ("at-most-once", "at-least-once"):
                    print(f"[{time.strftime('%H:%M:%S')}] fire {kind} {delivery}", file=sys.stderr)
                    results["fire"][f"{kind} {delivery}"] = await bench_fire(
                        kind, tmp, delivery, 1000
                    )
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="bench-runs.json", help="the JSON written")
    parser.add_argument("--nats-url", default="", help="a running nats-server -js (else start one)")
    parser.add_argument("--stores", default="memory,sqlite,nats", help="comma-separated")
    parser.add_argument("--pending", type=int, default=100_000, help="memory and SQLite")
    parser.add_argument("--nats-pending", type=int, default=10_000)
    parser.add_argument("--intervals", type=int, default=4, help="heartbeat intervals watched")
    parser.add_argument("--no-fire", action="store_true", help="skip the fire benchmark")
    args = parser.parse_args()
    args.stores = args.stores.split(",")
    if "nats" in args.stores:
        if not args.nats_url:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_shared import _start_server

            args.nats_url = _start_server()
        URL.append(args.nats_url)
    results = trio.run(main, args)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    _print_table(results)
    print(f"\nJSON written to {Path(args.output).resolve()}")
