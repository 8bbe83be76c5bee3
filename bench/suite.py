"""Issue 6's benchmark suite: items 1-8, each against its baseline, and the report.

``nox -s bench`` runs it (or ``python bench/suite.py``); it writes
``docs/benchmarks/results.json``, then ``bench/report.py`` turns that into
``docs/benchmarks/index.rst`` and its figures. Options: ``--huge`` adds item 2's
1,000,000-window point (minutes, GBs); ``--items 1,3`` runs some items only;
``--rounds N`` (default 15) paired rounds per figure; ``--tiny`` runs every benchmark
with tiny counts (the smoke test's mode: checks that it runs, measures nothing).

Pairing (see ``bench/_harness.py``): every figure is the median of ``--rounds`` rounds
(15 by default, as issue 6 asks; no item stops early), each running all variants of
its comparison once in rotated order on fresh event loops or processes with fixed
operation counts, and ratios are taken per round. Item 2 splits its passes so that
the 15 rounds fit (see :func:`item2`). ``nox -s bench`` takes about 10 minutes on an
idle 2-core machine (see the report's per-item times).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as harness
import ping_local
import ping_shared
import pyperf_local
from _harness import load, log, quantiles, ratio

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = ROOT / "docs" / "benchmarks"
#: Below this many rounds (``--tiny``), item 7's processes run 2 tasks each, not 25.
MIN_ROUNDS = 5
#: Seconds the one 1,000,000-event CLI replay may take; slower, its rate is reported
#: as an upper bound.
FULL_REPLAY_TIMEOUT = 180.0


@dataclass
class Params:
    """Operation counts: ``full()`` for the report, ``tiny()`` for the smoke test."""

    rounds: int = 15
    item1_loops: dict[str, int] = field(default_factory=dict)
    #: Pings per round of the keyed ping (a multiple of 1,000 windows).
    keyed_loops: int = 100_000
    scale_sizes: tuple[int, ...] = (10, 1_000, 100_000)
    #: The size ``--huge`` adds to item 2.
    huge_size: int = 1_000_000
    scale_loops: int = 50_000
    #: Item 2's windows (and tasks) processes; the ping rounds are split among them.
    scale_procs: int = 3
    fire_n: int = 10_000
    replay_small: tuple[int, int] = (10_000, 1_000)
    replay_full: tuple[int, int] = (1_000_000, 100_000)
    count_keys: int = 10
    latency_pings: int = 200
    hot_tasks: tuple[int, ...] = (1, 10, 100, 1_000)
    hot_pings: int = 1_000
    hot_cap: float = 3.0
    procs: int = 4
    dbos_pings: int = 100
    schedule_batch: dict[str, int] = field(default_factory=lambda: {"sqlite": 50, "nats": 100})
    pending: dict[str, int] = field(default_factory=lambda: {"sqlite": 100_000, "nats": 10_000})
    heartbeat_intervals: int = 3

    @classmethod
    def full(cls) -> Params:
        return cls(
            item1_loops={
                "ping-nowait": 50_000,
                "asyncio-call-later": 50_000,
                "throttlebounce": 50_000,
                "naive-trio": 2_000,
                "ping-async": 20_000,
                "checkpoint": 20_000,
            },
            keyed_loops=100_000,
        )

    @classmethod
    def tiny(cls) -> Params:
        return cls(
            rounds=2,
            item1_loops={name: 20 for name in pyperf_local.BENCHES if "keyed" not in name},
            keyed_loops=2_000,
            scale_sizes=(10, 1_000, 1_200),
            huge_size=1_500,
            scale_loops=100,
            scale_procs=1,
            fire_n=50,
            replay_small=(200, 20),
            replay_full=(400, 40),
            count_keys=2,
            latency_pings=5,
            hot_tasks=(1, 3),
            hot_pings=6,
            procs=2,
            dbos_pings=3,
            schedule_batch={"sqlite": 3, "nats": 3},
            pending={"sqlite": 1_100, "nats": 1_100},
            heartbeat_intervals=1,
        )


@dataclass
class Context:
    params: Params
    tmp: Path
    url: str = ""
    dbos: DbosProcess | None = None
    huge: bool = False
    workers: bool = False
    out_dir: Path | None = None


def run_rounds(ctx: Context, item: int, run_round: Any) -> int:
    """Call ``run_round(r)`` for each of the ``rounds`` rounds; returns the rounds done."""
    for r in range(ctx.params.rounds):
        run_round(r)
    log(f"item {item}: {ctx.params.rounds} rounds done (load {load()})")
    return ctx.params.rounds


def row(
    name: str,
    ours: float | None,
    unit: str,
    *,
    baseline: str = "",
    base: float | None = None,
    stats: dict[str, float] | None = None,
    ratio_label: str = "",
    target: str = "",
    met: bool | None = None,
    gap: str = "",
    n: int | None = None,
) -> dict[str, Any]:
    """One line of the report: our figure, the baseline's, the paired ratio's spread,
    the target and whether it is met (``gap``: by how much it is missed)."""
    return {
        "name": name,
        "ours": ours,
        "unit": unit,
        "baseline": baseline,
        "base": base,
        "ratio": stats,
        "ratio_label": ratio_label,
        "target": target,
        "met": met,
        "gap": gap,
        "n": n if n is not None else (stats or {}).get("n"),
        "load": load(),
    }


def speedup_row(
    name: str,
    ours: list[float],
    base: list[float],
    baseline: str,
    target: float | None,
    scale: float = 1e6,
    unit: str = "µs",
) -> dict[str, Any]:
    stats = ratio(base, ours)
    met = None if target is None else stats["median"] >= target
    gap = ""
    if met is False:
        assert target is not None
        gap = f"{stats['median']:.2f}x of {target:g}x: {target / stats['median']:.2f}x short"
    return row(
        name,
        quantiles(ours)["median"] * scale,
        unit,
        baseline=baseline,
        base=quantiles(base)["median"] * scale,
        stats=stats,
        ratio_label="speedup (baseline / ours)",
        target="" if target is None else f">= {target:g}x",
        met=met,
        gap=gap,
    )


# ----------------------------------------------------------------- 1


def item1_rows(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Item 1's report lines from the seconds per ping of each variant, by round."""
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
    return rows


#: The keyed coalescing ping and its baselines.
KEYED = ("ping-keyed", "asyncio-call-later-keyed", "floor-keyed")


def keyed_rows(values: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The keyed ping's report lines from the seconds per ping of each variant."""
    ours = values["ping-keyed"]
    floor = values["floor-keyed"]
    cost = ratio(ours, floor)
    return [
        speedup_row(
            "keyed: debounce_nowait on 1,000 open windows pinged in turn (max_delay set) "
            "vs asyncio call_later re-armed on 1,000 handles",
            ours,
            values["asyncio-call-later-keyed"],
            "call_later x 1,000",
            3.0,
            scale=1e9,
            unit="ns",
        ),
        row(
            "keyed: the same pings vs their floor (a dict lookup on (workflow, key), "
            "three attribute writes, min against the cap, a result tuple, inline)",
            quantiles(ours)["median"] * 1e9,
            "ns",
            baseline="floor",
            base=quantiles(floor)["median"] * 1e9,
            stats=cost,
            ratio_label="cost ratio (ours / floor)",
            target="<= 1.8x",
            met=cost["median"] <= 1.8,
            gap="" if cost["median"] <= 1.8 else f"{cost['median'] / 1.8:.2f}x over",
        ),
    ]


def _timed_in_rounds(
    ctx: Context, loops: dict[str, int], pyperf_json: str
) -> dict[str, list[float]]:
    """Seconds per loop of each of ``loops``' benchmarks, by round: pyperf worker
    processes with ``--workers``, else fresh event loops in this process."""
    if ctx.workers:
        tasks = {name: (pyperf_local.TASK[name], loops[name]) for name in loops}
        values, _ = harness.paired_pyperf(
            BENCH / "pyperf_local.py", tasks, ctx.params.rounds, warmups=1
        )
        return values
    values, _ = harness.paired_timefuncs(
        {name: (pyperf_local.BENCHES[name], loops[name]) for name in loops},
        ctx.params.rounds,
        (ctx.out_dir or ctx.tmp) / pyperf_json,
    )
    return values


def item1(ctx: Context) -> dict[str, Any]:
    loops = ctx.params.item1_loops
    if ctx.workers:
        # Each sample a pyperf worker process (about 1 s of start-up each).
        tasks = {name: (pyperf_local.TASK[name], loops[name]) for name in loops}
        values, meta = harness.paired_pyperf(
            BENCH / "pyperf_local.py", tasks, ctx.params.rounds, warmups=1
        )
    else:
        # Each sample a fresh event loop in this process, after a warm-up round.
        values, meta = harness.paired_timefuncs(
            {name: (pyperf_local.BENCHES[name], loops[name]) for name in loops},
            ctx.params.rounds,
            (ctx.out_dir or ctx.tmp) / "item1-pyperf.json",
        )
    rows = item1_rows(values)
    keyed_loops = dict.fromkeys(KEYED, ctx.params.keyed_loops)
    keyed = _timed_in_rounds(ctx, keyed_loops, "item1-keyed-pyperf.json")
    rows += keyed_rows(keyed)
    values.update(keyed)
    loops = {**loops, **keyed_loops}
    return {
        "title": "1. Coalescing ping (in memory)",
        "rows": rows,
        "samples_us": {k: [v * 1e6 for v in vs] for k, vs in values.items()},
        "loops": loops,
        "pyperf_meta": meta,
    }


# ----------------------------------------------------------------- 2


def item2(ctx: Context) -> dict[str, Any]:
    """Three passes, so that every figure gets its paired rounds without building
    100,000 windows per round: the tracemalloc memory pass (one process, a fresh loop
    per measurement), then ``scale_procs`` pairs of processes, a windows process
    (``ping_local.scale_process``: one coordinator per size, the ping rounds reuse
    the windows) and a tasks process (the RSS baseline), in alternating order."""
    sizes = list(ctx.params.scale_sizes) + ([ctx.params.huge_size] if ctx.huge else [])
    rounds = ctx.params.rounds
    script = str(BENCH / "ping_local.py")
    log("item 2: memory (tracemalloc)")
    memory = harness.run_json([script, "memory-rounds", "1000", str(rounds)], timeout=3600)
    procs = max(1, min(ctx.params.scale_procs, rounds))
    per_proc = -(-rounds // procs)  # the ping rounds of each windows process
    windows: list[dict[str, Any]] = []
    tasks: list[dict[str, Any]] = []
    for p in range(procs):
        log(f"item 2: {sum(sizes):,} windows and tasks, process pair {p + 1} of {procs}")
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
                windows.append(harness.run_json(args, timeout=3600))
            else:
                args = [script, "tasks", ",".join(map(str, sizes))]
                tasks.append(harness.run_json(args, timeout=3600))
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
    small = ping_local._small(sizes)
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
        "title": "2. Scale (in memory)",
        "rows": rows,
        "rounds": len(ping[first]),
        "processes": procs,
        "sizes": sizes,
        "ping_us": {str(s): [v * 1e6 for v in ping[s]] for s in sizes},
        "floor_us": {str(s): [v * 1e6 for v in floor[s]] for s in sizes},
        "traced_per_window": traced,
        "traced_per_task": traced_t,
    }


# ----------------------------------------------------------------- 3


def item3(ctx: Context) -> dict[str, Any]:
    n = ctx.params.fire_n
    out: dict[str, Any] = {"title": "3. Fire accuracy (real clock)", "rows": [], "cases": {}}
    leads = [ping_local.default_lead(n)]  # seconds from the start to the first due time
    for case, spread in (("uniform over 1 s", 1.0), ("burst within 0.1 s", 0.1)):
        got: dict[str, list[dict[str, float]]] = {"windows": [], "sleep_until": []}
        samples: dict[str, list[float]] = {}

        def one(r: int, spread: float = spread, got: Any = got, samples: Any = samples) -> None:
            order = ["windows", "sleep_until"] if r % 2 == 0 else ["sleep_until", "windows"]
            for _attempt in range(4):
                lead = leads[-1]
                runs = {}
                for kind in order:
                    runs[kind] = ping_local.fire_lateness(kind, n, spread, seed=r, lead=lead)
                slowest = max(setup for _, setup in runs.values())
                if slowest <= 0.8 * lead:
                    break
                # Set-up ate the lead: the lateness would measure the set-up. Again,
                # with a longer lead (kept for the following rounds).
                leads.append(round(2 * slowest, 2))
                log(f"item 3: set-up took {slowest:.2f} s of a {lead:.2f} s lead; again")
            for kind, (late, _) in runs.items():
                got[kind].append(ping_local.percentiles(late))
                # A sample for the report's plot (every run's own percentiles are above).
                samples.setdefault(kind, []).extend(late[:: max(1, len(late) // 200)])

        rounds = run_rounds(ctx, 3, one)
        out["cases"][case] = {
            "rounds": rounds,
            "leads": list(leads),
            "samples_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in samples.items()},
        }
        for stat in ("p50", "p99", "max"):
            ours = [g[stat] * 1e3 for g in got["windows"]]
            base = [g[stat] * 1e3 for g in got["sleep_until"]]
            diff = quantiles([a - b for a, b in zip(ours, base, strict=True)])
            target = case.startswith("uniform") and stat == "p99"
            met = diff["median"] <= 2.0 if target else None
            out["rows"].append(
                row(
                    f"{case}: lateness {stat}, {n:,} windows vs sleep_until tasks",
                    quantiles(ours)["median"],
                    "ms",
                    baseline="trio.sleep_until",
                    base=quantiles(base)["median"],
                    stats=diff,
                    ratio_label="ours - baseline (ms)",
                    target="<= +2 ms" if target else "",
                    met=met,
                    gap="" if met is not False else f"{diff['median'] - 2.0:.1f} ms over",
                )
            )
    return out


# ----------------------------------------------------------------- 4


def item4(ctx: Context) -> dict[str, Any]:
    small = ctx.tmp / "replay-small.jsonl"
    full = ctx.tmp / "replay-full.jsonl"
    ping_local.generate(small, *ctx.params.replay_small)
    script = str(BENCH / "ping_local.py")
    rates: dict[str, list[float]] = {"cli": [], "naive": []}
    events = ctx.params.replay_small[0]

    def cli(path: Path) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        summary = harness.run_json(ping_local.cli_replay_args(path), timeout=3600)
        return time.perf_counter() - t0, summary

    def cli_full(path: Path) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        summary = harness.run_json(ping_local.cli_replay_args(path), timeout=FULL_REPLAY_TIMEOUT)
        return time.perf_counter() - t0, summary

    def one(r: int) -> None:
        order = ["cli", "naive"] if r % 2 == 0 else ["naive", "cli"]
        for what in order:
            if what == "cli":
                seconds, _ = cli(small)
            else:
                t0 = time.perf_counter()
                harness.run_json([script, "naive-replay", str(small)], timeout=3600)
                seconds = time.perf_counter() - t0
            rates[what].append(events / seconds)

    n = run_rounds(ctx, 4, one)
    log(f"item 4: generating {ctx.params.replay_full[0]:,} events")
    ping_local.generate(full, *ctx.params.replay_full)
    log("item 4: CLI replay of the full log")
    t0 = time.perf_counter()
    try:
        seconds, summary = cli_full(full)
        bound = ""
    except subprocess.TimeoutExpired:
        seconds, summary = time.perf_counter() - t0, {}
        bound = f"; stopped after {seconds:.0f} s: the rate is an upper bound"
    full_rate = ctx.params.replay_full[0] / seconds
    stats = ratio(rates["cli"], rates["naive"])
    rows = [
        row(
            f"CLI replay, {ctx.params.replay_full[0]:,} events over "
            f"{ctx.params.replay_full[1]:,} keys (one run, process start included{bound})",
            full_rate,
            "events/s",
            target=">= 20,000 events/s",
            met=full_rate >= 20_000,
            gap="" if full_rate >= 20_000 else f"{20_000 / full_rate:.2f}x short",
            n=1,
        ),
        row(
            f"CLI replay vs naive MockClock replay, {events:,} events over "
            f"{ctx.params.replay_small[1]:,} keys (each a process)",
            quantiles(rates["cli"])["median"],
            "events/s",
            baseline="naive replay",
            base=quantiles(rates["naive"])["median"],
            stats=stats,
            ratio_label="speedup (ours / baseline)",
        ),
    ]
    return {
        "title": "4. Replay (CLI)",
        "rows": rows,
        "rounds": n,
        "full": {"seconds": seconds, "summary": summary},
        "rates": rates,
    }


# ----------------------------------------------------------------- 5


def item5(ctx: Context) -> dict[str, Any]:
    rows = []
    counts = {}
    targets = {
        "open": (2, "<= 2"),
        "owner-ping": (1, "1"),
        "other-ping": (2, "<= 2"),
    }
    for delivery in ("at-most-once", "at-least-once"):
        result = trio.run(ping_shared.count_requests, ctx.url, delivery, ctx.params.count_keys)
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
    return {"title": "5. NATS requests per operation", "rows": rows, "counts": counts}


# ----------------------------------------------------------------- 6


def item6(ctx: Context, ops: list[tuple[str, int]]) -> dict[str, Any]:
    if not ops:
        ops = [("get", 0), ("put", 300)]
    pings = ctx.params.latency_pings
    variants = ["ours", "raw", "store"]
    got: dict[str, list[dict[str, float]]] = {name: [] for name in variants}

    def one(r: int) -> None:
        k = r % len(variants)
        for what in variants[k:] + variants[:k]:
            if what == "ours":
                lat = trio.run(ping_shared.ping_latencies, ctx.url, pings)
            elif what == "store":
                lat = trio.run(ping_shared.store_latencies, ctx.url, ops, pings)
            else:
                lat = ping_shared.raw_latencies(ctx.url, ops, pings)
            got[what].append(ping_shared.summarize(lat))

    n = run_rounds(ctx, 6, one)
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
    return {"title": "6. Bridge overhead", "rows": rows, "rounds": n, "ops": ops}


# ----------------------------------------------------------------- 7


class DbosProcess:
    """``bench/dbos_worker.py`` (DBOS on SQLite) as a child process."""

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH / "baselines" / "dbos_worker.py"), str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"DBOS worker: {ready!r}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the DBOS worker exited")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, command: str, count: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command} {count}\n")
        self.proc.stdin.flush()
        return float(self._read()["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _procs(ctx: Context) -> dict[str, Any]:
    """``procs`` processes, 25 tasks each, pinging one key from a common start."""
    bucket = f"hot{uuid.uuid4().hex[:10]}"
    start = time.time() + 3.0
    pings = ctx.params.hot_pings // 2
    children = [
        subprocess.Popen(
            [
                sys.executable,
                str(BENCH / "ping_shared.py"),
                "hot-proc",
                ctx.url,
                bucket,
                "25" if ctx.params.rounds >= MIN_ROUNDS else "2",
                str(pings),
                str(start),
                str(ctx.params.hot_cap),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": harness.pythonpath()},
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


def item7(ctx: Context) -> dict[str, Any]:
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
                result = trio.run(ping_shared.hot_key, ctx.url, tasks, pings, None, None, cap)
            got.setdefault(name, []).append(result)

    n = run_rounds(ctx, 7, one)
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
        "title": "7. Hot key",
        "rows": rows,
        "rounds": n,
        "rates": {k: [g["per_s"] for g in v] for k, v in got.items()},
    }


# ----------------------------------------------------------------- 8


def item8(ctx: Context) -> dict[str, Any]:
    import runs

    assert ctx.dbos is not None
    dbos = ctx.dbos
    runs.URL[:] = [ctx.url]
    runs.TIME_CALLS_BUDGET = 1.5
    out: dict[str, Any] = {"title": "8. Deferred runs", "rows": [], "schedule": {}, "heartbeat": {}}
    rounds = ctx.params.rounds

    def enqueue(batch: int) -> Callable[[int], Awaitable[float]]:
        async def dbos_enqueue(r: int) -> float:
            return await trio.to_thread.run_sync(dbos.run, "enqueue", batch)

        return dbos_enqueue

    for kind in ("sqlite", "nats"):
        batch = ctx.params.schedule_batch[kind]
        log(f"item 8: schedule {kind}")
        figures = trio.run(
            runs.bench_schedule,
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
            log(f"item 8: heartbeat {kind} {pending:,} pending")
            h = trio.run(
                runs.bench_heartbeat,
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
    return out


# ----------------------------------------------------------------- main


def start_nats(tmp: Path) -> Any:
    sys.path.insert(0, str(ROOT))
    from tests.nats_server import NatsServer

    server = NatsServer(tmp / "nats-store")
    server.start()
    return server


def run(
    items: list[int],
    params: Params,
    huge: bool = False,
    output: Path | None = None,
    workers: bool = False,
) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": harness.machine(), "items": {}, "rounds": params.rounds}
    t_start = time.monotonic()
    results["seconds"] = 0.0
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trio-debounce-bench6-") as tmp_name:
        tmp = Path(tmp_name)
        ctx = Context(
            params=params,
            tmp=tmp,
            huge=huge,
            workers=workers,
            out_dir=None if output is None else output.parent,
        )
        server = None
        try:
            if any(i >= 5 for i in items):
                server = start_nats(tmp)
                ctx.url = server.url
            ops: list[tuple[str, int]] = []
            for item in items:
                if item in (7, 8) and ctx.dbos is None:
                    # Started only now: its queue threads poll SQLite in the background.
                    (tmp / "dbos").mkdir()
                    ctx.dbos = DbosProcess(tmp / "dbos")
                log(f"item {item} (load {load()})")
                t0 = time.monotonic()
                load0 = load()
                result = item6(ctx, ops) if item == 6 else globals()[f"item{item}"](ctx)
                if item == 5:
                    ops = [tuple(x) for x in result["counts"]["at-least-once"]["owner-ping-ops"]]
                result["seconds"] = round(time.monotonic() - t0, 1)
                result["load"] = [load0, load()]
                results["items"][str(item)] = result
                if output is not None:  # what is done survives a later failure
                    results["seconds"] = round(time.monotonic() - t_start, 1)
                    _write(results, output)
        finally:
            if ctx.dbos is not None:
                ctx.dbos.close()
            if server is not None:
                server.stop()
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["seconds"] = round(time.monotonic() - t_start, 1)
    if output is not None:
        _write(results, output)
    return results


def _write(results: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1, default=str) + "\n")


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the finally blocks stop nats-server and the DBOS worker


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The slowest items last: what is done is written after each item.
    parser.add_argument("--items", default="1,3,5,6,7,8,4,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--huge", action="store_true", help="item 2 at 1,000,000 windows too (1,500 with --tiny)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny counts: a smoke run")
    parser.add_argument(
        "--workers",
        action="store_true",
        help="item 1: each sample a pyperf worker process instead of a fresh event loop",
    )
    parser.add_argument("-o", "--output", type=Path, default=OUT / "results.json")
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args()
    params = Params.tiny() if args.tiny else Params.full()
    if not args.tiny:
        params.rounds = args.rounds
    items = [int(x) for x in args.items.split(",")]
    run(items, params, args.huge, args.output, args.workers)
    log(f"results written to {args.output}")
    if not args.no_report:
        import report

        report.write(args.output, args.output.parent)


if __name__ == "__main__":
    main()
