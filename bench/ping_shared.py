"""A shared window on a real loopback nats-server: requests per operation, the owner
ping's latency against raw nats-py, and the hot key.

Three items of ``bench/suite.py``:

* ``nats-requests`` (:func:`requests_item`, :func:`count_requests`): NATS requests per
  operation and delivery mode. Every message a client sends to the server goes through
  ``nats.aio.client.Client.publish`` (requests, JetStream publishes, flow-control
  replies); :class:`PublishCounter` counts them, so the figure holds whatever the
  backend does inside.
* ``owner-ping`` (:func:`owner_ping_item`): an owner ping through the backend on Trio
  (:func:`ping_latencies`) against raw nats-py on plain asyncio doing the KV operations
  an owner ping does (:func:`raw_latencies`; taken from the counter: the sequence of KV
  subjects it touched); :func:`store_latencies`, the same operations through the
  backend's store alone, splits the gap between the bridge and the coordinator.
* ``hot-key`` (:func:`hot_key_item`, :func:`hot_key`): tasks pinging one key, against
  DBOS's ``Debouncer`` on SQLite; ``python bench/ping_shared.py hot-proc URL BUCKET
  TASKS PINGS START CAP`` is one of the processes of the multi-process case.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio
from _harness import Context, pythonpath, quantiles, ratio, row, run_rounds, timed_awaits

import trio_debounce
from trio_debounce.nats import NatsConfig, open_nats_backend

WF = "wf"
SCRIPT = Path(__file__).resolve()


async def _noop(fire: trio_debounce.Fire) -> None:
    pass


#: Set to a host name ("thread", "trio-asyncio") to run the NATS items on that asyncio
#: host; ignored by a revision whose NatsConfig has no asyncio_host (bench/compare.py
#: runs this code against older revisions too).
HOST_ENV = "TRIO_DEBOUNCE_BENCH_ASYNCIO_HOST"


def config(url: str, bucket: str | None = None, **kw: Any) -> NatsConfig:
    host = os.environ.get(HOST_ENV)
    if host and "asyncio_host" in getattr(NatsConfig, "__dataclass_fields__", {}):
        kw.setdefault("asyncio_host", host)
    return NatsConfig(
        servers=(url,), bucket=bucket or f"b{uuid.uuid4().hex[:12]}", op_timeout=5.0, **kw
    )


# ----------------------------------------------------------------- requests per operation


class PublishCounter:
    """Counts the messages every nats-py client of this process publishes, by kind:
    the KV key's first segment (``w``, ``f``, ``p``, ...) for KV publishes and direct
    gets, ``api`` for other JetStream API requests, ``other`` for the rest."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str, int]] = []  # (op, key, payload bytes)

    def classify(self, subject: str, payload: bytes) -> tuple[str, str, str]:
        kv = f"$KV.{self.bucket}."
        if subject.startswith(kv):
            key = subject[len(kv) :]
            return key.split(".", 1)[0], "put", key
        if subject.startswith(f"$JS.API.DIRECT.GET.KV_{self.bucket}."):
            key = subject.rsplit(kv, 1)[-1]
            return key.split(".", 1)[0], "get", key
        if subject.startswith("$JS.API."):
            text = payload.decode(errors="replace")
            if kv in text:
                key = text.split(kv, 1)[1].split('"', 1)[0]
                return key.split(".", 1)[0], "get", key
            return "api", "api", subject
        return "other", "other", subject

    @contextmanager
    def installed(self) -> Iterator[PublishCounter]:
        from nats.aio.client import Client

        original = Client.publish
        counter = self

        async def publish(self: Any, subject: str, payload: bytes = b"", *a: Any, **kw: Any) -> Any:
            kind, op, key = counter.classify(subject, payload)
            counter.counts[kind] += 1
            counter.log.append((op, key, len(payload)))
            return await original(self, subject, payload, *a, **kw)

        Client.publish = publish  # type: ignore[method-assign]
        try:
            yield self
        finally:
            Client.publish = original  # type: ignore[method-assign]

    def take(self) -> tuple[Counter[str], list[tuple[str, str, int]]]:
        counts, log = self.counts, self.log
        self.counts, self.log = Counter(), []
        return counts, log


def _requests(counts: Counter[str]) -> int:
    """Requests of an operation: all but process-lease renewals (``p``)."""
    return sum(v for k, v in counts.items() if k != "p")


async def count_requests(url: str, delivery: str, keys: int = 10) -> dict[str, Any]:
    """Requests per operation under ``delivery``, each the mean over ``keys`` keys:
    ``open`` (a first ping: a new window), ``owner-ping`` (a ping from the window's
    owner), ``other-ping`` (a ping from a second process, not the owner) and
    ``finalize`` (from the window's due time until its fire is done, both processes'
    requests). Also the owner ping's KV operation sequence, the owner-ping item's baseline."""
    cfg = config(url)
    counter = PublishCounter(cfg.bucket)
    fired = trio.Event()
    done: list[str] = []

    async def handler(fire: trio_debounce.Fire) -> None:
        done.append(fire.key)
        if len(done) == keys:
            fired.set()

    out: dict[str, Any] = {"delivery": delivery, "keys": keys}
    with counter.installed():
        async with (
            open_nats_backend(cfg) as backend_a,
            open_nats_backend(cfg) as backend_b,
            trio_debounce.open_coordinator(
                handlers={WF: handler},
                backend=backend_a,
                delivery=delivery,  # type: ignore[arg-type]
                on_exit="cancel",
            ) as a,
            trio_debounce.open_coordinator(
                handlers={WF: handler},
                backend=backend_b,
                delivery=delivery,  # type: ignore[arg-type]
                on_exit="cancel",
            ) as b,
        ):
            names = [f"key{i}" for i in range(keys)]
            await a.debounce(WF, "warm", delay=3600.0)
            await trio.sleep(0.2)
            phases: dict[str, Any] = {}

            async def phase(
                name: str, coordinator: trio_debounce.Coordinator, delay: float
            ) -> None:
                counter.take()
                for key in names:
                    await coordinator.debounce(WF, key, {"n": 1}, delay=delay)
                counts, log = counter.take()
                phases[name] = (counts, log)

            await phase("open", a, 3600.0)
            await phase("owner-ping", a, 3600.0)
            await phase("other-ping", b, 3600.0)
            # Finalize: new windows due in 1.5 s, owned by a.
            names = [f"fin{i}" for i in range(keys)]
            await phase("open-finalized", a, 1.5)
            with trio.fail_after(30):
                await fired.wait()
            await trio.sleep(0.5)  # completion writes after the handlers
            phases["finalize"] = counter.take()
            for name, (counts, _) in phases.items():
                out[name] = {
                    "requests": _requests(counts) / keys,
                    "by_kind": {k: v / keys for k, v in sorted(counts.items())},
                }
            # The pings were sequential: the first key's share of the log is one ping's.
            owner_log = phases["owner-ping"][1]
            first = [e for e in owner_log if e[0] in ("get", "put")][: len(owner_log) // keys]
            out["owner-ping-ops"] = [(op, size) for op, _, size in first]
    return out


# ----------------------------------------------------------------- the owner ping


async def ping_latencies(url: str, pings: int, warm: int = 20) -> list[float]:
    """Seconds of each of ``pings`` owner pings (``await debounce``) into one window,
    through the NATS backend on a fresh Trio loop (run with ``trio.run``)."""
    async with (
        open_nats_backend(config(url)) as backend,
        trio_debounce.open_coordinator(
            handlers={WF: _noop}, backend=backend, on_exit="cancel"
        ) as coordinator,
    ):
        ping = partial(coordinator.debounce, WF, "k", {"n": 1}, delay=3600.0)
        return await timed_awaits(ping, pings, warm + 1)  # the first opens the window


async def store_latencies(
    url: str, ops: list[tuple[str, int]], pings: int, warm: int = 20
) -> list[float]:
    """The KV operations ``ops`` (as :func:`raw_latencies`) through the backend's store
    alone (``NatsKvStore.get``/``put``: one crossing into the asyncio host each, no
    coordinator), on a fresh Trio loop (run with ``trio.run``); seconds of each ping.
    It splits the owner ping's gap: the bridge's share (this against raw nats-py) and the
    coordinator's (the owner ping against this)."""
    from trio_debounce.nats._store import open_nats_store

    async with open_nats_store(config(url)) as store:
        values = {size: b"x" * max(size, 1) for _, size in ops}
        rev = await store.put("w.raw", b"x", last=0)

        async def ping() -> None:
            nonlocal rev
            for op, size in ops:
                if op == "get":
                    entry = await store.get("w.raw")
                    rev = entry.revision if entry is not None else rev
                else:
                    rev = await store.put("w.raw", values[size], last=rev)

        return await timed_awaits(ping, pings, warm)


def raw_latencies(url: str, ops: list[tuple[str, int]], pings: int, warm: int = 20) -> list[float]:
    """Raw nats-py on a fresh plain asyncio loop: per ping, the KV operations ``ops``
    (``("get", _)`` a ``kv.get``, ``("put", size)`` a ``kv.update`` of ``size`` bytes
    against the last revision seen) on one key; seconds of each ping.

    Raises:
      RuntimeError: trio_asyncio is imported in this process: it replaces asyncio's
        loop policy, so ``asyncio.run`` would measure trio-asyncio's (slower) loop,
        not the stdlib's (bench/nats_hosts.py measures that host in processes of
        their own)."""
    import nats

    if "trio_asyncio" in sys.modules:
        raise RuntimeError("raw nats-py baseline in a process that imported trio_asyncio")

    async def main() -> list[float]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            bucket = f"raw{uuid.uuid4().hex[:10]}"
            kv = await js.create_key_value(bucket=bucket, history=1)
            rev = await kv.create("w.raw", b"x")
            values = {size: b"x" * max(size, 1) for _, size in ops}

            async def ping() -> None:
                nonlocal rev
                for op, size in ops:
                    if op == "get":
                        entry = await kv.get("w.raw")
                        rev = entry.revision or rev
                    else:
                        rev = await kv.update("w.raw", values[size], last=rev)

            out = await timed_awaits(ping, pings, warm)
            await js.delete_key_value(bucket)
            return out
        finally:
            await nc.close()

    return asyncio.run(main())


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ----------------------------------------------------------------- the hot key


async def hot_key(
    url: str,
    tasks: int,
    pings: int,
    bucket: str | None = None,
    start_at: float | None = None,
    cap: float = 3.0,
) -> dict[str, Any]:
    """``tasks`` tasks of one coordinator pinging one key (``pings`` in all, split
    evenly), each awaiting its ``debounce()``, for at most ``cap`` seconds; acknowledged
    (stored) pings per second of the time taken. Errors (``on_backend_error="raise"``)
    and unstored pings are counted, not retried."""
    per_task = max(1, pings // tasks)
    acked = unstored = errors = 0
    async with (
        open_nats_backend(config(url, bucket)) as backend,
        trio_debounce.open_coordinator(
            handlers={WF: _noop}, backend=backend, on_exit="cancel", on_backend_error="raise"
        ) as coordinator,
    ):
        await coordinator.debounce(WF, "hot", 0, delay=3600.0)
        if start_at is not None:  # the processes of the multi-process case start together
            await trio.sleep(max(0.0, start_at - time.time()))

        async def worker(w: int) -> None:
            nonlocal acked, unstored, errors
            for i in range(per_task):
                try:
                    result = await coordinator.debounce(WF, "hot", w * per_task + i, delay=3600.0)
                except trio_debounce.BackendError:
                    errors += 1
                    continue
                if result.stored:
                    acked += 1
                else:
                    unstored += 1

        wall_start = time.time()
        t0 = time.perf_counter()
        with trio.move_on_after(cap) as capped:
            async with trio.open_nursery() as nursery:
                for w in range(tasks):
                    nursery.start_soon(worker, w)
        elapsed = time.perf_counter() - t0
    return {
        "wall_start": wall_start,
        "wall_end": wall_start + elapsed,
        "tasks": tasks,
        "pings": per_task * tasks,
        "acked": acked,
        "unstored": unstored,
        "errors": errors,
        "seconds": elapsed,
        "per_s": acked / elapsed,
        "capped": capped.cancelled_caught,
    }


#: The pings of the flow hot key's variants: each awaits one ping of key "hot" by one
#: coordinator (a debounce window: the baseline; a throttle, whose pings are absorbed
#: as the debounce's are; a rate limit whose every ping fires, a write of its own).
FLOW_HOT: dict[str, Any] = {
    "debounce": lambda c, i: c.debounce(WF, "hot", i, delay=3600.0),
    "throttle": lambda c, i: c.throttle(WF, "hot", i, interval=3600.0),
    "rate-limit": lambda c, i: c.rate_limit(WF, "hot", i, limit=10**9, period=3600.0),
}


async def flow_hot_key(
    url: str, variant: str, tasks: int, pings: int, cap: float
) -> dict[str, Any]:
    """``tasks`` tasks of one coordinator pinging one key with ``FLOW_HOT[variant]``
    (``pings`` in all), for at most ``cap`` seconds: acknowledged pings (for the rate
    limit, fires) per second of the time taken."""
    ping = FLOW_HOT[variant]
    per_task = max(1, pings // tasks)
    acked = errors = fired = 0
    async with (
        open_nats_backend(config(url)) as backend,
        trio_debounce.open_coordinator(
            handlers={WF: _noop}, backend=backend, on_exit="cancel", on_backend_error="raise"
        ) as coordinator,
    ):
        await ping(coordinator, -1)  # opens the window (and the connection's caches)

        async def worker(w: int) -> None:
            nonlocal acked, errors, fired
            for i in range(per_task):
                try:
                    result = await ping(coordinator, w * per_task + i)
                except trio_debounce.BackendError:
                    errors += 1
                    continue
                acked += result.stored
                fired += result.outcome is trio_debounce.Outcome.FIRE_IMMEDIATE

        t0 = time.perf_counter()
        with trio.move_on_after(cap):
            async with trio.open_nursery() as nursery:
                for w in range(tasks):
                    nursery.start_soon(worker, w)
        elapsed = time.perf_counter() - t0
    return {"per_s": acked / elapsed, "errors": errors, "fired": fired, "seconds": elapsed}


def flow_hot_key_item(ctx: Context) -> dict[str, Any]:
    """100 tasks on one key over NATS: a throttle's and a rate limit's pings against a
    debounce's (the baseline), paired in each round (issue 20)."""
    variants = list(FLOW_HOT)
    tasks = 100 if 100 in ctx.params.hot_tasks else max(ctx.params.hot_tasks)
    pings = max(ctx.params.hot_pings, 2 * tasks)
    got: dict[str, list[dict[str, Any]]] = {}

    def one(r: int) -> None:
        k = r % len(variants)
        for name in variants[k:] + variants[:k]:
            result = trio.run(flow_hot_key, ctx.url, name, tasks, pings, ctx.params.hot_cap)
            got.setdefault(name, []).append(result)

    n = run_rounds(ctx, "flow-hot-key", one)
    base = [g["per_s"] for g in got["debounce"]]
    rows = []
    for name in variants[1:]:
        rates = [g["per_s"] for g in got[name]]
        errors = sum(g["errors"] for g in got[name])
        fired = sum(g["fired"] for g in got[name])
        rows.append(
            row(
                f"hot key, {name}, {tasks} tasks: acknowledged pings/s ({fired} fires, "
                f"{errors} errors in all rounds)",
                quantiles(rates)["median"],
                "pings/s",
                baseline=f"debounce on the same key, {tasks} tasks",
                base=quantiles(base)["median"],
                stats=ratio(rates, base),
                ratio_label="ours / baseline",
            )
        )
    return {
        "title": "Flow-control hot key over NATS",
        "rows": rows,
        "rounds": n,
        "rates": {k: [g["per_s"] for g in v] for k, v in got.items()},
    }


def _hot_proc(url: str, bucket: str, tasks: int, pings: int, start: float, cap: float) -> None:
    print(json.dumps(trio.run(hot_key, url, tasks, pings, bucket, start, cap)))


def summarize(values: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(values), "p99": p(values, 0.99), "max": max(values)}


# ----------------------------------------------------------------- the items


def requests_item(ctx: Context) -> dict[str, Any]:
    """Requests per operation, both delivery modes; keeps the owner ping's KV
    operations in ``ctx`` for the owner-ping item."""
    rows = []
    counts = {}
    targets = {
        "open": (2, "<= 2"),
        "owner-ping": (1, "1"),
        "other-ping": (2, "<= 2"),
    }
    for delivery in ("at-most-once", "at-least-once"):
        result = trio.run(count_requests, ctx.url, delivery, ctx.params.count_keys)
        counts[delivery] = result
        fin = (1, "1") if delivery == "at-most-once" else (3, "<= 3")
        for op, (limit, text) in [*targets.items(), ("finalize", fin)]:
            got = result[op]["requests"]
            rows.append(
                row(
                    f"{delivery}: {op} (requests; by kind {result[op]['by_kind']})",
                    got,
                    "requests",
                    baseline="reference design",
                    base=2.0 if op != "finalize" else None,
                    target=text,
                    met=got <= limit,
                    gap="" if got <= limit else f"{got - limit:g} over",
                    n=ctx.params.count_keys,
                )
            )
    ctx.owner_ping_ops = [tuple(x) for x in counts["at-least-once"]["owner-ping-ops"]]
    return {"title": "NATS requests per operation", "rows": rows, "counts": counts}


def owner_ping_item(ctx: Context) -> dict[str, Any]:
    """The owner ping, its store alone and raw nats-py, paired; the KV operations are
    the ones the nats-requests item saw (a get and a 300-byte put without it)."""
    ops = ctx.owner_ping_ops
    if not ops:
        ops = [("get", 0), ("put", 300)]
    pings = ctx.params.latency_pings
    variants = ["ours", "raw", "store"]
    got: dict[str, list[dict[str, float]]] = {name: [] for name in variants}

    def one(r: int) -> None:
        k = r % len(variants)
        for what in variants[k:] + variants[:k]:
            if what == "ours":
                lat = trio.run(ping_latencies, ctx.url, pings)
            elif what == "store":
                lat = trio.run(store_latencies, ctx.url, ops, pings)
            else:
                lat = raw_latencies(ctx.url, ops, pings)
            got[what].append(summarize(lat))

    n = run_rounds(ctx, "owner-ping", one)
    rows = []
    what = "+".join(op for op, _ in ops)
    for stat in ("p50", "p99"):
        ours = [g[stat] for g in got["ours"]]
        raw = [g[stat] for g in got["raw"]]
        stats = ratio(ours, raw)
        rows.append(
            row(
                f"owner ping latency {stat}: NATS backend on Trio vs raw nats-py on asyncio "
                f"({what} per ping)",
                quantiles(ours)["median"] * 1e3,
                "ms",
                baseline="raw nats-py",
                base=quantiles(raw)["median"] * 1e3,
                stats=stats,
                ratio_label="ours / baseline",
                target="<= 1.3x",
                met=stats["median"] <= 1.3,
                gap="" if stats["median"] <= 1.3 else f"{stats['median'] / 1.3:.2f}x over",
            )
        )
    for stat in ("p50", "p99"):
        store = [g[stat] for g in got["store"]]
        raw = [g[stat] for g in got["raw"]]
        rows.append(
            row(
                f"the same {what} through the backend's store alone (the bridge, no "
                f"coordinator), latency {stat}, vs raw nats-py",
                quantiles(store)["median"] * 1e3,
                "ms",
                baseline="raw nats-py",
                base=quantiles(raw)["median"] * 1e3,
                stats=ratio(store, raw),
                ratio_label="store / baseline",
            )
        )
    return {
        "title": "Owner ping over NATS: the bridge's overhead",
        "rows": rows,
        "rounds": n,
        "ops": ops,
    }


def _procs(ctx: Context) -> dict[str, Any]:
    """``procs`` processes, ``proc_tasks`` tasks each, pinging one key from a common start."""
    bucket = f"hot{uuid.uuid4().hex[:10]}"
    start = time.time() + 3.0
    pings = ctx.params.hot_pings // 2
    children = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "hot-proc",
                ctx.url,
                bucket,
                str(ctx.params.proc_tasks),
                str(pings),
                str(start),
                str(ctx.params.hot_cap),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": pythonpath()},
        )
        for _ in range(ctx.params.procs)
    ]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=300)
        if child.returncode != 0:
            raise RuntimeError(f"hot-proc exited with {child.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    acked = sum(r["acked"] for r in results)
    span = max(r["wall_end"] for r in results) - min(r["wall_start"] for r in results)
    return {
        "per_s": acked / span,
        "acked": acked,
        "errors": sum(r["errors"] for r in results),
        "unstored": sum(r["unstored"] for r in results),
        "late_start": max(r["wall_start"] for r in results) - start,
    }


def hot_key_item(ctx: Context) -> dict[str, Any]:
    """1 to 1,000 tasks, and ``procs`` processes, on one key, against DBOS, paired."""
    assert ctx.dbos is not None
    dbos = ctx.dbos
    got: dict[str, list[dict[str, Any]]] = {}
    variants = [f"tasks-{t}" for t in ctx.params.hot_tasks] + [f"procs-{ctx.params.procs}", "dbos"]
    cap = ctx.params.hot_cap

    def one(r: int) -> None:
        k = r % len(variants)
        for name in variants[k:] + variants[:k]:
            if name == "dbos":
                seconds = dbos.run("debounce", ctx.params.dbos_pings)
                result: dict[str, Any] = {"per_s": ctx.params.dbos_pings / seconds}
            elif name.startswith("procs"):
                result = _procs(ctx)
            else:
                tasks = int(name.split("-")[1])
                pings = max(ctx.params.hot_pings, 2 * tasks)
                result = trio.run(hot_key, ctx.url, tasks, pings, None, None, cap)
            got.setdefault(name, []).append(result)

    n = run_rounds(ctx, "hot-key", one)
    dbos_rates = [g["per_s"] for g in got["dbos"]]
    rows = []
    for name in variants[:-1]:
        rates = [g["per_s"] for g in got[name]]
        stats = ratio(rates, dbos_rates)
        errors = sum(g.get("errors", 0) for g in got[name])
        unstored = sum(g.get("unstored", 0) for g in got[name])
        target = name == "tasks-100"
        med = quantiles(rates)["median"]
        rows.append(
            row(
                f"hot key, {name.replace('-', ' ')}: acknowledged pings/s "
                f"({errors} errors, {unstored} unstored in all rounds)",
                med,
                "pings/s",
                baseline="DBOS Debouncer (SQLite, 1 caller)",
                base=quantiles(dbos_rates)["median"],
                stats=stats,
                ratio_label="ours / baseline",
                target=">= 20,000/s" if target else "",
                met=(med >= 20_000) if target else None,
                gap=f"{20_000 / med:.1f}x short" if target and med < 20_000 else "",
            )
        )
    return {
        "title": "Hot key over NATS",
        "rows": rows,
        "rounds": n,
        "rates": {k: [g["per_s"] for g in v] for k, v in got.items()},
    }


if __name__ == "__main__":
    if sys.argv[1] == "hot-proc":
        _hot_proc(
            sys.argv[2],
            sys.argv[3],
            int(sys.argv[4]),
            int(sys.argv[5]),
            float(sys.argv[6]),
            float(sys.argv[7]),
        )
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
