"""Reads from a replica that lags (``StoreFaults.lag``) must not decide what no
compare-and-swap catches later: a register's answer after its writes conflicted, an
unconfirmed fire's queued delete, and the end of a ``queue-latest`` run. Each was
decided on a plain read before, found by a review of the stale-proof fix
(``test_stale_proofs.py``); the register and the end of a run now re-read from the
store's authority, and the queued delete reads from it."""

from __future__ import annotations

import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, backend
from trio_debounce import Outcome, open_coordinator
from trio_debounce._keys import window_key
from trio_debounce.testing import MemoryStore

KV_KEY = window_key("wf", "k")


async def test_a_ping_is_not_absorbed_unstored_into_a_flushed_window_seen_on_a_lagging_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A owns an open window (due in 10 s). B's replica stops applying writes of the
    # key. A flushes the window: it fires, its tombstone lands. B pings. Before, every
    # read of the register (Registrar._write_batch_recorded) came from the lagging
    # replica, so each compare-and-swap conflicted on the stale revision until B's
    # op_timeout, and the last read, a live owner with a fire pending after the ping,
    # coalesced B's ping without storing it (absorbs_unstored) into a window that had
    # fired: B's ping was in no fire. Now the read after a conflict is the leader's.
    store, fires = MemoryStore(), Fires()
    a_backend = backend(store, "A", op_timeout=1.0)
    b_backend = backend(store, "B", op_timeout=1.0)
    async with (
        open_coordinator(handlers={"wf": fires.handler("A")}, backend=a_backend) as a,
        open_coordinator(
            handlers={"wf": fires.handler("B")}, backend=b_backend, on_backend_error="raise"
        ) as b,
    ):
        await a.debounce("wf", "k", "a", delay=10.0)
        b_backend.faults.lag(KV_KEY)
        assert await a.flush("wf", "k")
        await trio.sleep(0.5)
        assert [f.payload for _, f in fires.log] == ["a"]
        r = await b.debounce("wf", "k", "b", delay=10.0)
        # Stored: a new window of B's over the fired one's tombstone.
        assert (r.outcome, r.owner, r.stored) == (Outcome.SCHEDULE_TRAILING, True, True)
        await trio.sleep(2 * LEASE)
        b_backend.faults.catch_up()
        await trio.sleep(20.0)
    assert [(p, f.payload) for p, f in fires.log] == [("A", "a"), ("B", "b")]


async def test_an_unconfirmed_fires_queued_delete_is_not_dropped_on_a_lagging_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's replica has not applied the window's creation (the key looks absent there).
    # A's fire commit never lands (the store fails every write until A's op_timeout):
    # A fires unconfirmed (its lease still held) and queues the window's delete.
    # Finalizer.apply_queued read the window with a plain get: the lagging replica
    # showed no window, so the delete was dropped as done (and the record deleted),
    # with no compare-and-swap to catch it. The window, still open
    # in the store and naming A, is re-armed by A's next reconcile once the replica
    # catches up: the same burst fires a second time.
    store, fires = MemoryStore(), Fires()
    b = backend(store, "A", op_timeout=1.0)
    async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=b) as a:
        await trio.sleep(0.1)
        b.faults.lag(KV_KEY)  # absent there, from now on
        await a.debounce("wf", "k", "a", delay=1.0)
        await trio.sleep(0.5)
        b.faults.fail_next(1000, ops=("put",))  # the fire's commit never lands
        await trio.sleep(3.0)
        assert [f.payload for _, f in fires.log] == ["a"]  # fired unconfirmed
        assert a.statistics().unconfirmed_fires == 1
        b.faults.clear()  # the lag stays
        await trio.sleep(2 * LEASE)
        b.faults.catch_up()
        await trio.sleep(4 * LEASE)
    assert [f.payload for _, f in fires.log] == ["a"]


async def test_a_queue_latest_runs_end_is_not_dropped_on_a_lagging_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's queue-latest run of k fires (its tombstone names the run as running) while
    # A's replica has stopped at the window as it was before the fire. B pings during
    # the run: B's window waits for A's run. The run returns: Finalizer.end_run writes
    # against A's remembered tombstone and conflicts (B wrote since). Before, _end_run
    # then read again with a plain get: the lagging replica showed a window naming no
    # run, so the end was taken as "nothing names it" (run_end_recorded) and never
    # written, and B's window waited for a live process's run that had ended: with no
    # run_timeout, until A exits (a hang). Now that read is the leader's.
    store, fires = MemoryStore(), Fires()
    a_backend = backend(store, "A", op_timeout=1.0)
    b_backend = backend(store, "B", op_timeout=1.0)
    async with (
        open_coordinator(handlers={"wf": fires.handler("A", hold=5.0)}, backend=a_backend) as a,
        open_coordinator(handlers={"wf": fires.handler("B")}, backend=b_backend) as b,
    ):
        await a.debounce("wf", "k", "a", delay=1.0, overlap="queue-latest")
        await trio.sleep(0.5)
        a_backend.faults.lag(KV_KEY)  # the open window, naming no run, from now on
        await trio.sleep(1.0)
        assert [(p, f.payload) for p, f in fires.log] == [("A", "a")]  # the run runs
        await b.debounce("wf", "k", "b", delay=1.0, overlap="queue-latest")
        await trio.sleep(10.0)  # the run returned at 6 s
        a_backend.faults.catch_up()
        await trio.sleep(6 * LEASE)
        assert [(p, f.payload) for p, f in fires.log] == [("A", "a"), ("B", "b")]
