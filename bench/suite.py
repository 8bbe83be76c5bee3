"""The benchmark suite: every item against its baseline, measured in the same run, and the report.

``nox -s bench`` runs it (or ``python bench/suite.py``); it writes
``docs/benchmarks/results.json``, then ``bench/report.py`` turns that into
``docs/benchmarks/index.rst`` and its figures. Options: ``--only ping-local,replay``
runs some items only (by name, see :data:`ITEMS`); ``--huge`` adds the scale item's
1,000,000-window point (minutes, GBs); ``--rounds N`` (default 15) paired rounds per
figure; ``--tiny`` runs every benchmark with tiny counts (the smoke test's mode: checks
that it runs, measures nothing); ``--workers`` takes each ping-local, ping-keyed and flow
sample in a pyperf worker process; ``--compare REV`` measures the before/after figures
against git revision REV instead (``bench/compare.py``; ``--only`` then names its
items).

Pairing (see ``bench/_harness.py``): every figure is the median of ``--rounds`` rounds
(15 by default; no item stops early), each running all variants of its comparison once
in rotated order on fresh event loops or processes with fixed operation counts, and
ratios are taken per round. The scale item splits its passes so that the 15 rounds fit
(see ``ping_local.scale_item``). ``nox -s bench`` takes about 10 minutes on an idle
2-core machine (see the report's per-item times).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness
import fire_lateness
import flow
import ping_local
import replay
from _harness import Context, Params, load, log
from baselines.dbos_worker import DbosProcess

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = ROOT / "docs" / "benchmarks"


class Item(NamedTuple):
    """An item of the suite: the function that measures it and what it needs."""

    run: Callable[[Context], dict[str, Any]]
    nats: bool = False
    dbos: bool = False


def _ping_shared(name: str) -> Callable[[Context], dict[str, Any]]:
    """The ping_shared item ``name``, imported when it runs (it imports nats-py)."""

    def run(ctx: Context) -> dict[str, Any]:
        import ping_shared

        return getattr(ping_shared, name)(ctx)  # type: ignore[no-any-return]

    return run


def _runs(ctx: Context) -> dict[str, Any]:
    import runs

    return runs.item(ctx)


#: Every item by name, in the report's order.
ITEMS: dict[str, Item] = {
    "ping-local": Item(ping_local.ping_item),
    "ping-keyed": Item(ping_local.keyed_item),
    "flow": Item(flow.item),
    "scale": Item(ping_local.scale_item),
    "fire-lateness": Item(fire_lateness.item),
    "replay": Item(replay.item),
    "nats-requests": Item(_ping_shared("requests_item"), nats=True),
    "owner-ping": Item(_ping_shared("owner_ping_item"), nats=True),
    "hot-key": Item(_ping_shared("hot_key_item"), nats=True, dbos=True),
    "flow-hot-key": Item(_ping_shared("flow_hot_key_item"), nats=True),
    "runs": Item(_runs, nats=True, dbos=True),
}
#: The default run order: the slowest last (what is done is written after each item);
#: nats-requests before owner-ping, which takes the owner ping's KV operations from it.
RUN_ORDER = (
    "ping-local",
    "ping-keyed",
    "flow",
    "fire-lateness",
    "nats-requests",
    "owner-ping",
    "hot-key",
    "flow-hot-key",
    "runs",
    "replay",
    "scale",
)


def start_nats(tmp: Path) -> Any:
    sys.path.insert(0, str(ROOT))
    from tests.harness.nats_server import NatsServer

    server = NatsServer(tmp / "nats-store")
    server.start()
    return server


def run(
    names: list[str],
    params: Params,
    huge: bool = False,
    output: Path | None = None,
    workers: bool = False,
) -> dict[str, Any]:
    unknown = [name for name in names if name not in ITEMS]
    if unknown:
        raise SystemExit(f"unknown items {unknown}; known: {', '.join(ITEMS)}")
    results: dict[str, Any] = {"machine": _harness.machine(), "items": {}, "rounds": params.rounds}
    t_start = time.monotonic()
    results["seconds"] = 0.0
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trio-debounce-bench-") as tmp_name:
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
            if any(ITEMS[name].nats for name in names):
                server = start_nats(tmp)
                ctx.url = server.url
            for name in names:
                if ITEMS[name].dbos and ctx.dbos is None:
                    # Started only now: its queue threads poll SQLite in the background.
                    (tmp / "dbos").mkdir()
                    ctx.dbos = DbosProcess(tmp / "dbos")
                log(f"{name} (load {load()})")
                t0 = time.monotonic()
                load0 = load()
                result = ITEMS[name].run(ctx)
                result["seconds"] = round(time.monotonic() - t0, 1)
                result["load"] = [load0, load()]
                results["items"][name] = result
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
    import json

    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1, default=str) + "\n")


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the finally blocks stop nats-server and the DBOS worker


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated item names (default: all, in this order: {','.join(RUN_ORDER)})",
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--huge", action="store_true", help="scale at 1,000,000 windows too (1,500 with --tiny)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny counts: a smoke run")
    parser.add_argument(
        "--workers",
        action="store_true",
        help="ping-local, ping-keyed, flow: each sample a pyperf worker process, not a fresh loop",
    )
    parser.add_argument("-o", "--output", type=Path, default=None)
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument(
        "--compare",
        metavar="REV",
        default=None,
        help="measure the before/after figures against git revision REV (bench/compare.py)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="--compare: exit 1 when a figure regressed"
    )
    args = parser.parse_args()
    if args.compare is not None:
        import compare

        argv = [args.compare, "--rounds", str(args.rounds)]
        argv += ["--only", args.only] if args.only else []
        argv += ["--tiny"] if args.tiny else []
        argv += ["--strict"] if args.strict else []
        argv += ["-o", str(args.output)] if args.output is not None else []
        raise SystemExit(compare.main(argv))
    output = args.output if args.output is not None else OUT / "results.json"
    params = Params.tiny() if args.tiny else Params.full()
    if not args.tiny:
        params.rounds = args.rounds
    names = [x for x in args.only.split(",") if x] if args.only else list(RUN_ORDER)
    run(names, params, args.huge, output, args.workers)
    log(f"results written to {output}")
    if not args.no_report:
        import report

        report.write(output, output.parent)


if __name__ == "__main__":
    main()
