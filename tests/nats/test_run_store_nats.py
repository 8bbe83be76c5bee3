"""NatsKvRunStore against a real nats-server (real clock): conformance, the index fed
by a KV watch, a server restart, and the payload limit."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import pytest
import trio

from tests.harness.nats_server import OP_TIMEOUT, NatsServer, store_config
from tests.runs.draining import check_peers_run_a_draining_process_runs
from trio_debounce import BackendUnavailableError, DocumentTooLargeError
from trio_debounce._keys import run_key
from trio_debounce._runs._kv_store import DOCUMENT_ALLOWANCE, encode_run
from trio_debounce.abc import Lease, RunState, StoredRun
from trio_debounce.nats import NatsConfig, NatsKvRunStore, _bridge, open_nats_run_store
from trio_debounce.nats._store import HEADROOM
from trio_debounce.testing import check_run_store

pytestmark = pytest.mark.slow

#: Seconds within which another connection's write must show in the index.
FOLLOW_BOUND = 2.0

T = TypeVar("T")


@asynccontextmanager
async def two_stores(server: NatsServer) -> AsyncIterator[tuple[NatsKvRunStore, NatsKvRunStore]]:
    """Two stores on the same bucket, each with its own connection (and loop)."""
    async with AsyncExitStack() as stack:
        one = await stack.enter_async_context(open_nats_run_store(store_config(server)))
        two = await stack.enter_async_context(open_nats_run_store(store_config(server)))
        yield one, two


def count_calls(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list[int]:
    """Count the calls of the async method ``obj.name`` (the count is ``len(...)``)."""
    calls: list[int] = []
    original = getattr(obj, name)

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return await original(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


async def eventually(check: Callable[[], Awaitable[T]], bound: float) -> tuple[T, float]:
    """Poll ``check`` until it returns a true value; the value and the seconds it took."""
    start = trio.current_time()
    with trio.fail_after(bound):
        while True:
            value = await check()
            if value:
                return value, trio.current_time() - start
            await trio.sleep(0.02)


def a_run(run_id: str, at: float = 100.0, **changes: object) -> StoredRun:
    return StoredRun(run_id, "wf", '{"n": 1}', at, created_at=1.0).replace(**changes)


async def consumer_count(store: NatsKvRunStore) -> int:
    nats = store._nats
    info = await nats._call("stream info", nats._kv._js.stream_info, nats._stream)
    count: int = info.state.consumer_count
    return count


async def test_conforms_across_two_connections(nats_server: NatsServer) -> None:
    with trio.fail_after(20):
        async with two_stores(nats_server) as (one, two):
            await check_run_store(one, other=two)
            await check_run_store(one)


@pytest.mark.realtime
async def test_index_follows_another_connection_without_listing(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(15):
        async with two_stores(nats_server) as (reader, writer):
            listings = count_calls(monkeypatch, reader._nats, "entries")
            consumers = await consumer_count(reader)

            async def listed(run_id: str) -> list[StoredRun]:
                return [r for r in await reader.list_runs() if r.run_id == run_id]

            made = await writer.create_run(a_run("x"))
            assert made is not None
            found, took = await eventually(lambda: listed("x"), FOLLOW_BOUND)
            assert found == [made]

            claimed = await writer.update_run(made.replace(owner="p", token=1))
            assert claimed is not None
            await eventually(
                lambda: _equal(listed("x"), [claimed]), FOLLOW_BOUND
            )  # a later revision replaces it

            lease = await writer.put_lease(Lease("proc", 1, 500.0))
            assert lease is not None
            await eventually(lambda: _equal(reader.list_leases(), [lease]), FOLLOW_BOUND)

            assert await writer.delete_run("x", revision=claimed.revision)
            assert await writer.delete_lease("proc", revision=lease.revision)
            await eventually(lambda: _equal(listed("x"), []), FOLLOW_BOUND)
            await eventually(lambda: _equal(reader.list_leases(), []), FOLLOW_BOUND)

            # read your writes: the store's own writes are listed at once
            own = await reader.create_run(a_run("own", state=RunState.PENDING))
            assert own is not None
            assert await reader.list_runs(workflow="wf") == [own]
            assert await reader.delete_run("own", revision=own.revision)
            assert await reader.list_runs() == []

            for _ in range(50):
                await reader.list_runs(states={RunState.PENDING}, limit=5)
                await reader.list_leases()
            assert listings == [], "no list call reads the bucket"
            assert await consumer_count(reader) == consumers, "no consumer per list"
            assert reader.statistics().rebuilds == 2
    assert took < FOLLOW_BOUND


async def _equal(got: Awaitable[T], expected: T) -> bool:
    return await got == expected


@pytest.mark.realtime
async def test_server_restart_fails_fast_then_the_index_converges(
    nats_server: NatsServer,
) -> None:
    with trio.fail_after(25):
        async with two_stores(nats_server) as (reader, writer):
            before = await writer.create_run(a_run("before"))
            assert before is not None
            await eventually(lambda: reader.list_runs(), FOLLOW_BOUND)

            nats_server.stop()
            await trio.sleep(0.2)  # let the clients read the EOF
            for call in (
                lambda: reader.list_runs(),
                lambda: reader.list_leases(),
                lambda: reader.get_run("before"),
                lambda: reader.create_run(a_run("while down")),
                lambda: writer.update_run(before.replace(owner="p")),
            ):
                start = trio.current_time()
                with pytest.raises(BackendUnavailableError):
                    await call()
                assert trio.current_time() - start < OP_TIMEOUT + 0.5
            assert not reader.statistics().in_sync

            nats_server.restart()

            # writes by another connection after the restart show up in the index
            async def write_after() -> StoredRun | None:
                try:
                    return await writer.create_run(a_run("after", at=200.0))
                except BackendUnavailableError:
                    return None

            after, _ = await eventually(write_after, 10.0)
            assert after is not None

            async def both_listed() -> bool:
                try:
                    runs = await reader.list_runs()
                except BackendUnavailableError:
                    return False
                return [r.run_id for r in runs] == ["before", "after"]

            _, took = await eventually(both_listed, 10.0)
            # the lease index is rebuilt too (maybe a moment later)
            await eventually(lambda: _true(reader.statistics().in_sync), 5.0)
            assert reader.statistics().rebuilds >= 4, "both indexes were rebuilt"
            assert await reader.list_leases() == []
            assert await reader.list_runs(due_before=150.0) == [before]
            # and the index follows again
            assert await writer.delete_run("after", revision=after.revision)
            await eventually(lambda: _equal(reader.list_runs(), [before]), FOLLOW_BOUND)
    assert took < 10.0


@pytest.mark.realtime
async def test_oversized_run_is_refused_before_sending(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(10):
        async with two_stores(nats_server) as (store, peer):
            nats = store._nats
            assert nats.max_value_bytes == nats._nc.max_payload - HEADROOM
            assert store.max_payload_bytes == nats.max_value_bytes - DOCUMENT_ALLOWANCE
            puts = count_calls(monkeypatch, nats, "put")
            big = a_run("big one", payload='"' + "x" * nats.max_value_bytes + '"')
            with pytest.raises(DocumentTooLargeError, match="'big one'"):
                await store.create_run(big)
            assert puts == []
            assert await store.get_run("big one") is None

            # the largest payload fits, and another connection's watch delivers it
            payload = '"' + "x" * (store.max_payload_bytes - 2) + '"'
            largest = await store.create_run(a_run("largest", payload=payload))
            assert largest is not None
            assert len(encode_run(largest)) <= nats.max_value_bytes
            found, _ = await eventually(peer.list_runs, FOLLOW_BOUND)
            assert found == [largest]


async def test_a_lost_cas_repairs_a_stale_index_entry(nats_server: NatsServer) -> None:
    with trio.fail_after(10):
        async with open_nats_run_store(store_config(nats_server)) as store:
            # a record whose delete the watch never saw (its marker purged first)
            ghost = a_run("ghost").replace(revision=10_000)
            store._runs.apply(run_key("ghost"), ghost.revision, encode_run(ghost))
            assert await store.list_runs() == [ghost]
            assert await store.update_run(ghost.replace(owner="p")) is None
            assert await store.list_runs() == []
            # a record the index holds at an old revision is refreshed the same way
            made = await store.create_run(a_run("real"))
            assert made is not None
            newer = await store._kv.put(run_key("real"), encode_run(made), last=made.revision)
            store._runs.slots[run_key("real")].revision = made.revision  # as if lagging
            assert not await store.delete_run("real", revision=made.revision)
            assert [r.revision for r in await store.list_runs()] == [newer]


@pytest.mark.realtime
async def test_a_dead_watch_is_logged_and_restarted(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(10):
        async with two_stores(nats_server) as (reader, writer):
            watch = reader._runs.watch
            assert watch is not None
            # Stop the watcher on nats-py's own loop, whichever host runs it.
            await _bridge.cross(watch._host, watch._watcher.stop)
            await eventually(lambda: _true(reader.statistics().rebuilds == 3), 5.0)
            assert any(
                r.levelno == logging.WARNING and "watch of 'r.' keys failed" in r.getMessage()
                for r in caplog.records
            )
            made = await writer.create_run(a_run("later"))
            await eventually(lambda: _equal(reader.list_runs(), [made]), FOLLOW_BOUND)


async def _true(value: bool) -> bool:
    return value


@pytest.mark.realtime
async def test_periodic_resync_keeps_serving(nats_server: NatsServer) -> None:
    with trio.fail_after(10):
        async with (
            open_nats_run_store(store_config(nats_server), resync_interval=0.2) as store,
            open_nats_run_store(store_config(nats_server)) as writer,
        ):
            made = await writer.create_run(a_run("kept"))
            assert made is not None
            start = trio.current_time()
            while trio.current_time() - start < 1.5:
                # never BackendUnavailableError: the old index answers during a resync
                if await store.list_runs() == [made]:
                    break
                await trio.sleep(0.01)
            rebuilds = store.statistics().rebuilds
            while store.statistics().rebuilds < rebuilds + 6:
                assert await store.list_runs() == [made]
                await trio.sleep(0.01)
            later = await writer.create_run(a_run("later", at=200.0))
            await eventually(lambda: _equal(store.list_runs(), [made, later]), FOLLOW_BOUND)


async def test_closed_store_refuses_calls(nats_server: NatsServer) -> None:
    with trio.fail_after(10):
        async with open_nats_run_store(store_config(nats_server)) as store:
            await store.aclose()
            await store.aclose()
            with pytest.raises(trio.ClosedResourceError):
                await store.list_runs()
        with pytest.raises(trio.ClosedResourceError):
            await store.get_run("x")
        with pytest.raises(trio.ClosedResourceError):
            await store.list_leases()


async def test_errors_in_the_block_are_not_wrapped(nats_server: NatsServer) -> None:
    with trio.fail_after(10), pytest.raises(KeyError):
        async with open_nats_run_store(store_config(nats_server)):
            raise KeyError("mine")


async def test_no_server_is_unavailable() -> None:
    from tests.harness.nats_server import free_port

    config = NatsConfig(servers=(f"nats://127.0.0.1:{free_port()}",), connect_timeout=0.5)
    with trio.fail_after(5), pytest.raises(BackendUnavailableError):
        async with open_nats_run_store(config):
            pytest.fail("connected to nothing")  # pragma: no cover


@pytest.mark.realtime
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_peers_run_a_draining_processs_runs_on_time(
    nats_server: NatsServer, delivery: Any
) -> None:
    config = store_config(nats_server, bucket="drain" + delivery.replace("-", ""))
    await check_peers_run_a_draining_process_runs(lambda: open_nats_run_store(config), delivery)
