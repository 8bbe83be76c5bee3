"""``DebounceBackend.open_window_watch``: the operator's view of a shared store as it
changes, on ``MemoryBackend`` (MockClock). The follower is a backend of its own, never
attached to a coordinator, as a tool's is; the windows are made by simulated processes
sharing the store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, SKEW, backend, die, process
from trio_debounce import BackendUnavailableError, WindowChange, open_coordinator
from trio_debounce._protocol import KvDebounceBackend, _watch
from trio_debounce.abc import DebounceBackend, KvEntry, KvStore
from trio_debounce.testing import MemoryBackend, MemoryStore

EPOCH = 1_000.0
#: When an unfired window is reported due, after its due time.
GRACE = SKEW + _watch.DUE_GRACE


class Follower:
    """The changes one watch has reported so far, read by a task of its own."""

    def __init__(self) -> None:
        self.changes: list[WindowChange] = []
        self.watch: _watch.WindowFollower | None = None
        self.backend: MemoryBackend | None = None

    def summary(self) -> list[tuple[str, str, str | None, int | None]]:
        """(change, key, state, ping count) of each change."""
        return [
            (
                c.change,
                c.key,
                None if c.window is None else c.window.state,
                None if c.window is None else c.window.ping_count,
            )
            for c in self.changes
        ]

    def take(self) -> list[tuple[str, str, str | None, int | None]]:
        """:meth:`summary`, and forget the changes."""
        out = self.summary()
        self.changes.clear()
        return out


@asynccontextmanager
async def following(
    store: MemoryStore, workflow: str | None = None, key_prefix: str | None = None
) -> AsyncIterator[Follower]:
    """A tool's backend on ``store`` following its windows, for the block."""
    tool = backend(store, "tool")
    follower = Follower()
    follower.backend = tool
    async with (
        tool.open_window_watch(workflow, key_prefix) as changes,
        trio.open_nursery() as nursery,
    ):
        assert isinstance(changes, _watch.WindowFollower)
        follower.watch = changes

        async def read() -> None:
            async for change in changes:
                follower.changes.append(change)

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        yield follower
        nursery.cancel_scope.cancel()


async def test_listed_then_opened_updated_fired_and_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    async with (
        process(store, fires, "A", hold=3.0) as (a, _, _),
        process(store, fires, "B") as (b, _, _),
    ):
        await a.debounce("wf", "k1", "x", delay=10.0)
        await b.debounce("wf", "k2", "y", delay=20.0)
        async with following(store) as f:
            # The present windows first, sorted, each as it is now.
            listed = f.take()
            assert listed == [("listed", "k1", "open", 1), ("listed", "k2", "open", 1)]
            t0 = trio.current_time()
            await b.debounce("wf", "k1", "xx", delay=10.0)  # into A's window
            await trio.testing.wait_all_tasks_blocked()
            [update] = f.changes
            assert update.window is not None
            assert (update.change, update.window.owner, update.window.ping_count) == (
                "updated",
                "A",
                2,
            )
            assert update.window.payload_bytes == len('"xx"')
            assert update.at == pytest.approx(EPOCH + t0)
            assert update.run_id == update.window.run_id
            f.changes.clear()
            await a.debounce("other", "k3", 1, delay=5.0, on_fire=fires.handler("A"))
            await trio.testing.wait_all_tasks_blocked()
            assert f.take() == [("opened", "k3", "open", 1)]
            # k1 fires at t0 + 10 (its handler holds 3 s), k3 at t0 + 5 (its handler
            # returns at once).
            await trio.sleep_until(t0 + 10.5)
            changes = f.take()
            assert ("fired", "k1", "firing", 2) in changes
            assert ("closed", "k3", None, None) in changes
            # The record of k1 goes when its handler returns: seen within a poll.
            await trio.sleep_until(t0 + 13.0 + _watch.RECORD_POLL + 0.1)
            [closed] = f.changes
            assert (closed.change, closed.key, closed.window) == ("closed", "k1", None)
            assert closed.run_id == update.run_id
            assert closed.at <= EPOCH + t0 + 13.0 + _watch.RECORD_POLL
            f.changes.clear()
            # A fired key's next window is a new run: opened.
            await b.debounce("wf", "k1", "z", delay=10.0)
            await trio.testing.wait_all_tasks_blocked()
            assert f.take() == [("opened", "k1", "open", 1)]
        assert [fire.key for _, fire in fires.log] == ["k3", "k1"]


async def test_no_change_for_writes_that_change_nothing_shown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    async with (
        process(store, fires, "A") as (a, _, _),
        process(store, fires, "B") as (b, _, _),
    ):
        await a.debounce("wf", "k", 1, delay=10.0)
        async with following(store) as f:
            f.changes.clear()
            # B's ping moves the due time; A wakes at the old one and writes its new
            # wake time (a write that changes nothing shown), and lease renewals (every
            # heartbeat) change no window either.
            await trio.sleep(5.0)
            await b.debounce("wf", "k", 2, delay=10.0)
            await trio.sleep(8.0)
            assert f.take() == [("updated", "k", "open", 2)]
            await trio.sleep(10.0)
            # Fired (its record and its tombstone), and its handler done at once.
            assert f.take() == [("fired", "k", "firing", 2), ("closed", "k", None, None)]
    assert [fire.ping_count for _, fire in fires.log] == [2]


async def test_filters(autojump_clock: trio.testing.MockClock) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    async with process(store, fires, "A") as (a, _, _):
        await a.debounce("wf", "apple", 1, delay=10.0)
        await a.debounce("other", "apricot", 1, delay=10.0, on_fire=fires.handler("A"))
        async with following(store, "wf", "ap") as f, following(store, key_prefix="apr") as g:
            await a.debounce("wf", "banana", 1, delay=10.0)
            await a.debounce("wf", "apple", 2, delay=10.0)
            await a.debounce("other", "apricot", 2, delay=10.0, on_fire=fires.handler("A"))
            await trio.testing.wait_all_tasks_blocked()
            assert f.take() == [("listed", "apple", "open", 1), ("updated", "apple", "open", 2)]
            assert g.take() == [
                ("listed", "apricot", "open", 1),
                ("updated", "apricot", "open", 2),
            ]
            assert {c.workflow for c in g.changes} <= {"other"}


async def test_a_dead_owners_window_becomes_due_and_is_taken_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    async with process(store, fires, "B") as (_, _, _), following(store) as f:
        async with process(store, fires, "A") as (a, a_backend, a_scope):
            await a.debounce("wf", "k", 1, delay=4.0)
            t0 = trio.current_time()
            die(a_backend, a_scope)
        await trio.testing.wait_all_tasks_blocked()
        assert f.take() == [("opened", "k", "open", 1)]
        # Unfired GRACE seconds after its due time: reported due then.
        await trio.sleep_until(t0 + 4.0 + GRACE + 0.01)
        [due] = f.changes
        assert due.window is not None
        assert (due.change, due.window.state, due.window.owner) == ("updated", "due", "A")
        assert due.at == pytest.approx(EPOCH + t0 + 4.0 + GRACE, abs=0.01)
        lease_left = due.window.owner_lease_left
        assert lease_left is not None
        assert lease_left < LEASE - 4.0 - GRACE + 0.01
        f.changes.clear()
        # B adopts it once A's lease lapsed (at a heartbeat), and fires it.
        await trio.sleep(LEASE + SKEW + LEASE / 3 + 1.0)
        assert [(c.change, c.window and (c.window.state, c.window.owner)) for c in f.changes] == [
            ("updated", ("due", "B")),  # taken over: still due
            ("fired", ("firing", "B")),
            ("closed", None),
        ]
        assert [p for p, _ in fires.of("k")] == ["B"]


async def test_a_cancel_closes_and_at_most_once_fires_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    async with (
        open_coordinator(
            handlers={"wf": fires.handler("A")},
            backend=backend(store, "A"),
            delivery="at-most-once",
        ) as a,
        following(store) as f,
    ):
        await a.debounce("wf", "gone", 1, delay=5.0)
        await a.debounce("wf", "fires", 1, delay=5.0, mode="leading")
        await trio.testing.wait_all_tasks_blocked()
        assert await a.cancel("wf", "gone")
        await trio.sleep(6.0)
        assert f.take() == [
            ("opened", "gone", "open", 1),
            ("opened", "fires", "open", 1),
            ("closed", "gone", None, None),
            ("closed", "fires", None, None),  # no fire record under at-most-once
        ]


async def test_an_interrupted_watch_lists_again_and_reports_only_differences(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    async with process(store, fires, "A") as (a, _, _):
        await a.debounce("wf", "same", 1, delay=1000.0)
        await a.debounce("wf", "pinged", 1, delay=1000.0)
        await a.debounce("wf", "cancelled", 1, delay=1000.0)
        async with following(store) as f:
            watch = f.watch
            assert watch is not None
            assert watch.snapshots == 1
            f.changes.clear()
            # Interrupted, and the first attempt to watch again fails: missed meanwhile.
            assert f.backend is not None
            f.backend.faults.fail_next(ops=("watch",))
            store.interrupt_watches()
            await a.debounce("wf", "pinged", 2, delay=1000.0)
            await a.cancel("wf", "cancelled")
            await a.debounce("wf", "new", 1, delay=1000.0)
            await trio.testing.wait_all_tasks_blocked()
            assert (watch.snapshots, f.changes) == (1, [])
            # Retried after RETRY_MIN: the new snapshot's differences, and only them.
            await trio.sleep(_watch.RETRY_MIN + 0.01)
            assert watch.snapshots == 2
            assert f.take() == [
                ("closed", "cancelled", None, None),
                ("opened", "new", "open", 1),
                ("updated", "pinged", "open", 2),
            ]
            # The new watch follows as the first did.
            await a.debounce("wf", "same", 2, delay=1000.0)
            await trio.testing.wait_all_tasks_blocked()
            assert f.take() == [("updated", "same", "open", 2)]
            # A watch that cannot be opened again is retried, with backoff.
            f.backend.faults.fail_next(3, ops=("watch",))
            store.interrupt_watches()
            await trio.sleep(_watch.RETRY_MIN + 2 * _watch.RETRY_MIN + 0.01)
            assert watch.snapshots == 2
            await trio.sleep(4 * _watch.RETRY_MIN)
            assert watch.snapshots == 3
            assert f.changes == []
            # And a periodic fresh snapshot, even without an interruption.
            await trio.sleep(_watch.RESYNC_INTERVAL)
            assert watch.snapshots == 4
            assert f.changes == []


async def test_errors(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore()
    tool = backend(store, "tool")
    with pytest.raises(TypeError, match="workflow must be a str or None, not 3"):
        async with tool.open_window_watch(3):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="key_prefix must be a str or None"):
        async with tool.open_window_watch(key_prefix=b"k"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="workflow must be a non-empty str"):
        async with tool.open_window_watch(""):
            pass
    # The first watch's failure is raised on entering.
    store.down = True
    with pytest.raises(BackendUnavailableError):
        async with tool.open_window_watch():
            pass
    store.down = False

    # The default of the interface, and a store that cannot watch.
    class Plain(KvStore):
        max_value_bytes = 1000
        created = 0.0

        async def get(self, key: str) -> KvEntry | None:
            raise AssertionError

        async def put(self, key: str, value: bytes, *, last: int) -> int:
            raise AssertionError

        async def delete(self, key: str, *, last: int) -> int:
            raise AssertionError

        async def purge_marker(self, key: str, *, revision: int) -> bool:
            raise AssertionError

        async def entries(self, prefix: str) -> list[KvEntry]:
            raise AssertionError

    with pytest.raises(NotImplementedError, match="Plain cannot watch its keys"):
        async with KvDebounceBackend(Plain()).open_window_watch():
            pass
    with pytest.raises(NotImplementedError, match="cannot watch its windows"):
        DebounceBackend.open_window_watch(tool)


async def test_the_memory_watch(autojump_clock: trio.testing.MockClock) -> None:
    store = MemoryStore()
    store.raw_put("a.1", b"one")
    store.raw_put("b.1", b"other")
    store.raw_put("a.2", None)
    async with store.open_watch("a.") as watch:
        first = await watch.receive_batch(1)
        assert [(e.key, e.value) for e in first if e is not None] == [("a.1", b"one")]
        rest = await watch.receive_batch()
        assert [(e and (e.key, e.value)) for e in rest] == [("a.2", None), None]
        revision = store.raw_put("a.1", b"two")
        await store.purge("a.1", last=revision)  # a purge is not seen
        store.raw_put("b.2", b"not ours")
        store.raw_put("a.3", b"three")
        batch = await watch.receive_batch()
        assert [(e and (e.key, e.value)) for e in batch] == [("a.1", b"two"), ("a.3", b"three")]
        with pytest.raises(ValueError, match="max_entries must be >= 1"):
            await watch.receive_batch(0)
        assert not watch.interrupted
        store.interrupt_watches()
        await watch.wait_interrupted()
        store.raw_put("a.4", b"lost")
        with trio.move_on_after(1.0) as scope:
            await watch.receive_batch()
        assert scope.cancelled_caught
    with pytest.raises(ValueError, match="prefix must end with"):
        async with store.open_watch("a"):
            pass
    # A partitioned process cannot open one.
    b = MemoryBackend(store)
    b.faults.partitioned = True
    with pytest.raises(BackendUnavailableError):
        async with b.open_window_watch():
            pass


async def test_a_queue_latest_window_waits_then_is_due(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    async with process(store, fires, "A", hold=20.0) as (a, _, _):
        options = {"delay": 1.0, "overlap": "queue-latest", "run_timeout": 8.0}
        await a.debounce("wf", "q", 1, **options)  # type: ignore[arg-type]
        await trio.sleep(1.5)  # fired: its run holds for 20 s (timeout 8 s)
        await a.debounce("wf", "q", 2, **options)  # type: ignore[arg-type]
        t0 = trio.current_time()
        async with following(store) as f:
            assert f.take() == [("listed", "q", "open", 1)]
            await trio.sleep_until(t0 + 1.0 + GRACE + 0.01)
            assert f.take() == [("updated", "q", "waiting", 1)]
            # The run's timeout (8 s after its fire) ends the wait: the window fires.
            await trio.sleep_until(t0 + 8.0)
            assert ("fired", "q", "firing", 1) in f.take()


async def test_a_waiting_window_is_due_once_its_runs_process_is_dead(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=EPOCH), Fires()
    options: dict[str, Any] = {"delay": 1.0, "overlap": "queue-latest", "run_timeout": 1000.0}
    async with process(store, fires, "B", hold=0.0) as (b, _, _), following(store) as f:
        async with process(store, fires, "A", hold=1000.0) as (a, a_backend, a_scope):
            await a.debounce("wf", "q", 1, **options)
            await trio.sleep(1.5)  # fired in A: its run holds the key (A's lease)
            await b.debounce("wf", "q", 2, **options)  # the next window: B's, waiting
            await trio.sleep(1.0 + GRACE + 0.01)
            assert [c for c in f.take() if c[1] == "q"][-1] == ("updated", "q", "waiting", 1)
            t_dead = trio.current_time()
            die(a_backend, a_scope)
        # A's lease lapses (with the skew): the run no longer blocks; B fires the window
        # when it looks again.
        await trio.sleep_until(t_dead + LEASE + SKEW + _watch._AFTER + 0.01)
        assert f.take() == [("updated", "q", "due", 1)]
        await trio.sleep(LEASE)
        assert f.take() == [("fired", "q", "firing", 1), ("closed", "q", None, None)]
        # B ran the window, and A's interrupted fire again (at least once).
        assert sorted(fire.payload for p, fire in fires.log if p == "B") == [1, 2]
