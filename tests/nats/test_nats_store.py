"""NatsKvStore against a real nats-server (real clock), plus the error mapping."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
import trio
from nats.aio.transport import TcpTransport

from tests.harness.nats_server import (
    OP_TIMEOUT,
    NatsServer,
    NatsServerFactory,
    free_port,
    store_config,
)
from trio_debounce._errors import (
    BackendAuthError,
    BackendConfigError,
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
    RevisionConflict,
)
from trio_debounce._kv import KvEntry
from trio_debounce.nats import NatsConfig
from trio_debounce.nats._bridge import cross
from trio_debounce.nats._store import NatsKvStore, _map_error, _State, open_nats_store

pytestmark = pytest.mark.slow


@asynccontextmanager
async def store_on(server: NatsServer, **kwargs: object) -> AsyncIterator[NatsKvStore]:
    async with open_nats_store(store_config(server, **kwargs)) as store:
        yield store


async def _get_once_reconnected(store: NatsKvStore, key: str) -> KvEntry | None:
    """``store.get(key)``, retried every 0.1 s while the store is unavailable (the
    client reconnects on its own, every second at most)."""
    while True:
        try:
            return await store.get(key)
        except BackendUnavailableError:
            await trio.sleep(0.1)


async def test_round_trip_with_revisions(nats_server: NatsServer) -> None:
    with trio.fail_after(5):
        async with store_on(nats_server) as store:
            assert await store.get("w.a") is None
            r1 = await store.put("w.a", b"one", last=0)
            assert r1 > 0
            entry = await store.get("w.a")
            assert entry is not None
            assert (entry.key, entry.value, entry.revision) == ("w.a", b"one", r1)
            r2 = await store.put("w.a", b"two", last=r1)
            assert r2 > r1
            r3 = await store.delete("w.a", last=r2)
            assert r3 > r2
            marker = await store.get("w.a")
            assert marker is not None
            assert (marker.value, marker.revision) == (None, r3)
            r4 = await store.put("w.a", b"", last=r3)  # a create on the marker
            entry = await store.get("w.a")
            assert entry is not None
            assert (entry.value, entry.revision) == (b"", r4)


async def test_a_leader_read_sees_what_a_get_sees(nats_server: NatsServer) -> None:
    # get_current reads through the stream leader (STREAM.MSG.GET), get through a
    # direct get: the same entries, values, markers and absences.
    with trio.fail_after(5):
        async with store_on(nats_server) as store:
            assert await store.get_current("w.c") is None
            r1 = await store.put("w.c", b"one", last=0)
            await store.put("w.other", b"x", last=0)
            assert await store.get_current("w.c") == KvEntry("w.c", b"one", r1)
            r2 = await store.put("w.c", b"", last=r1)
            assert await store.get_current("w.c") == KvEntry("w.c", b"", r2)
            r3 = await store.delete("w.c", last=r2)
            assert await store.get_current("w.c") == KvEntry("w.c", None, r3)
            assert await store.get("w.c") == await store.get_current("w.c")
            assert await store.purge_marker("w.c", revision=r3)
            assert await store.get_current("w.c") is None
            with pytest.raises(ValueError, match="not a valid KV key"):
                await store.get_current("w.*")


async def test_compare_and_swap_conflicts(nats_server: NatsServer) -> None:
    with trio.fail_after(5):
        async with store_on(nats_server) as store:
            r1 = await store.put("w.k", b"v", last=0)
            with pytest.raises(RevisionConflict):
                await store.put("w.k", b"again", last=0)
            with pytest.raises(RevisionConflict):
                await store.put("w.k", b"stale", last=r1 + 100)
            with pytest.raises(RevisionConflict):
                await store.delete("w.k", last=r1 + 100)
            marker = await store.delete("w.k", last=r1)
            # last=0 means "no entry at all": a delete marker is an entry
            with pytest.raises(RevisionConflict) as info:
                await store.put("w.k", b"create", last=0)
            assert isinstance(info.value.__cause__, nats.js.errors.APIError)
            with pytest.raises(RevisionConflict):
                await store.put("w.k", b"old", last=r1)
            r3 = await store.put("w.k", b"create", last=marker)
            entry = await store.get("w.k")
            assert entry is not None
            assert (entry.value, entry.revision) == (b"create", r3)


async def test_purge_marker_is_revision_checked(nats_server: NatsServer) -> None:
    with trio.fail_after(5):
        async with store_on(nats_server) as store:
            r1 = await store.put("w.p", b"v", last=0)
            marker = await store.delete("w.p", last=r1)
            assert await store.purge_marker("w.p", revision=marker) is True
            assert await store.get("w.p") is None
            assert await store.purge_marker("w.p", revision=marker) is False
            # after a purge the key has no entry: last=0 creates it
            r2 = await store.put("w.p", b"again", last=0)

            # a scan sees a marker; another writer re-creates the key before the purge
            marker = await store.delete("w.p", last=r2)
            scanned = await store.entries("w.")
            assert [(e.key, e.value, e.revision) for e in scanned] == [("w.p", None, marker)]
            newer = await store.put("w.p", b"newer", last=marker)
            assert await store.purge_marker("w.p", revision=marker) is False
            entry = await store.get("w.p")
            assert entry is not None
            assert (entry.value, entry.revision) == (b"newer", newer)


async def test_purge_is_revision_checked_and_leaves_no_marker(nats_server: NatsServer) -> None:
    # Fire records are removed by a purge: their ids are never reused, so delete
    # markers would only pile up in the bucket (the soak's bucket grew with them).
    with trio.fail_after(5):
        async with store_on(nats_server) as store:
            r1 = await store.put("f.a", b"record", last=0)
            r2 = await store.put("f.a", b"adopted", last=r1)
            assert await store.purge("f.a", last=r1) is False  # moved on: untouched
            entry = await store.get("f.a")
            assert entry is not None
            assert (entry.value, entry.revision) == (b"adopted", r2)
            assert await store.purge("f.a", last=r2) is True
            assert await store.get("f.a") is None  # no marker
            assert await store.entries("f.") == []
            assert await store.purge("f.a", last=r2) is False  # gone
            with pytest.raises(ValueError, match="last must be > 0"):
                await store.purge("f.a", last=0)


async def test_entries_under_a_prefix_include_markers(nats_server: NatsServer) -> None:
    with trio.fail_after(5):
        async with store_on(nats_server) as store:
            assert await store.entries("w.") == []
            ra = await store.put("w.x.a", b"a", last=0)
            rb = await store.put("w.x.b", b"b", last=0)
            rb = await store.put("w.x.b", b"b2", last=rb)
            rc = await store.delete("w.x.c", last=0)
            await store.put("w.xy.d", b"other prefix", last=0)
            await store.put("p.e", b"other kind", last=0)
            found = {(e.key, e.value, e.revision) for e in await store.entries("w.x.")}
            assert found == {("w.x.a", b"a", ra), ("w.x.b", b"b2", rb), ("w.x.c", None, rc)}
            assert len(await store.entries("w.")) == 4
            with pytest.raises(ValueError, match="end with"):
                await store.entries("w")


async def test_oversize_put_is_refused_before_sending(nats_server: NatsServer) -> None:
    with trio.fail_after(5):
        async with store_on(nats_server) as store:
            limit = store.max_value_bytes
            assert 0 < limit < 1024 * 1024
            with pytest.raises(DocumentTooLargeError):
                await store.put("w.big", b"x" * (limit + 1), last=0)
            # the largest accepted value really fits, and the connection is intact
            revision = await store.put("w.big", b"x" * limit, last=0)
            entry = await store.get("w.big")
            assert entry is not None
            assert (len(entry.value or b""), entry.revision) == (limit, revision)


@pytest.mark.realtime
async def test_no_server_is_unavailable_after_connect_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = NatsConfig(servers=(f"nats://127.0.0.1:{free_port()}",), connect_timeout=1.0)
    with trio.fail_after(5):
        start = trio.current_time()
        with pytest.raises(BackendUnavailableError, match=r"within 1\.0 s"):
            async with open_nats_store(config):
                pytest.fail("connected to nothing")  # pragma: no cover
        elapsed = trio.current_time() - start
    assert 0.9 <= elapsed < 4.0
    warnings = [r for r in caplog.records if r.name == "trio_debounce.nats"]
    assert warnings, "connection errors are logged"
    assert all(r.exc_info is None for r in warnings)
    assert len({r.getMessage() for r in warnings}) == len(warnings), "deduplicated"


@pytest.mark.realtime
async def test_refused_token_fails_at_once(
    nats_server_factory: NatsServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = nats_server_factory(token="right-t0ken")
    with trio.fail_after(8):
        start = trio.current_time()
        with pytest.raises(BackendAuthError) as info:
            async with store_on(server, token="wr0ng-t0ken", connect_timeout=10.0):
                pytest.fail("connected with a wrong token")  # pragma: no cover
        assert trio.current_time() - start < 5.0
        async with store_on(server, token="right-t0ken") as store:
            await store.put("w.t", b"ok", last=0)
    assert "t0ken" not in str(info.value)
    assert "t0ken" not in caplog.text


@pytest.mark.realtime
async def test_paused_server_times_out_and_cancel_crosses_the_bridge(
    nats_server: NatsServer,
) -> None:
    with trio.fail_after(10):
        async with store_on(nats_server) as store:
            await store.put("w.s", b"v", last=0)
            nats_server.pause()
            try:
                start = trio.current_time()
                with pytest.raises(BackendUnavailableError, match="may have been applied"):
                    await store.get("w.s")
                assert trio.current_time() - start < OP_TIMEOUT + 1.0
                # a Trio cancel of a call in flight cancels the asyncio side at once
                start = trio.current_time()
                with trio.move_on_after(0.1) as scope:
                    await store.get("w.s")
                assert scope.cancelled_caught
                assert trio.current_time() - start < 0.5
                assert store._nc._resp_map == {}, "the asyncio request future is gone"
            finally:
                nats_server.resume()
            entry = await store.get("w.s")
            assert entry is not None
            assert entry.value == b"v"


@pytest.mark.realtime
async def test_exit_is_bounded_while_the_server_is_paused(nats_server: NatsServer) -> None:
    with trio.fail_after(10):
        async with store_on(nats_server) as store:
            await store.put("w.s", b"v", last=0)
            nats_server.pause()
            start = trio.current_time()
        assert trio.current_time() - start < 2 * OP_TIMEOUT + 1.5
        nats_server.resume()


@pytest.mark.realtime
async def test_stopped_server_fails_fast_and_recovers(nats_server: NatsServer) -> None:
    with trio.fail_after(15):
        async with store_on(nats_server) as store:
            r1 = await store.put("w.r", b"before", last=0)
            nats_server.stop()
            await trio.sleep(0.2)  # let the client read the EOF
            start = trio.current_time()
            with pytest.raises(BackendUnavailableError):
                await store.get("w.r")
            with pytest.raises(BackendUnavailableError):
                await store.put("w.r", b"while down", last=r1)
            with pytest.raises(BackendUnavailableError):
                await store.put("w.down", b"while down", last=0)
            assert trio.current_time() - start < 3 * OP_TIMEOUT

            nats_server.restart()
            entry = await _get_once_reconnected(store, "w.r")
            assert entry is not None
            assert (entry.value, entry.revision) == (b"before", r1)
            await trio.sleep(0.3)
            # the writes attempted while down were not queued and sent later
            assert await store.get("w.down") is None
            assert await store.put("w.r", b"after", last=r1) > r1


async def _make_bucket(server: NatsServer, bucket: str, **kwargs: object) -> None:
    """Create a bucket with raw nats-py on a stdlib loop in a worker thread (no
    trio-asyncio: it does not import on every supported Python)."""

    async def make() -> None:
        nc = await nats.connect(server.url)
        try:
            await nc.jetstream().create_key_value(bucket=bucket, **kwargs)  # type: ignore[arg-type]
        finally:
            await nc.close()

    await trio.to_thread.run_sync(asyncio.run, make())


async def test_bucket_with_history_or_ttl_is_refused(nats_server: NatsServer) -> None:
    with trio.fail_after(10):
        await _make_bucket(nats_server, "hist", history=5)
        with pytest.raises(BackendConfigError, match="history 5"):
            async with store_on(nats_server, bucket="hist"):
                pytest.fail("bound a bucket with history")  # pragma: no cover
        await _make_bucket(nats_server, "ttl", ttl=60.0)
        with pytest.raises(BackendConfigError, match="TTL"):
            async with store_on(nats_server, bucket="ttl", create_bucket=False):
                pytest.fail("bound a bucket with a TTL")  # pragma: no cover


async def test_bind_only(nats_server: NatsServer) -> None:
    with trio.fail_after(10):
        with pytest.raises(BackendConfigError, match="does not exist"):
            async with store_on(nats_server, bucket="absent", create_bucket=False):
                pytest.fail("bound a missing bucket")  # pragma: no cover
        await _make_bucket(nats_server, "ready", history=1)
        async with store_on(nats_server, bucket="ready", create_bucket=False) as store:
            await store.put("w.b", b"v", last=0)


async def test_a_bucket_the_server_cannot_create_is_a_config_error(
    nats_server: NatsServer,
) -> None:
    # Three replicas on a server that is not clustered: refused for good, at once.
    with trio.fail_after(5), pytest.raises(BackendConfigError, match="3 replica") as info:
        async with store_on(nats_server, bucket="r3", replicas=3):
            pytest.fail("created a bucket of three replicas on one server")  # pragma: no cover
    assert "non-clustered" in str(info.value)


@pytest.mark.parametrize(
    "exc",
    [
        nats.js.errors.KeyWrongLastSequenceError(description="wrong last sequence: 3"),
        nats.js.errors.BadRequestError(
            code=400, err_code=10071, description="wrong last sequence: 3"
        ),
        nats.js.errors.APIError(code=400, err_code=10164, description="wrong last sequence"),
    ],
)
def test_conflicts_map_to_revision_conflict(exc: Exception) -> None:
    assert type(_map_error(exc, "put")) is RevisionConflict


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (nats.errors.NoServersError(), BackendUnavailableError),
        (nats.errors.ConnectionClosedError(), BackendUnavailableError),
        (nats.errors.TimeoutError(), BackendUnavailableError),
        (TimeoutError(), BackendUnavailableError),
        (nats.errors.OutboundBufferLimitError(), BackendUnavailableError),
        (nats.errors.StaleConnectionError(), BackendUnavailableError),
        (nats.errors.NoRespondersError(), BackendUnavailableError),
        (nats.js.errors.ServiceUnavailableError(code=503), BackendUnavailableError),
        (nats.errors.AuthorizationError(), BackendAuthError),
        (nats.errors.Error("nats: 'Authorization Violation'"), BackendAuthError),
        (
            nats.errors.Error('nats: permissions violation for publish to "$KV.b.k"'),
            BackendAuthError,
        ),
        (nats.js.errors.ServerError(code=500, description="boom"), BackendError),
        (nats.errors.Error("nats: something else"), BackendError),
    ],
)
def test_other_errors_map_by_kind(exc: Exception, expected: type[BackendError]) -> None:
    assert type(_map_error(exc, "get")) is expected


def test_mapped_messages_hide_secrets() -> None:
    state = _State(secrets=("s3cret",))
    exc = nats.errors.Error("nats: bad token s3cret for nats://u:pw@host:4222")
    message = str(_map_error(exc, "connect", state))
    assert "s3cret" not in message
    assert "pw@" not in message


def test_logged_connection_errors_are_deduplicated(caplog: pytest.LogCaptureFixture) -> None:
    state = _State(secrets=("s3cret",))
    caplog.set_level(logging.DEBUG, logger="trio_debounce.nats")

    async def main() -> None:
        for _ in range(3):
            await state.error_cb(OSError("connect call failed s3cret"))

    trio.run(main)
    records = [r for r in caplog.records if r.name == "trio_debounce.nats"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert records[0].exc_info is None
    assert "s3cret" not in records[0].getMessage()


async def test_each_reconnect_attempt_to_a_stopped_server_closes_the_last_ones_socket(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stopped (SIGSTOP) server's kernel still accepts connections, so each reconnect
    # attempt connects and then times out waiting for the server's INFO. nats-py keeps
    # one TcpTransport across attempts, and left each such attempt's stream open when
    # the next one replaced it (a socket per attempt, and a ResourceWarning when
    # collected): every attempt must find the last one's stream closed.
    found: list[bool] = []
    connect = TcpTransport.connect

    async def spy(self: TcpTransport, *args: Any, **kwargs: Any) -> None:
        writer = self._io_writer
        found.append(writer is None or writer.transport.is_closing())
        await connect(self, *args, **kwargs)

    monkeypatch.setattr(TcpTransport, "connect", spy)
    with trio.fail_after(20):
        async with store_on(nats_server, ping_interval=0.3, connect_timeout=0.3) as store:
            await store.put("w.a", b"one", last=0)
            await trio.to_thread.run_sync(nats_server.pause)
            try:
                # Stale after two unanswered pings; then an attempt every ~1.3 s.
                await trio.sleep(4.5)
            finally:
                await trio.to_thread.run_sync(nats_server.resume)
            entry = await _get_once_reconnected(store, "w.a")
            assert entry is not None
            assert entry.value == b"one"
    assert len(found) >= 3, found  # the first connect and at least two attempts
    assert all(found), found


async def test_a_socket_left_open_on_the_stores_loop_is_closed_with_the_store(
    nats_server: NatsServer,
) -> None:
    # Whatever connection nats-py lost track of (a replaced attempt, or one a
    # cancelled asyncio.wait_for left behind on Python 3.11) is closed when the store
    # closes, not collected after its loop has closed (a ResourceWarning in a later
    # test, seen in CI).
    url = urllib.parse.urlsplit(nats_server.url)
    host, port = url.hostname, url.port
    with trio.fail_after(10):
        async with store_on(nats_server) as store:
            _, writer = await cross(store._host, asyncio.open_connection, host, port)
            assert not writer.transport.is_closing()
    assert writer.transport.is_closing()
    assert writer.transport.get_extra_info("socket").fileno() == -1  # closed
