"""The README's example runs and prints what its comment says (on MockClock)."""

from __future__ import annotations

import functools
import re

import pytest
import trio
import trio.testing

from tests.harness.env import ROOT


def test_readme_example(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    [code] = [block for block in blocks if "nats" not in block and "sqlite" not in block]
    for other in blocks:  # the NATS example needs a server: it must at least compile
        compile(other, "README.md", "exec")
    real_run = trio.run
    monkeypatch.setattr(
        trio, "run", functools.partial(real_run, clock=trio.testing.MockClock(autojump_threshold=0))
    )
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out == "rebuilding docs after 3 changes: docs/a.rst\n"


def test_readme_deferred_run_example(capsys: pytest.CaptureFixture[str]) -> None:
    # On the real clock: the SQLite store's calls run in threads.
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    [code] = [block for block in blocks if "sqlite" in block]
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out == "reminding user 42 (attempt 1)\n"


def test_ci_runs_the_readme_test_command() -> None:
    # .ci/run runs the README's second set-up command verbatim, with the variables that
    # turn the skips of missing ../shared data and missing lint tools into failures.
    readme = (ROOT / "README.md").read_text()
    setup = re.findall(r"```sh\n(.*?)```", readme, flags=re.DOTALL)[0]  # the first screen
    commands = [line for line in setup.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2, setup
    test_command = commands[1]
    assert "'.[test,lint]'" in test_command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci
    for variable in ("TRIO_DEBOUNCE_REQUIRE_SHARED", "TRIO_DEBOUNCE_REQUIRE_LINT"):
        assert f"export {variable}=1" in ci
