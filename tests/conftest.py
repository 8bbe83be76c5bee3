from __future__ import annotations

import faulthandler
import fcntl
import importlib.util
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import settings

from tests import AUTO_HOST_ENV
from trio_debounce import Fire

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
NATS_PY_LOG = SHARED_DATA / "nats-py-commits.jsonl"

# CI runs the property tests on a fixed seed so a submission's result is reproducible;
# local runs explore new examples (and keep failures in .hypothesis/).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

#: Set (by .ci/run) to turn the skip of tests that need ../shared into a failure.
REQUIRE_SHARED_ENV = "TRIO_DEBOUNCE_REQUIRE_SHARED"

#: Set to 1 (by .ci/run) to turn the skip of tests whose linter or type checker (the
#: lint extra: ruff, mypy, pyright) is not installed into a failure.
REQUIRE_LINT_ENV = "TRIO_DEBOUNCE_REQUIRE_LINT"

#: Set (by ``nox -s chaos``) to run the long variants of the fault scenarios (more
#: rounds, runs and kills); the suite runs short ones that make the same assertions.
LONG_ENV = "TRIO_DEBOUNCE_LONG_TESTS"
LONG = os.environ.get(LONG_ENV) == "1"

# The CLI's NATS processes take their host from the environment (NatsConfig.from_env):
# under TRIO_DEBOUNCE_TEST_AUTO_HOST they run on the same host as the rest (tests/__init__.py).
if os.environ.get(AUTO_HOST_ENV):
    os.environ.setdefault("TRIO_DEBOUNCE_NATS_ASYNCIO_HOST", os.environ[AUTO_HOST_ENV])

# A worker that a signal ends (SIGTERM, SIGHUP) says so, with every thread's stack,
# before the default action: xdist itself only reports "node down".
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _signum in (signal.SIGTERM, signal.SIGHUP):
        faulthandler.register(_signum, all_threads=True, chain=True)


#: The xdist group of the tests marked ``realtime``.
REALTIME_GROUP = "realtime"


def _realtime(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in ("realtime", "solo"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every ``realtime`` test (it asserts wall-clock bounds, or loads the cores
    while others do) in one xdist group: under ``--dist loadgroup`` they all run in one
    worker, one at a time, while the other worker runs the rest (MockClock tests, tools,
    real-server tests without time bounds). Before xdist's own hook (in each worker),
    which reads the group marks.

    Under xdist the ``solo`` tests (also realtime) go last, when the other worker has
    most likely run out of tests: they make the other worker wait while they run (see
    :func:`_machine_share`), and at the end nothing waits."""
    for item in items:
        if _realtime(item):
            item.add_marker(pytest.mark.xdist_group(REALTIME_GROUP))
    if hasattr(config, "workerinput"):
        # The same stable order in every worker (xdist checks the collections match).
        items.sort(key=lambda item: item.get_closest_marker("solo") is not None)


@pytest.fixture(autouse=True)
def _realtime_tests_are_grouped(request: pytest.FixtureRequest) -> None:
    """Fail a ``realtime`` test that xdist did not put in its group: spread over both
    workers, the time bounds of two such tests would be measured beside each other."""
    node = request.node
    if (
        hasattr(request.config, "workerinput")
        and _realtime(node)
        and not node.nodeid.endswith(f"@{REALTIME_GROUP}")
    ):
        pytest.fail(
            "this realtime test is not in the xdist group 'realtime': run with --dist "
            "loadgroup (pyproject's addopts) and a pytest that pytest-xdist can group "
            "tests on (see the pin in pyproject.toml), or with -n 0",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _machine_share(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Under xdist, a ``solo`` test runs with no test at all beside it: the tests
    outside the realtime group hold a shared lock while they run, and a solo test
    takes it exclusively (the realtime group's other tests are in its own worker, one
    at a time, and take no lock). A turnstile lets a waiting solo test in before
    tests that ask later. Locks on files (``flock``) in the directory the workers'
    temporary directories share; the kernel drops them if a worker dies."""
    if not hasattr(request.config, "workerinput"):
        yield  # one process: one test at a time anyway
        return
    solo = request.node.get_closest_marker("solo") is not None
    if _realtime(request.node) and not solo:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "machine.lock", "a+b") as machine:
        with open(shared / "machine.turnstile", "a+b") as turnstile:
            if solo:
                fcntl.flock(turnstile, fcntl.LOCK_EX)
                fcntl.flock(machine, fcntl.LOCK_EX)
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            else:
                fcntl.flock(turnstile, fcntl.LOCK_SH)
                fcntl.flock(turnstile, fcntl.LOCK_UN)
                fcntl.flock(machine, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)


class Recorder:
    """A fire handler that records every fire and can take time to run."""

    def __init__(self, duration: float = 0.0) -> None:
        self.fires: list[Fire] = []
        self.duration = duration
        self.running = 0
        self.max_running = 0

    async def __call__(self, fire: Fire) -> None:
        self.fires.append(fire)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await trio.sleep(self.duration)
        finally:
            self.running -= 1

    def summary(self) -> list[tuple[float, str, object, int, str]]:
        return [(f.fired_at, f.key, f.payload, f.ping_count, f.edge.value) for f in self.fires]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


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


@pytest.fixture
def nats_py_log() -> Path:
    return shared_file(NATS_PY_LOG)


from tests.harness.nats_server import nats_server, nats_server_factory  # noqa: E402, F401
