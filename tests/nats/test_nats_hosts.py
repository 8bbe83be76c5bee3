"""The asyncio hosts of the NATS backend (``NatsConfig.asyncio_host``), each against a
real nats-server: the backend and run-store conformance suites on each host, the
bridge's cancellation contract, the thread host's thread and callbacks, the choice of
host, and its configuration."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from tests import AUTO_HOST_ENV
from tests.harness.env import in_other_ci_steps
from tests.harness.nats_server import NatsServer, free_port
from tests.harness.tcp_proxy import open_tcp_proxy
from trio_debounce import BackendConfigError, BackendUnavailableError
from trio_debounce.abc import DebounceBackend
from trio_debounce.nats import (
    NatsConfig,
    _bridge,
    _host_thread,
    _host_trio_asyncio,
    open_nats_backend,
    open_nats_run_store,
)
from trio_debounce.nats._store import NatsKvStore, open_nats_store
from trio_debounce.testing import check_debounce_backend, check_run_store

pytestmark = pytest.mark.slow

LEASE = 1.5
SKEW = 0.25
OP_TIMEOUT = 0.5


def _trio_asyncio_imports() -> bool:
    try:
        _host_trio_asyncio.import_trio_asyncio()
    except ImportError:
        return False
    return True


HOSTS = [
    "thread",
    pytest.param(
        "trio-asyncio",
        marks=[
            pytest.mark.skipif(not _trio_asyncio_imports(), reason="trio-asyncio does not import"),
            # The trio-asyncio step runs them anyway (README "Python versions and CI").
            in_other_ci_steps,
        ],
    ),
]


def config(server: NatsServer | None, host: str, **kwargs: Any) -> NatsConfig:
    kwargs.setdefault("bucket", "h" + uuid.uuid4().hex[:12])
    kwargs.setdefault("process_lease", LEASE)
    kwargs.setdefault("max_clock_skew", SKEW)
    kwargs.setdefault("op_timeout", OP_TIMEOUT)
    kwargs.setdefault("connect_timeout", 3.0)
    kwargs.setdefault("ping_interval", 1.0)
    url = f"nats://127.0.0.1:{free_port()}" if server is None else server.url
    kwargs.setdefault("servers", (url,))
    return NatsConfig(asyncio_host=host, **kwargs)


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == _host_thread.THREAD_NAME]


# ------------------------------------------------------------------ conformance


@pytest.mark.parametrize("host", HOSTS)
async def test_backend_conformance_on_each_host(nats_server: NatsServer, host: str) -> None:
    # The default op_timeout: the suite checks the protocol's answers, not its
    # latency (the realtime tests bound that), and a storm of 10 pings from 5
    # processes on a loaded machine can take longer than the fault tests' 0.5 s.
    cfg = config(nats_server, host, op_timeout=NatsConfig.op_timeout)
    opened = itertools.count()

    @asynccontextmanager
    async def open_backends(n: int) -> AsyncIterator[Sequence[DebounceBackend]]:
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


@pytest.mark.parametrize("host", HOSTS)
async def test_run_store_conformance_on_each_host(nats_server: NatsServer, host: str) -> None:
    cfg = config(nats_server, host)
    with trio.fail_after(30):
        async with open_nats_run_store(cfg) as one, open_nats_run_store(cfg) as two:
            await check_run_store(one, other=two)
            await check_run_store(one)


@pytest.mark.parametrize("host", HOSTS)
async def test_store_calls_and_watch_batches_cross(nats_server: NatsServer, host: str) -> None:
    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, host)) as store:
            assert store._host.name == host
            async with store.open_watch("w.") as watch:
                assert await watch.receive_batch() == [None]  # no initial values
                r1 = await store.put("w.a", b"1", last=0)
                r2 = await store.delete("w.a", last=r1)
                got: list[Any] = []
                while len(got) < 2:
                    got += await watch.receive_batch()
                assert [(e.key, e.value, e.revision) for e in got] == [
                    ("w.a", b"1", r1),
                    ("w.a", None, r2),
                ]
                # a receive cancelled while waiting loses nothing
                with trio.move_on_after(0.05) as scope:
                    await watch.receive_batch()
                assert scope.cancelled_caught
                r3 = await store.put("w.b", b"2", last=0)
                batch = await watch.receive_batch()
                assert [(e.key, e.revision) for e in batch if e is not None] == [("w.b", r3)]
            entries = await store.entries("w.")
            assert sorted((e.key, e.revision) for e in entries) == [("w.a", r2), ("w.b", r3)]


# ------------------------------------------------------------------ cancellation


@pytest.mark.realtime
@pytest.mark.parametrize("host", HOSTS)
async def test_a_cancelled_call_cancels_the_asyncio_side(
    nats_server: NatsServer, host: str
) -> None:
    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, host)) as store:
            await store.put("w.s", b"v", last=0)
            nats_server.pause()
            try:
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
@pytest.mark.parametrize("host", HOSTS)
async def test_a_swallowed_cancellation_is_repeated_then_abandoned(
    nats_server: NatsServer, host: str
) -> None:
    seen: list[str] = []

    async def swallows_once() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("first cancel swallowed")
        await asyncio.sleep(30)  # the re-cancel ends this
        return "never"

    async def swallows_always() -> str:
        # Past the grace, not forever: trio-asyncio's loop waits for its tasks when the
        # store exits, so this one ends 1 s after the grace (it slept 30 s once the
        # re-cancels stopped, and held the exit that long).
        loop = asyncio.get_running_loop()
        until = loop.time() + _bridge.CANCEL_GRACE + 1.0
        while loop.time() < until:
            try:
                await asyncio.sleep(until - loop.time())
            except asyncio.CancelledError:
                seen.append("swallowed")
        return "abandoned"

    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, host)) as store:
            start = trio.current_time()
            with trio.move_on_after(0.05) as scope:
                await _bridge.cross(store._host, swallows_once)
            assert scope.cancelled_caught
            assert seen == ["first cancel swallowed"]
            assert trio.current_time() - start < 0.05 + 0.5

            start = trio.current_time()
            with trio.move_on_after(0.05) as scope:
                await _bridge.cross(store._host, swallows_always)
            assert scope.cancelled_caught
            took = trio.current_time() - start
            assert 0.05 + _bridge.CANCEL_GRACE - 0.1 < took < 0.05 + _bridge.CANCEL_GRACE + 0.5
            assert seen.count("swallowed") >= 5  # cancelled every 0.05 s in the grace


@pytest.mark.parametrize("host", HOSTS)
async def test_an_error_and_a_result_cross_back(nats_server: NatsServer, host: str) -> None:
    async def fails() -> None:
        raise KeyError("from the loop")

    async def where() -> bool:
        return trio_thread is threading.current_thread()

    trio_thread = threading.current_thread()
    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, host)) as store:
            with pytest.raises(KeyError, match="from the loop"):
                await _bridge.cross(store._host, fails)
            # the thread host runs nats-py in its own thread, trio-asyncio in Trio's
            assert await _bridge.cross(store._host, where) is (host == "trio-asyncio")


@pytest.mark.realtime
@pytest.mark.parametrize("host", HOSTS)
async def test_calls_are_bounded_through_a_stalled_connection(
    nats_server: NatsServer, host: str
) -> None:
    # A call's bound: op_timeout, plus the grace for a call that swallows its
    # cancellation, plus a margin for a loaded machine.
    bound = OP_TIMEOUT + _bridge.CANCEL_GRACE + 1.0
    with trio.fail_after(30):
        async with open_tcp_proxy(nats_server.port) as proxy:
            cfg = config(None, host, servers=(f"nats://127.0.0.1:{proxy.port}",))
            async with open_nats_store(cfg) as store:
                revision = await store.put("w.k", b"v", last=0)
                proxy.stall()
                for call in (store.get("w.k"), store.put("w.k", b"w", last=revision)):
                    began = trio.current_time()
                    with pytest.raises(BackendUnavailableError):
                        await call
                    assert trio.current_time() - began < bound
                proxy.resume()
            for _ in range(500):  # the proxy sees the close before it exits
                if not proxy.open_connections:
                    break
                await trio.sleep(0.01)


# ------------------------------------------------------------------ the thread host


async def test_the_thread_is_joined_when_the_store_closes(nats_server: NatsServer) -> None:
    before = loop_threads()
    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, "thread")) as store:
            assert isinstance(store._host, _host_thread.ThreadHost)
            thread = store._host.thread
            assert thread.is_alive()
            assert loop_threads() == [*before, thread]
            assert isinstance(store._host.loop, asyncio.SelectorEventLoop)
            await store.put("w.t", b"v", last=0)
        assert not thread.is_alive()
        assert store._host.loop.is_closed()
        assert loop_threads() == before
        with pytest.raises(BackendUnavailableError, match="closed"):
            await store.get("w.t")


@pytest.mark.parametrize("how", ["in its cancellation", "in a task it starts"])
async def test_a_connection_opened_while_the_thread_host_stops_is_closed_with_it(
    how: str,
) -> None:
    # A task cancelled by the host's stop connects again, itself or through a task it
    # starts then (as nats-py's reconnect path can): that connection is closed before
    # the loop closes. Left open, it was collected after the loop had closed: an
    # unclosed socket, and "Event loop is closed" from its close (CI's ResourceWarning).
    writers: list[asyncio.StreamWriter] = []
    started = trio.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        async def connect() -> None:
            writers.append((await asyncio.open_connection("127.0.0.1", port))[1])
            await asyncio.sleep(3600)

        async def stubborn(host: _host_thread.ThreadHost) -> None:
            host.to_trio(started.set)
            try:
                await asyncio.sleep(3600)
            finally:
                if how == "in its cancellation":
                    await connect()
                else:
                    tasks.append(asyncio.get_running_loop().create_task(connect()))

        tasks: list[asyncio.Task[None]] = []
        with trio.fail_after(10):
            async with _host_thread.open_thread_host(()) as host:
                host.to_loop(lambda: tasks.append(host.loop.create_task(stubborn(host))))
                await started.wait()
        listener.settimeout(5)
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            assert conn.recv(1) == b""  # the host closed its end, not left it open
    assert writers == [] or writers[0].transport.is_closing()


async def test_the_thread_is_joined_when_the_open_fails() -> None:
    before = loop_threads()
    with trio.fail_after(10):
        with pytest.raises(BackendUnavailableError):
            async with open_nats_store(config(None, "thread", connect_timeout=0.3)):
                pass  # pragma: no cover
        with pytest.raises(BackendConfigError, match="creds_file"):
            async with open_nats_store(config(None, "thread", creds_file="/nonexistent")):
                pass  # pragma: no cover
    assert loop_threads() == before


async def test_the_thread_is_joined_when_the_caller_is_cancelled(
    nats_server: NatsServer,
) -> None:
    before = loop_threads()
    with trio.fail_after(10):
        with trio.move_on_after(0.5):
            async with open_nats_store(config(nats_server, "thread")) as store:
                assert isinstance(store._host, _host_thread.ThreadHost)
                await trio.sleep_forever()
        assert isinstance(store._host, _host_thread.ThreadHost)
        assert not store._host.thread.is_alive()
    assert loop_threads() == before


async def test_connection_callbacks_reach_trio_after_a_restart(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_debounce.nats")
    with trio.fail_after(20):
        async with open_nats_store(config(nats_server, "thread")) as store:
            async with store.open_watch("w.") as watch:
                changed = store._state.connection_changed
                nats_server.stop()
                await changed.wait()  # set by the disconnected callback, on Trio's side
                assert watch.interrupted
                assert not store.is_connected
                changed = store._state.connection_changed
                nats_server.restart()
                await changed.wait()  # the reconnected callback
                await store.wait_connected()
            assert await store.put("w.after", b"v", last=0) > 0
    by_message = {r.getMessage(): r for r in caplog.records if r.name == "trio_debounce.nats"}
    for message in ("disconnected from NATS; reconnecting", "reconnected to NATS"):
        assert message in by_message
        # run on Trio's side (the test's thread), never in the loop's thread
        assert by_message[message].threadName == threading.current_thread().name


async def test_the_thread_host_runs_after_trio_asyncio_was_imported(
    nats_server: NatsServer,
) -> None:
    if not _trio_asyncio_imports():
        pytest.skip("trio-asyncio does not import")
    assert "trio_asyncio" in sys.modules
    # why the thread host builds its loop itself: trio-asyncio refuses this in Trio
    with pytest.raises(RuntimeError, match="Trio"):
        asyncio.new_event_loop()
    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, "thread")) as store:
            assert await store.put("w.x", b"v", last=0) > 0


def test_the_thread_host_never_imports_trio_asyncio(nats_server: NatsServer) -> None:
    code = f"""
import sys, trio
from trio_debounce.nats import NatsConfig
from trio_debounce.nats._store import open_nats_store

async def main():
    config = NatsConfig(servers=({nats_server.url!r},), bucket="imp", asyncio_host="thread")
    async with open_nats_store(config) as store:
        await store.put("w.k", b"v", last=0)
        assert (await store.get("w.k")).value == b"v"
        async with store.open_watch("w.") as watch:
            await watch.receive_batch()

trio.run(main)
print("trio_asyncio" in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_importing_the_backend_imports_no_trio_asyncio_and_warns_nothing() -> None:
    code = "import sys, trio_debounce.nats; print('trio_asyncio' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_trio_asyncio_host_imports_it_without_its_warning() -> None:
    if not _trio_asyncio_imports():
        pytest.skip("trio-asyncio does not import")
    code = (
        "from trio_debounce.nats._host_trio_asyncio import import_trio_asyncio; "
        "print(import_trio_asyncio().__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trio_asyncio"


# ------------------------------------------------------------------ choosing the host


def _fail_import() -> Any:
    raise ImportError("simulated: trio-asyncio cannot be imported", name="trio_asyncio")


async def test_explicit_trio_asyncio_that_cannot_import_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_host_trio_asyncio, "import_trio_asyncio", _fail_import)
    before = loop_threads()
    with trio.fail_after(10):
        with pytest.raises(BackendConfigError, match=r"trio-asyncio.*simulated") as info:
            async with open_nats_store(config(None, "trio-asyncio")):
                pass  # pragma: no cover
        with pytest.raises(BackendConfigError, match="trio-asyncio"):
            async with open_nats_backend(config(None, "trio-asyncio")):
                pass  # pragma: no cover
    assert "asyncio_host='thread'" in str(info.value)
    assert loop_threads() == before


async def test_auto_falls_back_to_the_thread_host(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_host_trio_asyncio, "import_trio_asyncio", _fail_import)
    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, "auto")) as store:
            assert isinstance(store, NatsKvStore)
            assert store._host.name == "thread"
            assert await store.put("w.a", b"v", last=0) > 0


def test_auto_is_the_thread_host_even_where_trio_asyncio_imports() -> None:
    # In a fresh process without the suite's host setting (tests/__init__.py).
    code = "from trio_debounce.nats import _hosts; print(_hosts.AUTO_WHERE_TRIO_ASYNCIO_IMPORTS)"
    env = {k: v for k, v in os.environ.items() if k != AUTO_HOST_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "thread"


async def test_auto_is_the_host_this_run_asks_for(nats_server: NatsServer) -> None:
    """The suite runs once per host (tests/__init__.py): "auto" is the thread host,
    or trio-asyncio under TRIO_DEBOUNCE_TEST_AUTO_HOST=trio-asyncio."""
    expected = os.environ.get(AUTO_HOST_ENV) or "thread"
    with trio.fail_after(10):
        async with open_nats_store(config(nats_server, "auto")) as store:
            assert store._host.name == expected
            assert await store.put("w.a", b"v", last=0) > 0
    if os.environ.get(AUTO_HOST_ENV):  # and the CLI's processes (tests/conftest.py)
        assert NatsConfig.from_env(dict(os.environ)).asyncio_host == expected


# ------------------------------------------------------------------ configuration


def test_the_host_field() -> None:
    assert NatsConfig().asyncio_host == "auto"
    for host in ("auto", "thread", "trio-asyncio"):
        assert NatsConfig(asyncio_host=host).asyncio_host == host
    assert repr(NatsConfig(asyncio_host="thread")) == "NatsConfig(asyncio_host='thread')"
    with pytest.raises(ValueError, match=r"asyncio_host.*'fiber'"):
        NatsConfig(asyncio_host="fiber")
    with pytest.raises(TypeError, match="asyncio_host must be a str"):
        NatsConfig(asyncio_host=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("thread", "thread"), ("trio-asyncio", "trio-asyncio"), (" Auto ", "auto")],
)
def test_the_host_from_env(raw: str, expected: str) -> None:
    env = {"TRIO_DEBOUNCE_NATS_ASYNCIO_HOST": raw}
    assert NatsConfig.from_env(env).asyncio_host == expected
    assert NatsConfig.from_env({}).asyncio_host == "auto"


@pytest.mark.parametrize("raw", ["fiber", "", "trio_asyncio", "threads"])
def test_a_bad_host_from_env_names_the_variable_and_the_value(raw: str) -> None:
    env = {"TRIO_DEBOUNCE_NATS_ASYNCIO_HOST": raw}
    with pytest.raises(ValueError, match="TRIO_DEBOUNCE_NATS_ASYNCIO_HOST") as info:
        NatsConfig.from_env(env)
    assert repr(raw) in str(info.value)
    assert "auto, thread, trio-asyncio" in str(info.value)
