"""Tests of a docs-rebuild service, written with trio_debounce's pytest plugin.

Runs with pytest-trio's ``trio_mode = true`` in the pytest configuration (the plugin's
fixtures are synchronous; the tests are Trio tests).
"""

from __future__ import annotations

import uuid

import trio
import trio.testing

from trio_debounce import Outcome, open_coordinator
from trio_debounce.nats import NatsConfig, open_nats_backend
from trio_debounce.testing import FireRecorder, NatsServer, Processes


async def test_a_burst_fires_once(
    autojump_clock: trio.testing.MockClock, trio_debounce_fires: FireRecorder
) -> None:
    async with open_coordinator(handlers={"build": trio_debounce_fires}) as coordinator:
        t0 = trio.current_time()
        for path in ("a.rst", "b.rst", "c.rst"):
            await coordinator.debounce("build", "docs", path, delay=2.0)
            await trio.sleep(1.0)
        await coordinator.wait_idle()
    [fire] = trio_debounce_fires.fires
    assert (fire.payload, fire.ping_count, fire.fired_at) == ("c.rst", 3, t0 + 4.0)


async def test_two_processes_share_one_window(
    autojump_clock: trio.testing.MockClock,
    trio_debounce_processes: Processes,
    trio_debounce_fires: FireRecorder,
) -> None:
    async with trio_debounce_processes.open("A", "B", workflows=["build"]) as (a, b):
        first = await a.coordinator.debounce("build", "docs", "from A", delay=2.0)
        assert first.outcome is Outcome.SCHEDULE_TRAILING
        second = await b.coordinator.debounce("build", "docs", "from B", delay=2.0)
        assert second.outcome is Outcome.COALESCE
        await trio_debounce_fires.wait_for(1)
    assert trio_debounce_fires.processes == ["A"]  # the owner fires ...
    assert trio_debounce_fires.payloads == ["from B"]  # ... the latest payload


async def test_a_survivor_fires_a_dead_owners_window(
    autojump_clock: trio.testing.MockClock,
    trio_debounce_processes: Processes,
    trio_debounce_fires: FireRecorder,
) -> None:
    async with trio_debounce_processes.process("B", workflows=["build"]) as b:
        async with trio_debounce_processes.process("A", workflows=["build"]) as a:
            await a.coordinator.debounce("build", "docs", "from A", delay=3.0)
            await b.coordinator.debounce("build", "docs", "from B", delay=3.0)
            a.die()  # A owned the window; it dies before its fire
        await trio_debounce_fires.wait_for(1)  # B takes over once A's lease lapsed
        assert b.coordinator.statistics().takeovers == 1
    assert (trio_debounce_fires.processes, trio_debounce_fires.payloads) == (["B"], ["from B"])


async def test_against_a_real_nats_server(
    trio_debounce_nats_server: NatsServer, trio_debounce_fires: FireRecorder
) -> None:
    # The real clock: nats-py's timeouts cannot run on an autojumping one.
    config = NatsConfig(
        servers=(trio_debounce_nats_server.url,),
        bucket="b" + uuid.uuid4().hex[:12],
        process_lease=2.0,
    )
    with trio.fail_after(20):
        async with (
            open_nats_backend(config) as backend,
            open_coordinator(backend=backend, handlers={"build": trio_debounce_fires}) as c,
        ):
            await c.debounce("build", "docs", "a.rst", delay=0.2)
            await c.debounce("build", "docs", "b.rst", delay=0.2)
            await trio_debounce_fires.wait_for(1)
    assert trio_debounce_fires.payloads == ["b.rst"]
    assert trio_debounce_fires.fires[0].ping_count == 2
