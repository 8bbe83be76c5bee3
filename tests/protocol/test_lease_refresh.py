"""Concurrent lease refreshes of one process (the heartbeat, and every finalize that
finds the lease lapsed after a stall) must not fail each other's compare-and-swaps.

Found by the chaos soak (docs/reliability.rst): on a loaded host, a burst of finalizes
after a stall each renewed the lease at once, some ran out of retries ("could not renew
the lease"), and those windows fired unconfirmed (token 0) while their lease was held.
"""

from __future__ import annotations

import trio
import trio.testing

from trio_debounce.testing import MemoryBackend, MemoryStore


async def test_concurrent_refreshes_all_succeed_with_few_writes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    backend = MemoryBackend(store, process_id="a", process_lease=6.0, max_clock_skew=1.0)
    await backend.refresh_lease()
    backend.faults.delay_next(0.05, n=1000, ops=("put",))  # a slow store
    before = store.requests.get("put", 0)
    errors: list[Exception] = []

    async def refresh() -> None:
        try:
            await backend.refresh_lease()
        except Exception as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(12):
            nursery.start_soon(refresh)
    assert errors == []
    assert backend.lease_held()
    # Callers that waited for a refresh in flight share it instead of writing again.
    assert store.requests.get("put", 0) - before <= 2


async def test_a_death_found_by_a_refresh_is_reported_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = MemoryStore()
    a = MemoryBackend(store, process_id="a", process_lease=6.0, max_clock_skew=1.0)
    b = MemoryBackend(store, process_id="b", process_lease=6.0, max_clock_skew=1.0)
    await a.refresh_lease()
    await b.refresh_lease()
    await a.refresh_lease()  # a has seen b live
    await trio.sleep(10.0)  # b stops renewing: its lease lapses
    a.faults.delay_next(0.05, n=1000, ops=("put",))
    found: list[set[str]] = []

    async def refresh() -> None:
        found.append(set(await a.refresh_lease()))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(refresh)
    assert sorted(map(sorted, found)) == [[], [], [], ["b"]]
