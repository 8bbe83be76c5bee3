"""Steering a window from outside its owner (``trio-debounce flush``'s protocol):
:meth:`~trio_debounce.abc.DebounceBackend.request_flush` and the owner's heartbeat,
on ``MemoryBackend`` (MockClock)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import BEAT, LEASE, SKEW, WF, backend, die, near, process
from trio_debounce import FireStarted, open_coordinator
from trio_debounce.testing import MemoryStore


def reasons(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.fire.key, e.reason) for e in events if isinstance(e, FireStarted)]


async def test_a_flush_from_outside_fires_the_owners_window_within_a_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    events: list[Any] = []
    tool = backend(store, "tool")  # no coordinator, no lease: an operator's command
    async with process(store, fires, "A", on_event=events.append) as (a, a_backend, _):
        await a.debounce(WF, "k", 1, delay=60.0)
        await trio.sleep(1.0)
        await a.debounce(WF, "k", 2, delay=60.0)
        before = trio.current_time()
        status = await tool.request_flush(WF, "k")
        assert status is not None
        assert (status.owner, status.owner_live, status.ping_count) == ("A", True, 2)
        assert status.scheduled_at == near(a_backend.wall_time())
        await fires.wait_for(1)
        [(who, fire)] = fires.of("k")
        assert (who, fire.payload, fire.ping_count) == ("A", 2, 2)
        assert trio.current_time() - before <= BEAT + 0.1  # within one heartbeat
        assert reasons(events) == [("k", "flush")]
        await trio.sleep(70.0)  # past the due time the pings set: no second fire
        assert len(fires.of("k")) == 1
        assert await a.window_status(WF, "k") is None
        # The request was taken: the control key is gone, and a window opened since
        # (a new run) is not flushed by it.
        await a.debounce(WF, "k", 3, delay=60.0)
        await trio.sleep(3 * BEAT)
        assert len(fires.of("k")) == 1


async def test_a_peers_ping_takes_the_flushed_fire_before_the_owners_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The window is due from the flush on: a ping of any process finds it due, fires
    it, and opens the next window; the owner's late request finds its run gone."""
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    tool = backend(store, "tool")
    async with (
        process(store, fires, "A") as (a, _, _),
        process(store, fires, "B") as (b, _, _),
    ):
        await trio.sleep(BEAT / 2)  # between A's beats
        await a.debounce(WF, "k", 1, delay=60.0)
        await b.debounce(WF, "k", 2, delay=60.0)
        assert await tool.request_flush(WF, "k") is not None
        await b.debounce(WF, "k", 3, delay=60.0)  # at once: before A's next beat
        await fires.wait_for(1)
        [(_, first)] = fires.of("k")
        assert (first.payload, first.ping_count) == (2, 2)
        await trio.sleep(2 * BEAT)
        assert len(fires.of("k")) == 1  # the request named the first run only
        status = await a.window_status(WF, "k")
        assert status is not None
        assert status.ping_count == 1
        await trio.sleep(60.0)
        assert [(f.payload, f.ping_count) for _, f in fires.of("k")] == [(2, 2), (3, 1)]


async def test_a_dead_owners_flushed_window_fires_at_its_adoption(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    tool = backend(store, "tool")
    async with process(store, fires, "B") as (_, _, _):
        async with process(store, fires, "A") as (a, a_backend, a_scope):
            await a.debounce(WF, "k", 1, delay=600.0)
            die(a_backend, a_scope)
        await trio.sleep(LEASE + SKEW + 0.1)
        status = await tool.request_flush(WF, "k")
        assert status is not None
        assert (status.owner, status.owner_live) == ("A", False)
        opened = trio.current_time()
        await fires.wait_for(1)
        # Adopted at B's next reconcile: long before the 600 s the ping set.
        assert trio.current_time() - opened < 10 * BEAT
        assert [(p, f.payload) for p, f in fires.of("k")] == [("B", 1)]


async def test_nothing_to_flush_writes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    tool = backend(store, "tool")
    async with process(store, fires, "A") as (a, _, _):
        assert await tool.request_flush(WF, "none") is None
        await a.debounce(WF, "lead", 1, delay=60.0, mode="leading")
        await a.debounce(WF, "both", 1, delay=60.0, mode="both")  # one ping: no trailing
        revisions = {e.key: e.revision for e in await store.entries("w.")}
        assert await tool.request_flush(WF, "lead") is None
        assert await tool.request_flush(WF, "both") is None
        assert {e.key: e.revision for e in await store.entries("w.")} == revisions
        await a.debounce(WF, "both", 2, delay=60.0, mode="both")
        assert await tool.request_flush(WF, "both") is not None
        await trio.sleep(BEAT + 0.1)
        assert [(f.key, f.payload, f.edge.value) for _, f in fires.log] == [
            ("lead", 1, "leading"),
            ("both", 1, "leading"),
            ("both", 2, "trailing"),
        ]


async def test_a_flush_request_to_a_restarted_owner_is_not_applied_to_a_new_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request outlives its process (it died before its heartbeat read it); the next
    coordinator under the same process id reads it, and applies it only to its run."""
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    tool = backend(store, "tool")
    async with open_coordinator(
        handlers={WF: fires.handler("A")}, backend=backend(store, "A")
    ) as a:
        await a.debounce(WF, "k", 1, delay=60.0)
        assert await tool.request_flush(WF, "k") is not None
        await fires.wait_for(1)
    async with open_coordinator(
        handlers={WF: fires.handler("A2")}, backend=backend(store, "A")
    ) as a2:
        await a2.debounce(WF, "k", 2, delay=60.0)
        await trio.sleep(3 * BEAT)
        assert len(fires.log) == 1
