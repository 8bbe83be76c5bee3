"""The pairing harness of the issue-6 benchmark suite (``bench/suite.py``).

Every figure is the median of ``rounds`` paired runs: in each round every variant of a
comparison runs once, in an order rotated from round to round (A B, B A, ...), each on a
fresh event loop or in a fresh process, with a FIXED number of operations (no loop-count
calibration: asyncio's ``call_later`` slows as cancelled handles pile up, so a
calibrated count would move the ratio). A ratio is computed per round, between the
variants of that round, and reported as the median with its min, max and quartiles.

Timing of the micro-benchmarks is pyperf's: each sample is one pyperf worker process
(``script --worker --worker-task=K --loops=N --values=1``), which runs a warm-up, then
the benchmark's fixed ``N`` loops, and appends a pyperf ``Run`` (with its metadata:
load average, CPU, Python) to a JSON suite; the rotation of the workers is ours.
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
from collections.abc import Callable, Sequence
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
