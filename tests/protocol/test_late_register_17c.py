"""Issue 17, a register write that lands long after its answer was lost ("bug C"): a
write queued at a stalled server (or resent after a reconnect) may commit long after
its caller gave up, once its key is empty again. The reconcile that finds the late
window must settle it, not fire the burst again (docs/protocol.rst, "A register that
failed but landed"), however late it lands within ``LATE_WRITE_HORIZON``:

* the register failed open, and its burst fired in a local window. Before, the
  fail-open run id was forgotten at the first reconcile that did not list it, and a
  write landing after that was re-armed as an ordinary window and fired again;
* the register's re-read found its create not landed (yet) and wrote the pings again:
  that window fired and was swept, then the first create landed and opened a second
  window of the same run, which fired it twice, under at-most-once too."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, processes
from trio_debounce import Coordinator, FireReason
from trio_debounce._backend import LATE_WRITE_HORIZON
from trio_debounce._protocol._documents import WindowDoc
from trio_debounce._protocol._view import StoreView
from trio_debounce._shared import _forget_late_writes
from trio_debounce._window import CLOSED, OPEN
from trio_debounce.testing import MemoryBackend, MemoryStore, StoreFaults


def _faults(coordinator: Coordinator) -> StoreFaults:
    """The store faults of ``coordinator``'s MemoryBackend."""
    backend = coordinator._backend
    assert isinstance(backend, MemoryBackend)
    return backend.faults


@pytest.mark.parametrize("stall", [3 * LEASE, 0.5 * LATE_WRITE_HORIZON])
async def test_a_register_that_lands_long_after_its_fail_open_window_fired_is_not_fired_again(
    autojump_clock: trio.testing.MockClock, stall: float
) -> None:
    # A's create reaches the store `stall` seconds after it was sent; A gives up at its
    # op deadline and fails open; the local window fires at t0+3; reconciles (at the
    # heartbeat after the fail-open, then every two leases) run before the write lands.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB") as (a, _b):
        _faults(a).stall_next(stall, ops=("put",))
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


@pytest.mark.parametrize("delivery", ["at-most-once", "at-least-once"])
@pytest.mark.parametrize("stall", [3 * LEASE, 0.5 * LATE_WRITE_HORIZON])
async def test_a_create_written_again_that_lands_after_its_window_was_swept_is_not_fired_again(
    autojump_clock: trio.testing.MockClock, stall: float, delivery: str
) -> None:
    # A's create times out at 0.3 s (its answer lost) and reaches the store `stall`
    # seconds later. The re-read finds the key empty: the pings are written again (the
    # same run, the same write id) and stored. That window fires at t0+1 and its
    # tombstone is swept; then the first create lands on the empty key: a second window
    # of the run, owned by A. A's reconcile deletes it.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB", delivery=delivery) as (a, _b):
        _faults(a).stall_next(stall, ops=("put",), fail_after=0.3)
        t0 = trio.current_time()
        result = await a.debounce("wf", "k", "a", delay=1.0)
        assert result.stored
        assert a.statistics().fail_open_windows == 0
        await trio.sleep(stall + 4 * LEASE)
        assert await a.window_status("wf", "k") is None
    assert [(p, f.payload, f.run_id) for p, f in fires.log] == [("A", "a", result.active_run_id)]
    assert fires.log[0][1].fired_at == pytest.approx(t0 + 1.0, abs=0.02)


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
        _faults(a).stall_next(stall, ops=("put",))
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
        _faults(a).partitioned = True
        result = await a.debounce("wf", "k", "a", delay=1.0)
        _faults(a).partitioned = False
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
    monkeypatch.setattr("trio_debounce._shared.LATE_WRITES_KEPT", 2)
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


def test_late_openings_are_forgotten_after_the_horizon_and_beyond_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("trio_debounce._protocol._view.LATE_WRITES_KEPT", 2)
    view = StoreView(MemoryStore(), heartbeat_interval=1.0, skew=0.5)
    view.note_late_opening("k", "r1", "w1", 0.0)
    view.note_late_opening("k", "r2", "w2", 1.0)
    view.note_late_opening("k", "r3", "w3", 2.0)  # over the cap: r1 goes
    assert [run for _, run in view.late_openings] == ["r2", "r3"]
    view.note_late_opening("k", "r4", "w4", 1.0 + LATE_WRITE_HORIZON)  # r2 is past the horizon
    assert [run for _, run in view.late_openings] == ["r3", "r4"]
    # Only a run whose window closed since, within the horizon, and not owned here.
    doc = WindowDoc.__new__(WindowDoc)
    object.__setattr__(doc, "run_id", "r3")
    object.__setattr__(doc, "opened_by", "w3")
    object.__setattr__(doc, "write", "w3")
    assert not view.is_late_opening("k", doc, 3.0)
    view.note_run_closed("other", "r3")  # another key's run of the same id
    assert not view.is_late_opening("k", doc, 3.0)
    view.note_run_closed("k", "r3")
    assert view.is_late_opening("k", doc, 3.0)
    assert not view.is_late_opening("k", doc, 2.0 + LATE_WRITE_HORIZON)
    view.owned["k"] = "r3"
    assert not view.is_late_opening("k", doc, 3.0)


@pytest.mark.parametrize("delivery", ["at-most-once", "at-least-once"])
@pytest.mark.parametrize("outage", [2.5, 1.5 * LEASE])
async def test_a_retried_opening_whose_finalize_gave_up_still_fires(
    autojump_clock: trio.testing.MockClock, outage: float, delivery: str
) -> None:
    # (Found by a review of the fix above.) A's create fails (not applied); the
    # re-read finds the key empty and the pings are written again: window R, which
    # looks exactly as a late landing of that create would. At R's due time the store
    # is out for longer than op_timeout: the finalize gives up and leaves R in the
    # store for the reconcile, which must re-arm it (R never fired), not delete it.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A", delivery=delivery) as (a,):
        _faults(a).fail_next(1, ops=("put",))
        assert (await a.debounce("wf", "k", "a", delay=3.0)).stored
        await trio.sleep(2.9)
        _faults(a).partitioned = True
        await trio.sleep(outage)
        _faults(a).partitioned = False
        await trio.sleep(4 * LEASE)
    assert [(p, f.payload) for p, f in fires.log] == [("A", "a")]


@pytest.mark.parametrize("delivery", ["at-most-once", "at-least-once"])
async def test_a_run_id_given_to_two_keys_does_not_mark_the_other_keys_opening_closed(
    autojump_clock: trio.testing.MockClock, delivery: str
) -> None:
    # (Found by a second review.) k1's create fails and its pings are written again
    # under the caller's run id "X"; k2's window of the same run id fires. k1's
    # finalize then gives up in an outage: its window must still fire, not be taken
    # for a late create of a run that closed.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "A", delivery=delivery) as (a,):
        _faults(a).fail_next(1, ops=("put",))
        assert (await a.debounce("wf", "k1", "a1", delay=3.0, run_id="X")).stored
        assert (await a.debounce("wf", "k2", "a2", delay=1.0, run_id="X")).stored
        await trio.sleep(2.9)
        assert [f.key for _, f in fires.log] == ["k2"]
        _faults(a).partitioned = True
        await trio.sleep(1.5 * LEASE)
        _faults(a).partitioned = False
        await trio.sleep(4 * LEASE)
    assert sorted((f.key, f.payload) for _, f in fires.log) == [("k1", "a1"), ("k2", "a2")]


async def test_two_lost_creates_of_one_batch_that_both_land_late_fire_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # (Found by a second review.) Two creates of one batch have their answers lost and
    # each lands later, after the stored window fired and was swept: both are deleted.
    store, fires = MemoryStore(), Fires()
    async with processes(store, fires, "AB", delivery="at-most-once") as (a, _b):
        _faults(a).stall_next(3 * LEASE, ops=("put",), fail_after=0.1)
        _faults(a).stall_next(6 * LEASE, ops=("put",), fail_after=0.1)
        assert (await a.debounce("wf", "k", "a", delay=1.0)).stored
        await trio.sleep(12 * LEASE)
        assert await a.window_status("wf", "k") is None
    assert [(p, f.payload) for p, f in fires.log] == [("A", "a")]
