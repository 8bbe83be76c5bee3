"""Before/after: chosen figures of the working tree against an older git revision, in one run.

``python bench/compare.py REV`` (or ``python bench/suite.py --compare REV``) checks REV
out with ``git worktree add --detach`` into a temporary directory, then measures each
chosen figure in paired rounds: in each round one worker process per side (this
script, ``--worker``), the working tree's and REV's, in an order that alternates from
round to round (after, before; before, after; ...). The worker's measuring code is the
working tree's ``bench/`` for both sides; only the ``trio_debounce`` it imports differs,
chosen by ``PYTHONPATH`` (the worker reports the file it imported, and the run stops if
it is not the side's). The figures:

* ``ping-local``: a coalescing ``debounce_nowait`` into one open window (µs per ping).
* ``ping-keyed``: the same into 1,000 open windows pinged in turn, ``max_delay`` set.
* ``scale``: the coalescing ping on random keys among 100,000 open windows, over the
  same at 10 windows (the growth; one ratio per worker process).
* ``owner-ping``: an owner ping's latency through the NATS backend, p50 and p99, on a
  loopback ``nats-server`` started once for both sides.
* ``hot-key``: acknowledged pings/s of 100 tasks pinging one key through NATS.

Each figure is reported with both sides' medians and interquartile ranges, the median
(and IQR) of the per-round ratio after/before, and a verdict: "no regression" when
after's median is not more than 5 % worse than before's, or when the two sides'
interquartile ranges overlap. ``--tiny`` runs tiny counts (a smoke run: it measures
nothing). The machine (CPU model from ``lscpu``, cores, Python) and the load average
head the report; ``-o`` writes it as JSON as well; ``--strict`` exits with status 1
when a figure regressed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

import _harness  # noqa: E402
from _harness import load, log, quantiles, ratio  # noqa: E402

#: The default items, in run order.
ITEMS = ("ping-local", "ping-keyed", "scale", "owner-ping", "hot-key")
#: After's median may be this much worse than before's and still be no regression.
TOLERANCE = 0.05


@dataclass
class Counts:
    rounds: int = 15
    ping_loops: int = 50_000
    keyed_loops: int = 100_000
    scale_sizes: tuple[int, int] = (10, 100_000)
    scale_loops: int = 50_000
    latency_pings: int = 200
    hot_tasks: int = 100
    hot_pings: int = 1_000
    hot_cap: float = 3.0

    @classmethod
    def tiny(cls) -> Counts:
        return cls(
            rounds=2,
            ping_loops=200,
            keyed_loops=2_000,
            scale_sizes=(10, 1_200),
            scale_loops=100,
            latency_pings=5,
            hot_tasks=3,
            hot_pings=6,
        )


@dataclass(frozen=True)
class Figure:
    """One compared figure: its key in the worker's JSON, its label and unit, the
    factor from the worker's value to the unit, and whether higher is better."""

    key: str
    label: str
    unit: str
    scale: float = 1.0
    higher_is_better: bool = False


FIGURES: dict[str, list[Figure]] = {
    "ping-local": [Figure("ping", "coalescing ping, one open window", "µs", 1e6)],
    "ping-keyed": [Figure("ping", "keyed ping, 1,000 open windows in turn", "ns", 1e9)],
    "scale": [
        Figure("growth", "ping on random keys, {large:,} windows / {small:,} windows", "x"),
        Figure("ping_large", "ping on random keys among {large:,} windows", "µs", 1e6),
    ],
    "owner-ping": [
        Figure("p50", "owner ping over NATS, p50", "ms", 1e3),
        Figure("p99", "owner ping over NATS, p99", "ms", 1e3),
    ],
    "hot-key": [Figure("per_s", "hot key, {tasks} tasks: acknowledged pings/s", "/s", 1.0, True)],
}


# ----------------------------------------------------------------- worker side


def _worker(item: str, args: list[str]) -> dict[str, Any]:
    """Measure ``item`` once in this process (imports ``trio_debounce`` from
    ``PYTHONPATH``): a dict of figures in seconds (or a ratio, or a rate)."""
    import trio

    if item == "ping-local":
        import ping_local

        loops = int(args[0])
        ping_local.ping_nowait(max(1, loops // 10))  # warm-up, not kept
        return {"ping": ping_local.ping_nowait(loops) / loops}
    if item == "ping-keyed":
        import ping_local

        loops = int(args[0])
        ping_local.ping_keyed(ping_local.KEYED_WINDOWS)  # warm-up, not kept
        return {"ping": ping_local.ping_keyed(loops) / loops}
    if item == "scale":
        import ping_local

        sizes = [int(x) for x in args[0].split(",")]
        loops, first = int(args[1]), int(args[2])

        def done(out: dict[str, Any]) -> None:
            small, large = (out["ping"][str(s)][0] for s in sizes)
            result = {"growth": large / small, "ping_large": large, "ping_small": small}
            print(json.dumps({**result, **_imported()}), flush=True)
            os._exit(0)  # tearing 100,000 windows down would take longer than building them

        ping_local.scale_process(sizes, loops, 1, first, done, floor=False)
        raise AssertionError("scale_process returned")
    if item == "owner-ping":
        import ping_shared

        url, pings = args[0], int(args[1])
        return ping_shared.summarize(trio.run(ping_shared.ping_latencies, url, pings))
    if item == "hot-key":
        import ping_shared

        url, tasks, pings, cap = args[0], int(args[1]), int(args[2]), float(args[3])
        got = trio.run(ping_shared.hot_key, url, tasks, max(pings, 2 * tasks), None, None, cap)
        return {"per_s": got["per_s"], "errors": got["errors"], "unstored": got["unstored"]}
    raise SystemExit(f"unknown item {item!r}")


def _imported() -> dict[str, Any]:
    import trio_debounce

    return {"imported": str(Path(trio_debounce.__file__).resolve().parent.parent)}


# ----------------------------------------------------------------- driver side


def worker_args(item: str, counts: Counts, url: str, r: int) -> list[str]:
    if item == "ping-local":
        return [str(counts.ping_loops)]
    if item == "ping-keyed":
        return [str(counts.keyed_loops)]
    if item == "scale":
        # The round number seeds the key draws: both sides of a round draw the same keys.
        return [",".join(map(str, counts.scale_sizes)), str(counts.scale_loops), str(r)]
    if item == "owner-ping":
        return [url, str(counts.latency_pings)]
    if item == "hot-key":
        return [url, str(counts.hot_tasks), str(counts.hot_pings), str(counts.hot_cap)]
    raise ValueError(f"unknown item {item!r}; known: {', '.join(FIGURES)}")


def checkout(rev: str, into: Path) -> str:
    """``git worktree add --detach`` of ``rev`` into ``into``; returns its commit."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), commit],
        check=True,
        capture_output=True,
        text=True,
    )
    return commit


def remove_checkout(into: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(into)],
        check=False,
        capture_output=True,
    )


def verdict(before: dict[str, float], after: dict[str, float], higher: bool) -> tuple[bool, str]:
    """No regression: after's median at most :data:`TOLERANCE` worse than before's,
    or the interquartile ranges overlap."""
    b, a = before["median"], after["median"]
    within = a >= b * (1 - TOLERANCE) if higher else a <= b * (1 + TOLERANCE)
    overlap = after["q1"] <= before["q3"] and before["q1"] <= after["q3"]
    if within:
        return True, "no regression (median within 5 %)"
    if overlap:
        return True, "no regression (IQRs overlap)"
    worse = b / a if higher else a / b
    return False, f"REGRESSION ({worse:.2f}x worse, IQRs apart)"


def compare(
    rev: str, items: Sequence[str], counts: Counts, output: Path | None = None
) -> dict[str, Any]:
    for item in items:
        if item not in FIGURES:
            raise SystemExit(f"unknown item {item!r}; known: {', '.join(FIGURES)}")
    results: dict[str, Any] = {
        "machine": _harness.machine(),
        "rev": rev,
        "rounds": counts.rounds,
        "items": {},
    }
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trio-debounce-compare-") as tmp_name:
        tmp = Path(tmp_name)
        before_root = tmp / "before"
        results["commit"] = checkout(rev, before_root)
        server = None
        try:
            url = ""
            if {"owner-ping", "hot-key"} & set(items):
                from_tests = str(ROOT)
                sys.path.insert(0, from_tests)
                from tests.harness.nats_server import NatsServer

                server = NatsServer(tmp / "nats-store")
                server.start()
                url = server.url
            sides = {"after": ROOT, "before": before_root}
            for item in items:
                log(f"compare {item} (load {load()})")
                got: dict[str, list[dict[str, Any]]] = {"after": [], "before": []}
                for r in range(counts.rounds):
                    order = ["after", "before"] if r % 2 == 0 else ["before", "after"]
                    for side in order:
                        args = [str(BENCH / "compare.py"), "--worker", item]
                        args += worker_args(item, counts, url, r)
                        out = _harness.run_json(args, timeout=3600, root=sides[side])
                        if Path(out["imported"]) != sides[side].resolve():
                            raise RuntimeError(
                                f"the {side} worker imported trio_debounce from "
                                f"{out['imported']}, not {sides[side]}"
                            )
                        got[side].append(out)
                results["items"][item] = _summarize(item, got, counts)
                results["items"][item]["load"] = load()
        finally:
            if server is not None:
                server.stop()
            remove_checkout(before_root)
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["seconds"] = round(time.monotonic() - t_start, 1)
    results["no_regression"] = all(
        f["ok"] for item in results["items"].values() for f in item["figures"]
    )
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=1) + "\n")
    return results


def _summarize(item: str, got: dict[str, list[dict[str, Any]]], counts: Counts) -> dict[str, Any]:
    figures = []
    small, large = counts.scale_sizes
    for fig in FIGURES[item]:
        before = [g[fig.key] * fig.scale for g in got["before"]]
        after = [g[fig.key] * fig.scale for g in got["after"]]
        qb, qa = quantiles(before), quantiles(after)
        ok, text = verdict(qb, qa, fig.higher_is_better)
        figures.append(
            {
                "label": fig.label.format(small=small, large=large, tasks=counts.hot_tasks),
                "unit": fig.unit,
                "higher_is_better": fig.higher_is_better,
                "before": qb,
                "after": qa,
                "ratio": ratio(after, before),
                "ok": ok,
                "verdict": text,
                "before_values": before,
                "after_values": after,
            }
        )
    return {"figures": figures}


def _f(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def text_report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"before: {results['rev']} ({results['commit'][:12]}); after: the working tree ({ROOT})",
        f"machine: {m['cpu']}, {m['cores']} cores; {m['implementation']} {m['python']}, "
        f"trio {m['trio']}",
        f"load average (1, 5, 15 min): {m['loadavg_start']} at the start, "
        f"{m.get('loadavg_end')} at the end; {results['rounds']} paired rounds per figure, "
        f"{results.get('seconds', 0):.0f} s",
        "",
        f"{'figure':<58} {'before: median [IQR]':>24} {'after: median [IQR]':>24} "
        f"{'after/before [IQR]':>20}  verdict",
    ]
    for item, data in results["items"].items():
        for fig in data["figures"]:
            b, a, q = fig["before"], fig["after"], fig["ratio"]
            u = fig["unit"]
            lines.append(
                f"{(item + ': ' + fig['label'])[:58]:<58} "
                f"{_f(b['median']) + ' ' + u + ' [' + _f(b['q1']) + '-' + _f(b['q3']) + ']':>24} "
                f"{_f(a['median']) + ' ' + u + ' [' + _f(a['q1']) + '-' + _f(a['q3']) + ']':>24} "
                f"{_f(q['median']) + 'x [' + _f(q['q1']) + '-' + _f(q['q3']) + ']':>20}  "
                f"{fig['verdict']}"
            )
    lines += [
        "",
        "no regression" if results["no_regression"] else "REGRESSION: see the verdicts above",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only",
        default=",".join(ITEMS),
        help=f"comma-separated items (default: all of {', '.join(ITEMS)})",
    )


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the finally blocks stop nats-server and remove the checkout


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        out = _worker(argv[1], argv[2:])
        print(json.dumps({**out, **_imported()}))
        return 0
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the git revision to compare against (before)")
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tiny", action="store_true", help="tiny counts: a smoke run")
    parser.add_argument("-o", "--output", type=Path, default=None, help="also write JSON here")
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a figure regressed"
    )
    args = parser.parse_args(argv)
    counts = Counts.tiny() if args.tiny else Counts(rounds=args.rounds)
    items = [x for x in args.only.split(",") if x]
    results = compare(args.rev, items, counts, args.output)
    print(text_report(results))
    return 1 if args.strict and not results["no_regression"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
