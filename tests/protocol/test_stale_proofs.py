"""A lost at-least-once commit is proven on reads from the store's authority.

Found by the full chaos run of 2026-12-06 (``cluster-no-quorum``, one lost window): an
owner's at-least-once commit landed (its fire record, then its tombstone), but its
answer was lost when the node its client was connected to was killed, and its lease
lapsed in the quorum loss that followed, so it did not fire on its own view. When the
cluster came back, the owner decided its lost commit on a direct get, which a replica
still catching up answered with the window as it was before the commit (open, at the
revision the commit replaced). Read as "the commit did not land", the owner took its
fire record back; the sweeper then removed the tombstone, which no record needed any
more, and the window never fired. The store's blocks showed the record, the tombstone
naming its write, and the sweeper's delete 20 s later.

:meth:`StoreFaults.lag <trio_debounce.testing.StoreFaults.lag>` stands for that replica
here: the owner's ``get`` of the window key shows the open window, while
``get_current`` (the stream leader's read) and every write see the store. Each read
that decides a write whose answer was lost now comes from the leader: the writer's
next finalize of the run, its heartbeat's proof, a survivor's decision on a dead
writer's fire record, and a register's re-read. A finalize also re-reads from the
leader after a conflict, so a replica that stays behind does not spin it into an
unconfirmed fire.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, backend
from trio_debounce import BackendUnavailableError, Mode, Registered, open_coordinator
from trio_debounce._keys import window_key
from trio_debounce._protocol import WindowDoc
from trio_debounce.abc import KvEntry
from trio_debounce.testing import MemoryBackend, MemoryStore

KV_KEY = window_key("wf", "k")


async def _records(store: MemoryStore) -> list[str]:
    return [e.key for e in await store.entries("f.") if e.value is not None]


async def _window(store: MemoryStore) -> WindowDoc | None:
    entry = await store.get(KV_KEY)
    return None if entry is None or entry.value is None else WindowDoc.decode(entry.value)


async def _value(read: Awaitable[KvEntry | None]) -> bytes | None:
    entry = await read
    assert entry is not None
    return entry.value


async def _a_window_of_a(store: MemoryStore) -> tuple[MemoryBackend, MemoryBackend]:
    """Processes A and B on ``store``, their leases written; A has opened window r1 of
    ``KV_KEY`` (trailing, 5 s, payload "p1")."""
    a = backend(store, "A", op_timeout=1.0)
    b = backend(store, "B", op_timeout=1.0)
    for one in (a, b):
        await one.refresh_lease()
    await a.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="r1", payload="p1"
    )
    return a, b


@pytest.mark.parametrize("catch_up_after", [LEASE, 4 * LEASE, None])
async def test_a_lapsed_owners_lost_commit_is_not_taken_back_on_a_lagging_read(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    catch_up_after: float | None,
) -> None:
    store, fires = MemoryStore(), Fires()
    op_timeout = LEASE  # longer than the lease: it lapses while the call waits
    b = backend(store, "A", op_timeout=op_timeout)
    async with open_coordinator(handlers={"wf": fires.handler("A")}, backend=b) as a:
        await a.debounce("wf", "k", "a", delay=1.0)
        await trio.sleep(0.5)
        # The replica A reads from stops applying writes of the window key: it shows
        # the open window from now on.
        b.faults.lag(KV_KEY)
        b.faults.delay_next(0.0, ops=("put",))  # the fire record: landed and answered
        b.faults.delay_next(op_timeout + 3.0, ops=("put",))  # the commit: answered late
        b.faults.fail_next(1000, ops=("put",))  # every lease renewal fails meanwhile
        with caplog.at_level(logging.WARNING, logger="trio_debounce"):
            await trio.sleep(op_timeout + 2.0)
        assert "lease has lapsed; retrying instead of firing" in caplog.text
        assert fires.log == []
        doc = await _window(store)
        assert doc is not None
        assert doc.fired  # the commit landed
        b.faults.clear()  # the lag stays
        if catch_up_after is not None:
            await trio.sleep(catch_up_after)
            b.faults.catch_up()
        await trio.sleep(4 * LEASE)
        assert a.statistics().unconfirmed_fires == 0
    assert fires.by_attempt() == [("A", "k", "a", 1, 1)]
    assert await _records(store) == []  # the fire record was completed


async def test_a_takers_lost_commit_is_proven_by_its_heartbeat_on_a_lagging_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # B, a taker, fires A's window (force, take). Its commit lands with its answer
    # late, and its next adopt_orphans decides the lost commit, on a replica that still
    # shows the window open. The leader's read shows the tombstone naming the taker's
    # write: it runs.
    store = MemoryStore()
    _, taker = await _a_window_of_a(store)
    taker.faults.lag(KV_KEY)
    taker.faults.delay_next(0.0, ops=("put",))  # the fire record lands
    taker.faults.delay_next(3.0, ops=("put",))  # the commit lands; its answer is late
    with pytest.raises(BackendUnavailableError):
        await taker.finalize("wf", "k", "r1", take=True, force=True)
    await trio.sleep(3.0)
    doc = await _window(store)
    assert doc is not None
    assert doc.fired
    orphans = await taker.adopt_orphans({"wf"})
    assert [(f.key, f.payload, f.attempt) for f in orphans.fires] == [("k", "p1", 1)]
    await taker.complete(orphans.fires[0].fire_id)
    assert await _records(store) == []


async def test_lag_shows_keys_as_they_were_until_caught_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    b = MemoryBackend(store)
    faulty = b._view.store  # what the protocol reads and writes through
    first = await store.put("x.1", b"old", last=0)
    b.faults.lag("x.1", "x.2")
    await store.put("x.1", b"new", last=first)
    await store.put("x.2", b"born", last=0)
    assert await _value(faulty.get("x.1")) == b"old"
    assert await faulty.get("x.2") is None
    assert await _value(faulty.get_current("x.1")) == b"new"
    assert [e.value for e in await faulty.entries("x.")] == [b"old"]
    b.faults.clear()  # disarms faults; the lag stays
    assert await _value(faulty.get("x.1")) == b"old"
    b.faults.catch_up()
    assert await _value(faulty.get("x.1")) == b"new"
    assert sorted(e.key for e in await faulty.entries("x.")) == ["x.1", "x.2"]


async def test_a_survivor_decides_a_dead_writers_record_on_the_leaders_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A's fire committed (its record, then its tombstone) and A died in its handler.
    # B's replica still shows the window open, as it was before the commit: read
    # there, the record looks like "the owner died between writing the record and
    # deleting the window", and would be taken back with no one to fire the window.
    # The leader's read shows the tombstone naming the record's write: B re-runs it.
    store = MemoryStore()
    a, b = await _a_window_of_a(store)
    b.faults.lag(KV_KEY)
    fin = await a.finalize("wf", "k", "r1", force=True)
    assert fin.fire_id is not None  # A runs the handler, and dies in it
    a.faults.partitioned = True
    for _ in range(4):
        await trio.sleep(LEASE)
        await b.refresh_lease()
    orphans = await b.adopt_orphans({"wf"})
    assert [(f.key, f.payload, f.attempt) for f in orphans.fires] == [("k", "p1", 2)]
    assert orphans.windows == []  # the window fired: nothing to adopt
    await b.complete(orphans.fires[0].fire_id)
    assert await _records(store) == []


async def test_a_register_recognises_its_landed_write_on_the_leaders_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A ping's opening write lands and its answer is lost; the replica the process
    # reads from has not applied it (the key looks empty, as before the write). Read
    # there, "an empty key before and now proves nothing" and the ping fails; the
    # leader's read shows the window the write opened: the ping is answered stored.
    store = MemoryStore()
    b = backend(store, "B", op_timeout=1.0)
    await b.refresh_lease()
    b.faults.lag(KV_KEY)  # absent, there, from now on
    b.faults.delay_next(5.0, ops=("put",))  # the opening write lands; its answer is late
    reg = await b.register(
        "wf", "k", mode=Mode.TRAILING, delay=5.0, max_delay=None, run_id="r1", payload="p1"
    )
    assert (reg.outcome, reg.run_id, reg.stored) == (Registered.OPENED, "r1", True)
    doc = await _window(store)
    assert doc is not None
    assert (doc.run_id, doc.count, doc.fired) == ("r1", 1, False)
