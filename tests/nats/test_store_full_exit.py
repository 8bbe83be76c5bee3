"""An exit with ``on_exit="wait"`` (at-least-once) while the JetStream store is full, bounded by the
caller's cancel scope (docs/reliability.rst, ``store-full``; docs/design.rst, "Exits
during an outage").

The server's store holds 256 KiB (``max_file_store``) and a filler bucket takes all of
it, so every write of the windows' bucket is refused. The owner of a window cannot
renew its lease, so it may not fire unconfirmed (see "Stale owners" in
docs/protocol.rst), and its finalize cannot write: its exit with ``on_exit="wait"``
waits for the store, as during any outage. The library adds no timeout of its own; the
caller's cancel scope bounds the wait, the window is then handed off, and nothing is
lost: once the store has room, a live peer adopts the window and fires it, once. Under
at-most-once the exit does not wait: a fire that cannot be proven is dropped.
"""

from __future__ import annotations

import asyncio
from typing import Literal

import nats
import pytest
import trio

from tests.harness.fires import Fires
from tests.harness.nats_server import NatsServer, NatsServerFactory
from trio_debounce import open_coordinator
from trio_debounce.nats import NatsConfig, open_nats_backend

LEASE = 2.0
OP_TIMEOUT = 1.0
#: Seconds the owner's exit is allowed to wait for the store (the caller's bound).
EXIT_BOUND = 4.0
#: Seconds a cancelled exit may take past that: the shielded hand-off or release
#: (bounded by ``op_timeout`` each), the bridge's second, and a margin for load.
EXIT_SLACK = 3 * OP_TIMEOUT + 1.0 + 1.5


async def fill(url: str) -> int:
    """Fill the server's store with a bucket ``filler`` until it refuses even small
    values; returns the bytes written."""

    async def run() -> int:
        client = await nats.connect(url)
        try:
            kv = await client.jetstream().create_key_value(bucket="filler", history=1)
            written, n = 0, 0
            for size in (2000, 200, 20):
                while True:
                    try:
                        await kv.put(f"v{n}", b"x" * size)
                    except Exception:
                        break
                    written += size
                    n += 1
            return written
        finally:
            await client.close()

    return await trio.to_thread.run_sync(asyncio.run, run())


async def free(url: str) -> None:
    async def run() -> None:
        client = await nats.connect(url)
        try:
            await client.jetstream().delete_key_value("filler")
        finally:
            await client.close()

    await trio.to_thread.run_sync(asyncio.run, run())


@pytest.mark.realtime
@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
async def test_a_waiting_exit_on_a_full_store_is_bounded_by_a_cancel_scope(
    nats_server_factory: NatsServerFactory, delivery: Literal["at-least-once", "at-most-once"]
) -> None:
    server: NatsServer = nats_server_factory(conf="jetstream {\n  max_file_store: 262144\n}\n")
    cfg = NatsConfig(
        servers=(server.url,),
        bucket="full",
        process_lease=LEASE,
        op_timeout=OP_TIMEOUT,
        max_clock_skew=0.5,
    )
    fires = Fires()
    with trio.fail_after(60):
        async with (
            open_nats_backend(cfg, process_id="peer") as peer_backend,
            open_coordinator(
                backend=peer_backend, handlers={"wf": fires.handler("peer")}, delivery=delivery
            ),
        ):
            owner_exited = None
            with trio.move_on_after(EXIT_BOUND + 6.0) as outer:
                async with open_nats_backend(cfg, process_id="owner") as owner_backend:
                    with trio.CancelScope() as bound:
                        async with open_coordinator(
                            backend=owner_backend,
                            handlers={"wf": fires.handler("owner")},
                            delivery=delivery,
                            on_exit="wait",
                        ) as owner:
                            result = await owner.debounce("wf", "k", "payload", delay=1.0)
                            assert result.owner
                            assert await fill(server.url) > 200_000
                            exit_began = trio.current_time()
                            # The caller bounds the exit (not the fill above).
                            bound.deadline = exit_began + EXIT_BOUND
                    owner_exited = trio.current_time()
            assert not outer.cancelled_caught, "the owner's exit outlived its cancel scope"
            assert owner_exited is not None
            assert fires.log == []
            if delivery == "at-most-once":
                # A fire that cannot be proven is dropped at once: the exit does not
                # wait for the store, and the window may go unfired (at most once).
                assert not bound.cancelled_caught
                assert owner_exited - exit_began < EXIT_BOUND
            else:
                # The exit waited for the store (the owner may not fire with a lapsed
                # lease) until the caller's bound, then returned within the shielded
                # clean-up's bound.
                assert bound.cancelled_caught
                assert owner_exited - exit_began < EXIT_BOUND + EXIT_SLACK
            # The store has room again: the peer adopts the window and fires it (or,
            # at most once, may not).
            await free(server.url)
            deadline = trio.current_time() + 20.0
            while not fires.log and delivery == "at-least-once":
                assert trio.current_time() < deadline, "the window was lost"
                await trio.sleep(0.2)
            await trio.sleep(3 * LEASE)
    if delivery == "at-least-once":
        assert [(p, f.key, f.payload) for p, f in fires.log] == [("peer", "k", "payload")]
    else:
        assert [(p, f.key, f.payload) for p, f in fires.log] in ([], [("peer", "k", "payload")])
