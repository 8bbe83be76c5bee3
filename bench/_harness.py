"""The pairing harness of the benchmark suite (``bench/suite.py``) and of the before/after
comparison (``bench/compare.py``).

Every figure is the median of ``rounds`` paired runs: in each round every variant of a
comparison runs once, in an order rotated from round to round (A B, B A, ...), each on a
fresh event loop or in a fresh process, with a FIXED number of operations (no loop-count
calibration: asyncio's ``call_later`` slows as cancelled handles pile up, so a
calibrated count would move the ratio). A ratio is computed per round, between the
variants of that round, and reported as the median with its min, max and quartiles.

Timing of the micro-benchmarks is pyperf's: with ``--workers`` each sample is one
pyperf worker process (``script --worker --worker-task=K --loops=N --values=1``), which
runs a warm-up, then the benchmark's fixed ``N`` loops, and appends a pyperf ``Run``
(with its metadata: load average, CPU, Python) to a JSON suite; the rotation of the
workers is ours. Without it each sample is a fresh event loop in the suite's process.

Also here: the operation counts of every item (:class:`Params`), the context an item
runs in (:class:`Context`), one report line (:func:`row`), the machine a report names
(:func:`machine`) and one timed loop of awaits (:func:`timed_awaits`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyperf

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_model() -> str:
    """The CPU model: ``lscpu``'s "Model name", else ``/proc/cpuinfo``'s, else
    :func:`platform.processor`."""
    try:
        done = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10)
        for line in done.stdout.splitlines():
            if line.strip().startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine a report names: CPU model (``lscpu``), cores, Python, load average."""
    import trio

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "trio": trio.__version__,
        "pyperf": pyperf.__version__,
        "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """median, min, max and the quartiles of ``values``."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
        "n": len(ordered),
    }


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, float]:
    """Per-round ratios ``numerator[i] / denominator[i]``, summarised by :func:`quantiles`."""
    if len(numerator) != len(denominator):
        raise ValueError(f"unpaired samples: {len(numerator)} vs {len(denominator)}")
    return quantiles([a / b for a, b in zip(numerator, denominator, strict=True)])


def rotations(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The run order of each round: ``names`` rotated by one per round."""
    out = []
    for r in range(rounds):
        k = r % len(names)
        out.append(list(names[k:]) + list(names[:k]))
    return out


def paired_pyperf(
    script: Path,
    tasks: dict[str, tuple[int, int]],
    rounds: int,
    *,
    warmups: int = 1,
    timeout: float = 600.0,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Run pyperf benchmarks of ``script`` as alternating worker processes.

    ``tasks`` maps a benchmark name to ``(worker_task, loops)``: its registration index
    in the script's ``pyperf.Runner`` and its fixed loop count. Returns each name's
    seconds per loop in round order, and the metadata of the first run (pyperf's: CPU,
    load average when it ran, ...).
    """
    values: dict[str, list[float]] = {name: [] for name in tasks}
    meta: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trio-debounce-bench-") as tmp:
        for order in rotations(list(tasks), rounds):
            for name in order:
                task, loops = tasks[name]
                out = Path(tmp) / f"{name}.json"
                out.unlink(missing_ok=True)
                cmd = [
                    sys.executable,
                    str(script),
                    "--worker",
                    f"--worker-task={task}",
                    f"--loops={loops}",
                    "--values=1",
                    f"--warmups={warmups}",
                    "--quiet",
                    f"--output={out}",
                ]
                subprocess.run(
                    cmd,
                    check=True,
                    timeout=timeout,
                    stdout=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONPATH": pythonpath()},
                )
                bench = pyperf.Benchmark.load(str(out))
                if bench.get_name() != name:
                    raise RuntimeError(f"worker task {task} ran {bench.get_name()!r}, not {name!r}")
                values[name].extend(bench.get_values())
                if not meta:
                    meta = {
                        k: v
                        for k, v in bench.get_metadata().items()
                        if k in ("cpu_model_name", "cpu_count", "python_version", "load_avg_1min")
                    }
    return values, meta


def paired_timefuncs(
    funcs: dict[str, tuple[Callable[[int], float], int]],
    rounds: int,
    output: Path | None = None,
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """pyperf time functions (``func(loops) -> seconds``, each running its own fresh
    event loop), each with its fixed ``loops``, called in this process in rotated
    rounds after one warm-up round. Returns each name's seconds per loop in round
    order, and pyperf's metadata of this process; ``output``: the samples as a pyperf
    JSON suite (``python -m pyperf stats FILE``)."""
    per_loop: dict[str, list[float]] = {name: [] for name in funcs}
    orders = rotations(list(funcs), rounds + 1)
    for r, order in enumerate(orders):
        for name in order:
            func, loops = funcs[name]
            seconds = func(loops)
            if r > 0:
                per_loop[name].append(seconds / loops)
    from pyperf._collect_metadata import collect_metadata

    metadata: dict[str, Any] = collect_metadata()
    if output is not None:
        benches = []
        for name, values in per_loop.items():
            meta = {"name": name, "loops": funcs[name][1], "unit": "second"}
            runs = [pyperf.Run([v], metadata=meta, collect_metadata=False) for v in values]
            benches.append(pyperf.Benchmark(runs))
        pyperf.BenchmarkSuite(benches).dump(str(output), replace=True)
    keep = ("cpu_model_name", "cpu_count", "python_version", "load_avg_1min")
    return per_loop, {k: v for k, v in metadata.items() if k in keep}


def paired_inprocess(
    variants: dict[str, Callable[[int], Any]], rounds: int, *, warmup: bool = True
) -> dict[str, list[Any]]:
    """Call each variant (``variant(round_index)``, which runs its own fresh event loop
    and returns its figure) once per round, in rotated order; a warm-up round first,
    not kept, when ``warmup``."""
    out: dict[str, list[Any]] = {name: [] for name in variants}
    orders = rotations(list(variants), rounds + int(warmup))
    for r, order in enumerate(orders):
        for name in order:
            result = variants[name](r)
            if r >= int(warmup):
                out[name].append(result)
    return out


def pythonpath(root: Path = ROOT) -> str:
    """``PYTHONPATH`` for a worker process: ``root`` (the tree whose ``trio_debounce``
    it imports) first."""
    parts = [str(root)]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def run_json(args: Sequence[str], timeout: float = 600.0, root: Path = ROOT) -> Any:
    """Run ``python args...`` (a bench helper that prints one JSON document) with
    ``root``'s ``trio_debounce`` first on its path, and parse its output."""
    done = subprocess.run(
        [sys.executable, *args],
        check=True,
        timeout=timeout,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath(root)},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


async def timed_awaits(ping: Callable[[], Awaitable[Any]], pings: int, warm: int) -> list[float]:
    """Seconds of each of ``pings`` awaits of ``ping()``, after ``warm`` untimed ones.
    Loop-agnostic: it only awaits ``ping``, so it runs under Trio or plain asyncio."""
    for _ in range(warm):
        await ping()
    out = []
    for _ in range(pings):
        t0 = time.perf_counter()
        await ping()
        out.append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------- the suite's items


@dataclass
class Params:
    """Operation counts: ``full()`` for the report, ``tiny()`` for the smoke test."""

    rounds: int = 15
    #: ping-local: pings (windows, for the open-window pair) per sample, by variant.
    ping_loops: dict[str, int] = field(default_factory=dict)
    #: ping-keyed, flow: pings per sample (a multiple of 1,000 windows).
    keyed_loops: int = 100_000
    #: flow: pings (each a fire) of the hot key per sample, and tasks of its baseline.
    flow_hot_fires: int = 20_000
    scale_sizes: tuple[int, ...] = (10, 1_000, 100_000)
    #: The size ``--huge`` adds to the scale item.
    huge_size: int = 1_000_000
    scale_loops: int = 50_000
    #: The scale item's windows (and tasks) processes; the ping rounds are split among them.
    scale_procs: int = 3
    fire_n: int = 10_000
    replay_small: tuple[int, int] = (10_000, 1_000)
    replay_full: tuple[int, int] = (1_000_000, 100_000)
    #: replay: passes over the reference log per sample.
    reference_loops: int = 3
    count_keys: int = 10
    latency_pings: int = 200
    hot_tasks: tuple[int, ...] = (1, 10, 100, 1_000)
    #: Pings per hot-key round (at least 20,000: the target is measured on such rounds).
    hot_pings: int = 20_000
    hot_cap: float = 3.0
    procs: int = 4
    #: Tasks per process of the hot key's multi-process case.
    proc_tasks: int = 25
    dbos_pings: int = 100
    schedule_batch: dict[str, int] = field(
        default_factory=lambda: {"memory": 100, "sqlite": 50, "nats": 100}
    )
    pending: dict[str, int] = field(default_factory=lambda: {"sqlite": 100_000, "nats": 10_000})
    heartbeat_intervals: int = 3
    #: runs: persisted runs due at one instant, per fire figure.
    fire_runs: int = 1_000

    @classmethod
    def full(cls) -> Params:
        return cls(
            ping_loops={
                "ping-nowait": 50_000,
                "asyncio-call-later": 50_000,
                "throttlebounce": 50_000,
                "naive-trio": 2_000,
                "ping-async": 20_000,
                "checkpoint": 20_000,
                "shared-ping-memory": 5_000,
                "open-window": 10_000,
                "spawn-sleeper": 10_000,
            }
        )

    @classmethod
    def tiny(cls) -> Params:
        return cls(
            rounds=2,
            ping_loops=dict.fromkeys(Params.full().ping_loops, 20),
            keyed_loops=2_000,
            flow_hot_fires=20,
            scale_sizes=(10, 1_000, 1_200),
            huge_size=1_500,
            scale_loops=100,
            scale_procs=1,
            fire_n=50,
            replay_small=(200, 20),
            replay_full=(400, 40),
            reference_loops=1,
            count_keys=2,
            latency_pings=5,
            hot_tasks=(1, 3),
            hot_pings=6,
            procs=2,
            proc_tasks=2,
            dbos_pings=3,
            schedule_batch={"memory": 3, "sqlite": 3, "nats": 3},
            pending={"sqlite": 1_100, "nats": 1_100},
            heartbeat_intervals=1,
            fire_runs=20,
        )


@dataclass
class Context:
    """What an item runs with: the counts, a temporary directory, the loopback
    nats-server's URL, the DBOS baseline process, the suite's flags."""

    params: Params
    tmp: Path
    url: str = ""
    dbos: Any = None
    huge: bool = False
    workers: bool = False
    out_dir: Path | None = None
    #: The owner ping's KV operations, as the nats-requests item saw them.
    owner_ping_ops: list[tuple[str, int]] = field(default_factory=list)


def run_rounds(ctx: Context, item: str, run_round: Callable[[int], Any]) -> int:
    """Call ``run_round(r)`` for each of the ``rounds`` rounds; returns the rounds done."""
    for r in range(ctx.params.rounds):
        run_round(r)
    log(f"{item}: {ctx.params.rounds} rounds done (load {load()})")
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
    """A row for ``base / ours`` (seconds per operation, by round), against an
    optional ``>= target`` speedup."""
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


def cost_row(
    name: str,
    ours: list[float],
    base: list[float],
    baseline: str,
    *,
    target: float | None = None,
    scale: float = 1e6,
    unit: str = "µs",
    label: str = "ours / baseline",
) -> dict[str, Any]:
    """A row for ``ours / base`` (seconds per operation, by round), against an
    optional ``<= target`` cost ratio."""
    stats = ratio(ours, base)
    met = None if target is None else stats["median"] <= target
    gap = ""
    if met is False and target is not None:
        gap = f"{stats['median'] / target:.2f}x over"
    return row(
        name,
        quantiles(ours)["median"] * scale,
        unit,
        baseline=baseline,
        base=quantiles(base)["median"] * scale,
        stats=stats,
        ratio_label=label,
        target="" if target is None else f"<= {target:g}x",
        met=met,
        gap=gap,
    )


def timed_in_rounds(
    ctx: Context,
    script: Path,
    benches: dict[str, Callable[[int], float]],
    loops: dict[str, int],
    pyperf_json: str,
) -> dict[str, list[float]]:
    """Seconds per loop of each benchmark of ``loops``, by round: pyperf worker
    processes of ``script`` (whose pyperf runner registers ``benches`` in order) with
    ``--workers``, else fresh event loops in this process (samples saved as the pyperf
    suite ``pyperf_json`` beside the results)."""
    if ctx.workers:
        index = {name: i for i, name in enumerate(benches)}
        tasks = {name: (index[name], loops[name]) for name in loops}
        values, _ = paired_pyperf(script, tasks, ctx.params.rounds, warmups=1)
        return values
    values, _ = paired_timefuncs(
        {name: (benches[name], loops[name]) for name in loops},
        ctx.params.rounds,
        (ctx.out_dir or ctx.tmp) / pyperf_json,
    )
    return values
