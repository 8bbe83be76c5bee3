"""Stalls, slow replies and connections cut mid-write between coordinators and a real
``nats-server``, through the TCP proxy of :mod:`tests.harness.tcp_proxy`.

The short versions of the chaos stall scenarios (``tests/chaos/scenarios_cluster.py``).
Two coordinators share a bucket; one reaches the server through the proxy, the other
directly. While the proxy slows replies past ``op_timeout``, stalls, or cuts the
connection in the middle of a write, and while the server itself is stopped and
continued (``SIGSTOP``/``SIGCONT``): every store call and every ping stays within its
bound, pings fail open (or raise, per ``on_backend_error``), the coordinators' nurseries
never crash, and once the faults end the windows resume without loss (judged by the
chaos checker, :mod:`tests.chaos.checker`).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import trio

from tests.harness.cluster_load import Load, xfail_if_known
from tests.harness.nats_server import NatsServer
from tests.harness.tcp_proxy import TcpProxy, open_tcp_proxy
from trio_debounce import BackendUnavailableError
from trio_debounce.nats import NatsConfig
from trio_debounce.nats._store import open_nats_store

pytestmark = [pytest.mark.slow, pytest.mark.realtime]

LEASE = 2.0
SKEW = 0.5
OP_TIMEOUT = 1.0
#: A store call: op_timeout, plus up to a second for the bridge to abandon a nats-py
#: call that swallows its cancellation, plus a margin for a loaded machine.
STORE_CALL_BOUND = OP_TIMEOUT + 1.0 + 1.0
#: A ping: one more op_timeout to re-read a write whose answer was lost (docs/protocol.rst,
#: "Group commit").
PING_BOUND = 2 * OP_TIMEOUT + 1.0 + 1.0


def config(url: str, **kwargs: object) -> NatsConfig:
    base = NatsConfig(
        servers=(url,),
        bucket="x" + uuid.uuid4().hex[:12],
        process_lease=LEASE,
        max_clock_skew=SKEW,
        op_timeout=OP_TIMEOUT,
        connect_timeout=3.0,
        ping_interval=1.0,
    )
    return replace(base, **kwargs)  # type: ignore[arg-type]


@asynccontextmanager
async def proxied_pair(server: NatsServer, seed: int) -> AsyncIterator[tuple[Load, TcpProxy]]:
    """Coordinator A through a proxy, coordinator B direct, on one bucket."""
    async with open_tcp_proxy(server.port) as proxy:
        direct = config(server.url)
        via_proxy = replace(direct, servers=(f"nats://127.0.0.1:{proxy.port}",))
        load = Load(via_proxy, random.Random(seed))
        async with load.open("A"):
            load.config = direct
            async with load.open("B"):
                yield load, proxy


def assert_held(load: Load) -> None:
    report = load.check(ping_bound=PING_BOUND)
    detail = f"{report.summary()}; late commits {len(load.late_commits)}"
    assert report.pings > 20, detail
    assert not report.lost, detail
    assert not report.fired_twice, detail
    assert not report.wrong_payload, detail
    assert not report.hung, detail
    slow = [(what, round(secs, 2)) for what, secs in load.store_calls if secs > STORE_CALL_BOUND]
    assert not slow, slow


async def test_slow_replies_stall_and_cut_mid_write(nats_server: NatsServer) -> None:
    with trio.fail_after(90):
        async with proxied_pair(nats_server, 11) as (load, proxy):
            # Replies slower than op_timeout: A's calls time out within their bound
            # (and may have been applied), its pings fail open; B is unaffected.
            proxy.reply_delay = 1.5 * OP_TIMEOUT
            await load.run(8.0, 3.0)
            proxy.reply_delay = 0.0
            # A stall: nothing moves either way; the client's pings go unanswered and
            # it gives the connection up as stale, then reconnects through the proxy.
            proxy.stall()
            await load.run(8.0, 2.0)
            proxy.resume()
            await load.run(8.0, 2.0)
            # Cut mid-write, several times: the server gets part of a protocol line,
            # both sides are reset, the client reconnects.
            for _ in range(3):
                proxy.cut_mid_write()
                await load.run(8.0, 1.0)
            assert proxy.cuts_mid_write == 3
            # Recovery: pings are stored again and every window settles.
            await trio.sleep(2.0)
            await load.run(8.0, 2.0)
            report = await load.wait_settled(15.0, ping_bound=PING_BOUND)
            assert not report.lost, report.summary()
    stats = load.coordinators["A"].statistics()
    assert stats.fail_open_windows > 0, stats  # the faults were seen
    assert proxy.accepted > 1  # A reconnected
    assert_held(load)


async def test_sigstop_cycles_of_the_server(nats_server: NatsServer) -> None:
    with trio.fail_after(90):
        async with proxied_pair(nats_server, 12) as (load, _proxy):
            stopped = trio.Event()

            async def cycles() -> None:
                for pause in (0.5, 1.5, 3.5):  # shorter and longer than op_timeout
                    await trio.sleep(1.0)
                    await trio.to_thread.run_sync(nats_server.pause)
                    await trio.sleep(pause)
                    await trio.to_thread.run_sync(nats_server.resume)
                stopped.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cycles)
                await load.run(6.0, until=stopped)
            report = await load.wait_settled(15.0, ping_bound=PING_BOUND)
    xfail_if_known(load, report, STORE_CALL_BOUND)
    assert_held(load)


async def test_raise_mode_raises_within_the_bound_while_replies_are_slow(
    nats_server: NatsServer,
) -> None:
    with trio.fail_after(30):
        async with open_tcp_proxy(nats_server.port) as proxy:
            load = Load(config(f"nats://127.0.0.1:{proxy.port}"), random.Random(13))
            async with load.open("C", on_backend_error="raise"):
                proxy.reply_delay = 2 * OP_TIMEOUT
                began = trio.current_time()
                with pytest.raises(BackendUnavailableError):
                    await load.coordinators["C"].debounce("wf", "k", 1, delay=0.2)
                assert trio.current_time() - began < PING_BOUND
                proxy.reply_delay = 0.0
                await trio.sleep(2 * OP_TIMEOUT)  # late replies drain
                result = await load.coordinators["C"].debounce("wf", "k", 2, delay=0.2)
                assert result.stored


async def test_store_calls_are_bounded_through_a_stalled_proxy(nats_server: NatsServer) -> None:
    async with open_tcp_proxy(nats_server.port) as proxy:
        cfg = config(f"nats://127.0.0.1:{proxy.port}")
        with trio.fail_after(30):
            async with open_nats_store(cfg) as store:
                revision = await store.put("k", b"v", last=0)
                proxy.stall()
                for call in (store.get("k"), store.put("k", b"w", last=revision)):
                    began = trio.current_time()
                    with pytest.raises(BackendUnavailableError):
                        await call
                    assert trio.current_time() - began < STORE_CALL_BOUND
                proxy.resume()
                # The write that timed out was applied once the stall ended.
                for _ in range(50):
                    entry = await store.get("k")
                    if entry is not None and entry.value == b"w":
                        break
                    await trio.sleep(0.1)
                else:
                    raise AssertionError(f"the timed-out write never landed: {entry}")
