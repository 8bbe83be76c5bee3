"""Regressions found by the chaos runs on a NATS cluster, reproduced on the in-memory
fake under MockClock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

from tests.harness.fires import Fires
from trio_debounce import Coordinator, open_coordinator
from trio_debounce.testing import MemoryBackend, MemoryStore


@asynccontextmanager
async def _both_edges_window_of_a_and_b(
    store: MemoryStore, fires: Fires, delay: float
) -> AsyncIterator[tuple[Coordinator, MemoryBackend]]:
    """Coordinators A and B (6 s leases, op_timeout 1 s) and a both-edges window that
    A's ping opened (its leading fire) and B's ping joined (count 2, so a trailing
    fire is due); yields A and its backend."""
    a_backend = MemoryBackend(store, process_id="A", process_lease=6.0, op_timeout=1.0)
    b_backend = MemoryBackend(store, process_id="B", process_lease=6.0, op_timeout=1.0)
    async with (
        open_coordinator(handlers={"wf": fires.handler("A")}, backend=a_backend) as a,
        open_coordinator(handlers={"wf": fires.handler("B")}, backend=b_backend) as b,
    ):
        r = await a.debounce("wf", "k", "a", delay=delay, mode="both")
        assert r.owner
        r = await b.debounce("wf", "k", "b", delay=delay, mode="both")
        assert not r.owner
        assert r.ping_count == 2
        yield a, a_backend


async def test_concurrent_lease_renewals_apply_a_queued_delete_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A finalize that cannot reach the store fires unconfirmed and queues the window's
    # delete; every lease renewal applies the queue. During a cluster's quorum loss the
    # heartbeat and the finalizes that renew a lapsed lease renewed at once, and the
    # second to finish dropped an entry the first had dropped: a KeyError that crashed
    # the coordinator's nursery.
    fires = Fires()
    store = MemoryStore()
    backend = MemoryBackend(store, process_id="A", process_lease=30.0, op_timeout=1.0)
    async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=backend) as a:
        await a.debounce("wf", "k", "p", delay=1.0)
        backend.faults.partitioned = True
        await trio.sleep(2.5)  # the fire at 1 s: finalize fails until 2 s, fires anyway
        assert [f.payload for _, f in fires.log] == ["p"]
        assert a.statistics().unconfirmed_fires == 1
        assert len(backend._finalizer._queued_deletes) == 1
        backend.faults.partitioned = False
        # Every call is answered 0.1 s after it is applied. The first renewal reads
        # the window (0 s), deletes it (0.1 s) and drops the entry (0.2 s); the second
        # starts at 0.15 s, finds the window gone and drops the entry again (0.25 s).
        # (Only the part of refresh_lease() that two renewals ran concurrently.)
        backend.faults.delay_next(0.1, n=20)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(backend._finalizer.apply_queued)
            await trio.sleep(0.15)
            nursery.start_soon(backend._finalizer.apply_queued)
        assert not backend._finalizer._queued_deletes
        entry = await store.get("w.d2Y.aw")
        assert entry is None or entry.value is None  # the window is deleted
        # The coordinator is still alive and pings open a fresh window.
        r = await a.debounce("wf", "k", "q", delay=1.0)
        assert r.ping_count == 1
        await trio.sleep(1.5)
    assert [f.payload for _, f in fires.log] == ["p", "q"]


async def test_unconfirmed_both_edges_fire_keeps_a_peers_ping(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A both-edges window: A's ping opens it (leading fire), B's ping lands (count 2, so
    # a trailing fire is due). A's finalize cannot reach the store; A knows one ping,
    # so its unconfirmed fire has no trailing edge. The queued delete used to remove
    # the window once the store answered (B's ping came before the fire time), and
    # B's stored ping never fired. Now the window stays, A's reconcile re-arms it,
    # and the trailing edge fires with B's payload.
    fires = Fires()
    store = MemoryStore()
    async with _both_edges_window_of_a_and_b(store, fires, 2.0) as (a, a_backend):
        a_backend.faults.partitioned = True
        # A's heartbeat at 2 s fails; its finalize at 2 s fails until 3 s, with its
        # lease (renewed at 0 s) still held.
        await trio.sleep(3.5)
        assert a.statistics().unconfirmed_fires == 1
        a_backend.faults.partitioned = False
        await trio.sleep(20.0)  # the heartbeat at 4 s: the queued delete, a reconcile
    edges = [(p, f.payload, f.ping_count, f.edge.value) for p, f in fires.log]
    assert edges == [("A", "a", 1, "leading"), ("A", "b", 2, "trailing")]


async def test_unconfirmed_both_edges_fire_whose_commit_landed_runs_the_trailing_edge(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Found by the chaos soak under load: as above, A knows one ping of a both-edges
    # window and B's ping landed; A's commit (fire record, window delete) landed but
    # its answer came after op_timeout, so A fired unconfirmed without a trailing
    # edge, and its queued delete then removed the fire record: the only proof of the
    # trailing fire the commit had made. The record is now settled instead: the
    # commit landed, so the trailing edge runs, once, with B's payload.
    fires = Fires()
    store = MemoryStore()
    async with _both_edges_window_of_a_and_b(store, fires, 3.0) as (a, a_backend):
        await trio.sleep(2.5)  # past A's heartbeat at 2 s; the fire is due at 3 s
        # A commits against the revision of its own last write: its first commit
        # conflicts (B's ping), it takes its record back and reads again; then its
        # second record lands, and so does the window's commit, answered too late.
        a_backend.faults.delay_next(0.0, n=3, ops=("put",))
        a_backend.faults.delay_next(3.0, ops=("put",))
        await trio.sleep(2.0)
        assert a.statistics().unconfirmed_fires == 1
        await trio.sleep(20.0)  # heartbeats: the queued delete, a reconcile
    edges = [(p, f.payload, f.ping_count, f.edge.value, f.attempt) for p, f in fires.log]
    assert edges == [("A", "a", 1, "leading", 1), ("A", "b", 2, "trailing", 1)]
    assert [e for e in await store.entries("f.") if e.value is not None] == []
