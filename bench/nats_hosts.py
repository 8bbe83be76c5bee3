"""The asyncio hosts of the NATS backend, against raw nats-py (not a test).

Owner-ping latency (``await Coordinator.debounce`` into an open window, the owner's
own process) on a real loopback nats-server, for each host of
``NatsConfig.asyncio_host`` (``thread``: a stdlib loop in a thread of its own;
``trio-asyncio``), against the baseline: raw nats-py ``kv.get`` + ``kv.update`` of one
key on a stdlib asyncio loop. Every sample is a fresh process (the baseline and the
thread host never import trio_asyncio, which patches asyncio process-wide); each round
runs every variant once, in an order rotated from round to round, and each figure is a
ratio to the same round's baseline, summarised over the rounds (median, min, max).

Each worker also reports its CPU time per operation (every thread of the process, the
loop's included) and a hot-key phase: 100 tasks of the process each send 10
acknowledged pings to one key (the baseline: 100 asyncio tasks each making 10
revision-checked read-modify-writes of one key, retrying on conflict), in pings per
second.

Run: ``python bench/nats_hosts.py [--rounds 7] [--pings 400]``; prints a JSON report
and an RST table (for ``docs/nats.rst``) on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("raw", "thread", "trio-asyncio")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


#: The hot-key phase: this many tasks of one process ping one key, each this many times.
HOT_TASKS = 100
HOT_PINGS_PER_TASK = 10


def _cpu() -> float:
    """CPU seconds of this process so far, every thread (the loop's thread included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _figures(latencies: list[float]) -> dict[str, float]:
    return {"p50": _quantile(latencies, 0.5), "p99": _quantile(latencies, 0.99)}


# ------------------------------------------------------------------ workers


def worker_raw(url: str, pings: int, warm: int) -> dict[str, Any]:
    """Raw nats-py on a stdlib loop: one kv.get + one kv.update per ping."""
    import nats
    import nats.js.errors

    async def main() -> dict[str, Any]:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            bucket = f"raw{uuid.uuid4().hex[:10]}"
            kv = await js.create_key_value(bucket=bucket, history=1)
            rev = await kv.create("w.raw", b"x" * 200)
            value = b"y" * 200
            out: list[float] = []
            for i in range(warm + pings):
                if i == warm:
                    cpu0 = _cpu()
                t0 = time.perf_counter()
                entry = await kv.get("w.raw")
                rev = await kv.update("w.raw", value, last=entry.revision or rev)
                if i >= warm:
                    out.append(time.perf_counter() - t0)
            cpu_per_op = (_cpu() - cpu0) / pings

            # Hot key: HOT_TASKS tasks each make HOT_PINGS_PER_TASK acknowledged
            # read-modify-writes of one key (get, then update on its revision; a
            # conflict retries): the work a debounce ping on a shared key does.
            await kv.create("w.hot", b"0")

            async def one_task() -> None:
                done = 0
                while done < HOT_PINGS_PER_TASK:
                    entry = await kv.get("w.hot")
                    try:
                        await kv.update("w.hot", value, last=entry.revision)
                    except nats.js.errors.KeyWrongLastSequenceError:
                        continue
                    done += 1

            cpu0, t0 = _cpu(), time.perf_counter()
            await asyncio.gather(*(one_task() for _ in range(HOT_TASKS)))
            hot_seconds = time.perf_counter() - t0
            hot_cpu = (_cpu() - cpu0) / (HOT_TASKS * HOT_PINGS_PER_TASK)
            await js.delete_key_value(bucket)
            return {
                "latencies": out,
                "loop": type(asyncio.get_running_loop()).__name__,
                "cpu_per_op": cpu_per_op,
                "hot_per_second": HOT_TASKS * HOT_PINGS_PER_TASK / hot_seconds,
                "hot_cpu_per_op": hot_cpu,
            }
        finally:
            await nc.close()

    return asyncio.run(main())


def worker_host(host: str, url: str, pings: int, warm: int) -> dict[str, Any]:
    """Owner pings through the NATS backend on ``host``, on a fresh ``trio.run``."""
    import trio

    import trio_debounce
    import trio_debounce.nats._store as nats_store
    from trio_debounce.nats import NatsConfig, open_nats_backend

    crossings = 0
    cross = nats_store.cross  # type: ignore[attr-defined]

    async def counted(*args: Any) -> Any:
        nonlocal crossings
        crossings += 1
        return await cross(*args)

    nats_store.cross = counted  # type: ignore[attr-defined,assignment]

    async def noop(fire: trio_debounce.Fire) -> None:
        pass

    async def main() -> dict[str, Any]:
        config = NatsConfig(
            servers=(url,),
            bucket=f"b{uuid.uuid4().hex[:12]}",
            op_timeout=5.0,
            asyncio_host=host,
        )
        async with (
            open_nats_backend(config) as backend,
            trio_debounce.open_coordinator(
                handlers={"wf": noop}, backend=backend, on_exit="cancel"
            ) as coordinator,
        ):
            store: Any = backend._view.store  # type: ignore[attr-defined]
            while not hasattr(store, "_host"):
                store = store._store
            loop = type(store._host.loop).__name__
            out: list[float] = []
            for i in range(warm + 1 + pings):  # the first opens the window
                if i == warm + 1:
                    start = crossings
                    cpu0 = _cpu()
                t0 = time.perf_counter()
                await coordinator.debounce("wf", "k", {"n": i}, delay=3600.0)
                if i > warm:
                    out.append(time.perf_counter() - t0)
            cpu_per_op = (_cpu() - cpu0) / pings
            # store calls per ping (the heartbeat's few included)
            per_ping = (crossings - start) / pings

            # Hot key: HOT_TASKS tasks each send HOT_PINGS_PER_TASK acknowledged
            # pings to one key (the owner's group commit may merge them).
            await coordinator.debounce("wf", "hot", 0, delay=3600.0)

            async def one_task() -> None:
                for n in range(HOT_PINGS_PER_TASK):
                    await coordinator.debounce("wf", "hot", n, delay=3600.0)

            cpu0, t0 = _cpu(), time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(HOT_TASKS):
                    nursery.start_soon(one_task)
            hot_seconds = time.perf_counter() - t0
            hot_cpu = (_cpu() - cpu0) / (HOT_TASKS * HOT_PINGS_PER_TASK)
        return {
            "latencies": out,
            "loop": loop,
            "crossings_per_ping": per_ping,
            "cpu_per_op": cpu_per_op,
            "hot_per_second": HOT_TASKS * HOT_PINGS_PER_TASK / hot_seconds,
            "hot_cpu_per_op": hot_cpu,
        }

    result: dict[str, Any] = trio.run(main)
    result["trio_asyncio_imported"] = "trio_asyncio" in sys.modules
    return result


def worker(args: argparse.Namespace) -> None:
    if args.variant == "raw":
        result = worker_raw(args.url, args.pings, args.warm)
        result["trio_asyncio_imported"] = "trio_asyncio" in sys.modules
    else:
        result = worker_host(args.variant, args.url, args.pings, args.warm)
    print(json.dumps(result))


# ------------------------------------------------------------------ driver


def _run_worker(variant: str, url: str, pings: int, warm: int) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, __file__, "worker", variant, url, str(pings), str(warm)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def drive(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.harness.nats_server import NatsServer

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp) / "js")
        server.start()
        try:
            rounds: list[dict[str, Any]] = []
            for r in range(args.rounds + 1):  # round 0 warms the disk and caches
                k = r % len(VARIANTS)
                order = list(VARIANTS[k:] + VARIANTS[:k])
                samples = {v: _run_worker(v, server.url, args.pings, args.warm) for v in order}
                if r == 0:
                    continue
                rounds.append(samples)
                print(
                    f"round {r}: "
                    + ", ".join(
                        f"{v} p50 {1e6 * _figures(s['latencies'])['p50']:.0f} us"
                        for v, s in samples.items()
                    ),
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            server.stop()
    load_end = os.getloadavg()

    report: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
        "rounds": args.rounds,
        "pings": args.pings,
        "variants": {},
    }
    for v in VARIANTS:
        per_ping = [s[v].get("crossings_per_ping", 2.0) for s in rounds]
        figs = [_figures(s[v]["latencies"]) for s in rounds]
        base = [_figures(s["raw"]["latencies"]) for s in rounds]
        report["variants"][v] = {
            "loop": rounds[0][v]["loop"],
            "store_calls_per_ping": statistics.median(per_ping),
            "trio_asyncio_imported": rounds[0][v]["trio_asyncio_imported"],
            "p50_us": _summary([1e6 * f["p50"] for f in figs]),
            "p99_us": _summary([1e6 * f["p99"] for f in figs]),
            "p50_ratio": _summary([f["p50"] / b["p50"] for f, b in zip(figs, base, strict=True)]),
            "p99_ratio": _summary([f["p99"] / b["p99"] for f, b in zip(figs, base, strict=True)]),
            "cpu_us_per_op": _summary([1e6 * s[v]["cpu_per_op"] for s in rounds]),
            "cpu_ratio": _summary([s[v]["cpu_per_op"] / s["raw"]["cpu_per_op"] for s in rounds]),
            "hot_per_second": _summary([s[v]["hot_per_second"] for s in rounds]),
            "hot_ratio": _summary(
                [s[v]["hot_per_second"] / s["raw"]["hot_per_second"] for s in rounds]
            ),
            "hot_cpu_us_per_op": _summary([1e6 * s[v]["hot_cpu_per_op"] for s in rounds]),
        }
    ta_vs_thread = [
        _figures(s["trio-asyncio"]["latencies"])["p50"] / _figures(s["thread"]["latencies"])["p50"]
        for s in rounds
    ]
    report["trio_asyncio_p50_over_thread_p50"] = _summary(ta_vs_thread)
    report["trio_asyncio_hot_over_thread_hot"] = _summary(
        [s["trio-asyncio"]["hot_per_second"] / s["thread"]["hot_per_second"] for s in rounds]
    )
    report["trio_asyncio_cpu_over_thread_cpu"] = _summary(
        [s["trio-asyncio"]["cpu_per_op"] / s["thread"]["cpu_per_op"] for s in rounds]
    )
    print(json.dumps(report, indent=2))
    rst = _rst(report)
    print(rst)
    if args.rst is not None:
        Path(args.rst).write_text(rst + "\n")


def _versions() -> str:
    import importlib.metadata as metadata

    names = ("trio", "nats-py", "trio-asyncio")
    return ", ".join(f"{name} {metadata.version(name)}" for name in names)


def _rst(report: dict[str, Any]) -> str:
    """The report as reStructuredText, included by docs/nats.rst and
    docs/benchmarks/index.rst (``docs/benchmarks/hosts.inc``)."""
    load0, load1 = report["loadavg_start"][0], report["loadavg_end"][0]
    lines = [
        f"Measured by ``python bench/nats_hosts.py --rounds {report['rounds']} --pings "
        f"{report['pings']}`` with Python {report['python']}, {_versions()}, on "
        f"{report['cpu']} ({report['cores']} cores); load average {load0} (1 min) at "
        f"the start, {load1} at the end. Each figure is the median over the rounds; "
        "each ratio is taken within a round, to that round's raw nats-py baseline "
        "(median, and min-max over the rounds). *calls*: store calls per ping (the raw "
        "baseline makes two requests); *CPU*: the process's CPU time per ping, every "
        "thread included; *hot key*: acknowledged pings per second, 100 tasks of one "
        "process pinging one key 10 times each (the baseline: 100 asyncio tasks each "
        "making 10 revision-checked read-modify-writes of one key, retrying on "
        "conflict, which the coordinator's group commit does not have to do).",
        "",
        _table(report),
        "",
        "trio-asyncio's figures over the thread host's, per round (median, min-max): "
        f"owner-ping p50 {_spread(report['trio_asyncio_p50_over_thread_p50'])}, CPU per "
        f"ping {_spread(report['trio_asyncio_cpu_over_thread_cpu'])}, hot-key pings/s "
        f"{_spread(report['trio_asyncio_hot_over_thread_hot'])}.",
    ]
    return "\n".join(lines)


def _spread(summary: dict[str, float]) -> str:
    return f"{summary['median']:.2f} ({summary['min']:.2f}-{summary['max']:.2f})"


def _table(report: dict[str, Any]) -> str:
    rows = [
        (
            "variant",
            "loop",
            "calls",
            "p50 (us)",
            "p50 / raw",
            "p99 (us)",
            "p99 / raw",
            "CPU (us/op)",
            "CPU / raw",
            "hot key (/s)",
            "hot / raw",
        )
    ]
    for v, f in report["variants"].items():
        name = {"raw": "raw nats-py get+put", "thread": "thread host"}.get(v, "trio-asyncio host")
        rows.append(
            (
                name,
                f["loop"],
                f"{f['store_calls_per_ping']:.2f}",
                f"{f['p50_us']['median']:.0f}",
                _spread(f["p50_ratio"]),
                f"{f['p99_us']['median']:.0f}",
                _spread(f["p99_ratio"]),
                f"{f['cpu_us_per_op']['median']:.0f}",
                _spread(f["cpu_ratio"]),
                f"{f['hot_per_second']['median']:.0f}",
                _spread(f["hot_ratio"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rule = " ".join("=" * w for w in widths)
    lines = [rule, " ".join(c.ljust(w) for c, w in zip(rows[0], widths, strict=True)), rule]
    lines += [" ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows[1:]]
    lines.append(rule)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    w.add_argument("variant", choices=VARIANTS)
    w.add_argument("url")
    w.add_argument("pings", type=int)
    w.add_argument("warm", type=int)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pings", type=int, default=400)
    parser.add_argument("--warm", type=int, default=50)
    parser.add_argument(
        "--rst", help="also write the report's RST here (docs/benchmarks/hosts.inc)"
    )
    args = parser.parse_args()
    if args.command == "worker":
        worker(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
