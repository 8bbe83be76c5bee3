"""Several NATS stores in one ``trio.run``, each with its own trio-asyncio loop.

The documented one-process setup opens two (``open_nats_backend`` and
``open_nats_run_store``). A Trio task inherits the context of the task that spawned
it, and there the loop opened last is trio-asyncio's current loop; a store must still
run its calls on its own loop, which stays open while the store is, whatever loop a
calling task sees (regression: calls went to the current loop, and once that loop was
closed they failed, or Trio crashed with an internal error when one was cancelled).
"""

from __future__ import annotations

import uuid

import pytest
import trio

from tests.harness.nats_server import NatsServer
from trio_debounce.nats import NatsConfig
from trio_debounce.nats._store import open_nats_store

pytestmark = pytest.mark.slow


async def test_a_store_outlives_the_loop_of_a_store_opened_after_it(
    nats_server: NatsServer,
) -> None:
    config = NatsConfig(servers=(nats_server.url,), bucket="l" + uuid.uuid4().hex[:12])
    results: list[object] = []
    second_closed = trio.Event()
    with trio.fail_after(20):
        async with open_nats_store(config) as first, trio.open_nursery() as nursery:

            async def use_first() -> None:
                # Spawned while the second store's loop was the current one.
                await second_closed.wait()
                revision = await first.put("k", b"v", last=0)
                entry = await first.get("k")
                assert entry is not None
                results.append((revision, entry.value))
                # A call cancelled while in flight, on the store's own (open) loop.
                with trio.move_on_after(0.0):
                    await first.get("k")
                async with first.open_watch("k.") as watch:
                    results.append(await watch.receive_batch())

            async with open_nats_store(config) as second:
                await second.get("other")
                nursery.start_soon(use_first)
            second_closed.set()
    assert results == [(1, b"v"), [None]]
