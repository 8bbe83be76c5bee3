"""Scenarios, their result rows, and the table the chaos run prints.

A scenario is a function ``(Context) -> list[Row]`` registered with :func:`register`.
A :class:`Row` holds the table's columns; ``Row.zero`` names those the guarantees
promise to be zero, and :func:`failures` says which promised zeros are not.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

#: The table's count columns, in order.
COLUMNS = (
    "runs",
    "pings",
    "windows",
    "lost",
    "fired_twice",
    "interrupted",
    "hung_calls",
    "crashes",
)


@dataclass
class Row:
    """One line of the table.

    Attributes:
      scenario (str): the scenario (and variant, e.g. ``"death/at-most-once"``).
      runs (int): processes started (incarnations, restarts included).
      pings (int): pings (or schedule calls) made.
      windows (int): windows (active run ids, or deferred run ids) seen.
      lost (int): windows the guarantee says must fire and that did not (see the
        checker).
      fired_twice (int): windows whose fire started more than once.
      interrupted (int): fires whose handler a kill cut short.
      hung_calls (int): calls that took longer than their bound.
      crashes (int): processes that ended without being killed or told to stop, or
        whose coordinator's nursery raised.
      zero (tuple[str, ...]): the columns the guarantees promise to be zero.
      notes (list[str]): free text: not-stored pings, fail-open windows, trends,
        timings with the load average.
      problems (list[str]): broken promises outside the count columns (a leak trend,
        a twin process not refused); a row with any fails the run.
    """

    scenario: str
    runs: int = 0
    pings: int = 0
    windows: int = 0
    lost: int = 0
    fired_twice: int = 0
    interrupted: int = 0
    hung_calls: int = 0
    crashes: int = 0
    zero: tuple[str, ...] = ("lost", "hung_calls", "crashes")
    notes: list[str] = field(default_factory=list)
    #: Other broken promises (a leak trend, a twin not refused), as text.
    problems: list[str] = field(default_factory=list)

    def broken(self) -> list[str]:
        """The promised-zero columns that are not zero, as ``"name=value"``, and the
        other problems."""
        zeros = [f"{name}={getattr(self, name)}" for name in self.zero if getattr(self, name)]
        return zeros + self.problems


def load() -> str:
    """The 1/5/15-minute load averages, formatted for a note."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f}/{five:.2f}/{fifteen:.2f}"


@dataclass
class Context:
    """What a scenario gets.

    Attributes:
      short (bool): the short version (the normal test suite's), not the full one.
      seconds (float): the scenario's time budget for its load phase, seconds.
      tmp (Path): a directory of its own (logs, stores).
      rng (random.Random): seeded; the seed is in the run's header.
      log (list[str]): timestamped notes, each with the load average.
    """

    short: bool
    seconds: float
    tmp: Path
    rng: random.Random
    log: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        """Record ``text`` with the time and the CPU load (and echo it to stderr)."""
        line = f"{time.strftime('%H:%M:%S')} [{load()}] {text}"
        self.log.append(line)
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


ScenarioFn = Callable[[Context], list[Row]]


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: ScenarioFn
    short_seconds: float
    full_seconds: float


SCENARIOS: dict[str, Scenario] = {}


def register(
    name: str, *, short_seconds: float, full_seconds: float
) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register a scenario under ``name`` with its load-phase budgets (seconds)."""

    def decorate(fn: ScenarioFn) -> ScenarioFn:
        if name in SCENARIOS:
            raise ValueError(f"chaos scenario {name!r} is registered twice")
        SCENARIOS[name] = Scenario(name, fn, short_seconds, full_seconds)
        return fn

    return decorate


def discover() -> dict[str, Scenario]:
    """Import every ``tests.chaos.scenarios_*`` module; return the registry."""
    package = Path(__file__).parent
    for info in pkgutil.iter_modules([str(package)]):
        if info.name.startswith("scenarios_"):
            importlib.import_module(f"tests.chaos.{info.name}")
    return SCENARIOS


def failures(rows: Iterable[Row]) -> list[str]:
    """``"scenario: lost=2"`` for every promised zero that is not zero."""
    return [f"{row.scenario}: {', '.join(row.broken())}" for row in rows if row.broken()]


def table(rows: Iterable[Row]) -> str:
    """The rows as a fixed-width text table; a promised zero that is not is starred."""
    header = ("scenario", *COLUMNS)
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        cells = [row.scenario]
        for name in COLUMNS:
            value = getattr(row, name)
            cells.append(f"{value}*" if name in row.zero and value else str(value))
        lines.append(tuple(cells))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append(
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(line, widths, strict=True))
            )
        )
        if n == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)


def as_dict(row: Row) -> dict[str, object]:
    return dataclasses.asdict(row)
