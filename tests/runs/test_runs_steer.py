"""An operator's cancel and retry of a persisted run (``trio_debounce._runs._steer``,
what ``trio-debounce runs cancel|retry`` call), against live coordinators on the
in-memory run store under MockClock: a live owner that has the run armed never runs a
cancelled run, a started run is never cancelled, and a retried run is claimed and run
by a live peer at its next sweep, with its payload, the next attempt and a higher
fencing token. The CLI's own tests run the same against SQLite and a real
nats-server (tests/cli/test_cli_runs*.py)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.runs.test_runs import BEAT, Log, Process, start
from trio_debounce import BackendUnavailableError, RunState
from trio_debounce._runs._steer import cancel_pending_run, retry_failed_run, retry_refusal
from trio_debounce.abc import StoredRun
from trio_debounce.testing import MemoryRunStore, MemoryStore


async def test_a_cancelled_run_is_never_run_by_its_live_owner(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared, log = MemoryStore(), Log()
    owner = Process(shared, log, "a")
    operator = MemoryRunStore(shared)
    async with trio.open_nursery() as nursery:
        a = await start(nursery, owner)
        await a.schedule("wf", "r", {"n": 1}, after=5, persist=True)
        assert a.has_run("r")  # armed: due within the horizon
        steered = await cancel_pending_run(operator, "r")
        assert steered.done
        assert steered.run is not None
        assert (steered.run.state, steered.run.owner) == (RunState.PENDING, "a")
        assert await operator.get_run("r") is None
        await trio.sleep(20)
        assert log.starts == []
        again = await cancel_pending_run(operator, "r")
        assert (again.done, again.run) == (False, None)
        await owner.exit()


async def test_a_started_or_finished_run_is_not_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared, log = MemoryStore(), Log()
    owner = Process(shared, log, "a", hold=10)
    operator = MemoryRunStore(shared)
    async with trio.open_nursery() as nursery:
        a = await start(nursery, owner)
        await a.schedule("wf", "r", after=1, persist=True)
        await trio.sleep(2)
        assert len(log.starts) == 1  # its handler runs
        steered = await cancel_pending_run(operator, "r")
        assert not steered.done
        assert steered.run is not None
        assert steered.run.state is RunState.STARTED
        await trio.sleep(10)
        assert log.ends == [("a", "r")]
        done = await cancel_pending_run(operator, "r")
        assert done.run is not None
        assert (done.done, done.run.state, done.run.outcome) == (False, RunState.DONE, "ran")
        await owner.exit()


async def test_a_retried_run_is_claimed_and_run_by_a_live_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared, log = MemoryStore(), Log()
    failing = Process(shared, log, "a", handler=log.handler("a", fail=1))
    peer = Process(shared, log, "b")
    operator = MemoryRunStore(shared)
    async with trio.open_nursery() as nursery:
        a = await start(nursery, failing)
        await start(nursery, peer)
        await a.schedule("wf", "r", {"user": "ada"}, after=1, persist=True)
        await trio.sleep(2)
        failed = await operator.get_run("r")
        assert failed is not None
        assert (failed.state, failed.outcome, failed.attempt) == (RunState.DONE, "failed", 1)
        await failing.exit()  # only the peer is left to claim it

        t0 = trio.current_time()
        steered = await retry_failed_run(operator, "r")
        assert steered.done
        retried = steered.run
        assert retried is not None
        assert retried == failed.replace(
            state=RunState.PENDING,
            owner=None,
            epoch=0,
            scheduled_at=operator.wall_time(),
            outcome=None,
            finished_at=None,
            token=failed.token + 1,
            version=failed.version + 1,
            revision=retried.revision,
        )
        await trio.sleep(2 * BEAT)
        [first, second] = log.of("r")
        assert second[0] == "b"
        assert second[1] - t0 <= BEAT  # at the peer's next sweep
        fire = second[2]
        assert (fire.payload, fire.attempt) == ({"user": "ada"}, 2)
        assert fire.fencing_token > first[2].fencing_token
        assert fire.scheduled_at == retried.scheduled_at
        ran = await operator.get_run("r")
        assert ran is not None
        assert (ran.state, ran.outcome, ran.owner, ran.attempt) == (RunState.DONE, "ran", "b", 2)
        # A run that ran is not retried.
        refused = await retry_failed_run(operator, "r")
        assert (refused.done, refused.run) == (False, ran)
        await peer.exit()


async def test_retry_refuses_what_is_not_a_failed_tombstone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryRunStore()
    wall = store.wall_time()
    base = StoredRun("r", "wf", "{}", wall - 10, created_at=wall - 20)
    cases = {
        base: "it is pending, not failed",
        base.replace(state=RunState.STARTED): "it is started, not failed",
        base.replace(state=RunState.DONE, outcome="ran"): "its outcome is 'ran', not 'failed'",
        base.replace(state=RunState.DONE, outcome="expired"): "its outcome is 'expired'",
        base.replace(state=RunState.DONE, outcome="failed", expires_at=wall - 1): "expiry",
    }
    for run, reason in cases.items():
        refusal = retry_refusal(run, wall)
        assert refusal is not None
        assert reason in refusal
        made = await store.create_run(run)
        assert made is not None
        steered = await retry_failed_run(store, "r")
        assert (steered.done, steered.run) == (False, made)
        assert await store.delete_run("r", revision=made.revision)
    assert retry_refusal(base.replace(state=RunState.DONE, outcome="failed"), wall) is None
    assert (await retry_failed_run(store, "absent")).run is None


async def test_steering_loses_no_race_it_does_not_report(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A compare-and-swap that loses re-reads the run and decides again; a run that
    changes under every attempt raises rather than steering blind."""
    store = MemoryRunStore()
    made = await store.create_run(StoredRun("r", "wf", "{}", store.wall_time() + 60))
    assert made is not None
    original = store.delete_run
    lost: list[int] = []

    async def racing_delete(run_id: str, *, revision: int) -> bool:
        current = await store.get_run(run_id)
        assert current is not None
        if len(lost) < 3:  # a peer re-schedules it just before each of our writes
            lost.append(revision)
            await store.update_run(current.replace(version=current.version + 1))
        return await original(run_id, revision=revision)

    store.delete_run = racing_delete  # type: ignore[method-assign]
    steered = await cancel_pending_run(store, "r")
    assert steered.done
    assert steered.run is not None
    assert steered.run.version == made.version + 3
    assert len(lost) == 3

    made = await store.create_run(StoredRun("s", "wf", "{}", store.wall_time() + 60))
    assert made is not None

    async def always_changed(run_id: str, *, revision: int) -> bool:
        await trio.lowlevel.checkpoint()
        return False

    store.delete_run = always_changed  # type: ignore[method-assign]
    with pytest.raises(BackendUnavailableError, match="could not be cancelled under contention"):
        await cancel_pending_run(store, "s")
