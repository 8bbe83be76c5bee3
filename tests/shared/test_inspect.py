"""``Coordinator.inspect`` and ``DebounceBackend.processes``: the operator's view of a
shared store, on ``MemoryBackend`` (MockClock)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from tests.harness.fires import Fires
from tests.harness.memory import LEASE, SKEW, backend, process
from trio_debounce import Mode, RunOptions, open_coordinator
from trio_debounce._protocol._documents import FireRecord
from trio_debounce.testing import MemoryRunStore, MemoryStore


async def test_windows_of_every_owner_with_their_state(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=1_000.0), Fires()
    async with (
        process(store, fires, "A") as (a, a_backend, _),
        process(store, fires, "B") as (
            b,
            _,
            _,
        ),
    ):
        t0 = a_backend.wall_time()
        await a.debounce("wf", "k1", "x", delay=5.0, max_delay=9.0)
        await trio.sleep(1.0)
        await b.debounce("wf", "k1", "yy", delay=5.0, max_delay=9.0)  # into A's window
        await b.debounce("wf", "k2", "z", delay=5.0)
        await b.debounce("other", "k3", "z", delay=5.0, mode="leading", on_fire=fires.handler("B"))
        windows = await b.inspect()
        assert [(w.workflow, w.key, w.owner, w.state) for w in windows] == [
            ("other", "k3", "B", "open"),
            ("wf", "k1", "A", "open"),
            ("wf", "k2", "B", "open"),
        ]
        k1 = windows[1]
        assert (k1.mode, k1.ping_count, k1.payload_bytes) == (Mode.TRAILING, 2, len('"yy"'))
        assert k1.first_ping_at == pytest.approx(t0)
        assert k1.last_ping_at == pytest.approx(t0 + 1.0)
        assert k1.due_at == pytest.approx(t0 + 6.0)
        assert k1.cap_at == pytest.approx(t0 + 9.0)
        assert k1.owner_lease_left is not None
        assert 0 < k1.owner_lease_left <= LEASE
        assert k1.fencing_token > 0
        assert [w.key for w in await a.inspect(workflow="wf")] == ["k1", "k2"]
        assert [w.key for w in await a.inspect(key_prefix="k3")] == ["k3"]
        assert await a.inspect(workflow="nothing") == []
        processes = await a_backend.processes()
        assert [(p.process_id, p.live, p.windows, p.draining) for p in processes] == [
            ("A", True, 1, False),
            ("B", True, 2, False),
        ]
        for p in processes:
            assert p.heartbeat_interval == pytest.approx(LEASE / 3)
            assert p.last_beat_age is not None
            assert 0 <= p.last_beat_age <= LEASE / 3 + 0.01
            assert 0 < p.expires_in <= LEASE


async def test_a_running_handler_is_firing_and_a_dead_owners_window_is_due(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with process(store, fires, "A", hold=10.0) as (a, _, _):
        await a.debounce("wf", "slow", 1, delay=1.0)
        await trio.sleep(2.0)  # fired: its handler holds for 10 s (at least once)
        [slow] = await a.inspect()
        assert (slow.key, slow.state) == ("slow", "firing")
        # A window whose owner died: its due time passes with nobody to fire it.
        dead = backend(store, "D")
        await dead.refresh_lease()
        await dead.register(
            "wf", "orphan", mode=Mode.TRAILING, delay=1.0, max_delay=None, run_id="r",
            payload=None,
        )  # fmt: skip
        await trio.sleep(LEASE + SKEW + 0.5)
        states = {w.key: (w.state, w.owner_lease_left) for w in await a.inspect()}
        state, left = states["orphan"]
        assert state == "due"
        assert left is not None
        assert left < 0  # lapsed
        [d] = [p for p in await dead.processes() if p.process_id == "D"]
        assert (d.live, d.windows) == (False, 1)


async def test_inspect_needs_a_backend_and_good_arguments(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(handlers={"wf": Fires().handler("A")}) as c:
        with pytest.raises(RuntimeError, match="open the coordinator with a backend"):
            await c.inspect()
    async with process(MemoryStore(), Fires(), "A") as (a, _, _):
        with pytest.raises(TypeError, match="workflow must be a str or None, not 3"):
            await a.inspect(workflow=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="key_prefix must be a str or None, not b'k'"):
            await a.inspect(key_prefix=b"k")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="workflow must be a non-empty str"):
            await a.inspect(workflow="")


async def test_firing_needs_the_record_of_a_committed_fire(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(epoch=0.0), Fires()
    async with process(store, fires, "A") as (a, _, _):
        await a.debounce("wf", "k", 1, delay=5.0)
        [window] = await a.inspect()

        def record(write: str | None) -> bytes:
            return FireRecord(
                "B", "e", "wf", "k", window.run_id, None, 1, 0.0, 0.0, 1, write
            ).encode()

        # A record whose commit has not landed (a fire about to lose its
        # compare-and-swap, and to be taken back) is not a fire.
        store.raw_put("f.pending", record("not-the-tombstones-write"))
        assert [w.state for w in await a.inspect()] == ["open"]
        # A record of a version that did not name its commit is taken at its word.
        store.raw_put("f.old", record(None))
        assert [w.state for w in await a.inspect()] == ["firing"]


async def test_processes_count_the_persisted_runs_each_holds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A run store in the same bucket (``r.`` records): each process's pending and
    started runs are counted (by process id: a coordinator's run-store process id is
    its own, ``RunOptions.process_id``); done ones are not."""
    store = MemoryStore(epoch=1_000.0)

    async def job(run: Any) -> None:
        pass

    async with open_coordinator(
        handlers={"wf": job},
        run_handlers={"wf": job},
        backend=backend(store, "A"),
        run_store=MemoryRunStore(store),
        run_options=RunOptions(process_id="A"),  # the same id on both stores
    ) as a:
        await a.schedule("wf", "later-1", after=600.0, persist=True)
        await a.schedule("wf", "later-2", after=600.0, persist=True)
        await a.schedule("wf", "now", after=0.0, persist=True)
        await trio.sleep(1.0)  # "now" ran: a done tombstone, not counted
        await a.debounce("wf", "k", 1, delay=60.0)
        [info] = await backend(store, "tool").processes()
        assert (info.process_id, info.windows, info.runs) == ("A", 1, 2)
