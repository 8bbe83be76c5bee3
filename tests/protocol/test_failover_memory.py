"""No lost windows, on the in-memory fake under MockClock: shared payloads, failover
without a ping, both delivery guarantees, stale owners, fencing and hand-off."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import BEAT, LEASE, SKEW, backend, die, process, processes
from trio_debounce import (
    BackendUnavailableError,
    Edge,
    Finalized,
    LeadingReRunSkipped,
    Mode,
    Outcome,
    Registered,
    open_coordinator,
)
from trio_debounce._keys import window_key
from trio_debounce._protocol import _AFTER_KEEP, WindowDoc, _FireRecord
from trio_debounce.testing import MemoryBackend, MemoryStore

#: The longest a dead owner's window waits past its due time: its lease lapses, the
#: skew passes, and a survivor's next heartbeat notices.
FAILOVER = LEASE + SKEW + BEAT


async def test_payload_is_the_latest_stored_one_whoever_fires(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "A") as (a, _, _), process(store, fires, "B") as (b, _, _):
        await a.debounce("wf", "k", {"n": 1}, delay=2.0)
        await b.debounce("wf", "k", {"n": 2, "t": (1, 2)}, delay=2.0)
    # the owner fires B's payload, as JSON round-tripped (a tuple comes back a list)
    assert fires.by_attempt() == [("A", "k", {"n": 2, "t": [1, 2]}, 2, 1)]


async def test_a_payload_that_cannot_be_stored_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(max_value_bytes=2000), Fires()
    async with process(store, fires, "A") as (a, _, _):
        with pytest.raises(TypeError, match=r"payload <object object at .*> cannot be stored"):
            await a.debounce("wf", "k", object(), delay=1.0)
        with pytest.raises(ValueError, match="payload nan cannot be stored as JSON"):
            await a.debounce("wf", "k", float("nan"), delay=1.0)
        with pytest.raises(
            ValueError, match="payload of 'wf'/'k' is 5002 bytes serialized, more than the 2000"
        ):
            await a.debounce("wf", "k", "x" * 5000, delay=1.0)
        assert len(a) == 0
        assert a.statistics().fail_open_windows == 0
    assert fires.log == []


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_dead_owner_window_fires_without_a_ping(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B", delivery=delivery) as (b, _, _):
        async with process(store, fires, "A", delivery=delivery) as (a, a_backend, a_scope):
            t0 = trio.current_time()
            await a.debounce("wf", "k", "a", delay=3.0)
            await b.debounce("wf", "k", "b", delay=3.0)  # due at t0 + 3
            die(a_backend, a_scope)
        assert fires.log == []
        await trio.sleep(FAILOVER + 3.0)
        assert b.statistics().takeovers == 1
    [(process_, fire)] = fires.log
    assert (process_, fire.payload, fire.ping_count, fire.attempt) == ("B", "b", 2, 1)
    # fired at once when adopted, its time having passed, within the failover bound
    assert fire.fired_at <= t0 + 3.0 + FAILOVER


async def test_dead_owner_window_due_later_fires_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A") as (a, a_backend, a_scope):
            t0 = trio.current_time()
            await a.debounce("wf", "k", "a", delay=60.0)
            die(a_backend, a_scope)
        await trio.sleep(FAILOVER)
        # B adopted it before its time: it fires at its scheduled time, not before
        assert fires.log == []
        assert len(b) == 1
        await b.wait_idle()
    [(process_, fire)] = fires.log
    assert process_ == "B"
    assert fire.fired_at == pytest.approx(t0 + 60.0, abs=0.05)
    assert trio.current_time() == pytest.approx(t0 + 60.0, abs=0.05)


async def test_a_survivor_adopts_only_workflows_it_handles(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    other = backend(store, "O")
    async with open_coordinator(handlers={"other": fires.handler("O")}, backend=other) as o:
        async with process(store, fires, "A") as (a, a_backend, a_scope):
            await a.debounce("wf", "k", "a", delay=1.0)
            die(a_backend, a_scope)
        await trio.sleep(2 * FAILOVER)
        assert o.statistics().takeovers == 0
        async with process(store, fires, "B") as (b, _, _):
            await trio.sleep(BEAT)  # B adopts it at start
            assert b.statistics().takeovers == 1
    assert [(p, f.payload) for p, f in fires.log] == [("B", "a")]


async def test_at_least_once_reruns_a_fire_whose_process_died_in_the_handler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A", hold=100.0) as (a, a_backend, a_scope):
            await a.debounce("wf", "k", "a", delay=1.0)
            await trio.sleep(2.0)  # A's handler is running
            assert fires.by_attempt() == [("A", "k", "a", 1, 1)]
            die(a_backend, a_scope)
        await trio.sleep(FAILOVER)
        assert b.statistics().refires == 1
    assert fires.by_attempt() == [("A", "k", "a", 1, 1), ("B", "k", "a", 1, 2)]
    first, second = fires.log[0][1], fires.log[1][1]
    # the same fire, run again, under a later token (its own commit, the adoption)
    assert second.fencing_token > first.fencing_token
    assert second.run_id == first.run_id
    records = [e for k, e in store._data.items() if k.startswith("f.")]
    assert all(e.value is None for e in records)  # deleted once the re-run returned


async def test_at_most_once_never_reruns_and_drops_an_unproven_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B", delivery="at-most-once") as (b, _, _):
        async with process(store, fires, "A", hold=100.0, delivery="at-most-once") as (
            a,
            a_backend,
            a_scope,
        ):
            await a.debounce("wf", "k", "a", delay=1.0)
            await trio.sleep(2.0)
            die(a_backend, a_scope)  # inside the handler: that fire is lost, not re-run
        await trio.sleep(2 * FAILOVER)
        assert b.statistics().refires == 0
        # The backend unreachable at fire time: at-most-once re-reads for the commit's
        # proof while its lease is held, then drops the fire.
        b_backend = b._backend
        assert isinstance(b_backend, MemoryBackend)
        await b.debounce("wf", "j", "b", delay=1.0)
        b_backend.faults.partitioned = True
        await trio.sleep(LEASE - SKEW - 0.1)
        assert b.statistics().dropped_fires == 0  # still proving: its lease is held
        await trio.sleep(0.2)  # past it (renewed at the partition, at the latest)
        assert b.statistics().dropped_fires == 1
        assert [p for p, _ in fires.log] == ["A"]
        # The unproven fire had not committed: its window is still in the store, and
        # B's reconcile fires it once the backend answers (late, never twice).
        b_backend.faults.partitioned = False
        await trio.sleep(3 * LEASE)
    assert fires.by_attempt() == [("A", "k", "a", 1, 1), ("B", "j", "b", 1, 1)]


async def test_at_most_once_proves_a_fire_whose_answer_was_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "A", delivery="at-most-once") as (a, a_backend, _):
        await a.debounce("wf", "k", "a", delay=1.0)
        a_backend.faults.apply_then_fail_next(ops=("put",))  # the tombstone lands, unseen
        await trio.sleep(3.0)
        assert a.statistics().dropped_fires == 0
    assert fires.by_attempt() == [("A", "k", "a", 1, 1)]


async def test_stale_owner_does_not_fire_on_its_own_view(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A is cut off past its lease: it must not fire unconfirmed, since B may have
    # taken the window over (B has, and fires it once).
    store, fires = MemoryStore(), Fires()
    async with (
        process(store, fires, "A") as (a, a_backend, _),
        process(store, fires, "B") as (_b, _, _),
    ):
        await a.debounce("wf", "k", "a", delay=LEASE + SKEW + 2.0)
        a_backend.faults.partitioned = True
        with caplog.at_level(logging.WARNING, logger="trio_debounce"):
            await trio.sleep(LEASE + SKEW + 2.0 + FAILOVER)
        assert "lease has lapsed; retrying instead of firing" in caplog.text
        assert [p for p, _ in fires.log] == ["B"]
        a_backend.faults.partitioned = False
        await trio.sleep(2 * LEASE)
        assert a.statistics().unconfirmed_fires == 0
    assert [p for p, _ in fires.log] == ["B"]


async def test_fencing_tokens_increase_across_takeover_and_bucket_recreation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (_b, _, _):
        async with process(store, fires, "A") as (a, a_backend, a_scope):
            await a.debounce("wf", "k", 1, delay=1.0)
            await trio.sleep(2.0)
            await a.debounce("wf", "k", 2, delay=1.0)
            die(a_backend, a_scope)
        await trio.sleep(FAILOVER + 1.0)  # B adopts and fires A's second window
    recreated, later = MemoryStore(created=store.created + 3600.0), Fires()
    async with process(recreated, later, "C") as (c, _, _):
        await c.debounce("wf", "k", 3, delay=1.0)
    tokens = [f.fencing_token for _, f in fires.log + later.log]
    assert [(p, f.payload) for p, f in fires.log + later.log] == [("A", 1), ("B", 2), ("C", 3)]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 3
    # revisions restart in the re-created store, the creation time keeps the order
    assert later.log[0][1].fencing_token & ((1 << 40) - 1) < fires.log[-1][1].fencing_token & (
        (1 << 40) - 1
    )


@pytest.mark.parametrize("exit_how", ["handoff", "error"])
async def test_exit_hands_windows_off_to_a_live_peer(
    autojump_clock: trio.testing.MockClock, exit_how: str
) -> None:
    store, fires = MemoryStore(), Fires()
    on_exit: Any = "handoff" if exit_how == "handoff" else "wait"
    async with process(store, fires, "B") as (b, _, _):
        t0 = trio.current_time()
        with pytest.raises(RuntimeError) if exit_how == "error" else _nothing():
            async with process(store, fires, "A", on_exit=on_exit) as (a, _, _):
                await a.debounce("wf", "k1", "a1", delay=5.0)
                await a.debounce("wf", "k2", "a2", delay=8.0, mode="both")
                await a.debounce("wf", "k2", "a3", delay=8.0, mode="both")
                if exit_how == "error":
                    raise RuntimeError("boom")
        # A deleted its lease: B notices at its next heartbeat and adopts both windows
        await trio.sleep(BEAT + 0.1)
        await b.wait_idle()
    assert sorted((p, f.key, f.payload, f.edge) for p, f in fires.log) == [
        ("A", "k2", "a2", Edge.LEADING),
        ("B", "k1", "a1", Edge.TRAILING),
        ("B", "k2", "a3", Edge.TRAILING),
    ]
    trailing = {f.key: f.fired_at for p, f in fires.log if f.edge is Edge.TRAILING}
    assert trailing["k1"] == pytest.approx(t0 + 5.0, abs=0.05)  # on time
    assert trailing["k2"] == pytest.approx(t0 + 8.0, abs=0.05)


async def test_handoff_with_no_peer_waits_for_the_next_coordinator(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "A", on_exit="handoff") as (a, _, _):
        await a.debounce("wf", "k", "a", delay=5.0)
    await trio.sleep(100.0)
    assert fires.log == []
    async with process(store, fires, "C") as (_c, _, _):
        await trio.sleep(0.1)
    assert fires.by_attempt() == [("C", "k", "a", 1, 1)]


async def test_handoff_needs_a_backend_and_delivery_is_checked() -> None:
    with pytest.raises(ValueError, match="on_exit='handoff' needs a backend"):
        async with open_coordinator(on_exit="handoff"):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="delivery must be 'at-least-once' or 'at-most-once'"):
        async with open_coordinator(delivery="exactly-once"):  # type: ignore[arg-type]
            pass  # pragma: no cover


async def test_window_status(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "A") as (a, _, _), process(store, fires, "B") as (b, _, _):
        assert await b.window_status("wf", "k") is None
        r = await a.debounce("wf", "k", "a", delay=5.0, max_delay=20.0)
        await trio.sleep(1.0)
        await b.debounce("wf", "k", "b", delay=5.0)
        status = await b.window_status("wf", "k")
        assert status is not None
        assert status.owner == "A"
        assert status.owner_live
        assert status.run_id == r.active_run_id
        assert status.ping_count == 2
        assert status.last_ping_at - status.first_ping_at == pytest.approx(1.0, abs=1e-3)
        assert status.scheduled_at is not None
        assert status.scheduled_at - status.last_ping_at == pytest.approx(5.0, abs=1e-3)
        assert status.cap_at == pytest.approx(status.first_ping_at + 20.0, abs=1e-3)
        assert status.fencing_token & ((1 << 40) - 1) == status.revision
    async with open_coordinator() as local:
        with pytest.raises(RuntimeError, match="window_status"):
            await local.window_status("wf", "k")
    assert [p for p, _ in fires.log] == ["A"]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def test_statistics_count_takeovers_refires_and_drops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A", hold=100.0) as (a, a_backend, a_scope):
            await a.debounce("wf", "fired", 1, delay=1.0)
            await a.debounce("wf", "open", 2, delay=50.0)
            await trio.sleep(2.0)
            die(a_backend, a_scope)
        await trio.sleep(FAILOVER)
        stats = b.statistics()
        assert (stats.takeovers, stats.refires, stats.dropped_fires) == (1, 1, 0)
        await b.cancel("wf", "open")
    assert sorted((p, f.key, f.attempt) for p, f in fires.log) == [
        ("A", "fired", 1),
        ("B", "fired", 2),
    ]


async def test_a_ping_into_a_dead_owner_window_before_its_lease_lapses_is_not_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B's ping lands while dead A's lease is still live: it coalesces into A's window
    # (nobody can tell A is dead yet), and still fires within lease + skew + heartbeat
    # interval + delay of the death. (A's window is not due yet at B's ping: a ping at
    # or after its due time would take its fire and open the next window.)
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A") as (a, a_backend, a_scope):
            await a.debounce("wf", "k", "a", delay=BEAT + 2.0)
            await trio.sleep(BEAT)  # B's table now knows A alive
            died_at = trio.current_time()
            die(a_backend, a_scope)
        await trio.sleep(1.0)
        r = await b.debounce("wf", "k", "b", delay=2.0)
        assert not r.owner  # A's lease still looks live
        await trio.sleep(FAILOVER + 2.0)
    [(process_, fire)] = fires.log
    assert (process_, fire.payload, fire.ping_count) == ("B", "b", 2)
    fired_at = fire.fired_at
    assert fired_at <= died_at + LEASE + SKEW + BEAT + 2.0 + 0.1


async def test_death_between_the_fire_record_and_the_window_delete_fires_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A wrote its fire record, then died before it could delete the window: the fire
    # never committed. B adopts the window and fires it once; the stale record is
    # dropped, not run as a second attempt.
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A") as (a, a_backend, a_scope):
            await a.debounce("wf", "k", "a", delay=1.0)
            a_backend.faults.delay_next(0.0, ops=("put",))  # the fire record lands
            a_backend.faults.fail_next(100, ops=("put",))  # the window's commit fails
            await trio.sleep(1.5)  # A is retrying its window's commit
            die(a_backend, a_scope)
        assert [k for k, e in store._data.items() if k.startswith("f.") and e.value]
        await trio.sleep(FAILOVER + 1.0)
        assert b.statistics().refires == 0
    assert fires.by_attempt() == [("B", "k", "a", 1, 1)]
    assert not [k for k, e in store._data.items() if k.startswith("f.") and e.value]


async def test_a_lost_delete_answer_leaves_no_fire_record_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's window delete lands but its answer comes too late: A fires unconfirmed, and
    # deletes its fire record once the store answers, so nobody runs the fire again
    # after A has gone.
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A") as (a, a_backend, _):
            await a.debounce("wf", "k", "a", delay=1.0)
            a_backend.faults.delay_next(0.0, ops=("put",))  # the fire record
            a_backend.faults.delay_next(5.0, ops=("put",))  # its tombstone: answered late
            await trio.sleep(4 * BEAT)
            assert a.statistics().unconfirmed_fires == 1
        await trio.sleep(2 * FAILOVER)
        assert b.statistics().refires == 0
    assert fires.by_attempt() == [("A", "k", "a", 1, 1)]
    assert not [k for k, e in store._data.items() if k.startswith("f.") and e.value]


@pytest.mark.parametrize("mode", ["trailing", "both"])
async def test_a_ping_during_the_commit_fires_with_the_latest_payload(
    autojump_clock: trio.testing.MockClock, mode: Any
) -> None:
    # B's ping lands between A's read and A's window delete (A's fire-record write is
    # slow to answer; A flushes the window before its due time, so that the ping joins
    # it rather than taking its fire): A's commit loses, takes its record back and
    # commits again with a fresh record, so the fire is confirmed and carries B's
    # payload and the global count. (A reused record id used to conflict with its own
    # delete marker until op_timeout.)
    store, fires = MemoryStore(), Fires()
    async with (
        process(store, fires, "A") as (a, a_backend, _),
        process(store, fires, "B") as (b, _, _),
    ):
        await a.debounce("wf", "k", "a", delay=2.5, mode=mode)
        await trio.sleep(1.4)
        a_backend.faults.delay_next(0.2, ops=("put",))
        await a.flush("wf", "k")
        await trio.sleep(0.05)
        r = await b.debounce("wf", "k", "b", delay=2.0, mode=mode)
        assert r.ping_count == 2
        await trio.sleep(20.0)
        assert a.statistics().unconfirmed_fires == 0
        assert a_backend.conflicts >= 1  # the commit lost to B's ping
    trailing = [f for _, f in fires.log if f.edge is Edge.TRAILING]
    assert [(f.payload, f.ping_count) for f in trailing] == [("b", 2)]
    assert trailing[0].fencing_token > 0


async def test_pings_after_an_unconfirmed_fire_survive_a_normal_exit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A fires unconfirmed while cut off (a flush), the partition heals, B's ping lands
    # in the still-open window (before its due time: a ping at or after it would take
    # the fire and open the next window), and A leaves before its next heartbeat: the
    # release leaves the window to a peer (B), which fires it with B's ping.
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A") as (a, a_backend, _):
            await a.debounce("wf", "k", "a", delay=10.0)
            await trio.sleep(2.3)
            a_backend.faults.partitioned = True
            assert await a.flush("wf", "k")
            await trio.sleep(2.5)
            a_backend.faults.partitioned = False
            await b.debounce("wf", "k", "b-after-fire", delay=2.0)
        await trio.sleep(30.0)
    assert [(p, f.payload) for p, f in fires.log] == [("A", "a"), ("B", "b-after-fire")]


async def test_a_window_adopted_while_the_block_closes_is_left_for_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B adopts dead D's window in a reconcile whose listing is slow, and leaves its
    # block before arming it: the release leaves the window in the store (it used to
    # delete it, with its stored ping), and the next coordinator fires it.
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (_, b_backend, _):
        async with process(store, fires, "D") as (d, d_backend, d_scope):
            await d.debounce("wf", "k", "stored-ping", delay=30.0)
            die(d_backend, d_scope)
        adopt = b_backend.adopt_orphans

        async def slow_answer(workflows: Any) -> Any:
            orphans = await adopt(workflows)
            await trio.sleep(1.0)  # the adoption is written; its answer is slow
            return orphans

        b_backend.adopt_orphans = slow_answer  # type: ignore[method-assign]
        # B's heartbeat at t=8 finds D dead (lease 6 + skew 1) and adopts its window,
        # whose answer takes a second: B leaves in the middle of that.
        await trio.sleep(8.5)
        assert b_backend.takeovers == 1
    assert fires.log == []
    async with process(store, fires, "C"):
        await trio.sleep(40.0)
    assert [(p, f.payload) for p, f in fires.log] == [("C", "stored-ping")]


async def test_leading_and_trailing_fires_never_share_a_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with (
        process(store, fires, "A") as (a, a_backend, _),
        process(store, fires, "B") as (b, _, _),
    ):
        await trio.sleep(0.5)
        a_backend.faults.delay_next(0.0, ops=("put",))  # the leading fire's record
        a_backend.faults.apply_then_fail_next(ops=("put",))  # the opening write lands

        async def slow_backoff(attempt: int) -> None:
            await trio.sleep(0.01)

        a_backend._view.backoff = slow_backoff  # type: ignore[method-assign]

        async def ping_b() -> None:
            await trio.sleep(0.001)
            await b.debounce("wf", "k", "b", delay=1.0, mode="both")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ping_b)
            r = await a.debounce("wf", "k", "a", delay=5.0, mode="both")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
        await trio.sleep(10.0)
    tokens = [f.fencing_token for _, f in fires.log]
    assert [f.edge for _, f in fires.log] == [Edge.LEADING, Edge.TRAILING]
    assert tokens[0] < tokens[1]


async def test_a_stale_owners_fire_that_landed_unseen_runs_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by the chaos soak on a loaded machine (105 windows lost): an owner's
    # at-least-once finalize wrote its fire record and deleted the window, but the
    # delete's answer came after op_timeout, by which time the owner's lease had
    # lapsed (its renewals failed meanwhile). It rightly did not fire on its own view
    # and asked again, found the window gone, and nothing ever ran the committed
    # fire. Now the next finalize of the run proves the lost commit (its fire record)
    # and fires it, once, as its first attempt.
    store, fires = MemoryStore(), Fires()
    op_timeout = LEASE  # longer than the lease: it lapses while the call waits
    b = backend(store, "A", op_timeout=op_timeout)
    async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=b) as a:
        await a.debounce("wf", "k", "a", delay=1.0)
        await trio.sleep(0.5)
        b.faults.delay_next(0.0, ops=("put",))  # the fire record: landed and answered
        b.faults.delay_next(op_timeout + 3.0, ops=("put",))  # the commit: answered late
        b.faults.fail_next(1000, ops=("put",))  # every lease renewal fails meanwhile
        with caplog.at_level(logging.WARNING, logger="trio_debounce"):
            await trio.sleep(op_timeout + 2.0)
        assert "lease has lapsed; retrying instead of firing" in caplog.text
        assert fires.log == []
        b.faults.clear()
        await trio.sleep(3 * LEASE)
        assert a.statistics().unconfirmed_fires == 0
    assert fires.by_attempt() == [("A", "k", "a", 1, 1)]
    # the fire record was completed
    assert [e for e in await store.entries("f.") if e.value is not None] == []


async def test_a_takers_fire_that_landed_unseen_is_run_by_its_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A taker's at-least-once finalize (fire-early, a flush, a cap) whose commit
    # landed but whose answer came too late: no one else fires the window (its owner
    # finds it gone), so the taker's next adopt_orphans proves the commit by its fire
    # record and returns it to be run, as its first attempt.
    store = MemoryStore()
    owner, taker, run = await _a_taker_with_a_lost_commit(store, landed=True)
    orphans = await taker.adopt_orphans({"wf"})
    assert [(f.key, f.payload, f.attempt) for f in orphans.fires] == [("k", "p1", 1)]
    assert (await owner.finalize("wf", "k", run)).outcome is Finalized.ABANDONED
    await taker.complete(orphans.fires[0].fire_id)
    assert [e for e in await store.entries("f.") if e.value is not None] == []
    # Settled once: the next heartbeat returns nothing.
    assert (await taker.adopt_orphans({"wf"})).fires == []


def _window_key() -> str:
    return window_key("wf", "k")


async def _window(store: MemoryStore) -> WindowDoc | None:
    entry = await store.get(_window_key())
    return None if entry is None or entry.value is None else WindowDoc.decode(entry.value)


async def _records(store: MemoryStore) -> list[str]:
    """The run ids of the fire records in the store."""
    return [_FireRecord.decode(e.value).run_id for e in await store.entries("f.") if e.value]


async def _leased(store: MemoryStore, *names: str, **first: Any) -> list[MemoryBackend]:
    """Backends named ``names`` on ``store``, each with its lease written; ``first``
    are keyword arguments of the first one's."""
    backends = [backend(store, name, **(first if i == 0 else {})) for i, name in enumerate(names)]
    for b in backends:
        await b.refresh_lease()
    return backends


async def _a_taker_with_a_lost_commit(
    store: MemoryStore, *, landed: bool
) -> tuple[MemoryBackend, MemoryBackend, str]:
    """Owner B's window (run r1, payload "p1"); taker A's at-least-once finalize
    writes its fire record, and its commit either lands with its answer lost
    (``landed``) or never lands; A keeps the commit unproven."""
    taker, owner = await _leased(store, "A", "B", op_timeout=1.0)
    await owner.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="r1", payload="p1"
    )
    status = await taker.window_status("wf", "k")
    assert status is not None
    taker.faults.delay_next(0.0, ops=("put",))  # the fire record lands
    if landed:
        taker.faults.delay_next(3.0, ops=("put",))  # the commit lands; its answer is late
    else:
        taker.faults.fail_next(1000, ops=("put",))  # the commit never lands
    with pytest.raises(BackendUnavailableError):
        await taker.finalize("wf", "k", status.run_id, take=True, force=True)
    await trio.sleep(3.0)
    taker.faults.clear()
    return owner, taker, status.run_id


async def _owner_fires_the_next_ping(owner: MemoryBackend, run_id: str, payload: str) -> None:
    await owner.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id=run_id, payload=payload
    )
    status = await owner.window_status("wf", "k")
    assert status is not None
    fin = await owner.finalize("wf", "k", status.run_id, force=True)
    assert (fin.outcome, fin.payload) == (Finalized.FIRE, payload)
    if fin.fire_id is not None:
        await owner.complete(fin.fire_id)


async def _owner_fires_windows(owner: MemoryBackend, run: str, last: int) -> None:
    """The owner fires ``run`` (with "p2"), then windows r2 .. r<last>, each over the
    tombstone of the one before."""
    await _owner_fires_the_next_ping(owner, run, "p2")
    for n in range(2, last + 1):
        await _owner_fires_the_next_ping(owner, f"r{n}", f"p{n + 1}")


async def _a_lease_later(*backends: MemoryBackend) -> None:
    await trio.sleep(2 * LEASE)
    for b in backends:
        await b.refresh_lease()


async def test_a_record_whose_commit_never_landed_is_taken_back_after_its_tombstone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Found by the chaos run on a cluster (cluster-no-quorum, a confirmed fire of a
    # stale payload 40 s late): a taker's fire record whose commit never landed
    # outlived the tombstone of the owner's fire of the same run (the sweeper removed
    # it), and a gone window was taken as proof that the record's commit had landed.
    # Now the sweeper keeps a key's tombstone while a record of the key exists, and
    # the record is taken back, not run.
    store = MemoryStore()
    owner, taker, run = await _a_taker_with_a_lost_commit(store, landed=False)
    await _owner_fires_the_next_ping(owner, run, "p2")  # the same window, count 2
    await _a_lease_later(owner, taker)
    await owner.sweep()
    window = await _window(store)
    assert window is not None
    assert (window.run_id, window.fired) == (run, True)  # kept
    assert (await taker.adopt_orphans({"wf"})).fires == []
    assert await _records(store) == []
    # the record gone, the next sweep removes the tombstone
    await _a_lease_later(owner, taker)
    await owner.sweep()
    assert await _window(store) is None


async def test_a_dead_takers_record_whose_commit_never_landed_is_never_adopted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    owner, taker, _ = await _a_taker_with_a_lost_commit(store, landed=False)
    await _owner_fires_the_next_ping(owner, "r1", "p2")
    taker.faults.partitioned = True  # the taker dies with its record in the store
    await _a_lease_later(owner)
    await owner.sweep()
    await _a_lease_later(owner)
    orphans = await owner.adopt_orphans({"wf"})
    assert orphans.fires == []
    assert await _records(store) == []


@pytest.mark.parametrize("windows", [1, 2, 3])
async def test_newer_windows_over_the_tombstone_keep_the_proof(
    autojump_clock: trio.testing.MockClock, windows: int
) -> None:
    # Pings open newer windows over the owner's tombstone before the taker settles
    # (the second found by a review): each names the tombstones before it in "after",
    # so the taker's record is still taken back, not run with its stale payload.
    store = MemoryStore()
    owner, taker, run = await _a_taker_with_a_lost_commit(store, landed=False)
    await _owner_fires_windows(owner, run, windows)
    await owner.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="last", payload="p"
    )
    window = await _window(store)
    assert window is not None
    assert window.run_id == "last"
    assert [proof[0] for proof in window.after] == [f"r{n}" for n in range(windows, 0, -1)]
    await taker.refresh_lease()
    assert (await taker.adopt_orphans({"wf"})).fires == []


@pytest.mark.parametrize("dies", [False, True])
async def test_a_lost_commit_that_landed_runs_once_after_newer_windows_and_sweeps(
    autojump_clock: trio.testing.MockClock, dies: bool
) -> None:
    # The other side of the proof: the taker's commit did land. Two newer windows
    # open over its tombstone and fire, and the sweeper runs a lease after each: the
    # key's tombstone is kept while the taker's record exists (a review found the
    # last one swept, and the record then taken back: a lost fire). The taker's
    # heartbeat (or, if it died, a survivor) runs the fire it committed, once.
    store = MemoryStore()
    owner, taker, run = await _a_taker_with_a_lost_commit(store, landed=True)
    if dies:
        taker.faults.partitioned = True
    assert (await owner.finalize("wf", "k", run)).outcome is Finalized.ABANDONED
    for n, payload in ((2, "p2"), (3, "p3")):
        await _owner_fires_the_next_ping(owner, f"r{n}", payload)
        await _a_lease_later(owner)
        await owner.sweep()
    window = await _window(store)
    assert window is not None
    assert (window.run_id, window.fired) == ("r3", True)
    runner = owner if dies else taker
    if dies:
        await _a_lease_later(owner)
    else:
        await taker.refresh_lease()
    orphans = await runner.adopt_orphans({"wf"})
    expected_attempt = 2 if dies else 1
    assert [(f.run_id, f.payload, f.attempt) for f in orphans.fires] == [
        (run, "p1", expected_attempt)
    ]
    await runner.complete(orphans.fires[0].fire_id)
    assert (await runner.adopt_orphans({"wf"})).fires == []
    await _a_lease_later(owner)
    await owner.sweep()
    assert await _window(store) is None  # nothing pins it any more


async def _two_unconfirmed_fires_of_one_key(owner: MemoryBackend) -> None:
    """Two windows of one key, each committed with its answer lost: the owner fires
    both unconfirmed and queues the deletes, the second for the same key."""
    for run, payload in (("r1", "p1"), ("r2", "p2")):
        await owner.register(
            "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id=run, payload=payload
        )
        owner.faults.delay_next(0.0, ops=("put",))  # the fire record lands
        owner.faults.delay_next(3.0, ops=("put",))  # the commit lands, answer late
        with pytest.raises(BackendUnavailableError):
            await owner.finalize("wf", "k", run, force=True)  # fires unconfirmed
        assert not owner._finalizer._unproven  # lease held: an unconfirmed fire, not unproven
    await trio.sleep(3.0)
    owner.faults.clear()


async def test_a_replaced_queued_delete_still_deletes_its_fire_record(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Found by a review: the queued delete of the second window replaced the first's
    # (they are kept by key), so the first fire record was never deleted. It stayed
    # for the owner's whole life (peers skip a live owner's records), pinned the key's
    # tombstone, and ran again once the owner died.
    store = MemoryStore()
    owner, peer = await _leased(store, "B", "A", op_timeout=1.0)
    await _two_unconfirmed_fires_of_one_key(owner)
    await owner.refresh_lease()  # applies the queued deletes
    assert await _records(store) == []
    await _a_lease_later(owner, peer)
    await owner.sweep()
    assert await _window(store) is None
    owner.faults.partitioned = True  # the owner dies
    await _a_lease_later(peer)
    assert (await peer.adopt_orphans({"wf"})).fires == []


async def test_a_record_older_than_the_proofs_a_window_keeps_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The documented limit: a window names _AFTER_KEEP tombstones before it. A record
    # decided only after more windows of its key has lost its proof and runs
    # (at-least-once: a duplicate with an older payload, never a lost fire).
    store = MemoryStore()
    owner, taker, run = await _a_taker_with_a_lost_commit(store, landed=False)
    await _owner_fires_windows(owner, run, _AFTER_KEEP + 2)
    window = await _window(store)
    assert window is not None
    assert len(window.after) == _AFTER_KEEP
    assert run not in {proof[0] for proof in window.after}
    await taker.refresh_lease()
    orphans = await taker.adopt_orphans({"wf"})
    assert [(f.run_id, f.payload) for f in orphans.fires] == [(run, "p1")]


async def test_a_stale_record_listing_never_sweeps_the_proof_of_a_committed_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The sweeper lists the windows, then the fire records; on NATS a listing may
    # come from a replica that lags. A record listing that misses a committed fire's
    # record must not sweep its tombstone (the record would then be taken back: a
    # lost fire), so the tombstone's own record is read from the store's authority.
    store = MemoryStore()
    a, b = await _leased(store, "A", "B")
    await a.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="r1", payload="p1"
    )
    fin = await a.finalize("wf", "k", "r1", force=True)
    assert fin.outcome is Finalized.FIRE
    a.faults.partitioned = True  # A dies inside the handler
    entries = b._view.store.entries

    async def lagging(prefix: str) -> Any:
        return [] if prefix == "f." else await entries(prefix)

    b._view.store.entries = lagging  # type: ignore[method-assign]
    await _a_lease_later(b)
    await b.sweep()
    b._view.store.entries = entries  # type: ignore[method-assign]
    window = await _window(store)
    assert window is not None
    assert window.fired
    await _a_lease_later(b)
    orphans = await b.adopt_orphans({"wf"})
    assert [(f.run_id, f.payload, f.attempt) for f in orphans.fires] == [("r1", "p1", 2)]


async def test_a_failed_finalize_settles_at_the_next_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A finalize that failed may leave a lost commit (or a record to delete): the
    # next heartbeat reconciles (adopt_orphans settles it), not the sixth, so its
    # proof is read while fresh. The store is cut off only between two heartbeats,
    # so no failed beat is what triggers the reconcile.
    store, fires = MemoryStore(), Fires()
    b = backend(store, "A", op_timeout=1.0)
    async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=b) as c:
        calls: list[float] = []
        adopt = b.adopt_orphans

        async def counted(workflows: Any) -> Any:
            calls.append(trio.current_time())
            return await adopt(workflows)

        b.adopt_orphans = counted  # type: ignore[method-assign]
        start = trio.current_time()
        await c.debounce("wf", "k", "a", delay=2.1)  # due 0.1 s after the first beat
        await trio.sleep_until(start + BEAT + 0.05)
        b.faults.partitioned = True  # the finalize fails; the owner fires unconfirmed
        await trio.sleep_until(start + 2 * BEAT - 0.3)
        b.faults.partitioned = False
        assert [f.payload for _, f in fires.log] == ["a"]
        calls.clear()  # the reconcile at start
        await trio.sleep_until(start + 2 * BEAT + 0.1)
        assert calls, "no reconcile at the next heartbeat"


async def test_an_opening_write_that_landed_unseen_is_not_written_again_after_a_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Found by cluster-one-node ("two owners"): a ping's opening write landed but its
    # answer was lost; before its re-read, a peer took the window over (the pinger's
    # lease had lapsed) and fired it. The re-read found the tombstone, did not see
    # its own write in it, and wrote the ping again: a second window with the same
    # run id, fired a second time. The tombstone still names the opening write.
    store = MemoryStore()
    a, b = await _leased(store, "A", "B", op_timeout=1.0)
    a.faults.delay_next(1.5, ops=("put",))  # the opening write lands; its answer is late
    results: list[Any] = []

    async def ping() -> None:
        results.append(
            await a.register(
                "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="r1",
                payload="a",
            )
        )  # fmt: skip

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ping)
        await trio.sleep(0.5)  # the write has landed; A re-reads at 1.0
        fin = await b.finalize("wf", "k", "r1", take=True, force=True)
        assert (fin.outcome, fin.payload) == (Finalized.FIRE, "a")
    [result] = results
    assert (result.outcome, result.run_id) == (Registered.OPENED, "r1")
    window = await _window(store)
    assert window is not None
    assert (window.run_id, window.fired) == ("r1", True)  # no second window
    assert (await a.finalize("wf", "k", "r1")).outcome is Finalized.ABANDONED


async def _ping_r1(a: MemoryBackend, results: list[Any], **kwargs: Any) -> None:
    """A's ping that opens run r1 of key k (trailing, ``delay`` 0.2 s by default)."""
    kwargs.setdefault("delay", 0.2)
    kwargs.setdefault("mode", Mode.TRAILING)
    try:
        results.append(
            await a.register("wf", "k", max_delay=None, run_id="r1", payload="a", **kwargs)
        )
    except BackendUnavailableError as exc:
        results.append(exc)


async def _fire_newer_windows(
    store: MemoryStore, b: MemoryBackend, runs: list[str], mode: Mode = Mode.TRAILING
) -> None:
    """B takes and fires r1 (a trailing window; a leading one has no trailing edge:
    B's next ping closes it), then opens and fires one window per run of ``runs``."""
    if mode is Mode.TRAILING:
        fin = await b.finalize("wf", "k", "r1", take=True, force=True)
        assert (fin.outcome, fin.payload) == (Finalized.FIRE, "a")
        window = await _window(store)
        assert window is not None
        assert (window.run_id, window.fired) == ("r1", True)
    for run in runs:
        reg = await b.register(
            "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id=run, payload=run
        )
        assert (reg.outcome, reg.run_id) == (Registered.OPENED, run)
        assert (await b.finalize("wf", "k", run, force=True)).outcome is Finalized.FIRE


@pytest.mark.parametrize("mode", [Mode.TRAILING, Mode.LEADING])
async def test_an_opening_write_that_landed_unseen_is_recognised_under_newer_windows(
    autojump_clock: trio.testing.MockClock, mode: Mode
) -> None:
    # Found by cluster-one-node ("two owners", key k36): as above, but before the
    # re-read the peer's ping that took the fire also opened the key's next window,
    # which fired too. The re-read found that window's tombstone (not naming the
    # opening write), wrote the ping again, and so opened a second window of run r1,
    # fired a second time. The newer window's after still names r1.
    store = MemoryStore()
    a, b = await _leased(store, "A", "B", op_timeout=1.0)
    if mode is Mode.LEADING:
        a.faults.delay_next(0.0, ops=("put",))  # the leading fire's record, at once
    a.faults.delay_next(1.5, ops=("put",))  # the opening write lands; its answer is late
    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(_ping_r1, a, results, mode=mode))
        await trio.sleep(0.5)  # the write has landed; A re-reads at 1.0
        await _fire_newer_windows(store, b, ["r2"], mode)
        newer = await store.get(_window_key())
    [result] = results
    assert (result.outcome, result.run_id, result.ping_count) == (Registered.OPENED, "r1", 1)
    assert newer is not None
    if mode is Mode.LEADING:
        # The leading fire the opening owes runs here (at least once: its record was
        # written before the opening write), with the record's revision as its
        # fencing token: older than the fires of the key committed since.
        record = await store.get(result.fire_id)
        assert record is not None
        assert record.value
        assert _FireRecord.decode(record.value).run_id == "r1"
        assert result.fencing_token & ((1 << 40) - 1) == record.revision < newer.revision
    window = await _window(store)
    assert window is not None
    assert (window.run_id, window.fired) == ("r2", True)  # no second window of r1
    assert (await a.finalize("wf", "k", "r1")).outcome is Finalized.ABANDONED
    assert not await a.owned_windows()


@pytest.mark.parametrize("mode", [Mode.TRAILING, Mode.LEADING])
async def test_a_burst_whose_window_a_peer_fired_before_its_answer_fires_once(
    autojump_clock: trio.testing.MockClock, mode: Mode
) -> None:
    # The coordinators' side of the test above: A's opening write lands, its answer
    # comes past op_timeout (2 s); meanwhile B's ping finds the window due, takes its
    # fire and opens the next window, which fires too. Each burst fires once (a
    # leading edge at A, whose ping opened it), and A counts nothing as deleted.
    store, fires = MemoryStore(), Fires()
    async with (
        process(store, fires, "A") as (a, a_backend, _),
        process(store, fires, "B") as (
            b,
            _,
            _,
        ),
    ):
        if mode is Mode.LEADING:
            a_backend.faults.delay_next(0.0, ops=("put",))  # the leading fire's record
        a_backend.faults.delay_next(2.5, ops=("put",))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(a.debounce, "wf", "k", "a", delay=0.2, mode=mode))
            await trio.sleep(0.5)
            await b.debounce("wf", "k", "b", delay=0.2, mode=mode)
        await a.wait_idle()
        await b.wait_idle()
        assert a.statistics().deleted_externally == 0
    if mode is Mode.LEADING:
        expected = [("A", "k", "a", 1, 1), ("B", "k", "b", 1, 1)]
    else:
        expected = [("B", "k", "a", 1, 1), ("B", "k", "b", 1, 1)]
    assert sorted(fires.by_attempt()) == expected


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_the_end_of_a_queue_latest_run_keeps_the_tombstone_an_opening_is_known_by(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    # Found by a review: the end of the run deleted a tombstone that kept nothing else,
    # so the re-read of an opening whose answer was lost found an empty key and wrote
    # the ping again (a second window of r1, fired twice). The tombstone stays now.
    store = MemoryStore()
    a, b = await _leased(store, "A", "B", op_timeout=1.0)
    a.faults.delay_next(1.5, ops=("put",))  # the opening lands; its answer is late
    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(_ping_r1, a, results, overlap="queue-latest"))
        await trio.sleep(0.5)
        fin = await b.finalize("wf", "k", "r1", take=True, force=True, delivery=delivery)
        assert (fin.outcome, fin.payload) == (Finalized.FIRE, "a")
        if fin.fire_id:
            await b.complete(fin.fire_id)
        await b.end_run("wf", "k", "r1")
    [result] = results
    assert (result.outcome, result.run_id) == (Registered.OPENED, "r1")
    window = await _window(store)
    assert window is not None
    assert (window.run_id, window.fired, window.running) == ("r1", True, None)
    again = await a.finalize("wf", "k", "r1", force=True, delivery=delivery)
    assert again.outcome is Finalized.ABANDONED


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_an_opening_over_an_empty_key_whose_window_was_swept_is_not_written_again(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    # Found by a review: an opening over an empty key (revision 0) whose window then
    # fired and was swept (deleted, then purged back to no entry) looked unchanged to
    # a late re-read (revision 0 again), and was written again: r1 fired twice. A
    # re-read this late (past the lease less twice the skew) cannot tell: it fails.
    store = MemoryStore()
    a = backend(store, "A", op_timeout=5.0, clock_skew=-1.0)
    b = backend(store, "B", clock_skew=1.0)
    for x in (a, b):
        await x.refresh_lease()
    a.faults.delay_next(0.0, ops=("get",))  # the ping's first read: as is
    a.faults.apply_then_fail_next(ops=("put",))  # the opening lands; its answer is an error
    a.faults.stall_next(4.6, ops=("get",))  # the re-read reaches the store at 4.6
    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ping_r1, a, results)
        await trio.sleep(0.5)
        fin = await b.finalize("wf", "k", "r1", take=True, force=True, delivery=delivery)
        assert (fin.outcome, fin.payload) == (Finalized.FIRE, "a")
        if fin.fire_id:
            await b.complete(fin.fire_id)
        await trio.sleep(4.3 - trio.current_time())
        assert await b.sweep() == 1  # deleted and purged: no entry, revision 0
    [result] = results
    assert isinstance(result, BackendUnavailableError), result
    again = await a.finalize("wf", "k", "r1", force=True, delivery=delivery)
    assert again.outcome is not Finalized.FIRE


@pytest.mark.parametrize("gone", ["pushed out of after", "swept"])
async def test_an_opening_write_that_a_reread_cannot_place_is_not_written_again(
    autojump_clock: trio.testing.MockClock, gone: str
) -> None:
    # As above, but nothing the re-read finds names run r1 any more: AFTER_KEEP newer
    # windows have fired over it, or its tombstone was swept (the re-read comes past
    # the lease less twice the skew margin after the ping). The ping may have fired:
    # it fails (the coordinator fails open, and closes a window of r1 that turns up)
    # instead of opening r1 a second time.
    store = MemoryStore()
    op_timeout = 1.0 if gone == "pushed out of after" else LEASE - 2 * SKEW + 1.0
    a, b = await _leased(store, "A", "B", op_timeout=op_timeout)
    a.faults.delay_next(op_timeout + 0.5, ops=("put",))
    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ping_r1, a, results)
        await trio.sleep(0.5)
        if gone == "swept":
            await _fire_newer_windows(store, b, [])
            entry = await store.get(_window_key())
            assert entry is not None
            await store.delete(_window_key(), last=entry.revision)  # as the sweeper does
        else:
            await _fire_newer_windows(store, b, [f"r{i}" for i in range(2, _AFTER_KEEP + 3)])
    [result] = results
    assert isinstance(result, BackendUnavailableError)
    assert "could not tell whether the window its write opened (run r1) landed" in str(result)
    window = await _window(store)
    assert window is None or window.run_id != "r1"  # no second window of r1
    assert not await a.owned_windows()


async def test_an_opening_write_that_did_not_land_is_written_again_over_a_peers_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The other side of the rule: the opening write never landed, and before the
    # re-read a peer opened and fired a window over the one it was written over (r0):
    # that window's after names r0, not r1, so r1 never landed: the ping is written
    # again (over the peer's tombstone) and answered.
    store = MemoryStore()
    a, b = await _leased(store, "A", "B", op_timeout=1.0)
    await a.register(
        "wf", "k", mode=Mode.TRAILING, delay=0.1, max_delay=None, run_id="r0", payload="0"
    )
    assert (await a.finalize("wf", "k", "r0", force=True)).outcome is Finalized.FIRE
    a.faults.fail_next(ops=("put",))  # never applied, answered as a timeout
    a.faults.stall_next(0.5, ops=("get",))  # the re-read reaches the store at 0.5
    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_ping_r1, a, results)
        await trio.sleep(0.1)
        reg = await b.register(
            "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="r2", payload="b"
        )
        assert reg.outcome is Registered.OPENED
        assert (await b.finalize("wf", "k", "r2", force=True)).outcome is Finalized.FIRE
    [result] = results
    assert (result.outcome, result.run_id) == (Registered.OPENED, "r1")
    window = await _window(store)
    assert window is not None
    assert (window.run_id, window.fired, window.after[0][0]) == ("r1", False, "r2")


async def test_at_most_once_proves_a_commit_whose_answer_comes_after_op_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The tombstone lands at once; its answer comes 3 s later, past op_timeout (2 s),
    # the store answering every other call at once. The finalize gives the key's turn
    # back and proves the commit by re-reading: the burst fires once, on time.
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "A", delivery="at-most-once") as (a, a_backend, _):
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=1.0)
        await trio.sleep(0.9)
        a_backend.faults.delay_next(3.0, ops=("put",))  # the commit's answer is slow
        await trio.sleep(2.2)  # past the finalize's op_timeout: it proves by re-reads
        start = trio.current_time()
        r = await a.debounce("wf", "k", "b", delay=1.0)  # not held up by the proof
        assert trio.current_time() - start < 0.05
        assert r.outcome is Outcome.SCHEDULE_TRAILING  # the burst before had fired
        await a.wait_idle()
        assert a.statistics().dropped_fires == 0
    assert fires.by_attempt() == [("A", "k", "a", 1, 1), ("A", "k", "b", 1, 1)]
    first = fires.log[0][1]
    assert first.fired_at == pytest.approx(t0 + 1.0, abs=0.01)  # its due time
    assert first.fencing_token < fires.log[1][1].fencing_token


@pytest.mark.parametrize("delivery", ["at-most-once", "at-least-once"])
async def test_a_first_commit_that_lands_late_is_recognised(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    # The commit's write fails at once but reaches the store 1 s later (a leader
    # election); the re-read, made before it lands, sees the window open, so the
    # finalize decides again with a new write, which conflicts: the proof must still
    # know the first write. The burst fires once.
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "A", delivery=delivery) as (a, a_backend, _):
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=2.7)  # due between two heartbeats
        await trio.sleep(2.6)
        ops = ("put",) if delivery == "at-most-once" else ("delete", "put")
        a_backend.faults.stall_next(1.0, ops=ops, fail_after=0.2)  # lands at 3.7
        a_backend.faults.stall_next(0.5, ops=("get",))  # the re-read: sees it open
        a_backend.faults.stall_next(0.5, ops=ops)  # the second decision's write
        await trio.sleep(10.0)
        assert a.statistics().dropped_fires == 0
    assert fires.by_attempt() == [("A", "k", "a", 1, 1)]
    assert fires.log[0][1].fired_at == pytest.approx(t0 + 2.7, abs=0.01)


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_a_leading_fire_interrupted_by_a_crash_runs_again_at_least_once(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    # A dies inside a leading fire's handler. At-least-once wrote its record before
    # the opening write, so B runs it again (attempt 2, a higher token); at-most-once
    # never runs a leading fire twice.
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B", delivery=delivery) as (b, _, _):
        async with process(store, fires, "A", hold=100.0, delivery=delivery) as (
            a,
            a_backend,
            a_scope,
        ):
            r = await a.debounce("wf", "k", {"n": 1}, delay=3.0, mode="leading")
            assert r.outcome is Outcome.FIRE_IMMEDIATE
            await trio.sleep(0.5)
            die(a_backend, a_scope)
        await trio.sleep(2 * FAILOVER)
        assert b.statistics().refires == (delivery == "at-least-once")
    edges = [(p, f.edge, f.attempt, f.payload, f.ping_count) for p, f in fires.log]
    first = ("A", Edge.LEADING, 1, {"n": 1}, 1)
    if delivery == "at-most-once":
        assert edges == [first]
        assert not [k for k in store._data if k.startswith("f.")]  # no record written
        return
    assert edges == [first, ("B", Edge.LEADING, 2, {"n": 1}, 1)]
    assert fires.log[0][1].fencing_token < fires.log[1][1].fencing_token
    assert fires.log[1][1].first_ping_at == pytest.approx(fires.log[0][1].first_ping_at)
    assert not [k for k in store._data if k.startswith("f.")]  # completed


async def test_a_both_edges_leading_fire_runs_again_before_its_trailing_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    async with process(store, fires, "B") as (b, _, _):
        async with process(store, fires, "A", hold=100.0) as (a, a_backend, a_scope):
            await a.debounce("wf", "k", "a", delay=30.0, mode="both")
            await trio.sleep(0.5)
            r = await b.debounce("wf", "k", "b", delay=30.0, mode="both")
            assert not r.owner
            die(a_backend, a_scope)
        await trio.sleep(40.0)
    got = [(p, f.edge, f.attempt, f.payload) for p, f in fires.log]
    assert got == [
        ("A", Edge.LEADING, 1, "a"),
        ("B", Edge.LEADING, 2, "a"),  # adopted with the window, run again first
        ("B", Edge.TRAILING, 1, "b"),
    ]
    tokens = [f.fencing_token for _, f in fires.log]
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == 3


async def test_a_leading_rerun_is_skipped_once_a_later_fire_of_its_key_committed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A dies in the leading handler of window R; before its lease lapses, B's ping
    # after R's due time closes R and opens the next window with its own leading fire.
    # Running R's leading fire again then would put an older payload after a newer
    # one (its token would be higher): it is skipped, and counted.
    store, fires = MemoryStore(), Fires()
    events: list[Any] = []
    async with process(store, fires, "B", on_event=events.append) as (b, b_backend, _):
        async with process(store, fires, "A", hold=100.0) as (a, a_backend, a_scope):
            await a.debounce("wf", "k", "a", delay=1.0, mode="leading")
            run = await a.window_status("wf", "k")
            assert run is not None
            await trio.sleep(0.5)
            die(a_backend, a_scope)
        await trio.sleep(1.5)  # R is due; A's lease is still live
        r = await b.debounce("wf", "k", "b", delay=1.0, mode="leading")
        assert r.outcome is Outcome.FIRE_IMMEDIATE
        await trio.sleep(2 * FAILOVER)
        assert b.statistics().refires == 0
        assert b_backend.skipped_refires == 1
    [skipped] = [e for e in events if isinstance(e, LeadingReRunSkipped)]
    assert (skipped.workflow, skipped.key, skipped.run_id) == ("wf", "k", run.run_id)
    assert [(p, f.payload, f.attempt) for p, f in fires.log] == [("A", "a", 1), ("B", "b", 1)]
    assert not [k for k in store._data if k.startswith("f.")]  # taken back


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_a_handoff_exit_that_waits_for_a_handler_lets_a_peer_fire_on_time(
    autojump_clock: trio.testing.MockClock, delivery: Any
) -> None:
    # A leaves by a hand-off while a handler of its own takes 20 s. Its lease is marked
    # draining at once, so B adopts A's open window at its next heartbeat and fires it
    # on time, not once A's handler has returned; A's running fire stays A's.
    store, fires = MemoryStore(), Fires()

    async def a_handler(fire: Any) -> None:
        fires.log.append(("A", fire))
        if fire.key == "j":
            await trio.sleep(20.0)

    async with processes(store, fires, "B", delivery=delivery) as (b,):
        t0 = trio.current_time()
        async with open_coordinator(
            handlers={"wf": a_handler},
            backend=backend(store, "A"),
            on_exit="handoff",
            delivery=delivery,
        ) as a:
            await a.debounce("wf", "j", "busy", delay=0.5)
            await a.debounce("wf", "k", "a", delay=5.0)
            await trio.sleep(1.0)  # j's handler runs
        assert trio.current_time() == pytest.approx(t0 + 20.5, abs=0.05)  # A waited
        await b.wait_idle()
    assert [(p, f.key, f.payload) for p, f in fires.log] == [
        ("A", "j", "busy"),
        ("B", "k", "a"),
    ]
    k = fires.log[1][1]
    assert k.fired_at == pytest.approx(t0 + 5.0, abs=0.05)  # on time
    assert k.attempt == 1


async def test_an_opening_whose_answer_was_lost_recognises_a_peers_cancel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's opening write lands, its answer is late; meanwhile B cancels the window.
    # The cancel writes a tombstone of run r1 (never a bare delete), so A's re-read
    # recognises its run, closed: the ping is answered as landed in a closed window,
    # and is not written again (before, the delete left an empty key, and the ping
    # opened r1 again: the cancel was undone).
    store = MemoryStore()
    a, b = await _leased(store, "A", "B", op_timeout=1.0)
    a.faults.delay_next(1.5, ops=("put",))  # the opening write lands; its answer is late
    results: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(_ping_r1, a, results, delay=30.0))
        await trio.sleep(0.5)  # the write has landed; A re-reads at 1.0
        assert await b.cancel("wf", "k")
    [result] = results
    assert (result.outcome, result.run_id, result.ping_count) == (Registered.OPENED, "r1", 1)
    window = await _window(store)
    assert window is not None
    assert (window.run_id, window.fired, window.cancelled) == ("r1", True, True)
    assert (await a.finalize("wf", "k", "r1")).outcome is Finalized.ABANDONED
    assert not await a.owned_windows()


@pytest.mark.parametrize("noticed_by", ["finalize", "ping", "reconcile"])
async def test_a_peers_cancel_is_a_tombstone_the_owner_counts_once(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    noticed_by: str,
) -> None:
    # A peer (or trio-debounce cancel) cancels A's window: a cancel tombstone of its
    # run. Whichever of A's finalize, next ping or reconcile reads it first counts one
    # cancel; the window never fires.
    store, fires = MemoryStore(), Fires()
    tool = backend(store, "tool")
    delay = {"finalize": 30.0, "ping": 30.0, "reconcile": 1000.0}[noticed_by]
    with caplog.at_level(logging.WARNING, logger="trio_debounce"):
        async with process(store, fires, "A") as (a, _, _):
            await a.debounce("wf", "k", "a", delay=delay)
            await trio.sleep(2.0)
            assert await tool.cancel("wf", "k")
            entry = await store.get(_window_key())
            assert entry is not None
            assert entry.value is not None  # a tombstone, not a delete marker
            if noticed_by == "ping":
                r = await a.debounce("wf", "k", "b", delay=5.0)
                assert r.ping_count == 1  # a new window over the tombstone
            elif noticed_by == "reconcile":
                await trio.sleep(14 * BEAT)
                assert len(a) == 0
            await a.wait_idle()
            stats = a.statistics()
    assert (stats.cancelled, stats.deleted_externally) == (1, 1)
    assert [f.payload for _, f in fires.log] == (["b"] if noticed_by == "ping" else [])
    assert caplog.text.count("was closed by another writer") == 1
