"""A lease read from a replica that lags never decides a takeover.

JetStream answers a direct get (and a consumer's listing) from any replica of the
stream, with what that replica has applied so far. :class:`LaggingReplica` is such a
view of a shared :class:`~trio_debounce.testing.MemoryStore`, frozen for the leases of
chosen processes: its ``get`` and ``entries`` show their leases as they were when it
was frozen, while ``get_current`` (the stream leader's read) and every write see the
store itself. A process behind it sees a live owner's lease lapse; it must confirm by
a leader read before it counts the owner dead (docs/protocol.rst, "Stale reads").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from tests.harness.fires import Fires
from trio_debounce import Coordinator, Outcome, RunFire, RunOptions, open_coordinator
from trio_debounce._keys import process_key, run_lease_key
from trio_debounce._protocol import KvDebounceBackend
from trio_debounce._runs._kv_store import KvRunStore
from trio_debounce.abc import KvEntry, KvStore
from trio_debounce.testing import MemoryRunStore, MemoryStore

LEASE = 6.0
SKEW = 1.0
EPOCH = 1_700_000_000.0  # the MemoryStore's default epoch


class LaggingReplica(KvStore):
    """``store`` as a lagging replica shows it: frozen keys stay as they were when
    :meth:`freeze` was called (writes, and :meth:`get_current`, go to ``store``)."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.max_value_bytes = store.max_value_bytes
        self.created = store.created
        self._frozen: dict[str, KvEntry | None] = {}
        self.stale_reads = 0
        self.current_reads = 0

    async def freeze(self, *keys: str) -> None:
        """From now on, show ``keys`` as they are now in :meth:`get` and :meth:`entries`."""
        for key in keys:
            self._frozen[key] = await self._store.get(key)

    async def get(self, key: str) -> KvEntry | None:
        if key in self._frozen:
            self.stale_reads += 1
            await trio.lowlevel.checkpoint()
            return self._frozen[key]
        return await self._store.get(key)

    async def get_current(self, key: str) -> KvEntry | None:
        self.current_reads += 1
        return await self._store.get(key)

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        return await self._store.put(key, value, last=last)

    async def delete(self, key: str, *, last: int) -> int:
        return await self._store.delete(key, last=last)

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        return await self._store.purge_marker(key, revision=revision)

    async def entries(self, prefix: str) -> list[KvEntry]:
        found = []
        for entry in await self._store.entries(prefix):
            if entry.key in self._frozen:
                self.stale_reads += 1
                frozen = self._frozen[entry.key]
                if frozen is None:
                    continue
                entry = frozen
            found.append(entry)
        return found


def backend(store: KvStore, name: str) -> KvDebounceBackend:
    return KvDebounceBackend(
        store,
        process_id=name,
        process_lease=LEASE,
        max_clock_skew=SKEW,
        wall_time=lambda: EPOCH + trio.current_time(),
    )


async def test_a_lease_that_lapsed_on_a_lagging_replica_is_confirmed_by_the_leader(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store, fires = MemoryStore(), Fires()
    replica = LaggingReplica(store)
    a: Coordinator
    async with (
        open_coordinator(handlers={"wf": fires.handler("A")}, backend=backend(store, "A")) as a,
        open_coordinator(handlers={"wf": fires.handler("B")}, backend=backend(replica, "B")) as b,
    ):
        t0 = trio.current_time()
        await a.debounce("wf", "k", "a", delay=40.0)  # A owns the window
        # B's replica stops applying A's lease renewals: there, A's lease lapses after
        # LEASE seconds, while A renews it on the leader every heartbeat.
        await replica.freeze(process_key("A"))
        await trio.sleep(4 * LEASE)
        # B's pings and heartbeats (its adoption scans) saw the lapsed lease and asked
        # the leader, which shows it renewed: no takeover, the window stays A's.
        result = await b.debounce("wf", "k", "b", delay=40.0)
        assert (result.outcome, result.owner) == (Outcome.COALESCE, False)
        await trio.sleep(4 * LEASE)
        assert replica.stale_reads > 0
        assert replica.current_reads > 0
        assert b.statistics().takeovers == 0
        await trio.sleep(40.0)
    assert [(p, f.payload) for p, f in fires.log] == [("A", "b")]
    [(_, fire)] = fires.log
    assert fire.fired_at >= t0 + 40.0


class LaggingRunStore(KvRunStore):
    """A run store on a :class:`LaggingReplica`, on the shared store's wall clock."""

    def wall_time(self) -> float:
        return EPOCH + trio.current_time()


async def test_a_run_lease_that_lapsed_on_a_lagging_replica_is_confirmed_before_a_claim(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared = MemoryStore()
    replica = LaggingReplica(shared)
    ran: list[tuple[str, str]] = []

    def handler(name: str) -> Callable[[RunFire], Awaitable[None]]:
        async def handle(run: RunFire) -> None:
            ran.append((name, run.run_id))

        return handle

    def options(name: str) -> RunOptions:
        return RunOptions(process_id=name, lease=LEASE, heartbeat_interval=2.0, max_clock_skew=SKEW)

    async with (
        open_coordinator(
            run_store=MemoryRunStore(shared),
            run_handlers={"job": handler("a")},
            run_options=options("a"),
        ) as a,
        open_coordinator(
            run_store=LaggingRunStore(replica),
            run_handlers={"job": handler("b")},
            run_options=options("b"),
        ) as b,
    ):
        await a.schedule("job", "r", after=30.0, persist=True)  # a owns it
        # b's replica stops applying a's lease renewals: there, a's lease lapses.
        await replica.freeze(run_lease_key("a"))
        await trio.sleep(20.0)
        assert ran == []  # b's sweeps saw the lapsed lease, and the leader's answer
        assert replica.stale_reads > 0
        assert replica.current_reads > 0
        await trio.sleep(20.0)
        assert b.statistics().runs.taken_over == 0
    assert ran == [("a", "r")]
