"""Deferred runs: scheduling, heartbeat and fire throughput of the run stores, against
baselines in the same run (the ``runs`` item of ``bench/suite.py``, :func:`item`).

The stores: ``memory`` (``MemoryRunStore``, the in-process fake), ``sqlite``
(``open_sqlite_run_store`` on a temporary file) and ``nats`` (``open_nats_run_store``
on the suite's loopback ``nats-server -js``).

Not pyperf: the heartbeat figures need a store holding 100,000 runs, which pyperf's
worker processes would each have to build again. Instead each figure is timed in
rounds inside one process, its baselines timed in the same rounds in rotated order.

* ``schedule``: ``await coordinator.schedule(wf, id, payload, after=3600,
  persist=True)`` for new ids, one coordinator, sequential calls. Baselines: DBOS
  ``Queue.enqueue`` of a workflow delayed by an hour (SQLite), ``create`` (the store
  write it needs: ``store.create_run(StoredRun(...))`` on the same store) and
  ``get+create`` (the two calls it makes: ``get_run`` then ``create_run``).
  ``schedule-x10``/``create-x10``: the same from 10 concurrent tasks (throughput; each
  call's latency is 10 times the per-call figure).
* ``heartbeat`` with 0 and with many runs pending far in the future (100,000; NATS
  10,000), created through the store in bulk: a coordinator (lease 3 s, heartbeat
  interval 1 s) is watched over several intervals through a counting wrapper of its
  store: store calls and writes per interval, and the time of each. Then, on the bare
  store: one ``put_lease`` (a heartbeat), one claim sweep's reads (``list_leases`` and
  ``list_runs(states=active, due_before=now+60)``) with nothing due in the horizon,
  and the same ``list_runs`` with 1,000 runs due in it.
* ``fire`` (memory and SQLite, both deliveries): 1,000 persisted runs of one
  coordinator (heartbeat interval 1 s), written in bulk through the store, due at the
  same instant 3 s later (its claim sweep arms them), a handler that returns at once,
  ``max_concurrent_runs=100``: runs/s from their due time until the last handler
  started, and how late the first one started. Measured once per run.
"""

import itertools
import json
import math
import os
import sqlite3
import statistics
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

import trio
from _harness import Context, load, log, quantiles, ratio, row

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
        "load": load(),
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


# ----------------------------------------------------------------- schedule


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


# ----------------------------------------------------------------- heartbeat


#: Seconds :func:`_time_calls` spends on one figure.
TIME_CALLS_BUDGET = 1.5


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
                "load": load(),
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
            "load": load(),
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


# ----------------------------------------------------------------- fire


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
        "load": load(),
    }


# ----------------------------------------------------------------- the item


def item(ctx: Context) -> dict[str, Any]:
    """Schedule on each store against DBOS enqueue (paired), the heartbeat at 0 and
    many pending runs, and the fire throughput (once)."""
    assert ctx.dbos is not None
    dbos = ctx.dbos
    URL[:] = [ctx.url]
    out: dict[str, Any] = {
        "title": "Deferred runs",
        "rows": [],
        "schedule": {},
        "heartbeat": {},
        "fire": {},
    }
    rounds = ctx.params.rounds

    def enqueue(batch: int) -> Callable[[int], Awaitable[float]]:
        async def dbos_enqueue(r: int) -> float:
            return await trio.to_thread.run_sync(dbos.run, "enqueue", batch)

        return dbos_enqueue

    for kind in ("memory", "sqlite", "nats"):
        batch = ctx.params.schedule_batch[kind]
        log(f"runs: schedule {kind}")
        figures = trio.run(
            bench_schedule,
            kind,
            str(ctx.tmp),
            rounds,
            batch,
            {"dbos-enqueue": enqueue(batch)},
        )
        out["schedule"][kind] = figures
        ours = figures["schedule"]["values_s"]
        base = figures["dbos-enqueue"]["values_s"]
        stats = ratio(base, ours)
        out["rows"].append(
            row(
                f"schedule(persist=True) on {kind} vs DBOS enqueue on SQLite (sequential; runs/s)",
                1 / quantiles(ours)["median"],
                "runs/s",
                baseline="DBOS enqueue",
                base=1 / quantiles(base)["median"],
                stats=stats,
                ratio_label="speedup (ours / baseline)",
            )
        )
        both = figures["get+create"]["values_s"]
        out["rows"].append(
            row(
                f"schedule(persist=True) on {kind} vs the two store calls it makes "
                "(get_run + create_run; µs per call)",
                quantiles(ours)["median"] * 1e6,
                "µs",
                baseline="get_run + create_run",
                base=quantiles(both)["median"] * 1e6,
                stats=ratio(ours, both),
                ratio_label="ours / baseline",
            )
        )
        x10 = figures["schedule-x10"]["values_s"]
        out["rows"].append(
            row(
                f"schedule(persist=True) on {kind}, 10 concurrent tasks vs DBOS enqueue",
                1 / quantiles(x10)["median"],
                "runs/s",
                baseline="DBOS enqueue",
                base=1 / quantiles(base)["median"],
                stats=ratio(base, x10),
                ratio_label="speedup (ours / baseline)",
            )
        )
    for kind in ("sqlite", "nats"):
        out["heartbeat"][kind] = {}
        for pending in (0, ctx.params.pending[kind]):
            log(f"runs: heartbeat {kind} {pending:,} pending")
            h = trio.run(
                bench_heartbeat,
                kind,
                str(ctx.tmp),
                pending,
                ctx.params.heartbeat_intervals,
                min(1000, max(1, pending // 100)),
            )
            out["heartbeat"][kind][str(pending)] = h
        base, big = (out["heartbeat"][kind][str(p)] for p in (0, ctx.params.pending[kind]))
        writes = big["coordinator"]["writes_per_interval"]
        beat = big["put_lease"]
        out["rows"].append(
            row(
                f"heartbeat on {kind} with {ctx.params.pending[kind]:,} pending runs: "
                f"writes per 1 s tick (calls {big['coordinator']['calls_per_interval']})",
                writes,
                "writes/tick",
                baseline="0 pending",
                base=base["coordinator"]["writes_per_interval"],
                target="1 write per process per tick",
                met=writes <= 1.05,
                gap="" if writes <= 1.05 else f"{writes:.2f} writes",
                n=1,
            )
        )
        sweep = big["sweep_list_runs_0_due"]
        out["rows"].append(
            row(
                f"heartbeat on {kind}: one lease write (µs), and a claim sweep's run query "
                f"with nothing due ({sweep['us_per_call']:.0f} µs at "
                f"{ctx.params.pending[kind]:,} pending, "
                f"{base['sweep_list_runs_0_due']['us_per_call']:.0f} µs at 0)",
                beat["us_per_call"],
                "µs",
                baseline="0 pending",
                base=base["put_lease"]["us_per_call"],
                n=beat["rounds"],
            )
        )

    for kind in ("memory", "sqlite"):
        for delivery in ("at-most-once", "at-least-once"):
            log(f"runs: fire {kind} {delivery}")
            f = trio.run(bench_fire, kind, str(ctx.tmp), delivery, ctx.params.fire_runs)
            out["fire"][f"{kind} {delivery}"] = f
            out["rows"].append(
                row(
                    f"fire on {kind}, {delivery}: {f['runs']:,} persisted runs due at one "
                    f"instant, no-op handler, 100 at once (first start {f['first_start_ms']} "
                    "ms after due; one run)",
                    f["per_s"],
                    "runs/s",
                    n=1,
                )
            )
    return out
