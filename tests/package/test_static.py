"""ruff and mypy --strict are part of the suite, so CI enforces them too.

The tools come with the lint extra: without it these tests skip, unless
``TRIO_DEBOUNCE_REQUIRE_LINT=1`` (as in .ci/run) makes a missing tool a failure.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.harness.env import ROOT, lint_env, lint_tool

pytestmark = pytest.mark.slow


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*lint_tool(tool), *args],
        cwd=ROOT,
        env=lint_env(),
        capture_output=True,
        text=True,
        check=False,
    )


def test_ruff_lint_and_format() -> None:
    lint = _run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_strict() -> None:
    result = _run("mypy", "--strict")
    assert result.returncode == 0, result.stdout + result.stderr
