"""Cross-process debouncing on the in-memory fake backend, under MockClock.

Several coordinators in one ``trio.run`` share a MemoryStore, as separate processes
share a NATS bucket; the protocol code is the same one the NATS backend runs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import BEAT, LEASE, SKEW, backend, near, processes
from trio_debounce import (
    BackendAuthError,
    BackendUnavailableError,
    Coordinator,
    DebounceResult,
    Edge,
    Finalized,
    Mode,
    Outcome,
    Registered,
    open_coordinator,
)
from trio_debounce._keys import window_key
from trio_debounce.abc import DebounceBackend
from trio_debounce.testing import MemoryBackend, MemoryStore, check_debounce_backend


async def test_conformance_memory_backend(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore()
    opened = itertools.count()

    @asynccontextmanager
    async def open_backends(n: int) -> AsyncIterator[Sequence[DebounceBackend]]:
        # Fresh process ids: an id whose lease is still live would be watched for a
        # renewal before the first write (a twin, or a crashed predecessor).
        yield [backend(store, f"p{next(opened)}") for _ in range(n)]

    await check_debounce_backend(open_backends, process_lease=LEASE, max_clock_skew=SKEW, tick=1.0)


async def test_burst_over_three_processes_fires_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "ABC") as (a, b, c):
        t0 = trio.current_time()
        r = await a.debounce("wf", "k", "a1", delay=2.0)
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        assert r.owner
        assert r.scheduled_at == near(t0 + 2.0)
        for i, who in enumerate((b, c, a, b, c)):
            await trio.sleep(1.0)
            r = await who.debounce("wf", "k", f"p{i}", delay=2.0)
            assert r.outcome is Outcome.COALESCE
            assert r.owner is (who is a)
            assert r.ping_count == i + 2
            assert r.scheduled_at == near(trio.current_time() + 2.0)
    [(process, fire)] = fires.of("k")
    assert process == "A"
    assert fire.ping_count == 6
    assert fire.payload == "p4"  # the latest stored payload, whichever process sent it
    assert fire.fired_at == near(t0 + 7.0)
    assert fire.first_ping_at == near(t0)
    assert fire.edge is Edge.TRAILING


async def test_owner_extend_then_fire(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        t0 = trio.current_time()
        await a.debounce("wf", "k", 1, delay=5.0)
        await trio.sleep(3.0)
        r = await a.debounce("wf", "k", 2, delay=5.0)
        assert r.outcome is Outcome.COALESCE
        assert r.owner
        assert r.scheduled_at == near(t0 + 8.0)
        await a.wait_idle()
        assert trio.current_time() == near(t0 + 8.0)
    [(_, fire)] = fires.log
    assert (fire.payload, fire.ping_count, fire.fired_at) == (2, 2, near(t0 + 8.0))


async def test_non_owner_ping_pushes_the_fire_later(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=2.0)
        await trio.sleep(1.5)
        r = await b.debounce("wf", "k", "b", delay=10.0)
        assert not r.owner
        assert r.scheduled_at == near(t0 + 11.5)
        await trio.sleep(5.0)
        assert fires.log == []  # the owner woke at t0+2, found it pushed and rescheduled
    [(process, fire)] = fires.log
    assert process == "A"
    assert fire.fired_at == near(t0 + 11.5)
    assert fire.ping_count == 2


async def test_non_owner_ping_moves_the_fire_earlier(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The pinger that makes the window due earlier than its owner armed takes the fire
    # by compare-and-swap; it fires on time, once.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=30.0)
        r = await b.debounce("wf", "k", "b", delay=2.0)
        assert not r.owner
        assert r.scheduled_at == near(t0 + 2.0)
        await trio.sleep(40.0)
    [(process, fire)] = fires.log
    assert process == "B"
    assert fire.fired_at == near(t0 + 2.0)
    assert fire.payload == "b"
    assert fire.ping_count == 2


async def test_window_longer_than_the_lease_stays_with_its_owner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=10 * LEASE)
        for _ in range(5):
            await trio.sleep(LEASE)
            r = await b.debounce("wf", "k", "b", delay=10 * LEASE)
            assert not r.owner  # the heartbeat kept A's lease alive
    [(process, fire)] = fires.log
    assert process == "A"
    assert fire.ping_count == 6
    assert fire.fired_at == near(t0 + 5 * LEASE + 10 * LEASE)


async def test_dead_owner_is_taken_over_and_fires_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    dead = backend(store, "A")
    async with processes(store, fires, "B") as (b,):
        with trio.CancelScope() as a_scope:
            async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=dead) as a:
                t0 = trio.current_time()
                first = await a.debounce("wf", "k", "a", delay=100.0, max_delay=200.0)
                # A "dies": it can no longer reach the store, so it neither renews its
                # lease nor releases its window on the way out.
                dead.faults.partitioned = True
                a_scope.cancel()
        await trio.sleep(LEASE + SKEW + 0.5)
        r = await b.debounce("wf", "k", "b", delay=3.0)
        assert r.owner
        assert r.outcome is Outcome.COALESCE
        assert r.active_run_id == first.active_run_id
        assert r.ping_count == 2
    [(process, fire)] = fires.log
    assert process == "B"
    assert fire.payload == "b"
    assert fire.ping_count == 2
    assert fire.first_ping_at == near(t0)
    assert fire.fired_at == near(t0 + LEASE + SKEW + 0.5 + 3.0)


async def test_leading_across_processes(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        t0 = trio.current_time()
        r = await a.debounce("wf", "k", 0, delay=5.0, mode="leading")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
        assert r.scheduled_at is None
        for i in range(1, 4):
            await trio.sleep(3.0)
            who = (b, a)[i % 2]
            r = await who.debounce("wf", "k", i, delay=5.0, mode="leading")
            assert r.outcome is Outcome.COALESCE
            assert r.scheduled_at is None
            assert r.ping_count == i + 1
        # Closed only after 5 s of silence across both processes (t0+9+5), not before.
        await trio.sleep(4.9)
        r = await b.debounce("wf", "k", 9, delay=5.0, mode="leading")
        assert r.outcome is Outcome.COALESCE
        await trio.sleep(5.1)
        r = await b.debounce("wf", "k", 10, delay=5.0, mode="leading")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
    assert [(p, f.payload, f.edge) for p, f in fires.log] == [
        ("A", 0, Edge.LEADING),
        ("B", 10, Edge.LEADING),
    ]
    assert fires.log[1][1].fired_at == near(t0 + 9 + 4.9 + 5.1)


async def test_both_edges_across_processes(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        t0 = trio.current_time()
        await a.debounce("wf", "k", 0, delay=5.0, mode="both")
        r = await b.debounce("wf", "k", 1, delay=5.0, mode="both")
        assert r.scheduled_at == near(t0 + 5.0)
        assert r.ping_count == 2
    assert [(p, f.edge, f.ping_count) for p, f in fires.log] == [
        ("A", Edge.LEADING, 1),
        ("A", Edge.TRAILING, 2),
    ]


async def test_mode_clash_and_nowait_are_refused(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB", on_exit="cancel") as (a, b):
        await a.debounce("wf", "k", delay=5.0)
        with pytest.raises(ValueError, match="differs from the mode 'trailing'"):
            await b.debounce("wf", "k", delay=5.0, mode="leading")
        with pytest.raises(RuntimeError, match=r"await coordinator\.debounce"):
            a.debounce_nowait("wf", "k", delay=5.0)
        with pytest.raises(ValueError, match="too long for a KV key"):
            await a.debounce("wf", "x" * 2000, delay=5.0)
    assert fires.log == []


async def test_fail_open_gives_a_local_window(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        store.down = True
        with caplog.at_level(logging.WARNING, logger="trio_debounce"):
            r = await a.debounce("wf", "k", 1, delay=2.0)
            assert r.owner
            assert r.outcome is Outcome.SCHEDULE_TRAILING
            r = await a.debounce("wf", "k", 2, delay=2.0)  # the local window keeps its burst
            assert r.outcome is Outcome.COALESCE
            assert r.ping_count == 2
        assert "failing open" in caplog.text
        await a.wait_idle()
        stats = a.statistics()
        assert stats.fail_open_windows == 1
        assert stats.backend_errors >= 1
        store.down = False
    [(_, fire)] = fires.log
    assert fire.payload == 2


async def test_raise_on_backend_error(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A", on_backend_error="raise") as (a,):
        store.down = True
        with pytest.raises(BackendUnavailableError):
            await a.debounce("wf", "k", delay=2.0)
        store.down = False
        assert len(a) == 0
    assert fires.log == []


async def test_finalize_during_an_outage_fires_and_deletes_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        await a.debounce("wf", "k", 1, delay=1.0)
        await b.debounce("wf", "k", 2, delay=1.0)
        store.down = True
        # Due at 1 s; finalize retries for op_timeout (2 s), then the owner, whose lease
        # (renewed at 0 s, for 6 s) it still holds, fires.
        await trio.sleep(6.0)
        assert [p for p, _ in fires.log] == ["A"]  # fired without the backend
        assert a.statistics().unconfirmed_fires == 1
        assert store.raw_get("w.d2Y.aw") is not None
        assert store.raw_get("w.d2Y.aw").value is not None  # type: ignore[union-attr]
        store.down = False
        await trio.sleep(LEASE)  # a heartbeat applies the queued delete
        entry = store.raw_get("w.d2Y.aw")
        assert entry is None or entry.value is None
        await trio.sleep(LEASE)
    assert len(fires.log) == 1  # nothing fired twice


async def test_write_that_failed_but_landed_is_recognised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        assert isinstance(b._backend, MemoryBackend)
        await a.debounce("wf", "k", 1, delay=3.0)
        b._backend.faults.apply_then_fail_next(ops=("put",))
        r = await b.debounce("wf", "k", 2, delay=3.0)
        assert r.outcome is Outcome.COALESCE
        assert r.ping_count == 2
        a_backend = a._backend
        assert isinstance(a_backend, MemoryBackend)
        a_backend.faults.apply_then_fail_next(ops=("put",))
        r = await a.debounce("wf", "k", 3, delay=3.0)
        assert r.owner
        assert r.ping_count == 3
    [(_, fire)] = fires.log
    assert fire.ping_count == 3
    assert fire.payload == 3


async def test_conflict_storm_fires_once(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    names = [f"P{i}" for i in range(10)]
    async with processes(store, fires, names) as coordinators:
        results = []

        async def ping(c: Coordinator, i: int) -> None:
            results.append(await c.debounce("wf", "k", i, delay=2.0))

        async with trio.open_nursery() as nursery:
            for i, c in enumerate(coordinators):
                nursery.start_soon(ping, c, i)
        assert sorted(r.ping_count for r in results) == list(range(1, 11))
        assert sum(r.owner for r in results) == 1
    assert len(fires.log) == 1
    assert fires.log[0][1].ping_count == 10


async def test_exit_releases_owned_windows(autojump_clock: trio.testing.MockClock) -> None:
    # Under at-most-once, on_exit="cancel" deletes the windows it owns.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "B") as (b,):
        async with processes(store, fires, "A", on_exit="cancel", delivery="at-most-once") as (a,):
            await a.debounce("wf", "k", "a", delay=50.0)
        # A released its window (and its lease): B's ping opens a fresh one at once.
        r = await b.debounce("wf", "k", "b", delay=1.0)
        assert r.owner
        assert r.outcome is Outcome.SCHEDULE_TRAILING
    assert [(p, f.payload) for p, f in fires.log] == [("B", "b")]
    assert store.raw_get("p.QQ") is None or store.raw_get("p.QQ").value is None  # type: ignore[union-attr]


async def test_reconcile_rearms_a_window_that_names_us(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A write that timed out can commit later and make a coordinator the owner of a
    # window it never armed: the slow reconcile arms it.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        r = await backend_a.register(
            "wf", "k", mode=Mode.TRAILING, delay=2.0, max_delay=None, run_id="r"
        )
        assert r.owner
        assert len(a) == 0
        await trio.sleep(3 * LEASE)
    [(process, fire)] = fires.log
    assert process == "A"
    assert fire.run_id == "r"


async def cut_off(backend: MemoryBackend, start: float, end: float) -> None:
    """Partition ``backend`` from its store from ``start`` to ``end`` seconds from now."""
    await trio.sleep(start)
    backend.faults.partitioned = True
    await trio.sleep(end - start)
    backend.faults.partitioned = False


async def test_register_whose_answer_was_lost_is_recognised_before_failing_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's write lands at once but its answer comes after op_timeout: a re-read finds
    # its write id, so the ping is taken as stored, with no local window beside it.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        backend_a.faults.delay_next(5.0, ops=("put",))
        r = await a.debounce("wf", "k", "a", delay=1.0)
        assert r.ping_count == 1  # recognised, not applied a second time
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        assert r.owner
        assert r.stored
        assert a.statistics().fail_open_windows == 0
        await trio.sleep(3.0)
    assert [(p, f.ping_count, f.payload) for p, f in fires.log] == [("A", 1, "a")]


# delay 3: the local window is still open at the reconcile (t0+6) after the fail-open
@pytest.mark.parametrize("delay", [3.0, 20.0])
async def test_register_that_timed_out_but_landed_fires_once(
    autojump_clock: trio.testing.MockClock, delay: float
) -> None:
    # A's write lands at once but its answer comes after op_timeout, and the store stays
    # out of reach through the re-read that would recognise it: A fails open with a
    # local window, while the shared window names A and takes B's ping (made while
    # A's call is in flight, before the shared window is due: a ping at or after its
    # due time would open the next window instead). The burst still fires once, with
    # both pings counted.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        backend_a.faults.delay_next(5.0, ops=("put",))
        peer: list[DebounceResult] = []

        async def ping_b() -> None:
            await trio.sleep(2.5)
            peer.append(await b.debounce("wf", "k", "b", delay=delay))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cut_off, backend_a, 1.0, 4.5)
            nursery.start_soon(ping_b)
            r = await a.debounce("wf", "k", "a", delay=delay)
        assert r.owner
        assert a.statistics().fail_open_windows == 1
        [r] = peer
        assert not r.owner
        assert r.ping_count == 2
        await trio.sleep(3 * LEASE + delay)
    assert [p for p, _ in fires.log] == ["A"]
    [(_, fire)] = fires.log
    assert fire.ping_count == 2
    assert fire.payload == "b"  # the latest stored payload (B's), not A's local one


@pytest.mark.parametrize(
    ("peer_ping_at", "fires_expected"),
    [(0.5, [("A", "a")]), (6.0, [("A", "a"), ("B", "a"), ("B", "b")])],
)
async def test_landed_register_after_its_local_window_fired(
    autojump_clock: trio.testing.MockClock,
    peer_ping_at: float,
    fires_expected: list[tuple[str, str]],
) -> None:
    # The late write is found only after the fail-open window fired (t=5). A peer's
    # ping before the shared window's due time (t=1) joins it: the reconcile deletes
    # it (the local fire covered it). A peer's ping after that due time never joins
    # it: it takes the shared window's fire (A's ping again: the duplicate of a
    # landed register, see docs/protocol.rst) and opens its own window, so no ping is
    # lost.
    store, fires = MemoryStore(), Fires()
    lease = 30.0  # heartbeats (and the reconcile) every 10 s
    names = ("A", "B")
    async with AsyncExitStack() as stack:
        a, b = [
            await stack.enter_async_context(
                open_coordinator(
                    handlers={"wf": fires.handler(name)},
                    backend=backend(store, name, process_lease=lease),
                )
            )
            for name in names
        ]
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        backend_a.faults.delay_next(5.0, ops=("put",))
        t0 = trio.current_time()

        async def peer() -> None:
            await trio.sleep(peer_ping_at)
            await b.debounce("wf", "k", "b", delay=1.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer)
            nursery.start_soon(cut_off, backend_a, 1.0, 4.5)
            # the answer is lost at t0+2, the re-read cannot reach the store: fails
            # open at t0+4
            await a.debounce("wf", "k", "a", delay=1.0)
        await trio.sleep(25.0)
    assert sorted((p, f.payload) for p, f in fires.log) == fires_expected
    assert fires.log[0][1].fired_at == near(t0 + 5.0)


async def test_requests_per_operation(autojump_clock: trio.testing.MockClock) -> None:
    # The protocol's cost per operation, as the protocol page states it.
    store = MemoryStore()
    a, b = backend(store, "A"), backend(store, "B")
    await b.refresh_lease()  # B's lease table does not know A yet
    await a.refresh_lease()

    async def cost(call: Any) -> dict[str, int]:
        before = store.requests.copy()
        await call
        return dict(store.requests - before)

    kw: dict[str, Any] = {"mode": Mode.TRAILING, "delay": 5.0, "max_delay": None, "run_id": "r"}
    # opened: a first ping of the key reads it; then the owner writes against the
    # revision of its own last write
    assert await cost(a.register("wf", "k", **kw)) == {"get": 1, "put": 1}
    assert await cost(a.register("wf", "k", **kw)) == {"put": 1}  # extended
    # fire, at-least-once: a fire record, then the window's tombstone against the revision
    # of the owner's last write; the record's purge (no marker) once the handler returned
    await trio.sleep(5.0)
    await a.refresh_lease()  # as its heartbeat does (a lapsed lease is renewed first)
    before = store.requests.copy()
    fired = await a.finalize("wf", "k", "r")
    assert dict(store.requests - before) == {"put": 2}  # the record, the tombstone
    assert fired.outcome is Finalized.FIRE
    assert fired.fire_id is not None
    assert await cost(a.complete(fired.fire_id)) == {"purge": 1}  # no marker left
    # fire, at-most-once: one compare-and-swap that marks the window fired; the next
    # window opens over the delete marker, and then over the tombstone, unread
    assert await cost(a.register("wf", "k", **kw)) == {"put": 1}
    await trio.sleep(5.0)
    await a.refresh_lease()
    before = store.requests.copy()
    fired = await a.finalize("wf", "k", "r", delivery="at-most-once")
    assert dict(store.requests - before) == {"put": 1}
    assert fired.outcome is Finalized.FIRE
    assert fired.fire_id is None
    assert await cost(a.register("wf", "k", **kw)) == {"put": 1}
    await trio.sleep(2.0)
    # coalesced: the first time B meets owner A it reads A's lease, then never again;
    # B's next ping writes against the revision of its own last write
    assert await cost(b.register("wf", "k", **kw)) == {"get": 2, "put": 1}
    assert await cost(b.register("wf", "k", **kw)) == {"put": 1}
    # A's write against its own last revision loses to B's (and B's then to A's): a
    # re-read and a retry; the key is contended from then on, so each reads first
    assert await cost(a.register("wf", "k", **kw)) == {"get": 1, "put": 2}
    assert await cost(b.register("wf", "k", **kw)) == {"get": 1, "put": 2}
    assert await cost(a.register("wf", "k", **kw)) == {"get": 1, "put": 1}
    await trio.sleep(3.0)
    assert await cost(b.register("wf", "k", **kw)) == {"get": 1, "put": 1}
    await trio.sleep(2.0)
    # the owner finalizes after B pushed the fire: a reschedule records when it wakes
    await a.refresh_lease()
    assert await cost(a.finalize("wf", "k", "r")) == {"get": 1, "put": 1}


async def test_requests_per_operation_of_fires_that_keep_a_tombstone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # queue-latest and drop_stale fires leave a tombstone instead of a delete, written
    # against the owner's remembered revision as the delete is (docs/protocol.rst,
    # "Requests per operation"); the end of the run writes against the tombstone.
    store = MemoryStore()
    a = backend(store, "A")
    await a.refresh_lease()

    async def cost(call: Any) -> dict[str, int]:
        before = store.requests.copy()
        await call
        return dict(store.requests - before)

    kw: dict[str, Any] = {"mode": Mode.TRAILING, "delay": 5.0, "max_delay": None, "run_id": "r"}
    q = {**kw, "overlap": "queue-latest"}
    assert await cost(a.register("wf", "q", **q)) == {"get": 1, "put": 1}
    assert await cost(a.register("wf", "q", **q)) == {"put": 1}
    await trio.sleep(5.0)
    await a.refresh_lease()
    before = store.requests.copy()
    fired = await a.finalize("wf", "q", "r")
    assert dict(store.requests - before) == {"put": 2}  # the record, the tombstone
    assert (fired.outcome, fired.blocks) == (Finalized.FIRE, True)
    # the run ends: its running state is cleared from the tombstone it wrote, unread
    assert await cost(a.end_run("wf", "q", "r")) == {"put": 1}
    # at-most-once, drop_stale: one compare-and-swap of the tombstone that keeps the
    # fired order key; the next window opens over it, unread
    o = {**kw, "order_key": 3, "drop_stale": True}
    assert await cost(a.register("wf", "o", **o)) == {"get": 1, "put": 1}
    await trio.sleep(5.0)
    await a.refresh_lease()
    before = store.requests.copy()
    fired = await a.finalize("wf", "o", "r", delivery="at-most-once")
    assert dict(store.requests - before) == {"put": 1}
    assert fired.outcome is Finalized.FIRE
    assert await cost(a.register("wf", "o", **{**o, "order_key": 4})) == {"put": 1}
    # a stale ping writes nothing, decided on a fresh read
    r = await a.register("wf", "o", **{**o, "order_key": 2})
    assert r.outcome is Registered.STALE


@pytest.mark.parametrize(
    "garbage", [b"", b"not json", b'{"v": 99}', b'{"v": 1, "owner": 3}', b"[1, 2]"]
)
async def test_unreadable_document_is_treated_as_absent(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    store, fires = MemoryStore(), Fires()
    store.raw_put("w.d2Y.aw", garbage)
    async with processes(store, fires, "A") as (a,):
        with caplog.at_level(logging.WARNING, logger="trio_debounce"):
            r = await a.debounce("wf", "k", "a", delay=1.0)
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        assert "unreadable" in caplog.text
    assert [f.payload for _, f in fires.log] == ["a"]


async def test_contention_until_the_deadline_coalesces_without_storing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Every write of B loses (injected conflicts) until its deadline; A, the live owner,
    # has a fire pending after B's ping arrived, so B's ping is absorbed unstored.
    store, fires = MemoryStore(), Fires()
    b_backend = backend(store, "B", op_timeout=1.0)
    async with (
        processes(store, fires, "A") as (a,),
        open_coordinator(handlers={"wf": fires.handler("B")}, backend=b_backend) as b,
    ):
        await a.debounce("wf", "k", "a", delay=5.0)
        b_backend.faults.conflict_next(1000)
        r = await b.debounce("wf", "k", "b", delay=5.0)
        assert r.outcome is Outcome.COALESCE
        assert not r.owner
        assert not r.stored
        assert r.ping_count == 1  # what B last read
        assert b.statistics().unstored_pings == 1
        assert b_backend.unstored_coalesces == 1
        assert b_backend.conflicts > 1
        b_backend.faults.clear()
    assert [(p, f.ping_count) for p, f in fires.log] == [("A", 1)]


@pytest.mark.parametrize("ping", ["both-edges", "throttle"])
async def test_contention_never_absorbs_unstored_a_ping_no_fire_would_carry(
    autojump_clock: trio.testing.MockClock, ping: str
) -> None:
    # A both-edges window with one ping has no trailing fire to come: B's ping, not
    # stored, would be in no fire. A flow window counts each accepted ping in a fire.
    # Either way B's ping raises (it never fails open into a lost ping).
    store, fires = MemoryStore(), Fires()
    b_backend = backend(store, "B", op_timeout=1.0)
    async with (
        processes(store, fires, "A") as (a,),
        open_coordinator(
            handlers={"wf": fires.handler("B")}, backend=b_backend, on_backend_error="raise"
        ) as b,
    ):
        if ping == "both-edges":
            await a.debounce("wf", "k", "a", delay=5.0, mode="both")
        else:
            await a.throttle("wf", "k", "a", interval=5.0)
            await a.throttle("wf", "k", "a2", interval=5.0)  # a trailing fire pending
        b_backend.faults.conflict_next(1000)
        if ping == "both-edges":
            call = b.debounce("wf", "k", "b", delay=5.0, mode="both")
        else:
            call = b.throttle("wf", "k", "b", interval=5.0)
        with pytest.raises(BackendUnavailableError, match=r"did not complete within 1\.0 s"):
            await call
        assert b_backend.unstored_coalesces == 0
        b_backend.faults.clear()


async def test_contention_without_a_live_owner_is_a_backend_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    a_backend = backend(store, "A", op_timeout=1.0)
    async with open_coordinator(
        handlers={"wf": fires.handler("A")}, backend=a_backend, on_backend_error="raise"
    ) as a:
        a_backend.faults.conflict_next(1000)
        with pytest.raises(BackendUnavailableError, match=r"did not complete within 1\.0 s"):
            await a.debounce("wf", "k", delay=5.0)
        a_backend.faults.clear()
    assert fires.log == []


async def test_oversized_document_is_refused_before_sending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(max_value_bytes=600), Fires()
    async with processes(store, fires, "A") as (a,):
        with pytest.raises(ValueError, match="exceeds 600"):
            await a.debounce("wf", "k", delay=1.0, run_id="r" * 700)
        assert a.statistics().fail_open_windows == 0
        assert len(a) == 0
    assert fires.log == []


async def test_sweep_removes_markers_and_long_dead_leases_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    dead, live = backend(store, "dead"), backend(store, "live")
    await dead.refresh_lease()
    await dead.register("wf", "kept", mode=Mode.TRAILING, delay=1e6, max_delay=None, run_id="r1")
    await dead.register("wf", "gone", mode=Mode.TRAILING, delay=1e6, max_delay=None, run_id="r2")
    await dead.cancel("wf", "gone")
    await trio.sleep(11 * LEASE + SKEW + 1.0)  # expired more than 10 leases ago
    await live.refresh_lease()
    removed = await live.sweep()
    assert removed == 2  # the cancel tombstone of "gone" and the dead process's lease
    assert store.raw_get("w.d2Y.Z29uZQ") is None
    assert store.raw_get("p.ZGVhZA") is None
    kept = store.raw_get("w.d2Y.a2VwdA")
    assert kept is not None
    assert kept.value is not None  # a dead owner's window waits for a takeover
    assert store.raw_get("p.bGl2ZQ") is not None
    # One sweeper at a time: another process does not sweep while the lock is held.
    other = backend(store, "other")
    await other.refresh_lease()
    assert await other.sweep() == 0


@pytest.mark.parametrize("skew", [-0.9, 0.9])
async def test_clock_skew_within_tolerance_takes_nothing_over(
    autojump_clock: trio.testing.MockClock, skew: float
) -> None:
    store, fires = MemoryStore(), Fires()
    skewed = backend(store, "B", clock_skew=skew)
    async with (
        processes(store, fires, "A") as (a,),
        open_coordinator(handlers={"wf": fires.handler("B")}, backend=skewed) as b,
    ):
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=4 * LEASE)
        for _ in range(7):
            await trio.sleep(LEASE / 2)
            r = await b.debounce("wf", "k", "b", delay=4 * LEASE)
            assert not r.owner
            # B's fire time, converted back to Trio's clock, is exact despite the skew
            assert r.scheduled_at == near(trio.current_time() + 4 * LEASE)
    [(process, fire)] = fires.log
    assert process == "A"
    assert fire.ping_count == 8
    assert fire.fired_at == near(t0 + 3.5 * LEASE + 4 * LEASE + skew)


@pytest.mark.parametrize("on_backend_error", ["fail-open", "raise"])
async def test_refused_permissions_are_never_failed_open(
    autojump_clock: trio.testing.MockClock, on_backend_error: Any
) -> None:
    store, fires = MemoryStore(), Fires()
    a_backend = backend(store, "A")
    async with open_coordinator(
        handlers={"wf": fires.handler("A")}, backend=a_backend, on_backend_error=on_backend_error
    ) as a:
        a_backend.faults.fail_next(ops=("get",), error=BackendAuthError)
        with pytest.raises(BackendAuthError):
            await a.debounce("wf", "k", delay=1.0)
        assert a.statistics().fail_open_windows == 0
        assert len(a) == 0
    assert fires.log == []


async def test_flush_of_a_both_edges_window_with_one_known_ping(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        await a.debounce("wf", "one", 1, delay=5.0, mode="both")
        assert not await a.flush("wf", "one")  # no trailing fire known to be due
        await a.debounce("wf", "two", 1, delay=5.0, mode="both")
        await b.debounce("wf", "two", 2, delay=5.0, mode="both")
        # A does not know of B's ping until it finalizes: False, yet the flush fires it
        assert not await a.flush("wf", "two")
        await a.wait_idle()
        assert trio.current_time() < 1.0
    assert [(f.key, f.edge, f.ping_count) for _, f in fires.log] == [
        ("one", Edge.LEADING, 1),
        ("two", Edge.LEADING, 1),
        ("two", Edge.TRAILING, 2),
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"process_lease": 0}, ValueError, "process_lease must be > 0"),
        ({"op_timeout": float("nan")}, ValueError, "op_timeout must not be NaN"),
        ({"max_clock_skew": -1.0}, ValueError, "max_clock_skew must be > 0"),
        ({"process_lease": "60"}, TypeError, "process_lease must be a number"),
        ({"process_id": ""}, ValueError, "process_id must be a non-empty str"),
        ({"clock_skew": float("inf")}, ValueError, "clock_skew must be a finite number"),
    ],
)
def test_bad_backend_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        MemoryBackend(MemoryStore(), **kwargs)


async def test_a_backend_serves_one_coordinator_at_a_time() -> None:
    shared = MemoryBackend(MemoryStore())
    async with open_coordinator(backend=shared):
        with pytest.raises(RuntimeError, match="already serves an open coordinator"):
            async with open_coordinator(backend=shared):
                pass  # pragma: no cover
    async with open_coordinator(backend=shared):  # free again once the first closed
        pass
    with pytest.raises(TypeError, match=r"must be a trio_debounce\.abc\.DebounceBackend"):
        async with open_coordinator(backend=object()):  # type: ignore[arg-type]
            pass  # pragma: no cover


async def test_leading_edge_fires_when_the_opening_write_was_overwritten_before_its_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's opening write lands but its answer is lost; B pings before A's retry reads
    # the document back. A still recognises the window as the one it opened (by the
    # opening write's id), so its leading edge fires, once.
    store, fires = MemoryStore(), Fires()
    a_backend = backend(store, "A")
    async with (
        processes(store, fires, "B") as (b,),
        open_coordinator(handlers={"wf": fires.handler("A")}, backend=a_backend) as a,
    ):
        a_backend.faults.delay_next(0.0, ops=("put",))  # the leading fire's record
        a_backend.faults.apply_then_fail_next(ops=("put",))  # the opening write

        async def slow_backoff(attempt: int) -> None:
            await trio.sleep(0.3)  # A's retry comes after B's ping

        a_backend._view.backoff = slow_backoff  # type: ignore[method-assign]

        async def peer() -> None:
            await trio.sleep(0.1)
            r = await b.debounce("wf", "k", "b", delay=5.0, mode="leading")
            assert r.outcome is Outcome.COALESCE

        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer)
            r = await a.debounce("wf", "k", "a", delay=5.0, mode="leading")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
        assert r.owner
        assert r.ping_count == 2
    assert [(p, f.payload, f.edge) for p, f in fires.log] == [("A", "a", Edge.LEADING)]


async def test_reconcile_drops_an_owner_window_a_peer_took(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B took A's fire long before A's armed time; A's reconcile notices the window is
    # gone, so A stops counting it as pending (wait_idle returns) and can never fire it.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        await a.debounce("wf", "k", "a", delay=100 * LEASE)
        await b.debounce("wf", "k", "b", delay=1.0)
        assert a.statistics().pending_trailing_fires == 1
        await a.wait_idle()
        assert trio.current_time() <= 2 * LEASE + 0.1  # the reconcile, not the armed time
        assert a.statistics().pending_trailing_fires == 0
        assert len(a) == 0
    assert [(p, f.payload) for p, f in fires.log] == [("B", "b")]


async def test_a_stale_finalize_does_not_forget_a_newer_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's first window is taken by B; A opens a second one under the same key. When
    # A's stale task for the first window finds it abandoned, A must still release the
    # second one at exit, so B's next ping opens a fresh window (a new leading edge).
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "B") as (b,):
        async with processes(store, fires, "A", on_exit="cancel", delivery="at-most-once") as (a,):
            await a.debounce("wf", "k", 1, delay=3 * LEASE, mode="both")
            await b.debounce("wf", "k", 2, delay=1.0, mode="both")  # B takes it at t=1
            await trio.sleep(2.0)
            await a.debounce("wf", "k", 3, delay=10 * LEASE, mode="both")  # a new window
            await trio.sleep(3 * LEASE)  # A's stale task wakes and is abandoned
        r = await b.debounce("wf", "k", 4, delay=1.0, mode="both")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
    assert [(p, f.payload, f.edge) for p, f in fires.log] == [
        ("A", 1, Edge.LEADING),
        ("B", 2, Edge.TRAILING),
        ("A", 3, Edge.LEADING),
        ("B", 4, Edge.LEADING),
    ]


async def test_a_run_id_that_cannot_be_shared_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        with pytest.raises(ValueError, match="run_id '\\\\ud800' is not valid Unicode"):
            await a.debounce("wf", "k", delay=1.0, run_id="\ud800")
    assert fires.log == []


async def test_no_takeover_right_after_an_outage(autojump_clock: trio.testing.MockClock) -> None:
    # After B's store calls fail and then answer again, B waits one heartbeat interval
    # plus the tolerated skew before taking anything over, so live peers can renew
    # their leases first.
    store = MemoryStore()
    a, b = backend(store, "A"), backend(store, "B")
    kw: dict[str, Any] = {"mode": Mode.TRAILING, "delay": 1e6, "max_delay": None}
    await a.register("wf", "k", run_id="r", **kw)  # A then stops renewing: it is dead
    await b.refresh_lease()
    await trio.sleep(LEASE + SKEW + 1.0)
    b.faults.partitioned = True
    with pytest.raises(BackendUnavailableError):
        await b.refresh_lease()
    b.faults.partitioned = False
    await b.refresh_lease()  # the backend answers again
    r = await b.register("wf", "k", run_id="x", **kw)
    assert r.outcome is Registered.COALESCED  # A's lease lapsed long ago, yet no takeover
    await trio.sleep(b.heartbeat_interval + SKEW)
    r = await b.register("wf", "k", run_id="x", **kw)
    assert r.outcome is Registered.TOOK_OVER
    assert r.run_id == "r"
    assert r.ping_count == 3


@pytest.mark.parametrize("on_backend_error", ["fail-open", "raise"])
async def test_a_lease_write_that_does_not_answer_at_start(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    on_backend_error: Any,
) -> None:
    store = MemoryStore()
    slow = backend(store, "A")
    slow.faults.delay_next(100.0, ops=("put",))  # the lease write gets no answer in time
    if on_backend_error == "raise":
        with pytest.raises(BackendUnavailableError, match="lease could not be written"):
            async with open_coordinator(backend=slow, on_backend_error="raise"):
                pytest.fail("opened")  # pragma: no cover
        return
    with caplog.at_level(logging.WARNING, logger="trio_debounce"):
        async with open_coordinator(backend=slow, on_exit="cancel"):
            pass
    assert "backend unavailable at start" in caplog.text


async def test_a_fail_open_fire_carries_token_zero(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        store.down = True
        await a.debounce("wf", "k", "x", delay=1.0, mode="both")
        await a.debounce("wf", "k", "y", delay=1.0, mode="both")
        await a.wait_idle()
        store.down = False
    assert [(f.edge, f.fencing_token) for _, f in fires.log] == [
        (Edge.LEADING, 0),
        (Edge.TRAILING, 0),
    ]
    async with open_coordinator(handlers={"wf": fires.handler("L")}) as local:
        await local.debounce("wf", "k", delay=1.0, mode="both")
        await local.debounce("wf", "k", delay=1.0, mode="both")
    assert [f.fencing_token for p, f in fires.log if p == "L"] == [1, 2]


async def test_a_takeover_deferred_by_the_outage_grace_comes_when_the_grace_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B starts in an outage that ends at once: the grace after it defers adopting the
    # dead A's window, and the takeover follows within a heartbeat of the grace's end,
    # not at the next periodic reconcile (six heartbeats later).
    store, fires = MemoryStore(), Fires()
    dead = backend(store, "A")
    with trio.CancelScope() as a_scope:
        async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=dead) as a:
            t0 = trio.current_time()
            await a.debounce("wf", "k", "a", delay=LEASE + SKEW + 2.0)
            dead.faults.partitioned = True
            a_scope.cancel()
    await trio.sleep(LEASE + SKEW + 0.5)  # A's lease has lapsed
    b = backend(store, "B")
    b.faults.fail_next(1)  # a call at start fails: the outage, over at once
    started = trio.current_time()
    async with open_coordinator(handlers={"wf": fires.handler("B")}, backend=b) as c:
        with trio.fail_after(20 * LEASE):
            await fires.wait_for(1)
        seen = trio.current_time()
        assert c.statistics().takeovers == 1
    [(process, fire)] = fires.log
    assert (process, fire.payload) == ("B", "a")
    grace_ends = started + b.heartbeat_interval + SKEW
    assert t0 + LEASE + SKEW + 2.0 < grace_ends  # the window came due in the grace
    assert grace_ends <= seen <= grace_ends + b.heartbeat_interval + 0.1


@pytest.mark.parametrize("pinger", ["owner", "peer"])
@pytest.mark.parametrize("on_backend_error", ["raise", "fail-open"])
async def test_a_ping_during_a_stall_is_never_answered_as_merged_into_a_fired_window(
    autojump_clock: trio.testing.MockClock, pinger: str, on_backend_error: Any
) -> None:
    # The pinger's store stalls past the ping's deadline (its requests reach the store
    # only later). Meanwhile the window came due and its owner fired it: the ping was
    # never stored and no fire is to come, so it must raise or fail open; coalescing it
    # unstored (stored=False) into the fired window would lose it without a word.
    store, fires = MemoryStore(), Fires()
    a_backend, b_backend = backend(store, "A"), backend(store, "B")
    stalled = a_backend if pinger == "owner" else b_backend
    async with (
        open_coordinator(
            handlers={"wf": fires.handler("A")},
            backend=a_backend,
            on_backend_error=on_backend_error,
        ) as a,
        open_coordinator(
            handlers={"wf": fires.handler("B")},
            backend=b_backend,
            on_backend_error=on_backend_error,
        ) as b,
    ):
        c = a if pinger == "owner" else b
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=2.0)
        await b.debounce("wf", "k", "b0", delay=2.0)  # B knows the window (cached)
        await trio.sleep(1.5)
        stalled.faults.stall_next(4.0, n=10_000)
        if on_backend_error == "raise":
            with pytest.raises(BackendUnavailableError, match="did not complete"):
                await c.debounce("wf", "k", "late", delay=2.0)
        else:
            r = await c.debounce("wf", "k", "late", delay=2.0)
            assert r.stored, r  # a local window (failed open), not an unstored merge
            assert c.statistics().fail_open_windows == 1
        assert c.statistics().unstored_pings == 0
        assert trio.current_time() >= t0 + 1.5 + 2.0  # the op_timeout: 2 s
        await trio.sleep(10.0)
        stalled.faults.clear()
    payloads = [f.payload for _, f in fires.log]
    assert payloads.count("b0") == 1  # the burst before the stall fired once
    assert payloads.count("late") == (on_backend_error == "fail-open")


async def test_a_stalled_write_whose_caller_gave_up_lands_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    b = backend(store, "B")
    view = b._view.store  # B's client of the store, through its faults
    revision = await view.put("x", b"1", last=0)
    b.faults.stall_next(5.0, n=2, ops=("put",))
    with trio.move_on_after(1.0) as scope:
        await view.put("x", b"2", last=revision)
    assert scope.cancelled_caught
    entry = await view.get("x")
    assert entry is not None
    assert entry.value == b"1"  # not yet: a read sees the old value
    await trio.sleep(4.0)
    entry = store.raw_get("x")
    assert entry is not None
    assert entry.value == b"2"  # landed 5 s after it was sent
    # A stalled write that conflicts by the time it lands does not land.
    with trio.move_on_after(1.0):
        await view.put("x", b"3", last=revision)
    await trio.sleep(5.0)
    entry = store.raw_get("x")
    assert entry is not None
    assert entry.value == b"2"
    # A stalled call that is waited for is applied and answered after the stall.
    b.faults.stall_next(5.0, ops=("delete",))
    start = trio.current_time()
    assert (await view.delete("x", last=entry.revision)) > entry.revision
    assert trio.current_time() - start == pytest.approx(5.0)
    with pytest.raises(ValueError, match="seconds must be finite"):
        b.faults.stall_next(-1.0)


@pytest.mark.parametrize("noticed_by", ["finalize", "ping", "reconcile"])
async def test_a_window_deleted_from_outside_counts_as_a_cancel_once(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    noticed_by: str,
) -> None:
    # An operator deletes an open window's key (a KV delete, as `nats kv del` does).
    # Whichever of the owner's finalize, its next ping or its reconcile notices first
    # counts it once: a cancel, and deleted_externally; one warning.
    store, fires = MemoryStore(), Fires()
    delay = {"finalize": 30.0, "ping": 30.0, "reconcile": 1000.0}[noticed_by]
    with caplog.at_level(logging.WARNING, logger="trio_debounce"):
        async with processes(store, fires, "A") as (a,):
            t0 = trio.current_time()
            await a.debounce("wf", "k", "a", delay=delay)
            await trio.sleep(2.0)
            store.raw_put(window_key("wf", "k"), None)  # the operator's delete
            if noticed_by == "ping":
                r = await a.debounce("wf", "k", "b", delay=5.0)
                assert r.outcome is Outcome.SCHEDULE_TRAILING  # a new window
                assert r.ping_count == 1
                assert a.statistics().deleted_externally == 1
            elif noticed_by == "reconcile":
                await trio.sleep(14 * BEAT)  # past two periodic reconciles
                assert a.statistics().deleted_externally == 1
                assert len(a) == 0
            await a.wait_idle()
            stats = a.statistics()
    assert (stats.cancelled, stats.deleted_externally) == (1, 1)
    if noticed_by == "ping":
        [(_, fire)] = fires.log  # only the new window fires, with the new ping
        assert (fire.payload, fire.ping_count) == ("b", 1)
        assert fire.fired_at == near(t0 + 2.0 + 5.0)
    else:
        assert fires.log == []
    assert caplog.text.count("was closed by another writer") == 1


async def test_a_peers_fire_is_never_taken_for_a_delete(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A peer's ping moves A's window earlier and takes its fire; A wakes at its own
    # armed time, long after (more than a lease): the tombstone is still there, so A
    # counts nothing as deleted.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, b):
        await a.debounce("wf", "k", "a", delay=5 * LEASE)
        r = await b.debounce("wf", "k", "b", delay=1.0)
        assert not r.owner
        await trio.sleep(6 * LEASE)
        await a.wait_idle()
    assert [(p, f.payload) for p, f in fires.log] == [("B", "b")]
    assert a.statistics().deleted_externally == 0
    assert a.statistics().cancelled == 0


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_requests_of_a_leading_opening(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    # The request table: under at-least-once a leading opening adds 1 put (its fire
    # record, before the opening write) and 1 purge (once the handler has returned).
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A", delivery=delivery) as (a,):
        await trio.sleep(0.1)  # past the start-up's requests
        before = dict(store.requests)
        r = await a.debounce("wf", "k", "x", delay=1.0, mode="leading")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
        await a.wait_idle()
        await trio.lowlevel.checkpoint()
        spent = {op: n - before.get(op, 0) for op, n in store.requests.items()}
        spent = {op: n for op, n in spent.items() if n}
    # the document's read and the opening write, in both modes
    want = {"get": 1, "put": 2, "purge": 1} if delivery == "at-least-once" else {"get": 1, "put": 1}
    assert spent == want
    assert [(p, f.edge) for p, f in fires.log] == [("A", Edge.LEADING)]


async def test_a_shared_window_refuses_a_delay_no_clock_can_keep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 1e308 s was accepted and, once the exit jumped the clock there, a heartbeat's
    # interval no longer moved it: the coordinator spun for ever.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        with pytest.raises(ValueError, match=r"delay of a shared window .* got 1e\+308"):
            await a.debounce("wf", "k", delay=1e308)
        with pytest.raises(ValueError, match=r"max_delay of a shared window .* got 2000000000.0"):
            await a.debounce("wf", "k", delay=1.0, max_delay=2e9, mode="both")
        r = await a.debounce("wf", "k", delay=1e9)  # the longest it keeps
        assert r.outcome is Outcome.SCHEDULE_TRAILING
        assert await a.cancel("wf", "k")
    assert fires.log == []


@pytest.mark.parametrize("on_backend_error", ["raise", "fail-open"])
async def test_an_opening_leading_ping_cut_short_answers_within_two_op_timeouts(
    autojump_clock: trio.testing.MockClock, on_backend_error: Any
) -> None:
    # At least once, a ping opening a leading window writes its leading fire's record
    # first. The record is written; then the store stalls (every call reaches it 10 s
    # late): the opening write and its re-read are each cut by op_timeout (2 s), and
    # the record, now unneeded, is not taken back in time either. The ping is answered
    # 2 * op_timeout after it arrived (it raises, or fails open), not after a third
    # op_timeout spent on the record (6 s before); the heartbeat deletes the record
    # once the store answers.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, ["A"], on_backend_error=on_backend_error) as (a,):
        a_backend = a._backend
        assert isinstance(a_backend, MemoryBackend)
        a_backend.faults.delay_next(0.0, ops=("get",))  # the window's first read
        a_backend.faults.delay_next(0.0, ops=("put",))  # the leading fire's record
        a_backend.faults.stall_next(10.0, n=50, ops=("get", "put", "purge"))
        t0 = trio.current_time()
        try:
            result: Any = await a.debounce("wf", "k", "a", delay=1.0, mode="leading")
        except BackendUnavailableError as exc:
            result = exc
        took = trio.current_time() - t0
        assert [e.key for e in await store.entries("f.")] != []  # the record is there
        a_backend.faults.clear()
        await trio.sleep(30.0)
        assert [e.key for e in await store.entries("f.")] == []  # and taken back
    assert took <= 2 * 2.0 + 0.01, took
    if on_backend_error == "raise":
        assert isinstance(result, BackendUnavailableError), result
    else:
        assert result.outcome is Outcome.FIRE_IMMEDIATE
        assert [(f.payload, f.edge) for _, f in fires.log] == [("a", Edge.LEADING)]


async def test_a_batch_whose_first_phase_ran_over_still_answers_within_two_op_timeouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # cluster-one-node (2026-12-06): two pings were answered 14.3 s after they arrived,
    # their batch's re-read given a full op_timeout from when its first phase ended,
    # 4.3 s past its deadline. Here a step of the first phase runs over (shielded,
    # 1.5 s with op_timeout 1 s), the write is then cut short, and the store stalls:
    # the re-read gets only what is left of 2 * op_timeout (2.5 s before).
    store = MemoryStore()
    a = backend(store, "A", op_timeout=1.0)
    await a.refresh_lease()
    kw: dict[str, Any] = {"mode": Mode.TRAILING, "delay": 5.0, "max_delay": None}
    await a.register("wf", "k", run_id="r1", payload=1, **kw)
    owner_live = a._leases.owner_live

    async def slow(doc: Any, now: float) -> bool:
        with trio.CancelScope(shield=True):
            await trio.sleep(1.5)
        return await owner_live(doc, now)

    a._leases.owner_live = slow  # type: ignore[method-assign]
    a.faults.stall_next(10.0, n=20, ops=("get", "put"))
    t0 = trio.current_time()
    with pytest.raises(BackendUnavailableError, match=r"did not complete within 1\.0 s"):
        await a.register("wf", "k", run_id="r2", payload=2, **kw)
    assert trio.current_time() - t0 <= 2 * 1.0 + 0.01


@pytest.mark.parametrize("on_backend_error", ["raise", "fail-open"])
async def test_a_ping_waiting_behind_its_keys_writes_answers_within_two_op_timeouts(
    autojump_clock: trio.testing.MockClock, on_backend_error: Any
) -> None:
    # The store stalls (every call reaches it 10 s late). L's write of the key is cut
    # by op_timeout (2 s) and re-read for one more; P, 0.1 s behind L, waits for it;
    # then the window's due finalize takes the key's turn before P (2 s more). P is
    # answered 2 * op_timeout after it arrived, as a timeout (it raises, or fails
    # open), not after everything ahead of it (5.9 s); so is Q, 0.1 s behind P.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, ["A"], on_backend_error=on_backend_error) as (a,):
        await a.debounce("wf", "k", "0", delay=1.0)
        a_backend = a._backend
        assert isinstance(a_backend, MemoryBackend)
        await trio.sleep(0.5)
        a_backend.faults.stall_next(10.0, n=50)
        took: dict[str, tuple[float, Any]] = {}

        async def ping(name: str) -> None:
            t0 = trio.current_time()
            try:
                result: Any = await a.debounce("wf", "k", name, delay=1.0)
            except BackendUnavailableError as exc:
                result = exc
            took[name] = (trio.current_time() - t0, result)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping, "L")
            await trio.sleep(0.1)
            nursery.start_soon(ping, "P")
            await trio.sleep(0.1)
            nursery.start_soon(ping, "Q")  # waits behind P: timed once P gives up
        a_backend.faults.clear()
        await trio.sleep(30.0)
    for name in ("L", "P", "Q"):
        seconds, result = took[name]
        assert seconds <= 2 * 2.0 + 0.01, (name, seconds)
        if on_backend_error == "raise":
            assert isinstance(result, BackendUnavailableError), (name, result)
    if on_backend_error == "fail-open":
        # L opened a local window, and P and Q joined it: it fires Q's payload.
        assert took["L"][1].outcome is Outcome.SCHEDULE_TRAILING
        assert took["P"][1].outcome is Outcome.COALESCE
        assert took["Q"][1].outcome is Outcome.COALESCE
        assert "Q" in [f.payload for _, f in fires.log]
