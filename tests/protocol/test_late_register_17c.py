"""Issue 17, a register that lands long after it failed ("bug C"): a write queued at a
stalled server (or resent after a reconnect) may commit long after its caller gave up.
Under ``on_backend_error="fail-open"`` its burst already fired in a local window; the
reconcile that finds the late window must settle it (docs/protocol.rst, "A register
that failed but landed"), however late it lands within ``LATE_WRITE_HORIZON``. Before,
the fail-open run id was forgotten at the first reconcile that did not list it, and a
write landing after that was re-armed as an ordinary window and fired the burst again."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, processes
from trio_debounce import FireReason
from trio_debounce._shared import LATE_WRITE_HORIZON, _forget_late_writes
from trio_debounce._window import CLOSED, OPEN
from trio_debounce.testing import MemoryBackend, MemoryStore


@pytest.mark.parametrize("stall", [3 * LEASE, 0.5 * LATE_WRITE_HORIZON])
async def test_a_register_that_lands_long_after_its_fail_open_window_fired_is_not_fired_again(
    autojump_clock: trio.testing.MockClock, stall: float
) -> None:
    # A's create reaches the store `stall` seconds after it was sent; A gives up at its
    # op deadline and fails open; the local window fires at t0+3; reconciles (at the
    # heartbeat after the fail-open, then every two leases) run before the write lands.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, _b):
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        backend_a.faults.stall_next(stall, ops=("put",))
        t0 = trio.current_time()
        result = await a.debounce("wf", "k", "a", delay=1.0)
        assert a.statistics().fail_open_windows == 1
        # The write lands, then the reconciles of two more leases run.
        await trio.sleep(stall + 4 * LEASE)
        assert store.requests["put"] >= 1
        assert await a.window_status("wf", "k") is None  # the late window was deleted
    assert [(p, f.payload, f.run_id) for p, f in fires.log] == [("A", "a", result.active_run_id)]
    [(_, fire)] = fires.log
    assert fire.fired_at == pytest.approx(t0 + 3.0, abs=0.02)  # the local window's fire
    assert fire.reason is FireReason.DELAY


async def test_a_late_register_that_a_peer_pinged_into_still_fires_the_peers_ping(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The same late write, then B's ping joins the late window before A's reconcile
    # settles it (its due time is long past, so B's ping takes its fire: A's burst
    # again, the documented duplicate of a landed register) and B's ping is never
    # lost: it fires in the window it opens.
    store, fires = MemoryStore(), Fires()
    stall = 3 * LEASE
    async with processes(store, fires, "AB") as (a, b):
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        backend_a.faults.stall_next(stall, ops=("put",))
        await a.debounce("wf", "k", "a", delay=1.0)
        await trio.sleep(stall + 0.1)
        await b.debounce("wf", "k", "b", delay=1.0)
        await trio.sleep(4 * LEASE)
    assert [p for p, f in fires.log if f.payload == "b"] == ["B"]


async def test_fail_open_run_ids_are_forgotten_after_the_late_write_horizon(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Memory stays bounded: a closed fail-open window's run id is dropped by the first
    # reconcile LATE_WRITE_HORIZON after a reconcile found it closed.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A") as (a,):
        backend_a = a._backend
        assert isinstance(backend_a, MemoryBackend)
        backend_a.faults.partitioned = True
        result = await a.debounce("wf", "k", "a", delay=1.0)
        backend_a.faults.partitioned = False
        assert a.statistics().fail_open_windows == 1
        shared = a._shared
        assert shared is not None
        await trio.sleep(4 * LEASE)
        assert result.active_run_id in shared._fail_open_runs  # kept past its reconcile
        closed_at = shared._fail_open_closed[result.active_run_id]
        await trio.sleep_until(closed_at + LATE_WRITE_HORIZON - 0.1)
        assert result.active_run_id in shared._fail_open_runs  # the horizon is not over
        await trio.sleep(2 * LEASE + 0.2)  # a reconcile every two leases
        assert shared._fail_open_runs == {}
        assert shared._fail_open_closed == {}
    assert len(fires.log) == 1


class _W:
    def __init__(self, state: int) -> None:
        self.state = state


def test_forget_late_writes_keeps_open_and_listed_runs_and_caps_the_closed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("trio_debounce._shared._LATE_WRITES_KEPT", 2)
    runs: dict[str, object] = {
        "open": _W(OPEN),
        "listed": _W(CLOSED),
        "c1": _W(CLOSED),
        "c2": _W(CLOSED),
        "c3": _W(CLOSED),
    }
    closed: dict[str, float] = {}
    _forget_late_writes(runs, closed, {"listed"}, 100.0)  # type: ignore[arg-type]
    # At most two closed run ids are kept, the newest; an open or listed one stays.
    assert sorted(runs) == ["c2", "c3", "listed", "open"]
    assert sorted(closed) == ["c2", "c3"]
    _forget_late_writes(runs, closed, {"listed"}, 100.0 + LATE_WRITE_HORIZON)  # type: ignore[arg-type]
    assert sorted(runs) == ["listed", "open"]
    assert closed == {}
