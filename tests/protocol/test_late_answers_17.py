"""Issue 17, late answers under at-least-once: a fire commit whose fire record landed but
whose answer came after ``op_timeout`` never sent its tombstone, so it cannot have
landed. Found by the fault fuzz of tests/chaos/FAULT_FUZZ.md (``fuzz_flow.py batch``,
``FTYPES=delay``, seed 10): a taker's record whose answer was late was kept as a lost
commit, decided at a later reconcile after more than ``_AFTER_KEEP`` newer windows of
its key had fired, taken for a commit that landed (the "in doubt" answer of a full
``after``), and run again beside the owner's fire of the same run. And a ping whose
take failed under ``on_backend_error="raise"`` (every flow window) left its lost
commit to the sixth heartbeat's reconcile, not the next, long enough for its proof to
go the same way."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import BEAT, WF, backend
from trio_debounce import BackendUnavailableError, Finalized, Mode, open_coordinator
from trio_debounce._keys import window_key
from trio_debounce._protocol import _AFTER_KEEP, WindowDoc, _FireRecord
from trio_debounce.testing import MemoryBackend, MemoryStore

#: More windows than a window's ``after`` names: the proof of the first is gone.
_NEWER = _AFTER_KEEP + 2


async def _window(store: MemoryStore) -> WindowDoc:
    entry = await store.get(window_key("wf", "k"))
    assert entry is not None
    assert entry.value is not None
    return WindowDoc.decode(entry.value)


async def _records(store: MemoryStore) -> list[str]:
    """The run ids of the fire records in the store."""
    return [_FireRecord.decode(e.value).run_id for e in await store.entries("f.") if e.value]


async def _ping(b: MemoryBackend, run_id: str, payload: str) -> None:
    await b.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id=run_id, payload=payload
    )


async def _owner_fires(owner: MemoryBackend, run_id: str) -> None:
    """The owner fires its window ``run_id`` (confirmed) and completes its record."""
    fin = await owner.finalize("wf", "k", run_id, force=True)
    assert fin.outcome is Finalized.FIRE
    assert fin.fire_id is not None
    await owner.complete(fin.fire_id)


async def _owner_fires_newer_windows(owner: MemoryBackend) -> None:
    """Windows n1 .. n<_NEWER>, each opened over the tombstone before it and fired."""
    for n in range(1, _NEWER + 1):
        await _ping(owner, f"n{n}", f"q{n}")
        await _owner_fires(owner, f"n{n}")


async def _two(store: MemoryStore) -> tuple[MemoryBackend, MemoryBackend]:
    """Taker A and owner B, each with its lease written; B's window r1 holds "p1"."""
    taker, owner = backend(store, "A"), backend(store, "B")
    for b in (taker, owner):
        await b.refresh_lease()
    await _ping(owner, "r1", "p1")
    return taker, owner


async def test_a_takers_record_whose_tombstone_was_never_sent_is_taken_back_not_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The taker's fire record lands, its answer comes after op_timeout: the take gives
    # up before sending its tombstone. The owner fires r1, then more windows of the key
    # fire than a window's "after" names. The taker's next adopt_orphans must take its
    # record back: before, it ran r1 a second time (attempt 1), with the owner's run.
    store = MemoryStore()
    taker, owner = await _two(store)
    taker.faults.delay_next(3.0, ops=("put",))  # the record lands; its answer is late
    with pytest.raises(BackendUnavailableError):
        await taker.finalize("wf", "k", "r1", take=True, force=True)
    await trio.sleep(3.0)
    assert await _records(store) == ["r1"]
    await _owner_fires(owner, "r1")
    await _owner_fires_newer_windows(owner)
    assert "r1" not in {run for run, _ in (await _window(store)).after}
    await taker.refresh_lease()  # a heartbeat: its queued deletes, then the reconcile
    assert (await taker.adopt_orphans({"wf"})).fires == []
    assert await _records(store) == []


async def test_a_reread_under_newer_windows_never_fires_a_commit_whose_tombstone_was_not_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The same within one finalize: the taker's fire record is written but its answer
    # is lost (an error), and the re-read that follows comes late (a stalled read),
    # after the owner fired r1 and more windows than "after" names. The taker's
    # tombstone was never sent: its finalize must be abandoned, not fire r1 again.
    store = MemoryStore()
    taker, owner = await _two(store)
    await _ping(taker, "r1", "p2")  # the taker knows the window (no read before the commit)
    taker.faults.apply_then_fail_next(1, ops=("put",))  # the record lands; answer lost
    taker.faults.stall_next(1.0, ops=("get",))  # the re-read reaches the store 1 s later
    result: list[Finalized] = []

    async def take() -> None:
        result.append((await taker.finalize("wf", "k", "r1", take=True, force=True)).outcome)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        await trio.sleep(0.5)  # the taker's re-read is stalled
        await _owner_fires(owner, "r1")
        await _owner_fires_newer_windows(owner)
    assert result == [Finalized.ABANDONED]
    assert await _records(store) == []


async def test_a_take_that_failed_in_a_raising_register_is_settled_at_the_next_heartbeat(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Under on_backend_error="raise" (as for every flow window, which never fails open)
    # a ping that takes a due fire and fails leaves its commit unproven, like a failed
    # finalize: the next heartbeat must reconcile and decide it while its proof is
    # fresh. Here the taker A's tombstone is stalled (it reaches the store after the
    # owner B's commit of the same run, so it never lands); B then fires more windows
    # of the key than "after" names. Before, A decided at its sixth heartbeat, found
    # the proof gone, ran B's run a second time (attempt 1, payload of B's ping).
    store, fires = MemoryStore(), Fires()
    a, b = backend(store, "A", op_timeout=1.0), backend(store, "B")
    async with AsyncExitStack() as stack:
        ca, cb = [
            await stack.enter_async_context(
                open_coordinator(
                    handlers={WF: fires.handler(name)}, backend=x, on_backend_error="raise"
                )
            )
            for name, x in (("A", a), ("B", b))
        ]
        start = trio.current_time()
        await trio.sleep_until(start + BEAT + 0.5)
        await cb.debounce(WF, "k", "b0", delay=1.0)  # B's window, due at BEAT + 1.5
        b.faults.stall_next(0.5, ops=("put",))  # B's commit lands at BEAT + 2.0
        await trio.sleep_until(start + BEAT + 1.6)
        a.faults.delay_next(0.0, ops=("put",))  # A's fire record lands at once
        a.faults.stall_next(3.0, ops=("put",))  # its tombstone comes after B's commit
        with pytest.raises(BackendUnavailableError):
            await ca.debounce(WF, "k", "a0", delay=1.0)  # at the due time: takes the fire
        await trio.sleep_until(start + 3 * BEAT + 0.5)  # past A's next heartbeat
        for n in range(_NEWER):
            await cb.debounce(WF, "k", f"b{n + 1}", delay=0.1)
            await trio.sleep(0.5)
        await trio.sleep_until(start + 7 * BEAT + 0.5)  # past A's sixth heartbeat
    runs = Counter(fire.run_id for _, fire in fires.log)
    assert sorted(runs.values()) == [1] * (_NEWER + 1)
    assert [fire.payload for _, fire in fires.log] == [f"b{n}" for n in range(_NEWER + 1)]
    assert await _records(store) == []  # A's record was taken back
