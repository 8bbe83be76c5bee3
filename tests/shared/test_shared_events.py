"""The ``on_event`` hook with a backend (``MemoryBackend``, MockClock): takeovers by a
ping and by adoption, a ping failed open, a late fire's lateness, and the backend's
own events (store calls, lease renewals and lapses, proofs, external deletes)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, SKEW, WF, backend, near, process, processes
from trio_debounce import (
    BackendUnavailableError,
    CommitProven,
    CoordinatorEvent,
    FireFinished,
    FireReason,
    FireStarted,
    LeadingReRunSkipped,
    LeaseLapsed,
    LeaseRenewed,
    Mode,
    Outcome,
    PingAnswered,
    PingFailedOpen,
    PingRejected,
    StoreCalled,
    WindowDeletedExternally,
    WindowTakenOver,
    open_coordinator,
)
from trio_debounce.testing import MemoryStore

KW: dict[str, Any] = {"mode": Mode.TRAILING, "max_delay": None}
BACKEND_EVENTS = (StoreCalled, LeaseRenewed, LeaseLapsed, CommitProven, LeadingReRunSkipped)


async def _dead_owner(store: MemoryStore, delay: float) -> float:
    """A window of process A (run "r", payload "a", due ``delay`` after now), whose
    lease then lapses (A is dead); returns the window's due time (Trio's clock)."""
    a = backend(store, "A")
    await a.refresh_lease()
    due = trio.current_time() + delay
    await a.register("wf", "k", run_id="r", payload="a", delay=delay, **KW)
    await trio.sleep(LEASE + SKEW + 1.0)
    return due


async def test_an_adopted_window_is_reported_and_its_fire_carries_its_lateness(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    due = await _dead_owner(store, 1.0)  # due long before anyone adopts it
    events: list[CoordinatorEvent] = []
    async with open_coordinator(
        handlers={"wf": fires.handler("B")}, backend=backend(store, "B"), on_event=events.append
    ) as b:
        with trio.fail_after(10 * LEASE):
            await fires.wait_for(1)
    [taken] = [e for e in events if isinstance(e, WindowTakenOver)]
    assert (taken.workflow, taken.key, taken.by) == ("wf", "k", "adoption")
    [started] = [e for e in events if isinstance(e, FireStarted)]
    assert (started.fire.run_id, started.fire.payload) == ("r", "a")
    assert started.fire.fired_at == due
    assert started.lateness == started.at - due > LEASE  # it waited for A's lease
    assert started.at >= taken.at
    assert b.statistics().takeovers == 1


async def test_a_window_taken_over_by_a_ping_is_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    events: list[CoordinatorEvent] = []
    b_backend = backend(store, "B")
    async with open_coordinator(
        handlers={"wf": fires.handler("B")}, backend=b_backend, on_event=events.append
    ) as b:
        # A opens a window and dies while B runs: B's start saw A alive, and B
        # adopts only at every sixth heartbeat; its ping after A's lease lapsed
        # (before that heartbeat) finds A's window and takes it over.
        a = backend(store, "A")
        await a.refresh_lease()
        await a.register("wf", "k", run_id="r", payload="a", delay=1e6, **KW)
        await trio.sleep(LEASE + SKEW + 0.5)
        assert trio.current_time() < 6 * b_backend.heartbeat_interval
        r = await b.debounce("wf", "k", "b", delay=1.0)
        assert (r.outcome, r.active_run_id, r.owner) == (Outcome.COALESCE, "r", True)
        await b.cancel("wf", "k")
    taken = [(e.key, e.by) for e in events if isinstance(e, WindowTakenOver)]
    assert taken == [("k", "ping")]
    [answered] = [e for e in events if isinstance(e, PingAnswered)]
    assert answered.result == r
    assert b.statistics().takeovers == 1


async def test_a_ping_failed_open_is_reported_and_a_raised_one_rejected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    for on_backend_error in ("fail-open", "raise"):
        events: list[CoordinatorEvent] = []
        async with open_coordinator(
            handlers={"wf": fires.handler("A")},
            backend=backend(store, "A" + on_backend_error),
            on_backend_error=on_backend_error,
            on_event=events.append,
        ) as a:
            store.down = True
            with contextlib.suppress(BackendUnavailableError):
                await a.debounce("wf", "k", 1, delay=2.0)
            store.down = False
        kinds = [
            type(e).__name__ for e in events if not isinstance(e, (FireStarted, *BACKEND_EVENTS))
        ]
        if on_backend_error == "fail-open":
            assert kinds == ["PingFailedOpen", "PingAnswered", "FireFinished"]
            [failed] = [e for e in events if isinstance(e, PingFailedOpen)]
            assert (failed.workflow, failed.key) == ("wf", "k")
            assert "down" in str(failed.error)
        else:
            assert kinds == ["PingRejected"]
            [rejected] = [e for e in events if isinstance(e, PingRejected)]
            assert isinstance(rejected.error, BackendUnavailableError)


async def test_store_calls_and_lease_renewals_are_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Every request to the store, with its duration and outcome: a lost
    # compare-and-swap is a "conflict", a request without an answer "unavailable".
    store, fires = MemoryStore(epoch=0.0), Fires()
    events: list[CoordinatorEvent] = []
    b = backend(store, "A")
    async with open_coordinator(
        handlers={"wf": fires.handler("A")}, backend=b, on_event=events.append
    ) as a:
        renewed = [e for e in events if isinstance(e, LeaseRenewed)]
        assert [(e.expires_in, e.draining) for e in renewed] == [(LEASE, False)]  # the start
        events.clear()
        b.faults.delay_next(0.25, ops=("put",))
        await a.debounce("wf", "k", 1, delay=1.0)
        b.faults.conflict_next()
        await a.debounce("wf", "k", 2, delay=1.0)  # re-reads, then writes again
        b.faults.fail_next(ops=("get",))
        await a.debounce("wf", "k2", 3, delay=1.0)
        # The windows' requests (the heartbeat's and the reconcile's may come between).
        windows = [
            e
            for e in events
            if isinstance(e, StoreCalled) and e.key.startswith("w.") and e.op != "entries"
        ]
        calls = [(e.op, e.outcome) for e in windows]
        assert calls[:2] == [("get", "ok"), ("put", "ok")]  # k, first ping
        assert ("put", "conflict") in calls
        assert calls[-3:] == [("get", "unavailable"), ("get", "ok"), ("put", "ok")]
        assert windows[1].duration == pytest.approx(0.25)
        assert windows[-3].key != windows[0].key  # k2
        events.clear()
        await trio.sleep(b.heartbeat_interval + 0.01)
        assert any(isinstance(e, LeaseRenewed) for e in events)
    assert b._view.on_event is None  # detached


async def test_no_hook_reports_nothing_from_the_backend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    b = backend(MemoryStore(epoch=0.0), "A")
    async with open_coordinator(handlers={"wf": Fires().handler("A")}, backend=b) as a:
        assert b._view.on_event is None
        await a.debounce("wf", "k", 1, delay=1.0)


async def test_a_lapsed_lease_is_reported_once_per_lapse(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    events: list[CoordinatorEvent] = []
    b = backend(store, "A")
    async with open_coordinator(
        handlers={"wf": fires.handler("A")}, backend=b, on_event=events.append
    ):
        b.faults.partitioned = True
        await trio.sleep(LEASE + 2 * b.heartbeat_interval)  # beats fail past the lease
        b.faults.partitioned = False
        await trio.sleep(2 * b.heartbeat_interval)  # renewed again
    lapses = [e for e in events if isinstance(e, LeaseLapsed)]
    assert len(lapses) == 1
    assert 0 <= lapses[0].overdue < b.heartbeat_interval + 0.01
    renewed_after = [e for e in events if isinstance(e, LeaseRenewed) and e.at > lapses[0].at]
    assert renewed_after


async def test_an_external_delete_and_a_proof_are_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    events: list[CoordinatorEvent] = []
    b = backend(store, "A")
    async with open_coordinator(
        handlers={"wf": fires.handler("A")},
        backend=b,
        delivery="at-most-once",
        on_event=events.append,
    ) as a:
        r = await a.debounce("wf", "k", "x", delay=5.0)
        [entry] = [e for e in await store.entries("w.") if e.value]
        await store.delete(entry.key, last=entry.revision)  # an operator's KV delete
        await trio.sleep(6.0)  # the finalize finds it gone
        [deleted] = [e for e in events if isinstance(e, WindowDeletedExternally)]
        assert (deleted.workflow, deleted.key, deleted.run_id) == ("wf", "k", r.active_run_id)
        assert a.statistics().deleted_externally == 1
        # An at-most-once commit whose answer comes past op_timeout: proven by re-reads.
        await a.debounce("wf", "k", "y", delay=1.0)
        await trio.sleep(0.9)
        b.faults.delay_next(3.0, ops=("put",))
        await trio.sleep(4.0)
    [proven] = [e for e in events if isinstance(e, CommitProven)]
    assert (proven.key, proven.landed) == ("k", True)
    [fired] = [e for e in events if isinstance(e, FireFinished)]
    assert (fired.fire.payload, fired.reason) == ("y", "delay")
    assert proven.at <= fired.at


async def test_a_shared_fire_says_why_it_fired(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    events: list[CoordinatorEvent] = []
    async with open_coordinator(
        handlers={"wf": fires.handler("A")}, backend=backend(store, "A"), on_event=events.append
    ) as a:
        await a.debounce("wf", "silence", 1, delay=1.0)
        for _ in range(3):  # at 0, 0.9 and 1.8: the silence would come at 2.8
            await a.debounce("wf", "capped", 1, delay=1.0, max_delay=2.5)
            await trio.sleep(0.9)
        await a.debounce("wf", "flushed", 1, delay=10.0)
        await a.debounce("wf", "counted", 1, delay=10.0, max_count=2)
        await a.debounce("wf", "counted", 2, delay=10.0, max_count=2)
        await a.debounce("wf", "led", 1, delay=1.0, mode="leading")
        await a.flush("wf", "flushed")
        await trio.sleep(5.0)
    reasons = {e.fire.key: e.reason for e in events if isinstance(e, FireStarted)}
    assert reasons == {e.fire.key: e.fire.reason for e in events if isinstance(e, FireStarted)}
    assert reasons == {
        "silence": "delay",
        "capped": "max-delay",
        "flushed": "flush",
        "counted": "max-count",
        "led": "leading",
    }


# ------------------------------------------------- why a shared fire fired


async def test_an_adopted_window_due_before_its_adoption_says_adoption(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for delay, reason in ((1.0, FireReason.ADOPTION), (1000.0, FireReason.DELAY)):
        store, fires = MemoryStore(epoch=0.0), Fires()
        # Due long before B adopts it, or long after (its usual reason then).
        due = await _dead_owner(store, delay)
        async with open_coordinator(
            handlers={"wf": fires.handler("B")}, backend=backend(store, "B")
        ) as b:
            with trio.fail_after(2 * delay + 10 * LEASE):
                await fires.wait_for(1)
            assert b.statistics().takeovers == 1
        [(_, fire)] = fires.log
        assert (fire.payload, fire.fired_at, fire.reason) == ("a", due, reason)


async def test_a_shared_fire_early_overflow_says_overflow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    opts: dict[str, Any] = {"payload_policy": "collect", "max_items": 2, "delay": 10.0}
    async with processes(store, fires, "AB") as (a, b):
        await a.debounce(WF, "k", 1, **opts)
        await b.debounce(WF, "k", 2, **opts)
        await b.debounce(WF, "k", 3, **opts)  # full: B takes the fire at once
        await trio.sleep(0.5)
        assert [(p, f.payload, f.reason) for p, f in fires.of("k")] == [
            ("B", [1, 2], FireReason.OVERFLOW)
        ]
    assert [f.reason for _, f in fires.of("k")][1:] == [FireReason.DELAY]


async def test_a_shared_exit_flush_says_exit(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with processes(store, fires, "A", on_exit="flush") as (a,):
        await a.debounce(WF, "exit", 1, delay=10.0)
        await a.debounce(WF, "user", 2, delay=10.0)
        await trio.sleep(1.0)
        assert await a.flush(WF, "user")
        await trio.sleep(0.5)
    assert sorted((f.key, f.reason) for _, f in fires.log) == [
        ("exit", FireReason.EXIT),
        ("user", FireReason.FLUSH),
    ]


async def test_a_shared_queue_latest_window_that_waited_for_its_run_says_run_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    queue: dict[str, Any] = {"overlap": "queue-latest", "delay": 1.0}
    async with (
        process(store, fires, "A", hold=5.0) as (a, _, _),
        process(store, fires, "B", hold=5.0) as (b, _, _),
    ):
        t0 = trio.current_time()
        await a.debounce(WF, "k", 1, **queue)  # fires at 1 on A, runs until 6
        await trio.sleep(2.0)
        await b.debounce(WF, "k", 2, **queue)  # due at 3: waits for A's run
        await trio.sleep_until(t0 + 20.0)
        await b.debounce(WF, "k", 3, **queue)  # no run blocks it
        await trio.sleep(8.0)
    assert [(f.payload, f.reason) for _, f in fires.of("k")] == [
        (1, FireReason.DELAY),
        (2, FireReason.RUN_END),
        (3, FireReason.DELAY),
    ]
    assert fires.of("k")[1][1].fired_at == near(t0 + 6.0)
