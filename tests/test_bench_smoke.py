"""The benchmark suite still runs: ``bench/suite.py --tiny`` runs every benchmark of
issue 6 once with tiny counts (real nats-server, DBOS on SQLite) and writes its report.

Nothing here asserts a time: the figures of a tiny run mean nothing. The benchmarks
themselves live in ``bench/`` (outside ``testpaths``) and run with ``nox -s bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Tiny counts, but about 30 processes (DBOS, nats-server, replays): minutes under load.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_issue6_bench_runs_every_item(tmp_path: Path) -> None:
    for module in ("pyperf", "matplotlib", "throttlebounce", "dbos"):
        pytest.importorskip(module, reason=f"the bench extra ({module}) is not installed")
    out = tmp_path / "results.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "suite.py"), "--tiny", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=580,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results["items"]) == [str(i) for i in range(1, 9)]
    for key, item in results["items"].items():
        assert item["rows"], f"item {key} reported no figure"
        for row in item["rows"]:
            assert row["ours"] is not None, (key, row["name"])
    # Item 5 counted requests for every operation of both delivery modes.
    counts = results["items"]["5"]["counts"]
    for delivery in ("at-most-once", "at-least-once"):
        for op in ("open", "owner-ping", "other-ping", "finalize"):
            assert counts[delivery][op]["requests"] > 0, (delivery, op)
    page = (tmp_path / "index.rst").read_text()
    assert "Benchmarks\n==========" in page
    assert all(f"{i}. " in page for i in range(1, 9))
    assert (tmp_path / "item1.png").stat().st_size > 0
