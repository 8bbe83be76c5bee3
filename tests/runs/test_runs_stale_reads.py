"""A deferred run's step decided on a replica that lags (``StoreFaults.lag``).

After an update of a run record whose answer was lost, the scheduler reads the record
again to learn whether the update landed. Read from a replica that has not applied
it, the record looked unchanged ("did not land: write again"); the write then
conflicted (it had landed), the next read was as stale, and the loop wrote and read
again with no pause until the replica caught up. The scheduler now decides on
``RunStore.get_run_current``, which the run stores on a KV bucket read from the store's
authority (``KvStore.get_current``: on NATS the stream leader), as they read leases.
``get_run`` stays a plain read: a steering user (``trio-debounce runs cancel``) needs
no leader reads.
"""

from __future__ import annotations

import collections

import trio
import trio.testing

from tests.runs.test_runs import Log, options
from trio_debounce import RunState, open_coordinator
from trio_debounce._keys import run_key
from trio_debounce.testing import MemoryRunStore, MemoryStore

#: More writes than the test makes unless a step spins, by far.
WRITE_LIMIT = 200


class _BoundedRequests(collections.Counter[str]):
    """The store's request counter, raising once writes pass :data:`WRITE_LIMIT`: a loop
    that never sleeps would otherwise hang the test (MockClock's time stands still
    while a task keeps running)."""

    def __setitem__(self, op: str, n: int) -> None:
        if op == "put" and n > WRITE_LIMIT:
            raise AssertionError(f"{n} writes: the step spins on a stale read")
        super().__setitem__(op, n)


async def test_a_runs_lost_step_answer_is_decided_on_the_leaders_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    shared = MemoryStore()
    store = MemoryRunStore(shared)
    async with open_coordinator(
        run_handlers={"wf": log.handler("a")}, run_store=store, run_options=options("a")
    ) as c:
        await c.schedule("wf", "r", after=21, persist=True)
        await trio.sleep(20.5)  # after the heartbeat at 20 s; the next is at 22 s
        shared.requests = _BoundedRequests(shared.requests)
        # The replica this process reads from stops applying the run's writes, and
        # the start step (at 21 s) lands with its answer lost.
        store.faults.lag(run_key("r"))
        store.faults.apply_then_fail_next(1, ops=("put",))
        await trio.sleep(5)
        assert [(run.run_id, run.attempt) for _, _, run in log.starts] == [("r", 1)]
        store.faults.catch_up()
        info = await c.get_run("r")
        assert info is not None
        assert info.state is RunState.DONE
    assert shared.requests["put"] < WRITE_LIMIT
