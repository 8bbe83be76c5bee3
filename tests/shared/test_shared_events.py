"""The ``on_event`` hook with a backend (``MemoryBackend``, MockClock): takeovers by a
ping and by adoption, a ping failed open, and a late fire's lateness."""

from __future__ import annotations

import contextlib
from typing import Any

import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, SKEW, backend
from trio_debounce import (
    BackendUnavailableError,
    CoordinatorEvent,
    FireStarted,
    Mode,
    Outcome,
    PingAnswered,
    PingFailedOpen,
    PingRejected,
    WindowTakenOver,
    open_coordinator,
)
from trio_debounce.testing import MemoryStore

KW: dict[str, Any] = {"mode": Mode.TRAILING, "max_delay": None}


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
        kinds = [type(e).__name__ for e in events if not isinstance(e, FireStarted)]
        if on_backend_error == "fail-open":
            assert kinds == ["PingFailedOpen", "PingAnswered", "FireFinished"]
            [failed] = [e for e in events if isinstance(e, PingFailedOpen)]
            assert (failed.workflow, failed.key) == ("wf", "k")
            assert "down" in str(failed.error)
        else:
            assert kinds == ["PingRejected"]
            [rejected] = [e for e in events if isinstance(e, PingRejected)]
            assert isinstance(rejected.error, BackendUnavailableError)
