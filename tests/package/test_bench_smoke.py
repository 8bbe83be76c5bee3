"""The benchmark suite still runs: ``bench/suite.py --tiny`` runs every item once with
tiny counts (real nats-server, DBOS on SQLite) and writes its report, and
``bench/suite.py --compare HEAD --tiny`` runs the before/after figures against a
checkout of the last commit.

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

from tests.harness.env import ROOT

# Tiny counts, but about 30 processes (DBOS, nats-server, replays): minutes under load.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITEMS = [
    "fire-lateness",
    "flow",
    "hot-key",
    "nats-requests",
    "owner-ping",
    "ping-keyed",
    "ping-local",
    "replay",
    "runs",
    "scale",
]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    for module in ("pyperf", "matplotlib", "throttlebounce", "dbos"):
        pytest.importorskip(module, reason=f"the bench extra ({module}) is not installed")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "suite.py"), "--tiny", *args],
        capture_output=True,
        text=True,
        timeout=580,
        env=env,
    )


def test_bench_suite_runs_every_item(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = _bench("-o", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results["items"]) == ITEMS
    for key, item in results["items"].items():
        assert item["rows"], f"{key} reported no figure"
        for row in item["rows"]:
            assert row["ours"] is not None, (key, row["name"])
    # nats-requests counted requests for every operation of both delivery modes.
    counts = results["items"]["nats-requests"]["counts"]
    for delivery in ("at-most-once", "at-least-once"):
        for op in ("open", "owner-ping", "other-ping", "finalize"):
            assert counts[delivery][op]["requests"] > 0, (delivery, op)
    page = (tmp_path / "index.rst").read_text()
    assert "Benchmarks\n==========" in page
    assert all(results["items"][key]["title"] in page for key in ITEMS)
    assert (tmp_path / "ping-local.png").stat().st_size > 0


def test_bench_compare_against_head(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to compare against")
    out = tmp_path / "compare.json"
    done = _bench("--compare", "HEAD", "-o", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert list(results["items"]) == ["ping-local", "ping-keyed", "scale", "owner-ping", "hot-key"]
    for key, item in results["items"].items():
        for figure in item["figures"]:
            assert figure["before"]["n"] == figure["after"]["n"] == 2, (key, figure["label"])
            assert "regression" in figure["verdict"].lower(), (key, figure["verdict"])
    assert "load average" in done.stdout
    assert "no regression" in done.stdout or "REGRESSION" in done.stdout
