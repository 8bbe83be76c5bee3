"""Deferred runs on the in-memory store under MockClock: the API, claims, heartbeat,
takeover, delivery guarantees, late, expired and misfired runs, and each mistake of the
reference design."""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from trio_debounce import (
    BackendUnavailableError,
    Coordinator,
    DocumentTooLargeError,
    ProcessIdTakenError,
    RunFire,
    RunOptions,
    RunState,
    open_coordinator,
)
from trio_debounce._runs._kv_store import decode_lease, encode_lease
from trio_debounce.abc import Lease
from trio_debounce.testing import MemoryRunStore, MemoryStore
from trio_debounce.testing._memory import DEFAULT_EPOCH

LEASE = 6.0
BEAT = 2.0
SKEW = 1.0
#: The longest an orphaned run waits past its due time (or the death): the lease
#: lapses, the skew passes, and a survivor's next sweep (every heartbeat) claims it.
TAKEOVER = LEASE + SKEW + BEAT


def options(name: str, **kwargs: Any) -> RunOptions:
    kwargs.setdefault("lease", LEASE)
    kwargs.setdefault("heartbeat_interval", BEAT)
    kwargs.setdefault("max_clock_skew", SKEW)
    kwargs.setdefault("horizon", 10.0)
    return RunOptions(process_id=name, **kwargs)


def wall(t: float) -> float:
    """The store's wall time at Trio time ``t``."""
    return DEFAULT_EPOCH + t


@dataclass
class Log:
    """Every start of a run handler, by process."""

    starts: list[tuple[str, float, RunFire]] = field(default_factory=list)
    ends: list[tuple[str, str]] = field(default_factory=list)

    def handler(self, name: str, hold: float = 0.0, fail: int = 0) -> Any:
        failures = {"left": fail}

        async def handle(run: RunFire) -> None:
            self.starts.append((name, trio.current_time(), run))
            await trio.sleep(hold)
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("handler failure")
            self.ends.append((name, run.run_id))

        return handle

    def of(self, run_id: str) -> list[tuple[str, float, RunFire]]:
        return [s for s in self.starts if s[2].run_id == run_id]


class Process:
    """A simulated process with one coordinator on a shared MemoryStore."""

    def __init__(
        self, shared: MemoryStore, log: Log, name: str, *, hold: float = 0.0, **kwargs: Any
    ) -> None:
        self.name = name
        self.store = MemoryRunStore(shared, clock_skew=kwargs.pop("clock_skew", 0.0))
        self.log = log
        self.hold = hold
        self.handler = kwargs.pop("handler", None) or log.handler(name, hold)
        self.kwargs = kwargs
        self.scope = trio.CancelScope()
        self.stop = trio.Event()
        self.coordinator: Coordinator | None = None
        self.exited = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[Coordinator]) -> None:
        run_options = self.kwargs.pop("run_options", None) or options(self.name)
        try:
            with self.scope:
                async with open_coordinator(
                    run_handlers={"wf": self.handler},
                    run_store=self.store,
                    run_options=run_options,
                    **self.kwargs,
                ) as c:
                    self.coordinator = c
                    task_status.started(c)
                    await self.stop.wait()
        finally:
            self.exited.set()

    def kill(self) -> None:
        """The process dies: it can no longer reach the store and its tasks stop."""
        self.store.faults.partitioned = True
        self.scope.cancel()

    async def exit(self) -> None:
        """A clean exit of the coordinator's block."""
        self.stop.set()
        await self.exited.wait()


async def start(nursery: trio.Nursery, process: Process) -> Coordinator:
    c: Coordinator = await nursery.start(process.run)
    return c


# ------------------------------------------------------------------ the API


async def test_runs_fire_at_their_time_with_their_payload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        at = datetime.datetime.fromtimestamp(wall(7.5), tz=datetime.UTC)
        r1 = await c.schedule("wf", "r1", {"n": (1, 2)}, at=at, persist=True)
        r2 = await c.schedule("wf", "r2", (1, 2), after=3.0)
        await c.schedule("wf", "r3", "x", at=wall(5.25), persist=True)
        assert (r1.outcome, r1.version, r1.persisted, r1.owner) == ("scheduled", 1, True, "a")
        assert r1.scheduled_at == wall(7.5)
        assert (r2.persisted, r2.scheduled_at) == (False, wall(3.0))
        assert c.has_run("r1")
        assert c.has_run("r2")
        assert c.has_run("r3")
        await trio.sleep(10)
        got = [(t, run.run_id, run.payload, run.attempt) for _, t, run in log.starts]
        # A persisted payload is JSON round-tripped even in the scheduling process;
        # a non-persisted one is passed as it is.
        assert got == [
            (3.0, "r2", (1, 2), 1),
            (5.25, "r3", "x", 1),
            (7.5, "r1", {"n": [1, 2]}, 1),
        ]
        fire = log.of("r1")[0][2]
        assert (fire.scheduled_at, fire.started_at, fire.persisted) == (wall(7.5), wall(7.5), True)
        assert not c.has_run("r1")
        info = await c.get_run("r1")
        assert info is not None
        assert (info.state, info.outcome, info.attempt) == (RunState.DONE, "ran", 1)
        stats = c.statistics().runs
        assert (stats.scheduled, stats.completed, stats.held, stats.running) == (3, 3, 0, 0)
        await a.exit()


async def test_schedule_rejects_bad_input_by_name(autojump_clock: trio.testing.MockClock) -> None:
    log = Log()
    store = MemoryRunStore(MemoryStore(max_value_bytes=8000))
    async with open_coordinator(
        run_handlers={"wf": log.handler("a")}, run_store=store, run_options=options("a")
    ) as c:
        with pytest.raises(LookupError, match="'other'"):
            await c.schedule("other", "r", after=1)
        # Both or neither is a type error too (the overloads); this is the run-time check.
        with pytest.raises(TypeError, match="exactly one of at= and after="):
            await c.schedule("wf", "r", after=1, at=wall(5))  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="exactly one of at= and after="):
            await c.schedule("wf", "r")  # type: ignore[call-overload]
        naive = datetime.datetime(2030, 1, 1)
        with pytest.raises(ValueError, match="timezone-aware"):
            await c.schedule("wf", "r", at=naive)
        with pytest.raises(ValueError, match="after must be >= 0"):
            await c.schedule("wf", "r", after=-1)
        with pytest.raises(ValueError, match="expires_at"):
            await c.schedule("wf", "r", after=5, expires_at=wall(4))
        with pytest.raises(TypeError, match=r"run 'bad-payload'.*JSON"):
            await c.schedule("wf", "bad-payload", {1, 2}, after=1, persist=True)
        with pytest.raises(TypeError, match=r"run 'nan'.*JSON"):
            await c.schedule("wf", "nan", float("nan"), after=1, persist=True)
        with pytest.raises(DocumentTooLargeError, match="run 'big'"):
            await c.schedule("wf", "big", "x" * 8000, after=1, persist=True)
        with pytest.raises(ValueError, match="run_id"):
            await c.schedule("wf", "", after=1)
        await c.schedule("wf", "taken", after=1, persist=True)
        c.set_run_handler("wf2", log.handler("a"))
        with pytest.raises(ValueError, match="'taken' is already scheduled for workflow 'wf'"):
            await c.schedule("wf2", "taken", after=1, persist=True)
        assert await store.get_run("bad-payload") is None
        assert await store.get_run("big") is None
    async with open_coordinator(run_handlers={"wf": log.handler("b")}) as c:
        with pytest.raises(ValueError, match="persist=True needs a run store"):
            await c.schedule("wf", "r", after=1, persist=True)
    with pytest.raises(trio.ClosedResourceError):
        await c.schedule("wf", "r", after=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lease": 0}, "lease must be > 0"),
        ({"lease": 6, "heartbeat_interval": 4}, "at most lease / 2"),
        ({"lease": 6, "heartbeat_interval": 2, "max_clock_skew": 4}, "below lease"),
        ({"horizon": 1, "lease": 6, "heartbeat_interval": 2}, "horizon must be at least"),
        ({"max_concurrent_runs": 0}, "max_concurrent_runs must be an int >= 1"),
        ({"retries": -1}, "retries must be an int >= 0"),
        ({"misfire_grace": float("nan")}, "misfire_grace must not be NaN"),
        ({"process_id": ""}, "process_id"),
    ],
)
def test_run_options_are_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        RunOptions(**kwargs)


async def test_rescheduling_replaces_time_and_payload_and_is_idempotent_after_a_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        await c.schedule("wf", "r", "first", after=5, persist=True)
        again = await c.schedule("wf", "r", "second", after=8, persist=True)
        assert (again.outcome, again.version, again.scheduled_at) == ("rescheduled", 2, wall(8))
        await trio.sleep(6)
        assert log.starts == []
        await trio.sleep(3)
        assert [(t, run.payload) for _, t, run in log.starts] == [(8.0, "second")]
        done = await c.schedule("wf", "r", "third", after=1, persist=True)
        assert (done.outcome, done.scheduled_at) == ("already-ran", wall(8))
        local = await c.schedule("wf", "l", "x", after=1)
        await trio.sleep(2)
        local_again = await c.schedule("wf", "l", "y", after=1)
        assert local_again.outcome == "already-ran"
        await trio.sleep(5)
        assert [run.run_id for _, _, run in log.starts] == ["r", "l"]
        assert local.outcome == "scheduled"
        await a.exit()


async def test_tombstones_are_purged_after_the_retention(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a", run_options=options("a", retention=100.0))
        c = await start(nursery, a)
        await c.schedule("wf", "r", after=1, persist=True)
        await trio.sleep(2)
        assert (await c.schedule("wf", "r", after=1, persist=True)).outcome == "already-ran"
        # Purges run every 10th sweep (one per heartbeat): well within 100 + 25 s.
        await trio.sleep(100 + 10 * BEAT + 5)
        assert await a.store.get_run("r") is None
        assert (await c.schedule("wf", "r", after=1, persist=True)).outcome == "scheduled"
        await trio.sleep(2)
        assert len(log.of("r")) == 2
        await a.exit()


async def test_cancel_run_removes_the_run_from_the_store(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        await c.schedule("wf", "p", after=5, persist=True)
        await c.schedule("wf", "far", after=500, persist=True)
        await c.schedule("wf", "l", after=5)
        assert await c.cancel_run("p") is True
        assert await c.cancel_run("far") is True
        assert await c.cancel_run("l") is True
        assert await c.cancel_run("p") is False
        assert await c.cancel_run("unknown") is False
        assert not c.has_run("p")
        assert await a.store.get_run("p") is None
        await trio.sleep(600)
        assert log.starts == []
        await a.exit()
        # The reference design left the row on cancel: the run came back at restart.
        b = Process(shared, log, "a")
        await start(nursery, b)
        await trio.sleep(600)
        assert log.starts == []
        await b.exit()


async def test_cancel_run_raises_when_the_store_is_unreachable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        await c.schedule("wf", "p", after=50, persist=True)
        a.store.faults.fail_next(5)
        with pytest.raises(BackendUnavailableError):
            await c.cancel_run("p")
        a.store.faults.clear()
        info = await c.get_run("p")
        assert info is not None
        assert info.state is RunState.PENDING
        await a.exit()


# ------------------------------------------------------------------ claims and takeover


async def test_a_new_run_is_claimed_by_its_creator_not_fired_by_a_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The reference design wrote new rows unclaimed: a peer booting while the creator
    # lived fired them too.
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        for i in range(5):
            await c.schedule("wf", f"r{i}", after=3 + i, persist=True)
        await start(nursery, Process(shared, log, "b"))
        await trio.sleep(20)
        assert sorted((who, run.run_id) for who, _, run in log.starts) == [
            ("a", f"r{i}") for i in range(5)
        ]
        nursery.cancel_scope.cancel()


async def test_a_dead_processs_runs_are_taken_over_by_a_live_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The reference design re-claimed only at boot: a dead process's runs waited for
    # some restart. Here the peer was up before the death and takes them over.
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        await start(nursery, Process(shared, log, "b"))
        await c.schedule("wf", "soon", "x", after=2, persist=True)
        await c.schedule("wf", "later", "y", after=30, persist=True)
        await c.schedule("wf", "local", "z", after=2)
        await trio.sleep(1)
        a.kill()
        died = trio.current_time()
        await trio.sleep(60)
        soon = log.of("soon")
        assert [(who, run.attempt) for who, _, run in soon] == [("b", 1)]
        assert wall(2) <= wall(soon[0][1]) <= wall(died + TAKEOVER)
        assert soon[0][2].fencing_token > 1  # the claim bumped it
        later = log.of("later")
        # On time (the wall clock's resolution near 1.7e9 is about 2e-7 s).
        assert [who for who, _, _ in later] == ["b"]
        assert later[0][1] == pytest.approx(30.0, abs=1e-6)
        # A non-persisted run dies with its process.
        assert log.of("local") == []
        nursery.cancel_scope.cancel()


async def test_takeover_waits_for_the_lease_and_skew_even_with_a_fast_peer_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        # b's wall clock runs ahead by the largest tolerated skew.
        await start(nursery, Process(shared, log, "b", clock_skew=SKEW))
        await c.schedule("wf", "r", after=1.5, persist=True)
        # a stalls (cannot reach the store) right after a heartbeat at t=0 (its lease
        # was written at open, t=0, to expire at LEASE).
        a.store.faults.partitioned = True
        await trio.sleep(40)
        taken = log.of("r")
        assert [who for who, _, _ in taken] == ["b"]
        # Never before a's lease lapsed on the store's clock.
        assert taken[0][1] > LEASE
        a.store.faults.partitioned = False
        nursery.cancel_scope.cancel()


async def test_a_clean_exit_releases_claims_so_a_peer_runs_them_on_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The reference design never released claims.
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        await start(nursery, Process(shared, log, "b"))
        await c.schedule("wf", "r", after=3, persist=True)
        await c.schedule("wf", "l", after=3)
        with trio.testing.assert_checkpoints():
            await a.exit()
        assert c.statistics().runs.dropped_at_exit == 1
        await trio.sleep(10)
        assert [(who, t) for who, t, _ in log.of("r")] == [("b", 3.0)]
        assert log.of("l") == []
        nursery.cancel_scope.cancel()


async def test_a_restart_with_a_stable_process_id_takes_its_runs_back_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "svc")
        c = await start(nursery, a)
        for i in range(3):
            await c.schedule("wf", f"r{i}", i, after=2 + i, persist=True)
        a.kill()
        await trio.sleep(10)  # past every due time, before the lease (+ skew) lapses
        restarted = trio.current_time()
        await start(nursery, Process(shared, log, "svc"))
        await trio.sleep(1)
        assert sorted((run.run_id, run.attempt, t) for _, t, run in log.starts) == [
            (f"r{i}", 1, restarted) for i in range(3)
        ]
        lease = await MemoryRunStore(shared).get_lease("svc")
        assert lease is not None
        assert lease.epoch == 2
        await trio.sleep(30)
        assert len(log.starts) == 3
        nursery.cancel_scope.cancel()


async def test_each_firing_step_is_checked_against_the_claim(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The reference design fired without checking the claim: a run cancelled or
    # re-scheduled elsewhere after its owner armed it ran anyway.
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        ca = await start(nursery, a)
        b = Process(shared, log, "b")
        cb = await start(nursery, b)
        await ca.schedule("wf", "cancelled", after=5, persist=True)
        await ca.schedule("wf", "moved", "old", after=5, persist=True)
        await ca.schedule("wf", "earlier", "old", after=8, persist=True)
        assert ca.has_run("cancelled")
        # b changes them; a's timers still hold the old records.
        assert await cb.cancel_run("cancelled") is True
        moved = await cb.schedule("wf", "moved", "new", after=7, persist=True)
        assert (moved.outcome, moved.owner) == ("rescheduled", "a")  # the claim is kept
        await cb.schedule("wf", "earlier", "new", after=3.5, persist=True)
        await trio.sleep(20)
        assert log.of("cancelled") == []
        assert [(who, t, run.payload) for who, t, run in log.of("moved")] == [("a", 7.0, "new")]
        # Moved earlier by a peer: the owner sees it at its next sweep (one heartbeat).
        ((who, t, run),) = log.of("earlier")
        assert (who, run.payload, run.version if hasattr(run, "version") else 2) == (
            "a",
            "new",
            2,
        )
        assert 3.5 <= t <= 3.5 + BEAT
        nursery.cancel_scope.cancel()


async def test_a_second_coordinator_with_a_live_process_id_is_refused(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        old = Process(shared, log, "svc")
        c_old = await start(nursery, old)
        await c_old.schedule("wf", "r", after=30, persist=True)
        await trio.sleep(0.5)
        before = await MemoryRunStore(shared).get_lease("svc")
        assert before is not None
        assert before.heartbeat_interval == BEAT
        t0 = trio.current_time()
        with pytest.raises(ProcessIdTakenError, match="'svc'"):
            await start(nursery, Process(shared, log, "svc"))
        assert 0 < trio.current_time() - t0 <= BEAT + SKEW
        after = await MemoryRunStore(shared).get_lease("svc")
        assert after is not None
        assert after.epoch == before.epoch  # nothing written
        await c_old.schedule("wf", "s", after=5, persist=True)  # the earlier runs on
        await trio.sleep(40)
        assert [(who, run.run_id) for who, _, run in log.starts] == [("svc", "s"), ("svc", "r")]
        assert "is held by a live coordinator" in caplog.text
        nursery.cancel_scope.cancel()


async def test_a_restart_after_a_crash_waits_one_heartbeat_and_the_skew(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(
            shared, log, "svc", run_options=options("svc", lease=30.0, heartbeat_interval=5.0)
        )
        c = await start(nursery, a)
        await c.schedule("wf", "r", after=2, persist=True)
        a.kill()  # its lease (30 s) stays live for a while
        await trio.sleep(1)
        t0 = trio.current_time()
        await start(nursery, Process(shared, log, "svc"))
        # Watched for the holder's recorded interval (5 s), not ours (2 s).
        assert trio.current_time() - t0 == 5.0 + SKEW
        await trio.sleep(1)
        assert [(who, t, run.attempt) for who, t, run in log.starts] == [("svc", t0 + 6.0, 1)]
        lease = await MemoryRunStore(shared).get_lease("svc")
        assert lease is not None
        assert lease.epoch == 2
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("beat", "read"), [(2.5, 2.5), (3, 3.0), ("2", None), (-1, None), (0, None), (True, None)]
)
def test_a_run_lease_keeps_its_heartbeat_interval_only_when_usable(
    beat: object, read: float | None
) -> None:
    doc = {"v": 1, "pid": "p", "epoch": 1, "exp": 5.0, "released": False, "beat": beat}
    assert decode_lease(json.dumps(doc).encode(), 7).heartbeat_interval == read
    lease = Lease("p", 1, 5.0, heartbeat_interval=2.5)
    assert decode_lease(encode_lease(lease), 7) == lease.replace(revision=7)


async def test_a_released_run_lease_is_not_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "svc")
        await start(nursery, a)
        await a.exit()
        t0 = trio.current_time()
        await start(nursery, Process(shared, log, "svc"))
        assert trio.current_time() == t0
        nursery.cancel_scope.cancel()


async def test_a_stalled_run_lease_holder_is_fenced_once_it_resumes(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        old = Process(shared, log, "svc")
        c_old = await start(nursery, old)
        await c_old.schedule("wf", "r", after=30, persist=True)
        old.store.faults.partitioned = True  # cannot renew: a stall, seen from outside
        await start(nursery, Process(shared, log, "svc"))
        old.store.faults.partitioned = False
        await trio.sleep(40)
        assert len(log.of("r")) == 1
        assert "was taken by another coordinator" in caplog.text
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ delivery


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_a_death_inside_the_handler(
    autojump_clock: trio.testing.MockClock, delivery: str
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a", hold=5.0, delivery=delivery)
        c = await start(nursery, a)
        await start(nursery, Process(shared, log, "b", delivery=delivery))
        await c.schedule("wf", "r", after=1, persist=True)
        await trio.sleep(2)  # a is inside the handler
        a.kill()
        await trio.sleep(30)
        starts = [(who, run.attempt) for who, _, run in log.of("r")]
        if delivery == "at-least-once":
            # Never lost: b runs it again, as attempt 2, with a higher token.
            assert starts == [("a", 1), ("b", 2)]
            first, second = (run.fencing_token for _, _, run in log.of("r"))
            assert second > first
        else:
            # Never twice: its tombstone was written before the handler ran, so it is lost.
            assert starts == [("a", 1)]
        nursery.cancel_scope.cancel()


class LaggingLeaseIndex(MemoryRunStore):
    """A run store whose lease listing lags far behind (a slow consumer on the NATS
    store's lease watch): it shows every lease as it was when ``freeze()`` was
    called."""

    frozen: list[Any] | None = None

    async def freeze(self) -> None:
        self.frozen = await super().list_leases()

    async def list_leases(self) -> list[Any]:
        if self.frozen is not None:
            await trio.lowlevel.checkpoint()
            return list(self.frozen)
        return await super().list_leases()


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_a_lagging_lease_listing_never_claims_a_live_owners_run(
    autojump_clock: trio.testing.MockClock, delivery: str
) -> None:
    # Found by the chaos run slow-lease-watch: a peer whose lease index lagged saw a
    # live owner's lease as expired and claimed its started run, which ran twice
    # inside live processes. The sweep now reads such a lease itself before claiming.
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a", hold=4 * LEASE, delivery=delivery)
        c = await start(nursery, a)
        b = Process(shared, log, "b", delivery=delivery)
        lagging = LaggingLeaseIndex(shared)
        b.store = lagging
        await start(nursery, b)
        await lagging.freeze()  # a's lease as of now: "expired" after one lease
        await c.schedule("wf", "r", after=1, persist=True)
        await trio.sleep(5 * LEASE)  # a's handler runs for four leases, renewing
        assert [(who, run.attempt) for who, _, run in log.of("r")] == [("a", 1)]
        assert ("a", "r") in log.ends
        nursery.cancel_scope.cancel()


async def test_retries_with_backoff_under_at_least_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    store = MemoryRunStore()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", fail=2)},
        run_store=store,
        run_options=options("a", retries=3, retry_backoff=1.0),
    ) as c:
        await c.schedule("wf", "r", after=1, persist=True)
        await trio.sleep(10)
        assert [(t, run.attempt) for _, t, run in log.starts] == [(1, 1), (2, 2), (4, 3)]
        tokens = [run.fencing_token for _, _, run in log.starts]
        assert tokens == sorted(set(tokens))
        stats = c.statistics().runs
        assert (stats.retried, stats.completed, stats.failed) == (2, 1, 0)
        info = await c.get_run("r")
        assert info is not None
        assert (info.outcome, info.attempt) == ("ran", 3)


async def test_only_a_failed_tombstone_keeps_its_payload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A failed run keeps its payload in the store (``trio-debounce runs retry`` runs
    it again); every other tombstone drops it."""
    log = Log()
    store = MemoryRunStore()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", fail=1)},
        run_store=store,
        run_options=options("a"),
    ) as c:
        await c.schedule("wf", "failed", {"n": 1}, after=1, persist=True)
        await c.schedule("wf", "ran", {"n": 2}, after=2, persist=True)
        await trio.sleep(5)
        failed, ran = await store.get_run("failed"), await store.get_run("ran")
        assert failed is not None
        assert ran is not None
        assert (failed.outcome, failed.payload) == ("failed", '{"n":1}')
        assert (ran.outcome, ran.payload) == ("ran", "null")


async def test_no_retries_under_at_most_once(autojump_clock: trio.testing.MockClock) -> None:
    log = Log()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", fail=1)},
        run_store=MemoryRunStore(),
        run_options=options("a", retries=3),
        delivery="at-most-once",
    ) as c:
        await c.schedule("wf", "r", after=1, persist=True)
        await trio.sleep(10)
        assert len(log.starts) == 1
        assert c.statistics().runs.failed == 1


# ------------------------------------------------------------------ time


async def test_late_expired_and_misfired_runs(autojump_clock: trio.testing.MockClock) -> None:
    log = Log()
    shared = MemoryStore()
    dropped: list[tuple[str, str]] = []
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        await c.schedule("wf", "late", after=2, persist=True)
        await c.schedule("wf", "expires", after=2, persist=True, expires_at=wall(5))
        await c.schedule("wf", "misfires", after=2, persist=True)
        a.kill()
        await trio.sleep(20)
        b = Process(
            shared,
            log,
            "b",
            run_options=options("b", misfire_grace=30.0),
            on_expired=lambda run, reason: dropped.append((run.run_id, reason)),
        )
        cb = await start(nursery, b)
        await trio.sleep(1)
        # Runs late runs late, by default at once, with their logical time.
        assert {run.run_id for _, _, run in log.starts} == {"late", "misfires"}
        ((_, _, late),) = log.of("late")
        assert late.scheduled_at == wall(2)
        assert late.started_at >= wall(20)
        assert dropped == [("expires", "expired")]
        assert cb.statistics().runs.expired == 1
        info = await cb.get_run("expires")
        assert info is not None
        assert (info.state, info.outcome) == (RunState.DONE, "expired")
        nursery.cancel_scope.cancel()

    log = Log()
    shared = MemoryStore()
    dropped.clear()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        await c.schedule("wf", "misfires", after=2, persist=True)
        a.kill()
        await trio.sleep(60)
        b = Process(
            shared,
            log,
            "b",
            run_options=options("b", misfire_grace=30.0),
            on_expired=lambda run, reason: dropped.append((run.run_id, reason)),
        )
        cb = await start(nursery, b)
        await trio.sleep(1)
        assert log.starts == []
        assert dropped == [("misfires", "misfired")]
        assert cb.statistics().runs.misfired == 1
        nursery.cancel_scope.cancel()


async def test_a_wall_clock_behind_trio_never_fires_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The wall clock steps back by 5 s while a run sleeps: the task wakes at its Trio
    # deadline, re-reads the wall clock, and sleeps again.
    step = {"back": 0.0}

    def wall_time() -> float:
        return wall(trio.current_time()) - step["back"]

    log = Log()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a")},
        run_options=options("a", wall_time=wall_time),
    ) as c:
        await c.schedule("wf", "r", at=wall(10))
        await trio.sleep(4)
        step["back"] = 5.0
        await trio.sleep(20)
        assert [(t, run.started_at) for _, t, run in log.starts] == [(15.0, wall(10))]


async def test_only_runs_within_the_horizon_hold_a_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        slow = options("a", lease=60.0, heartbeat_interval=20.0, horizon=100.0)
        a = Process(shared, log, "a", run_options=slow)
        c = await start(nursery, a)
        for i in range(50):
            await c.schedule("wf", f"far{i}", after=1000 + i, persist=True)
            await c.schedule("wf", f"local{i}", after=1000 + i)
        await c.schedule("wf", "near", after=5, persist=True)
        # Only "near" holds a task; the rest wait in the store or in a heap.
        assert list(c._runs._armed) == ["near"]
        assert c.statistics().runs.held == 51  # 50 non-persisted + "near"
        assert c.has_run("near")
        assert not c.has_run("far0")
        assert c.has_run("local0")
        await trio.sleep(1000 - 100 - 1)
        assert list(c._runs._armed) == []
        await trio.sleep(50 + 100 + 2)
        assert len(log.starts) == 101
        for _, t, run in log.starts:
            if run.run_id != "near":
                due = 1000 + int(run.run_id.removeprefix("far").removeprefix("local"))
                assert t == pytest.approx(due, abs=1e-6)
        nursery.cancel_scope.cancel()


async def test_one_lease_write_per_heartbeat_whatever_the_number_of_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        for i in range(300):
            await c.schedule("wf", f"r{i}", after=10_000, persist=True)
        before = shared.requests["put"]
        await trio.sleep(10 * BEAT + 0.5)
        assert shared.requests["put"] - before == 10
        assert c.statistics().runs.heartbeats >= 10
        nursery.cancel_scope.cancel()


async def test_max_concurrent_runs_starts_the_earliest_due_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    running = {"now": 0, "max": 0}

    async def handler(run: RunFire) -> None:
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        log.starts.append(("a", trio.current_time(), run))
        await trio.sleep(1)
        running["now"] -= 1

    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a")
        c = await start(nursery, a)
        for i in range(10):
            await c.schedule("wf", f"r{i}", after=2 + 0.01 * (9 - i), persist=True)
        a.kill()
        await trio.sleep(20)
        b = Process(
            shared, log, "b", run_options=options("b", max_concurrent_runs=2), handler=handler
        )
        await start(nursery, b)
        await trio.sleep(20)
        assert running["max"] == 2
        # Two at a time, earliest due first (within a pair, the order is Trio's).
        pairs = [{run.run_id for _, t, run in log.starts if t == 20 + k} for k in range(5)]
        assert pairs == [{f"r{9 - 2 * k}", f"r{8 - 2 * k}"} for k in range(5)]
        nursery.cancel_scope.cancel()


async def test_drain_runs_runs_everything_held_now(autojump_clock: trio.testing.MockClock) -> None:
    log = Log()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a")},
        run_store=MemoryRunStore(),
        run_options=options("a", lease=600.0, heartbeat_interval=200.0, horizon=400.0),
    ) as c:
        await c.schedule("wf", "p", 1, after=3600, persist=True)
        await c.schedule("wf", "l", 2, after=50)
        assert await c.drain_runs() == 2
        assert sorted((t, run.run_id, run.scheduled_at) for _, t, run in log.starts) == [
            (0.0, "l", wall(50)),
            (0.0, "p", wall(3600)),
        ]
        await trio.sleep(4000)
        assert len(log.starts) == 2


async def test_the_exit_does_not_wait_for_deferred_runs(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    log = Log()
    store = MemoryRunStore()
    with caplog.at_level(logging.WARNING, logger="trio_debounce.runs"):
        async with open_coordinator(
            run_handlers={"wf": log.handler("a", hold=3)},
            run_store=store,
            run_options=options("a"),
        ) as c:
            await c.schedule("wf", "p", after=86_400, persist=True)
            await c.schedule("wf", "l", after=86_400)
            await c.schedule("wf", "now", after=0, persist=True)
            await c.schedule("wf", "local-now", after=0)
            await trio.sleep(1)
            entered = trio.current_time()
    # It waited for the running handler only.
    assert trio.current_time() == entered + 2
    assert sorted(run.run_id for _, _, run in log.starts) == ["local-now", "now"]
    # Only the one waiting for its time (not the running one) is dropped.
    assert "1 non-persisted deferred run(s) dropped at exit" in caplog.text
    assert c.statistics().runs.dropped_at_exit == 1
    pending = await store.get_run("p")
    assert pending is not None
    assert pending.state is RunState.PENDING
    lease = await store.get_lease("a")
    assert lease is not None
    assert lease.released


async def test_the_start_fails_when_the_store_is_unreachable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryRunStore()
    store.faults.partitioned = True
    with pytest.raises(BackendUnavailableError):
        async with open_coordinator(run_store=store, run_options=options("a")):
            pytest.fail("the block must not run")  # pragma: no cover


async def test_store_faults_at_fire_time_lose_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    store = MemoryRunStore()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a")}, run_store=store, run_options=options("a")
    ) as c:
        await c.schedule("wf", "outage", after=1, persist=True)
        await c.schedule("wf", "lost-answer", after=20, persist=True)
        await trio.sleep(0.5)
        # The start step fails for a while (an outage): retried, run late, once.
        store.faults.fail_next(4, ops=("put",))
        await trio.sleep(10)
        assert [(run.run_id, run.attempt) for _, _, run in log.starts] == [("outage", 1)]
        # The start step lands but its answer is lost: the re-read proves it.
        store.faults.apply_then_fail_next(1, ops=("put",))
        await trio.sleep(15)
        assert [(run.run_id, run.attempt) for _, _, run in log.starts] == [
            ("outage", 1),
            ("lost-answer", 1),
        ]
        info = await c.get_run("lost-answer")
        assert info is not None
        assert info.state is RunState.DONE


async def test_refusals_and_garbage_in_the_store_do_not_crash_the_coordinator(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    from trio_debounce import BackendAuthError
    from trio_debounce._keys import run_key

    log = Log()
    shared = MemoryStore()
    store = MemoryRunStore(shared)
    async with open_coordinator(
        run_handlers={"wf": log.handler("a")}, run_store=store, run_options=options("a")
    ) as c:
        await c.schedule("wf", "refused", after=1, persist=True)
        store.faults.fail_next(1, ops=("put",), error=BackendAuthError)
        await trio.sleep(2)
        assert "the store refused a step" in caplog.text
        # Garbage where a run document should be: ignored with a warning.
        entry = await shared.get(run_key("refused"))
        assert entry is not None
        await shared.put(run_key("refused"), b"\xff not json", last=entry.revision)
        await shared.put(run_key("garbage"), b"{}", last=0)
        await trio.sleep(10)
        assert "ignoring the run document" in caplog.text
        # The coordinator still works.
        await c.schedule("wf", "after", after=1, persist=True)
        await trio.sleep(2)
        assert [run.run_id for _, _, run in log.starts] == ["after"]


async def test_a_run_that_expires_while_waiting_for_a_slot_is_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    dropped: list[tuple[str, str]] = []
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", hold=10)},
        run_options=options("a", max_concurrent_runs=1),
        run_store=MemoryRunStore(),
        on_expired=lambda run, reason: dropped.append((run.run_id, reason)),
    ) as c:
        await c.schedule("wf", "long", after=1)
        await c.schedule("wf", "short-lived", after=2, expires_at=wall(3), persist=True)
        await trio.sleep(20)
    assert [run.run_id for _, _, run in log.starts] == ["long"]
    assert dropped == [("short-lived", "expired")]


async def test_cancelling_a_running_local_run_keeps_it_ran(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", hold=5)}, run_options=options("a")
    ) as c:
        await c.schedule("wf", "r", after=1)
        await trio.sleep(2)
        info = await c.get_run("r")
        assert info is not None
        assert info.state is RunState.STARTED
        assert [i.state for i in await c.list_runs()] == [RunState.STARTED]
        assert await c.cancel_run("r") is False
        await trio.sleep(5)
        assert (await c.schedule("wf", "r", after=1)).outcome == "already-ran"
        assert [(i.state, i.outcome) for i in await c.list_runs()] == [(RunState.DONE, "ran")]
        await trio.sleep(5)
    assert len(log.starts) == 1


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
@pytest.mark.parametrize("slow_start", [False, True])
async def test_a_reschedule_racing_the_fire(
    autojump_clock: trio.testing.MockClock, delivery: str, slow_start: bool
) -> None:
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a", delivery=delivery)
        ca = await start(nursery, a)
        cb = await start(nursery, Process(shared, log, "b", delivery=delivery))
        await ca.schedule("wf", "r", "old", after=5, persist=True)
        await trio.sleep(5 - trio.current_time())
        if slow_start:
            a.store.faults.delay_next(0.5, ops=("put",))  # the owner's start lands late
        result = await cb.schedule("wf", "r", "new", after=3, persist=True)
        await trio.sleep(20)
        late = 0.5 if slow_start else 0.0
        runs = [(t, run.payload) for _, t, run in log.of("r")]
        if result.outcome == "already-ran":
            # The fire won: it ran once, with the old payload (at-most-once writes its
            # tombstone before the handler).
            assert runs == [(5.0 + late, "old")]
        else:
            # The re-schedule won or came while the old version ran: the new version
            # runs once at its time, after at most one run of the old one.
            assert result.outcome == "rescheduled"
            assert runs[-1] == (8.0, "new")
            assert runs[:-1] in ([], [(5.0 + late, "old")])
        nursery.cancel_scope.cancel()


async def test_a_failed_finish_write_is_written_again_not_run_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    store = MemoryRunStore()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a")},
        run_store=store,
        run_options=options("a", lease=30.0, heartbeat_interval=10.0, horizon=20.0),
    ) as c:
        await c.schedule("wf", "r", after=5, persist=True)
        await trio.sleep(4)
        # The start lands; the finish fails once without landing.
        store.faults.fail_next(1, ops=("put",))
        store.faults.clear()
        await trio.sleep(1)
        store.faults.fail_next(1, ops=("put",))
        await trio.sleep(60)
        assert [run.attempt for _, _, run in log.starts] == [1]
        info = await c.get_run("r")
        assert info is not None
        assert (info.state, info.outcome) == (RunState.DONE, "ran")
        assert c.statistics().runs.stale == 0


async def test_a_huge_retry_count_does_not_overflow_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", fail=1100)},
        run_options=options("a", retries=1100, retry_backoff=0.001),
    ) as c:
        await c.schedule("wf", "r", after=1)
        await trio.sleep(1100 * 60)
    assert len(log.starts) == 1101


async def test_the_exit_does_not_wait_forever_for_an_unreachable_store(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    store = MemoryRunStore()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", hold=1)},
        run_store=store,
        run_options=options("a"),
    ) as c:
        await c.schedule("wf", "r", after=1, persist=True)
        await trio.sleep(1.5)
        store.faults.partitioned = True  # the finish cannot be written
    # Bounded by the lease (then the run is left to whoever holds its claim).
    assert trio.current_time() < 1.5 + LEASE + 10


async def test_a_handler_can_schedule_its_successor_while_the_block_exits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryRunStore()
    scheduled: list[str] = []

    async def tick(run: RunFire) -> None:
        await trio.sleep(1)
        result = await c.schedule("wf", "tick-2", after=60, persist=True)
        scheduled.append(result.outcome)

    async with open_coordinator(
        run_handlers={"wf": tick}, run_store=store, run_options=options("a")
    ) as c:
        await c.schedule("wf", "tick-1", after=1, persist=True)
        await trio.sleep(1.5)
    assert scheduled == ["scheduled"]
    successor = await store.get_run("tick-2")
    assert successor is not None
    assert successor.state is RunState.PENDING


async def test_an_abort_drops_waiting_local_runs_with_a_warning(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    log = Log()
    with trio.CancelScope() as scope:
        async with open_coordinator(
            run_handlers={"wf": log.handler("a")}, run_options=options("a")
        ) as c:
            await c.schedule("wf", "l", after=100)
            scope.cancel()
            await trio.sleep(1)
    assert c.statistics().runs.dropped_at_exit == 1
    assert not c.has_run("l")
    assert "1 non-persisted deferred run(s) dropped at exit" in caplog.text


async def test_drain_runs_waits_for_runs_re_armed_by_another_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with open_coordinator(
        run_handlers={"wf": log.handler("a", hold=10)},
        run_options=options("a", max_concurrent_runs=1),
    ) as c:
        await c.schedule("wf", "a", after=100)
        await c.schedule("wf", "b", after=200)
        returned: list[float] = []

        async def drain() -> None:
            await c.drain_runs()
            returned.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            await trio.lowlevel.checkpoint()
            nursery.start_soon(drain)
        assert returned == [20.0, 20.0]
        assert not c.has_run("a")
        assert c.statistics().runs.held == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"limit": -1}, ValueError, "limit must be an int >= 0"),
        ({"limit": 1.5}, ValueError, "limit must be an int >= 0"),
        ({"workflow": 5}, TypeError, "workflow"),
        ({"owner": 5}, TypeError, "owner"),
        ({"state": "running"}, ValueError, "state must be one of"),
    ],
)
async def test_list_runs_rejects_bad_filters(
    autojump_clock: trio.testing.MockClock,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    async with open_coordinator(run_options=options("a")) as c:
        with pytest.raises(error, match=match):
            await c.list_runs(**kwargs)


async def test_a_time_too_large_for_a_float_is_refused_by_name(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(
        run_handlers={"wf": Log().handler("a")}, run_options=options("a")
    ) as c:
        with pytest.raises(ValueError, match="at must be finite"):
            await c.schedule("wf", "r", at=10**400)
        with pytest.raises(ValueError, match="expires_at must be finite"):
            await c.schedule("wf", "r", after=1, expires_at=10**400)


async def test_names_that_cannot_leave_the_process_are_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_coordinator(run_options=options("a")) as c:
        with pytest.raises(ValueError, match="lone surrogate"):
            c.set_run_handler("\ud800", Log().handler("a"))
    from trio_debounce import SqliteRunStore

    with pytest.raises(ValueError, match="lone surrogate"):
        SqliteRunStore("\ud800.db")


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_a_clean_exit_that_waits_for_a_handler_lets_peers_run_its_runs_on_time(
    autojump_clock: trio.testing.MockClock, delivery: str
) -> None:
    # A leaves its block while a run handler of its own takes 20 s; its persisted run
    # "later" comes due during that wait. The exit marks A's lease draining at once,
    # so B claims "later" at its next sweep and runs it on time; A's started run stays
    # A's (never run twice).
    log = Log()
    shared = MemoryStore()
    async with trio.open_nursery() as nursery:
        a = Process(shared, log, "a", handler=log.handler("a", hold=20.0), delivery=delivery)
        c = await start(nursery, a)
        await start(nursery, Process(shared, log, "b", delivery=delivery))
        await c.schedule("wf", "busy", after=1.0, persist=True)
        await c.schedule("wf", "later", after=6.0, persist=True)
        await trio.sleep(2.0)
        assert [who for who, _, _ in log.of("busy")] == ["a"]
        exited = trio.current_time()
        nursery.start_soon(a.exit)
        await trio.sleep(1.0)
        lease = await MemoryRunStore(shared).get_lease("a")
        assert lease is not None
        assert lease.draining  # marked at the exit's start, and kept by the heartbeat
        await trio.sleep(8.0)
        assert [(who, t) for who, t, _ in log.of("later")] == [("b", 6.0)]
        assert not a.exited.is_set()  # A still waits for its handler
        await a.exited.wait()
        assert trio.current_time() == pytest.approx(exited + 19.0)
        await trio.sleep(10.0)
        assert [who for who, _, _ in log.of("busy")] == ["a"]
        nursery.cancel_scope.cancel()
