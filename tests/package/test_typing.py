"""The public types, as a user's type checker sees them.

pyright's ``--verifytypes`` must find every public symbol's type known (100 %
completeness), and a user's snippet must type-check where it should and fail where it
should, under both mypy --strict and pyright (strict). The tools come with the lint
extra: without it these tests skip, unless ``TRIO_DEBOUNCE_REQUIRE_LINT=1`` (as in
.ci/run) makes a missing tool a failure.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.env import REQUIRE_LINT_ENV, ROOT, lint_env, lint_tool

pytestmark = pytest.mark.slow

#: A user's module. The lines marked ``# E`` must be type errors (each one exactly),
#: every other line must type-check.
SNIPPET = '''\
# pyright: strict
from __future__ import annotations

import datetime
from collections.abc import Generator

import trio_debounce
from trio_debounce import Coordinator, Fire, ModeName, RunFire, RunStateName


class Later:
    """An awaitable that is not a coroutine (as a Future or a Task is)."""

    def __await__(self) -> Generator[None, None, str]:
        yield
        return "done"


def wrapped(fire: Fire) -> Later:
    return Later()


def wrapped_run(run: RunFire) -> Later:
    return Later()


async def counts(fire: Fire) -> int:
    return fire.ping_count


def not_async(fire: Fire) -> None:
    pass


async def main(c: Coordinator, when: datetime.datetime) -> None:
    mode: ModeName = "both"
    state: RunStateName = "done"
    await c.debounce("wf", "k", delay=1.0, mode="leading")
    await c.debounce("wf", "k", delay=1.0, mode=trio_debounce.Mode.BOTH, on_fire=counts)
    c.debounce_nowait("wf", "k", delay=1.0, mode=mode, on_fire=wrapped)
    c.set_handler("wf", wrapped)
    c.set_run_handler("wf", wrapped_run)
    await c.schedule("wf", at=when)
    await c.schedule("wf", at=12.5, expires_at=when)
    await c.schedule("wf", "r", None, after=3.0, persist=True)
    await c.list_runs(state="pending")
    await c.list_runs(state=state)
    async with trio_debounce.open_coordinator(
        handlers={"wf": wrapped}, run_handlers={"wf": wrapped_run}
    ):
        pass
    await c.debounce("wf", "k", delay=1.0, mode="sideways")  # E
    c.debounce_nowait("wf", "k", delay=1.0, mode="sideways")  # E
    await c.schedule("wf", at=12.5, after=3.0)  # E
    await c.schedule("wf", at=when, after=3.0)  # E
    await c.schedule("wf")  # E
    await c.schedule("wf", at="tomorrow")  # E
    await c.list_runs(state="running")  # E
    c.set_handler("wf", not_async)  # E
'''

#: The 1-based numbers of the lines marked ``# E``.
BAD_LINES = {n for n, line in enumerate(SNIPPET.splitlines(), 1) if line.endswith("# E")}


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=lint_env(), capture_output=True, text=True, check=False, timeout=120
    )


def _snippet(tmp_path: Path) -> Path:
    path = tmp_path / "snippet.py"
    path.write_text(SNIPPET)
    return path


def test_verifytypes_completeness_is_100_percent() -> None:
    verify = ["--verifytypes", "trio_debounce", "--ignoreexternal", "--outputjson"]
    result = _run([*lint_tool("pyright"), *verify], ROOT)
    try:
        report = json.loads(result.stdout)
    except ValueError:
        pytest.fail(f"pyright wrote no JSON report:\n{result.stdout}{result.stderr}")
    completeness = report["typeCompleteness"]
    problems = [
        f"{symbol['name']}: {diagnostic['message']}"
        for symbol in completeness["symbols"]
        for diagnostic in symbol["diagnostics"]
        if diagnostic["severity"] == "error"
    ]
    assert completeness["completenessScore"] == 1.0, "\n".join(problems)


def test_snippet_under_mypy_strict(tmp_path: Path) -> None:
    path = _snippet(tmp_path)
    # Run in tmp_path: the project's mypy config (its files) is not the user's.
    result = _run(
        [*lint_tool("mypy"), "--strict", "--cache-dir", str(tmp_path / "cache"), path.name],
        tmp_path,
    )
    output = result.stdout + result.stderr
    lines = [int(n) for n in re.findall(r"^snippet\.py:(\d+): error:", output, re.MULTILINE)]
    # One error per bad line, so a bad line cannot hide a second, unexpected error.
    assert sorted(lines) == sorted(BAD_LINES), output
    assert result.returncode == 1, output


def test_snippet_under_pyright_strict(tmp_path: Path) -> None:
    path = _snippet(tmp_path)
    result = _run(
        [*lint_tool("pyright"), "--outputjson", "--pythonpath", sys.executable, path.name],
        tmp_path,
    )
    try:
        report = json.loads(result.stdout)
    except ValueError:
        pytest.fail(f"pyright wrote no JSON report:\n{result.stdout}{result.stderr}")
    diagnostics = report["generalDiagnostics"]
    errors = {d["range"]["start"]["line"] + 1 for d in diagnostics if d["severity"] == "error"}
    assert errors == BAD_LINES, json.dumps(diagnostics, indent=1)
    # One error per bad line, so a bad line cannot hide a second, unexpected error.
    assert report["summary"]["errorCount"] == len(BAD_LINES), json.dumps(diagnostics, indent=1)


def test_a_missing_tool_skips_or_fails_by_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(REQUIRE_LINT_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="lint extra"):
        lint_tool("no_such_linter")
    monkeypatch.setenv(REQUIRE_LINT_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{REQUIRE_LINT_ENV}=1 is set"):
        lint_tool("no_such_linter")
    monkeypatch.setattr(sys, "executable", str(Path("/nonexistent/bin/python")))
    with pytest.raises(pytest.fail.Exception, match="pyright is not installed"):
        lint_tool("pyright")
