"""The chaos checker's leading-edge rule, on hand-made driver events."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chaos.checker import check


def fire(kind: str, proc: str, run: str, token: int, attempt: int = 1, t: float = 1.0) -> Any:
    return {
        "ev": kind,
        "proc": proc,
        "t": t,
        "key": "k",
        "run": run,
        "payload": f"{proc}:0",
        "count": 1,
        "attempt": attempt,
        "token": token,
        "edge": "leading",
    }


@pytest.mark.parametrize(
    ("events", "lost"),
    [
        # Interrupted by a kill and never run again: lost under at-least-once.
        ([fire("start", "A", "r1", 5)], ["r1"]),
        # Run again to its end by a survivor: kept.
        ([fire("start", "A", "r1", 5), *[fire(e, "B", "r1", 9, 2) for e in ("start", "end")]], []),
        # Not run again because a later fire of its key started: by design.
        ([fire("start", "A", "r1", 5), *[fire(e, "B", "r2", 7) for e in ("start", "end")]], []),
    ],
)
def test_an_interrupted_leading_fire_must_run_again_at_least_once(
    events: list[Any], lost: list[str]
) -> None:
    report = check(events, delivery="at-least-once", ping_bound=10.0, killed=["A"])
    assert report.lost == lost
    assert check(events, delivery="at-most-once", ping_bound=10.0, killed=["A"]).lost == []
