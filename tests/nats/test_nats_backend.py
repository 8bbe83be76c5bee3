"""The cross-process protocol against a real ``nats-server`` with JetStream.

Real clock (under trio-asyncio, nats-py's own timeouts run on Trio's clock, so an
autojumping MockClock would expire them at once), small delays, and an outer
``trio.fail_after`` on every test. Coordinators with distinct process ids share one
bucket in one ``trio.run``, each through its own connection.
"""

from __future__ import annotations

import itertools
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from tests.harness.fires import Fires
from tests.harness.nats_server import NatsServer, NatsServerFactory, free_port
from trio_debounce import (
    BackendAuthError,
    BackendUnavailableError,
    Coordinator,
    Edge,
    Mode,
    Outcome,
    ProcessIdTakenError,
    Registered,
    Registration,
    open_coordinator,
)
from trio_debounce._keys import window_key
from trio_debounce._protocol import KvDebounceBackend
from trio_debounce.abc import DebounceBackend, KvEntry, KvStore
from trio_debounce.nats import NatsConfig, open_nats_backend
from trio_debounce.nats._store import open_nats_store
from trio_debounce.testing import check_debounce_backend

LEASE = 1.5
SKEW = 0.25
OP_TIMEOUT = 0.5

pytestmark = pytest.mark.slow


def config(server: NatsServer, **kwargs: Any) -> NatsConfig:
    kwargs.setdefault("bucket", "b" + uuid.uuid4().hex[:12])
    kwargs.setdefault("process_lease", LEASE)
    kwargs.setdefault("max_clock_skew", SKEW)
    kwargs.setdefault("op_timeout", OP_TIMEOUT)
    kwargs.setdefault("connect_timeout", 3.0)
    kwargs.setdefault("ping_interval", 1.0)
    return NatsConfig(servers=(server.url,), **kwargs)


@asynccontextmanager
async def processes(
    cfg: NatsConfig, fires: Fires, names: Sequence[str], **kwargs: Any
) -> AsyncIterator[list[Coordinator]]:
    async with AsyncExitStack() as stack:
        coordinators = []
        for name in names:
            backend = await stack.enter_async_context(open_nats_backend(cfg, process_id=name))
            coordinators.append(
                await stack.enter_async_context(
                    open_coordinator(
                        handlers={"wf": fires.handler(name)}, backend=backend, **kwargs
                    )
                )
            )
        yield coordinators


async def test_conformance_nats_backend(nats_server: NatsServer) -> None:
    # The default op_timeout: the suite checks the protocol's answers, not its
    # latency (the realtime tests bound that), and a storm of 10 pings from 5
    # processes on a loaded machine can take longer than the fault tests' 0.5 s.
    cfg = config(nats_server, op_timeout=NatsConfig.op_timeout)
    opened = itertools.count()

    @asynccontextmanager
    async def open_backends(n: int) -> AsyncIterator[Sequence[DebounceBackend]]:
        # Fresh process ids: an id whose lease is still live would be watched for a
        # renewal before the first write (a twin, or a crashed predecessor).
        async with AsyncExitStack() as stack:
            yield [
                await stack.enter_async_context(
                    open_nats_backend(cfg, process_id=f"p{next(opened)}")
                )
                for _ in range(n)
            ]

    with trio.fail_after(40):
        await check_debounce_backend(
            open_backends, process_lease=LEASE, max_clock_skew=SKEW, tick=0.05
        )


async def test_two_and_three_processes_fire_each_burst_once(nats_server: NatsServer) -> None:
    fires = Fires()
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "ABC") as (a, b, c):
            results = []
            for i in range(9):
                who = (a, b, c)[i % 3]
                for key in ("k1", "k2"):
                    results.append((key, await who.debounce("wf", key, i, delay=0.4)))
                await trio.sleep(0.05)
            for key in ("k1", "k2"):
                mine = [r for k, r in results if k == key]
                assert [r.ping_count for r in mine] == list(range(1, 10))
                assert len({r.active_run_id for r in mine}) == 1
                assert [r.owner for r in mine] == [True, False, False] * 3
            await trio.sleep(0.8)
            assert sorted(fires.by_edge()) == [
                # the latest stored payload (C's ping 8), whichever process fires
                ("A", "k1", 8, 9, Edge.TRAILING),
                ("A", "k2", 8, 9, Edge.TRAILING),
            ]


async def test_window_options_across_processes_on_a_real_server(nats_server: NatsServer) -> None:
    # max_count: the third ping (C's) fires the window at once, from C; order keys: the
    # payload with the highest key is kept whoever writes last.
    fires = Fires()
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "ABC") as (a, b, c):
            t0 = trio.current_time()
            for who, order in ((a, 5), (b, 9), (c, 7)):
                await who.debounce("wf", "count", f"c{order}", delay=5.0, max_count=3)
                await who.debounce("wf", "order", f"o{order}", delay=0.4, order_key=order)
            with pytest.raises(ValueError, match="opened with an order_key"):
                await a.debounce("wf", "order", "x", delay=0.4)
            await fires.wait_first()
            await trio.sleep(1.0)
    by_key = {f.key: (p, f.payload, f.ping_count) for p, f in fires.log}
    assert by_key == {"count": ("C", "c7", 3), "order": ("A", "o9", 3)}
    [(_, counted)] = fires.of("count")
    assert counted.fired_at - t0 < 2.0  # at the third ping, not after the 5 s delay


async def test_shared_reducer_on_a_real_server(nats_server: NatsServer) -> None:
    # The accumulated value lives in the bucket's document, folded by each process's
    # own reducer of the same name; a process without it cannot ping.
    fires = Fires()
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "ABC") as (a, b, c):
            for who in (a, b):
                who.set_reducer("sum", lambda acc, new: acc + new, initial=int)
            for who, n in ((a, 1), (b, 2), (a, 3)):
                await who.debounce("wf", "k", n, delay=0.5, payload_policy="sum")
            with pytest.raises(ValueError, match="got 'sum'"):
                await c.debounce("wf", "k", 4, delay=0.5, payload_policy="sum")
            await fires.wait_first()
            await trio.sleep(0.5)
    assert [(p, f.payload, f.ping_count) for p, f in fires.log] == [("A", 6, 3)]


@pytest.mark.realtime
async def test_shared_fire_early_on_a_real_server(nats_server: NatsServer) -> None:
    # The ping that finds the window full (C's) takes its fire by compare-and-swap and
    # opens the next window.
    fires = Fires()
    opts: dict[str, Any] = {"payload_policy": "collect", "max_items": 2}
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "ABC") as (a, b, c):
            t0 = trio.current_time()
            await a.debounce("wf", "k", "a", delay=1.0, **opts)
            await b.debounce("wf", "k", "b", delay=1.0, **opts)
            r = await c.debounce("wf", "k", "c", delay=1.0, **opts)
            assert (r.outcome, r.owner, r.ping_count) == (Outcome.SCHEDULE_TRAILING, True, 1)
            await fires.wait_first()
            assert trio.current_time() - t0 < 1.0  # at once, not after the delay
            await trio.sleep(1.5)
    assert [(p, f.payload, f.ping_count) for p, f in fires.log] == [
        ("C", ["a", "b"], 2),
        ("C", ["c"], 1),
    ]


async def test_shared_queue_latest_on_a_real_server(nats_server: NatsServer) -> None:
    # A runs the first fire for 1.5 s; B's window comes due meanwhile and waits, with
    # scheduled_at None; when A's run returns, A takes and fires it, once, with the
    # latest payload.
    cfg = config(nats_server)
    fires = Fires()
    opts: dict[str, Any] = {"overlap": "queue-latest"}
    with trio.fail_after(20):
        async with (
            open_nats_backend(cfg, process_id="A") as a_backend,
            open_nats_backend(cfg, process_id="B") as b_backend,
            open_coordinator(handlers={"wf": fires.handler("A", hold=1.5)}, backend=a_backend) as a,
            open_coordinator(handlers={"wf": fires.handler("B")}, backend=b_backend) as b,
        ):
            await a.debounce("wf", "k", 1, delay=0.1, **opts)
            await fires.wait_first()
            started = trio.current_time()
            await b.debounce("wf", "k", 2, delay=0.1, **opts)
            await trio.sleep(0.4)  # due, and waiting
            r = await b.debounce("wf", "k", 3, delay=0.1, **opts)
            assert (r.outcome, r.scheduled_at, r.ping_count) == (Outcome.COALESCE, None, 2)
            status = await a.window_status("wf", "k")
            assert status is not None
            assert status.scheduled_at is None
        # (the exit waits for B's waiting window)
    assert [(p, f.payload, f.ping_count) for p, f in fires.log] == [("A", 1, 1), ("A", 3, 2)]
    [(_, first), (_, second)] = fires.log
    assert second.fired_at - first.fired_at >= 1.5 - 0.05  # after the run, not beside it
    assert started - first.fired_at < 0.5


async def test_shared_drop_stale_on_a_real_server(nats_server: NatsServer) -> None:
    # The last fired order key outlives the window (in its tombstone), for every process.
    fires = Fires()
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "ABC") as (a, b, c):
            await a.debounce("wf", "k", "e5", delay=0.2, order_key=5)
            await b.debounce("wf", "k", "e7", delay=0.2, order_key=7)
            await fires.wait_first()
            await trio.sleep(0.2)
            r = await c.debounce("wf", "k", "e6", delay=0.2, order_key=6, drop_stale=True)
            assert (r.outcome, r.ping_count) == (Outcome.STALE, 0)
            r = await c.debounce("wf", "k", "e8", delay=0.2, order_key=8, drop_stale=True)
            assert r.outcome is Outcome.SCHEDULE_TRAILING
            await trio.sleep(0.6)
    assert [(p, f.payload) for p, f in fires.log] == [("A", "e7"), ("C", "e8")]
    assert c.statistics().stale_pings == 1


@pytest.mark.realtime
async def test_owner_extend_and_non_owner_push(nats_server: NatsServer) -> None:
    fires = Fires()
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "AB") as (a, b):
            t0 = trio.current_time()
            await a.debounce("wf", "k", "a1", delay=0.3)
            r = await a.debounce("wf", "k", "a2", delay=0.3)
            assert r.owner
            assert r.outcome is Outcome.COALESCE
            await trio.sleep(0.2)
            r = await b.debounce("wf", "k", "b", delay=0.8)  # pushes the fire later
            assert not r.owner
            assert r.scheduled_at is not None
            pushed = r.scheduled_at
            await trio.sleep(0.5)
            assert fires.log == []  # A woke at its armed time and rescheduled
            await trio.sleep(0.6)
            [(process, fire)] = fires.log
            assert process == "A"
            assert fire.payload == "b"  # the latest stored payload, B's
            assert fire.ping_count == 3
            assert fire.fired_at == pytest.approx(pushed, abs=0.05)
            assert fire.first_ping_at == pytest.approx(t0, abs=0.05)


@pytest.mark.realtime
async def test_non_owner_moves_the_fire_earlier(nats_server: NatsServer) -> None:
    fires = Fires()
    with trio.fail_after(20):
        # on_exit="cancel": A learns that B took the fire only when its own task wakes
        # at the time it armed (30 s), which a "wait" exit would wait for.
        async with processes(config(nats_server), fires, "AB", on_exit="cancel") as (a, b):
            await a.debounce("wf", "k", "a", delay=30.0)
            start = trio.current_time()
            r = await b.debounce("wf", "k", "b", delay=0.3)
            with trio.fail_after(2):
                await fires.wait_first()
            assert trio.current_time() - start < 1.0
            assert fires.by_edge() == [("B", "k", "b", 2, Edge.TRAILING)]
            assert fires.log[0][1].fired_at == pytest.approx(r.scheduled_at, abs=0.05)
        assert len(fires.log) == 1  # A's later finalize was abandoned


async def test_window_longer_than_the_lease_stays_with_its_owner(nats_server: NatsServer) -> None:
    fires = Fires()
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "AB") as (a, b):
            await a.debounce("wf", "k", "a", delay=3 * LEASE)
            for _ in range(3):
                await trio.sleep(LEASE)
                r = await b.debounce("wf", "k", "b", delay=0.2 + 3 * LEASE)
                assert not r.owner
            await a.flush("wf", "k")
            await a.wait_idle()
            assert fires.by_edge() == [("A", "k", "b", 4, Edge.TRAILING)]


async def test_dead_owner_is_taken_over_and_fires_once(nats_server: NatsServer) -> None:
    fires = Fires()
    cfg = config(nats_server)
    with trio.fail_after(20):
        async with processes(cfg, fires, "B") as (b,):
            with trio.CancelScope() as a_scope:
                async with open_nats_backend(cfg, process_id="A") as backend_a:
                    assert isinstance(backend_a, KvDebounceBackend)
                    handlers = {"wf": fires.handler("A")}
                    async with open_coordinator(handlers=handlers, backend=backend_a) as a:
                        first = await a.debounce("wf", "k", "a", delay=60.0, mode="both")
                        # The leading handler returns and its fire record is purged
                        # (else, at-least-once, a survivor would run it again).
                        for _ in range(500):
                            if fires.log and not a.statistics().running_handlers:
                                break
                            await trio.sleep(0.01)
                        # A's process "dies": its coordinator stops heartbeating and
                        # cannot release (its store stops answering).
                        a_scope.cancel()
                        backend_a._view.store = _Dead()
            await trio.sleep(LEASE + SKEW + 0.3)
            r = await b.debounce("wf", "k", "b", delay=0.3, mode="both")
            assert r.owner
            assert r.outcome is Outcome.COALESCE
            assert r.active_run_id == first.active_run_id
            assert r.ping_count == 2
            await trio.sleep(0.6)
        assert fires.by_edge() == [
            ("A", "k", "a", 1, Edge.LEADING),  # not fired again by the takeover
            ("B", "k", "b", 2, Edge.TRAILING),
        ]


async def test_a_live_process_id_refuses_a_second_start_not_a_restart(
    nats_server: NatsServer,
) -> None:
    fires = Fires()
    cfg = config(nats_server)
    with trio.fail_after(30):
        with trio.CancelScope() as a_scope:
            async with open_nats_backend(cfg, process_id="svc") as backend_a:
                assert isinstance(backend_a, KvDebounceBackend)
                handlers = {"wf": fires.handler("first")}
                async with open_coordinator(handlers=handlers, backend=backend_a) as a:
                    await a.debounce("wf", "early", "a", delay=0.3)
                    async with open_nats_backend(cfg, process_id="svc") as twin:
                        with pytest.raises(ProcessIdTakenError, match="'svc'"):
                            async with open_coordinator(
                                handlers={"wf": fires.handler("twin")}, backend=twin
                            ):
                                pytest.fail("the twin started")  # pragma: no cover
                    # The earlier one runs on, unfenced.
                    assert (await a.debounce("wf", "after", "b", delay=0.3)).owner
                    await a.debounce("wf", "left", "c", delay=3.0)
                    await trio.sleep(LEASE)
                    assert backend_a.lease_held()
                    # Then it "dies" with a window open: no heartbeat, no release.
                    a_scope.cancel()
                    backend_a._view.store = _Dead()
        # A restart under the same id while the dead lease is live: not refused; it
        # takes the id and the window over (no renewal came while it watched).
        async with open_nats_backend(cfg, process_id="svc") as backend_b:
            handlers = {"wf": fires.handler("restart")}
            async with open_coordinator(handlers=handlers, backend=backend_b):
                # "left" came due 3 s after its ping; a call that timed out at the
                # start (a loaded machine) defers the takeover by a heartbeat or two.
                await fires.wait_for(3)
    assert [(who, f.key) for who, f in fires.log] == [
        ("first", "early"),
        ("first", "after"),
        ("restart", "left"),
    ]


class _Dead(KvStore):
    """A store that no longer answers, standing in for a dead process's connection."""

    max_value_bytes = 0
    created = 0.0

    async def get(self, key: str) -> KvEntry | None:
        raise BackendUnavailableError("dead")

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        raise BackendUnavailableError("dead")

    async def delete(self, key: str, *, last: int) -> int:
        raise BackendUnavailableError("dead")

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        raise BackendUnavailableError("dead")

    async def entries(self, prefix: str) -> list[KvEntry]:
        raise BackendUnavailableError("dead")


async def test_leading_across_processes(nats_server: NatsServer) -> None:
    fires = Fires()
    with trio.fail_after(20):
        async with processes(config(nats_server), fires, "AB") as (a, b):
            r = await a.debounce("wf", "k", 0, delay=0.5, mode="leading")
            assert r.outcome is Outcome.FIRE_IMMEDIATE
            for i in range(1, 5):
                await trio.sleep(0.2)
                r = await (b, a)[i % 2].debounce("wf", "k", i, delay=0.5, mode="leading")
                assert r.outcome is Outcome.COALESCE
            await trio.sleep(0.9)
            r = await b.debounce("wf", "k", 5, delay=0.5, mode="leading")
            assert r.outcome is Outcome.FIRE_IMMEDIATE
        assert fires.by_edge() == [
            ("A", "k", 0, 1, Edge.LEADING),
            ("B", "k", 5, 1, Edge.LEADING),
        ]


async def test_conflict_storm_of_ten_coordinators(nats_server: NatsServer) -> None:
    fires = Fires()
    names = [f"P{i}" for i in range(10)]
    with trio.fail_after(30):
        async with processes(config(nats_server, op_timeout=2.0), fires, names) as cs:
            results = []

            async def ping(c: Coordinator, i: int) -> None:
                results.append(await c.debounce("wf", "k", i, delay=0.5))

            async with trio.open_nursery() as nursery:
                for i, c in enumerate(cs):
                    nursery.start_soon(ping, c, i)
            assert sorted(r.ping_count for r in results) == list(range(1, 11))
            assert sum(r.owner for r in results) == 1
            assert all(r.stored for r in results)
            await trio.sleep(1.0)
        assert len(fires.log) == 1
        assert fires.log[0][1].ping_count == 10


@pytest.mark.realtime
async def test_server_stopped_mid_window_then_restarted(nats_server: NatsServer) -> None:
    fires = Fires()
    lease = 2.0  # the owner still holds its lease when its finalize fails (at ~0.7 s)
    with trio.fail_after(40):
        async with processes(config(nats_server, process_lease=lease), fires, "AB") as (a, b):
            await a.debounce("wf", "k", "a", delay=0.2)
            await b.debounce("wf", "k", "b", delay=0.2)
            nats_server.stop()
            # No call hangs past its bound: a ping fails open within op_timeout.
            start = trio.current_time()
            r = await b.debounce("wf", "other", "x", delay=0.2)
            assert trio.current_time() - start < OP_TIMEOUT + 0.5
            assert r.owner  # a local window
            await trio.sleep(0.2 + OP_TIMEOUT + 0.5)
            # A held the window and its lease: it fired although finalize could not
            # reach the server. An unconfirmed fire carries the last count and payload
            # its owner saw (its own ping).
            assert sorted(fires.by_edge()) == [
                ("A", "k", "a", 1, Edge.TRAILING),
                ("B", "other", "x", 1, Edge.TRAILING),
            ]
            assert a.statistics().unconfirmed_fires == 1
            assert b.statistics().fail_open_windows == 1
            nats_server.start()
            await trio.sleep(3 * lease)  # reconnect, heartbeats apply the queued delete
            fires.log.clear()
            # Cross-process mode resumes; the old window is gone, nothing fires twice.
            r = await b.debounce("wf", "k", "b2", delay=0.3)
            assert r.outcome is Outcome.SCHEDULE_TRAILING
            assert r.owner
            r = await a.debounce("wf", "k", "a2", delay=0.3)
            assert not r.owner
            assert r.ping_count == 2
            await trio.sleep(0.8)
            assert fires.by_edge() == [("B", "k", "a2", 2, Edge.TRAILING)]


async def test_register_that_times_out_but_lands(nats_server: NatsServer) -> None:
    # The server is paused between a register's read and its write: the write times
    # out and the ping fails open locally; the server then resumes and applies the
    # write, which makes A the owner of a shared window that B pings into. The burst
    # fires once, on A.
    fires = Fires()
    cfg = config(nats_server)
    with trio.fail_after(30):
        async with (
            processes(cfg, fires, "B") as (b,),
            open_nats_backend(cfg, process_id="A") as backend_a,
        ):
            assert isinstance(backend_a, KvDebounceBackend)
            backend_a._view.store = PauseAfterGet(backend_a._view.store, nats_server, "w.d2Y.aw")
            async with open_coordinator(
                handlers={"wf": fires.handler("A")}, backend=backend_a
            ) as a:
                r = await a.debounce("wf", "k", "a", delay=2.0)
                assert a.statistics().fail_open_windows == 1
                assert r.owner
                nats_server.resume()
                await trio.sleep(0.3)
                r = await b.debounce("wf", "k", "b", delay=2.0)
                assert r.ping_count == 2  # the write that timed out had landed
                assert not r.owner
                await trio.sleep(2 * LEASE + 2.0)
        assert [p for p, *_ in fires.by_edge()] == ["A"]
        assert fires.log[0][1].ping_count == 2


class PauseAfterGet(KvStore):
    """The real NATS store, with the server paused (SIGSTOP) right after one read of
    ``key`` returns, so the write that follows is sent to a stopped server."""

    def __init__(self, store: KvStore, server: NatsServer, key: str) -> None:
        self._store = store
        self._server = server
        self._key = key
        self.max_value_bytes = store.max_value_bytes
        self.created = store.created

    async def get(self, key: str) -> KvEntry | None:
        entry = await self._store.get(key)
        if key == self._key and not self._server.paused:
            self._key = ""
            self._server.pause()
        return entry

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        return await self._store.put(key, value, last=last)

    async def delete(self, key: str, *, last: int) -> int:
        return await self._store.delete(key, last=last)

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        return await self._store.purge_marker(key, revision=revision)

    async def entries(self, prefix: str) -> list[KvEntry]:
        return await self._store.entries(prefix)


@pytest.mark.realtime
async def test_start_up_with_the_server_down() -> None:
    cfg = NatsConfig(servers=(f"nats://127.0.0.1:{free_port()}",), connect_timeout=1.0)
    start = time.monotonic()
    with trio.fail_after(10), pytest.raises(BackendUnavailableError):
        async with open_nats_backend(cfg):
            pytest.fail("connected to nothing")  # pragma: no cover
    assert 0.9 <= time.monotonic() - start < 4.0


@pytest.mark.realtime
async def test_wrong_credentials(nats_server_factory: NatsServerFactory) -> None:
    server = nats_server_factory(token="s3cret-token")
    cfg = NatsConfig(servers=(server.url,), token="wrong-token", connect_timeout=10.0)
    start = time.monotonic()
    with trio.fail_after(10), pytest.raises(BackendAuthError) as info:
        async with open_nats_backend(cfg):
            pytest.fail("authenticated with a wrong token")  # pragma: no cover
    assert time.monotonic() - start < 5.0
    assert "wrong-token" not in str(info.value)


async def test_key_deleted_and_recreated_in_a_race(nats_server: NatsServer) -> None:
    # A cancel (a delete marker) races pings from three processes, round after round:
    # every ping lands either in the old window or in exactly one new one, which was
    # opened over the delete marker by compare-and-swap.
    cfg = config(nats_server)
    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            owner, canceller, *pingers = [
                await stack.enter_async_context(open_nats_backend(cfg, process_id=f"p{i}"))
                for i in range(5)
            ]
            kw: dict[str, Any] = {"mode": Mode.TRAILING, "delay": 5.0, "max_delay": None}
            for round_ in range(8):
                old = await owner.register("wf", "k", run_id=f"old{round_}", **kw)
                assert old.outcome is Registered.OPENED
                results: list[Registration] = []
                cancelled: list[bool] = []

                async def ping(
                    backend: DebounceBackend, run_id: str, into: list[Registration]
                ) -> None:
                    into.append(await backend.register("wf", "k", run_id=run_id, **kw))

                async def cancel(into: list[bool]) -> None:
                    into.append(await canceller.cancel("wf", "k"))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel, cancelled)
                    for i, backend in enumerate(pingers):
                        nursery.start_soon(ping, backend, f"new{round_}.{i}", results)
                assert cancelled == [True]
                into_old = [r for r in results if r.run_id == old.run_id]
                into_new = [r for r in results if r.run_id != old.run_id]
                assert sorted(r.ping_count for r in into_old) == list(range(2, 2 + len(into_old)))
                if into_new:
                    assert len({r.run_id for r in into_new}) == 1
                    assert [r.outcome for r in into_new].count(Registered.OPENED) == 1
                    assert sorted(r.ping_count for r in into_new) == list(
                        range(1, 1 + len(into_new))
                    )
                    assert await canceller.cancel("wf", "k")
                else:
                    assert not await canceller.cancel("wf", "k")


async def test_fencing_tokens_increase_across_a_bucket_recreation(nats_server: NatsServer) -> None:
    fires = Fires()
    cfg = config(nats_server)
    with trio.fail_after(30):
        for round_ in range(2):
            async with processes(cfg, fires, "A") as (a,):
                for i in range(3 - 2 * round_):  # fewer writes the second time
                    await a.debounce("wf", f"k{i}", round_, delay=0.05)
                await a.wait_idle()
            # Re-create the bucket from scratch: revisions start again at 1.
            nats_server.stop()
            shutil.rmtree(nats_server.store_dir)
            await trio.sleep(0.01)
            nats_server.start()
    tokens = [(f.payload, f.fencing_token) for _, f in fires.log if f.key == "k0"]
    assert [payload for payload, _ in tokens] == [0, 1]
    (_, old), (_, new) = tokens
    assert new > old
    assert new & ((1 << 40) - 1) <= old & ((1 << 40) - 1)  # revisions alone did not grow


@pytest.mark.parametrize(
    ("pinger", "on_backend_error"),
    [("peer", "raise"), ("peer", "fail-open"), ("owner", "raise")],
)
async def test_a_ping_while_the_server_is_stopped_is_never_merged_unstored(
    nats_server: NatsServer, pinger: str, on_backend_error: Any
) -> None:
    # nats-server stopped (SIGSTOP) past two op_timeouts while a window comes due: a
    # ping made then finds no fire it can promise (the due time has passed unread), so
    # it raises or fails open, never coalesces with stored=False.
    fires = Fires()
    cfg = config(nats_server)
    with trio.fail_after(40):
        async with processes(cfg, fires, "AB", on_backend_error=on_backend_error) as (a, b):
            c = a if pinger == "owner" else b
            await a.debounce("wf", "k", "a", delay=1.5)
            assert (await b.debounce("wf", "k", "b", delay=1.5)).stored
            await trio.sleep(0.7)
            await trio.to_thread.run_sync(nats_server.pause)
            try:
                if on_backend_error == "raise":
                    with pytest.raises(BackendUnavailableError):
                        await c.debounce("wf", "k", "late", delay=1.5)
                else:
                    r = await c.debounce("wf", "k", "late", delay=1.5)
                    assert r.stored, r  # failed open, not merged unstored
                    assert c.statistics().fail_open_windows == 1
                assert c.statistics().unstored_pings == 0
                await trio.sleep(2.0)
            finally:
                await trio.to_thread.run_sync(nats_server.resume)
            # Leaving the blocks waits for every pending fire (on_exit="wait").
    shared = [f for p, f in fires.log if p == "A"]
    assert len(shared) == 1  # the burst fired once, by its owner, after the stall
    # A stopped server still receives what was sent: the ping's write may have landed.
    assert shared[0].payload in ("b", "late")
    if on_backend_error == "fail-open":
        name = "A" if pinger == "owner" else "B"
        assert [f.payload for p, f in fires.log if p == name].count("late") >= 1


async def test_a_window_deleted_with_a_kv_delete_counts_as_a_cancel(
    nats_server: NatsServer,
) -> None:
    # An operator deletes an open window's key on the real server (a JetStream KV
    # delete marker): its owner's finalize counts it as a cancel, once, and fires
    # nothing.
    fires = Fires()
    cfg = config(nats_server)
    with trio.fail_after(20):
        async with processes(cfg, fires, "A") as (a,), open_nats_store(cfg) as operator:
            await a.debounce("wf", "k", "a", delay=1.0)
            kv_key = window_key("wf", "k")
            entry = await operator.get(kv_key)
            assert entry is not None
            await operator.delete(kv_key, last=entry.revision)
            await a.wait_idle()
            stats = a.statistics()
    assert fires.log == []
    assert (stats.cancelled, stats.deleted_externally) == (1, 1)


@pytest.mark.realtime
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_a_handoff_exit_that_waits_for_a_handler_lets_a_peer_fire_on_time(
    nats_server: NatsServer, delivery: Any
) -> None:
    # A leaves by a hand-off while a handler of its own takes 4 s: its lease is marked
    # draining at once, so B adopts A's open window at its next heartbeat and fires it
    # on time, while A still waits.
    fires = Fires()
    cfg = config(nats_server)
    when: dict[str, float] = {}

    async def a_handler(fire: Any) -> None:
        fires.log.append(("A", fire))
        if fire.key == "j":
            await trio.sleep(3.0)

    async def watch(t0: float) -> None:
        await fires.wait_for(2)
        when["k"] = trio.current_time() - t0

    with trio.fail_after(20):
        async with processes(cfg, fires, "B", delivery=delivery), trio.open_nursery() as nursery:
            t0 = trio.current_time()
            nursery.start_soon(watch, t0)
            async with (
                open_nats_backend(cfg, process_id="A") as backend_a,
                open_coordinator(
                    handlers={"wf": a_handler},
                    backend=backend_a,
                    on_exit="handoff",
                    delivery=delivery,
                ) as a,
            ):
                await a.debounce("wf", "j", "busy", delay=0.2)
                await a.debounce("wf", "k", "a", delay=1.2)
                await trio.sleep(0.7)
            when["a_left"] = trio.current_time() - t0
    assert [(p, f.key) for p, f in fires.log] == [("A", "j"), ("B", "k")]
    assert when["a_left"] >= 3.0  # A waited for its handler
    assert fires.log[1][1].attempt == 1
    # B fired it at about its due time (1.2 s after the ping), while A still waited:
    # within a heartbeat interval (lease / 3) and scheduling margin
    assert when["k"] < 1.2 + LEASE / 3 + 0.5, when
