"""The suite's hooks and fixtures, for every directory under ``tests/``: the xdist
grouping of the ``realtime`` and ``solo`` tests, the ``recorder``, ``nats_py_log``,
``nats_server`` and ``nats_server_factory`` fixtures. What tests import (recorders,
simulated processes, servers, paths) is in :mod:`tests.harness`."""

from __future__ import annotations

import faulthandler
import fcntl
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests import AUTO_HOST_ENV
from tests.harness.env import NATS_PY_LOG, shared_file
from tests.harness.fires import Recorder
from tests.harness.nats_server import nats_server, nats_server_factory  # noqa: F401 (fixtures)

# CI runs the property tests on a fixed seed so a submission's result is reproducible;
# local runs explore new examples (and keep failures in .hypothesis/).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

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


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def nats_py_log() -> Path:
    return shared_file(NATS_PY_LOG)
