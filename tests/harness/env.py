"""Where the suite runs: the repository's root, the reference data beside it, and the
environment variables that turn skips into failures or pick the long variants.

Test modules import these from here, at any depth under ``tests/`` (a path computed
from a test file's own ``__file__`` changes with its directory; :data:`ROOT` does not).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests import AUTO_HOST_ENV

#: The repository's root (the directory of ``pyproject.toml``).
ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = ROOT.parent / "shared" / "data"
NATS_PY_LOG = SHARED_DATA / "nats-py-commits.jsonl"

#: Set (by .ci/run) to turn the skip of tests that need ../shared into a failure.
REQUIRE_SHARED_ENV = "TRIO_DEBOUNCE_REQUIRE_SHARED"

#: Set to 1 (by .ci/run) to turn the skip of tests whose linter or type checker (the
#: lint extra: ruff, mypy, pyright) is not installed into a failure.
REQUIRE_LINT_ENV = "TRIO_DEBOUNCE_REQUIRE_LINT"

#: Set (by ``nox -s chaos``) to run the long variants of the fault scenarios (more
#: rounds, runs and kills); the suite runs short ones that make the same assertions.
LONG_ENV = "TRIO_DEBOUNCE_LONG_TESTS"
LONG = os.environ.get(LONG_ENV) == "1"


#: Set to 1 (by the 3.14 step of .ci/run: ``nox -s tests-3.14``) to run the operator
#: commands' longer tests against a real server (races of steering commands with a
#: live owner, users restricted to the documented permissions), which the README's
#: suite leaves out for its time budget: CI runs them on 3.14, every submission.
OPERATOR_ENV = "TRIO_DEBOUNCE_OPERATOR_TESTS"

#: Skips a test in the README's suite; it runs where :data:`OPERATOR_ENV` or
#: :data:`LONG_ENV` is set.
operator_long = pytest.mark.skipif(
    not (LONG or os.environ.get(OPERATOR_ENV) == "1"),
    reason=f"runs in CI's 3.14 step ({OPERATOR_ENV}=1): the suite's time budget",
)


#: Skips a test in the README's suite that CI's trio-asyncio step (every NATS test, on
#: that host: ``TRIO_DEBOUNCE_TEST_AUTO_HOST``) and its 3.14 step (:data:`OPERATOR_ENV`)
#: run anyway: the suite's time budget. ``nox -s chaos`` (:data:`LONG_ENV`) runs it too.
in_other_ci_steps = pytest.mark.skipif(
    not (LONG or os.environ.get(OPERATOR_ENV) == "1" or bool(os.environ.get(AUTO_HOST_ENV))),
    reason="runs in CI's trio-asyncio and 3.14 steps: the suite's time budget",
)


def deliveries(in_the_suite: str) -> list[object]:
    """The ``delivery`` parameters of a SIGKILL scenario: ``in_the_suite`` in every
    run, the other delivery mode only in the long run (``nox -s chaos``), where each
    such test runs both. The suite's time budget (README, "Python versions and CI")
    has room for one of each; each mode stays in the suite through another
    scenario's choice."""
    other = "at-most-once" if in_the_suite == "at-least-once" else "at-least-once"
    long_only = pytest.mark.skipif(
        not LONG, reason=f"runs in nox -s chaos ({LONG_ENV}=1): the suite's time budget"
    )
    return [in_the_suite, pytest.param(other, marks=long_only)]


def shared_file(path: Path) -> Path:
    """Return ``path`` if it exists; else skip, or fail when CI requires ../shared."""
    if not path.exists():
        reason = f"reference data {path} is absent (../shared is not beside the project)"
        if os.environ.get(REQUIRE_SHARED_ENV):
            pytest.fail(f"{reason}, and {REQUIRE_SHARED_ENV} is set")
        pytest.skip(reason)
    return path


def lint_tool(name: str) -> list[str]:
    """The command that runs the lint extra's tool ``name`` (``"ruff"``, ``"mypy"`` or
    ``"pyright"``) of this interpreter's environment; skip if it is not installed, or
    fail when CI requires the lint extra (``TRIO_DEBOUNCE_REQUIRE_LINT=1``)."""
    if name == "pyright":
        # pyright's entry point (a wrapper that runs it on Node.js) sits beside python.
        entry = Path(sys.executable).parent / "pyright"
        found, command = entry.exists(), [str(entry)]
    else:
        found, command = importlib.util.find_spec(name) is not None, [sys.executable, "-m", name]
    if not found:
        reason = f"{name} is not installed (it is in the lint extra: pip install -e '.[lint]')"
        if os.environ.get(REQUIRE_LINT_ENV) == "1":
            pytest.fail(f"{reason}, and {REQUIRE_LINT_ENV}=1 is set")
        pytest.skip(reason)
    return command


def lint_env() -> dict[str, str]:
    """The environment for a lint tool: this one, with this interpreter's bin directory
    first on PATH (pyright's wrapper looks for python and its Node.js there)."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")])}
