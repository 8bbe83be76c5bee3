"""Replay: the CLI's ``trio-debounce replay`` against a naive replay on a MockClock,
and the reference log through the replay engine against parsing it.

* The CLI (``python -m trio_debounce replay``) over a deterministic log
  (:func:`generate`), each run a process of its own, in paired rounds against
  :func:`naive_replay` (the same log through a coordinator on an autojump
  ``MockClock``, one ``trio.sleep_until`` per event, also a process); then once over
  the 1,000,000-event log.
* ``../shared/data/nats-py-commits.jsonl`` (1,321 events; trailing, delay 3600, max
  delay 7200) through ``trio_debounce._cli._replay.replay``, per event, against parsing
  the same lines (``parse_event``), per event, in paired rounds in this process.

``python bench/replay.py naive-replay LOG`` and ``generate LOG EVENTS KEYS`` run one
step in a process of its own (the first prints JSON).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio.testing
from _harness import Context, log, paired_timefuncs, quantiles, ratio, row, run_json, run_rounds

import trio_debounce

WF = "wf"
BENCH = Path(__file__).resolve().parent
#: The reference log, beside the project in ``../shared``.
REFERENCE = BENCH.parent.parent / "shared" / "data" / "nats-py-commits.jsonl"
#: Seconds the one 1,000,000-event CLI replay may take; slower, its rate is reported
#: as an upper bound.
FULL_REPLAY_TIMEOUT = 180.0

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


# ----------------------------------------------------------------- the reference log


def _reference_lines() -> list[str]:
    return REFERENCE.read_text().splitlines()


def replay_reference(loops: int) -> float:
    """``loops`` replays of the reference log (trailing, delay 3600, max delay 7200)
    through the replay engine, parsing included."""
    from trio_debounce._cli._events import parse_event
    from trio_debounce._cli._replay import replay

    lines = _reference_lines()
    t0 = time.perf_counter()
    for _ in range(loops):
        events = (parse_event(t, n, key_field="key", time_field="ts") for n, t in enumerate(lines))
        replay(events, delay=3600.0, max_delay=7200.0)
    return time.perf_counter() - t0


def parse_reference(loops: int) -> float:
    """Baseline: ``loops`` passes of parsing the reference log's lines."""
    from trio_debounce._cli._events import parse_event

    lines = _reference_lines()
    t0 = time.perf_counter()
    for _ in range(loops):
        for n, text in enumerate(lines):
            parse_event(text, n, key_field="key", time_field="ts")
    return time.perf_counter() - t0


def reference_rows(ctx: Context) -> list[dict[str, Any]]:
    """The reference log's replay against its parsing, per event, in paired rounds
    (fresh state per sample, in this process, after a warm-up round)."""
    if not REFERENCE.exists():
        return []
    loops = ctx.params.reference_loops
    values, _ = paired_timefuncs(
        {
            "replay-reference": (replay_reference, loops),
            "parse-reference": (parse_reference, loops),
        },
        ctx.params.rounds,
    )
    events = len(_reference_lines())
    ours = [v / events for v in values["replay-reference"]]
    base = [v / events for v in values["parse-reference"]]
    return [
        row(
            f"reference log ({events:,} events, delay 3600, max delay 7200) through the "
            "replay engine vs parsing its lines, per event",
            quantiles(ours)["median"] * 1e6,
            "µs",
            baseline="parse only",
            base=quantiles(base)["median"] * 1e6,
            stats=ratio(ours, base),
            ratio_label="ours / baseline",
        )
    ]


def item(ctx: Context) -> dict[str, Any]:
    """The CLI against the naive replay (paired, a process each), the full log once,
    and the reference log against its parsing."""
    small = ctx.tmp / "replay-small.jsonl"
    full = ctx.tmp / "replay-full.jsonl"
    generate(small, *ctx.params.replay_small)
    script = str(BENCH / "replay.py")
    rates: dict[str, list[float]] = {"cli": [], "naive": []}
    events = ctx.params.replay_small[0]

    def cli(path: Path) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        summary = run_json(cli_replay_args(path), timeout=3600)
        return time.perf_counter() - t0, summary

    def cli_full(path: Path) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        summary = run_json(cli_replay_args(path), timeout=FULL_REPLAY_TIMEOUT)
        return time.perf_counter() - t0, summary

    def one(r: int) -> None:
        order = ["cli", "naive"] if r % 2 == 0 else ["naive", "cli"]
        for what in order:
            if what == "cli":
                seconds, _ = cli(small)
            else:
                t0 = time.perf_counter()
                run_json([script, "naive-replay", str(small)], timeout=3600)
                seconds = time.perf_counter() - t0
            rates[what].append(events / seconds)

    n = run_rounds(ctx, "replay", one)
    log(f"replay: generating {ctx.params.replay_full[0]:,} events")
    generate(full, *ctx.params.replay_full)
    log("replay: CLI replay of the full log")
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
    rows += reference_rows(ctx)
    return {
        "title": "Replay",
        "rows": rows,
        "rounds": n,
        "full": {"seconds": seconds, "summary": summary},
        "rates": rates,
    }


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "naive-replay":
        print(json.dumps(naive_replay(Path(sys.argv[2]))))
    elif command == "generate":
        generate(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown command {command!r}")
