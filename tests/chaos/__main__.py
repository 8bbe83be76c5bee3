"""``python -m tests.chaos``: run the chaos scenarios and print the table.

Options: ``--short`` (the test suite's budgets), ``--only NAME`` (repeatable; a prefix
matches), ``--scale X`` (multiply every full budget), ``--seed N``, ``--json PATH``
(the rows, notes and log as JSON), ``--list``. Exits 1 if a promised zero is not zero
(or another promise broke), 2 if a scenario raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.chaos.registry import Context, Row, discover, failures, load, table


def say(text: str = "") -> None:
    """One line on standard output, flushed (the table is the run's output)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="keep the logs in this dir")
    args = parser.parse_args(argv)
    scenarios = discover()
    if args.list:
        for s in scenarios.values():
            say(f"{s.name}: short {s.short_seconds} s, full {s.full_seconds} s")
        return 0
    chosen = [
        s
        for s in scenarios.values()
        if not args.only or any(s.name.startswith(prefix) for prefix in args.only)
    ]
    seed = random.randrange(2**32) if args.seed is None else args.seed
    say(f"chaos: {len(chosen)} scenarios, seed {seed}, {load()}")
    rows: list[Row] = []
    log: list[str] = []
    errors = 0
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.keep is None:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="trio-debounce-chaos-"))
        else:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = str(args.keep)
        for n, scenario in enumerate(chosen):
            seconds = scenario.short_seconds if args.short else scenario.full_seconds * args.scale
            ctx = Context(
                short=args.short,
                seconds=seconds,
                tmp=Path(tmp) / scenario.name,
                rng=random.Random(seed + n),
                log=log,
            )
            ctx.tmp.mkdir(parents=True)
            ctx.note(f"{scenario.name}: begins ({seconds:.0f} s of load)")
            start = time.monotonic()
            try:
                rows += scenario.fn(ctx)
            except Exception:
                errors += 1
                text = traceback.format_exc()
                ctx.note(f"{scenario.name}: raised\n{text}")
                rows.append(Row(scenario=scenario.name, problems=["raised: see the log"]))
            ctx.note(f"{scenario.name}: took {time.monotonic() - start:.0f} s")
    say()
    say(table(rows))
    say()
    for row in rows:
        for note in row.notes:
            say(f"  {row.scenario}: {note}")
    broken = failures(rows)
    say(f"\nchaos: {time.monotonic() - began:.0f} s in all, {load()}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"seed": seed, "rows": [vars(r) for r in rows], "log": log}, indent=1)
        )
    if broken:
        say("BROKEN PROMISES:\n  " + "\n  ".join(broken))
    if errors:
        return 2
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
