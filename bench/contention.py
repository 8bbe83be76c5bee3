"""Ten writers pinging one shared key: failure rate and latency by document size.

Run from the project root: ``python bench/contention.py`` (MemoryBackend, in one
process) and ``python bench/contention.py --nats`` (a real ``nats-server -js`` started on
a free loopback port through ``tests/harness/nats_server.py``; needs the test extra). Each of
ten coordinators, each with its own backend (one simulated process each), sends
``--pings`` pings of a payload of each size to the same key with a 0.2 s delay, a few ms
apart at random. A ping fails when it raises (no write within the operation deadline and
no live owner to fall back on) or returns ``stored=False`` (absorbed by a live owner's
window without being written). Latency is the wall time of ``await debounce()``. The
figures depend on the machine's load: they are for comparing sizes within one run.

With ``--collect`` the windows use ``payload_policy="collect"`` with
``overflow="drop-oldest"``: every ping adds a 100-byte payload to the list in the shared
document, bounded by ``max_items`` 10, 100 and 1,000 (documents of about 1 KB, 10 KB
and 100 KB once full), and a ping that cannot be written raises instead of being
absorbed unstored. ``--overflow fire-early`` uses that overflow instead (a ping that
finds the list full fires it, from the pinger's process, and opens the next window), and
``--reducer`` folds the payloads with a named reducer (a list of them, registered in
every process) instead of ``"collect"``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

import trio

import trio_debounce
from trio_debounce.abc import DebounceBackend

SIZES = (100, 10_000, 100_000)
WRITERS = 10


async def _noop(fire: trio_debounce.Fire) -> None:
    pass


async def measure(
    open_backend: Callable[[str], AbstractAsyncContextManager[DebounceBackend]],
    size: int,
    pings: int,
    collect: bool = False,
    overflow: str = "drop-oldest",
    reducer: bool = False,
) -> tuple[int, int, int, list[float]]:
    latencies: list[float] = []
    unstored = errors = 0
    payload = "x" * (100 if collect else size)
    options: dict[str, Any] = {}
    if collect:
        options = {"payload_policy": "collect", "overflow": overflow, "max_items": size}
    if reducer:
        options = {"payload_policy": "tail", "overflow": "fire-early", "max_items": size}

    async def writer(coordinator: trio_debounce.Coordinator) -> None:
        nonlocal unstored, errors
        for _ in range(pings):
            await trio.sleep(random.uniform(0, 0.005))
            t0 = time.perf_counter()
            try:
                result = await coordinator.debounce("wf", "k", payload, delay=0.2, **options)
                unstored += not result.stored
            except trio_debounce.BackendError:
                errors += 1
            latencies.append(time.perf_counter() - t0)

    async with AsyncExitStack() as stack:
        coordinators = []
        for i in range(WRITERS):
            backend = await stack.enter_async_context(open_backend(f"p{i}"))
            coordinator = await stack.enter_async_context(
                trio_debounce.open_coordinator(
                    handlers={"wf": _noop}, backend=backend, on_backend_error="raise"
                )
            )
            coordinator.set_reducer("tail", _tail, initial=list)
            coordinators.append(coordinator)
        async with trio.open_nursery() as nursery:
            for coordinator in coordinators:
                nursery.start_soon(writer, coordinator)
    return WRITERS * pings, unstored, errors, sorted(latencies)


def _tail(acc: list[Any], new: Any) -> list[Any]:
    acc.append(new)
    return acc


def report(label: str, size: str, total: int, unstored: int, errors: int, lat: list[float]) -> None:
    p99 = lat[max(0, int(0.99 * len(lat)) - 1)]
    print(
        f"{label} {size}: {total} pings, failed {unstored + errors} "
        f"({(unstored + errors) / total:.1%}: {unstored} unstored, {errors} raised), "
        f"latency p50 {statistics.median(lat) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
        f"max {lat[-1] * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats", action="store_true", help="a real nats-server")
    parser.add_argument("--pings", type=int, default=30, help="pings per writer")
    parser.add_argument("--collect", action="store_true", help="collect payloads")
    parser.add_argument("--overflow", choices=("drop-oldest", "fire-early"), default="drop-oldest")
    parser.add_argument("--reducer", action="store_true", help="fold with a named reducer")
    args = parser.parse_args()
    args.collect = args.collect or args.reducer
    sizes = (10, 100, 1000) if args.collect else SIZES
    extra = (args.overflow, args.reducer)

    def label(size: int) -> str:
        if args.collect:
            what = "reducer" if args.reducer else f"collect {args.overflow}"
            return f"{what} max_items {size:>4} (full: ~{size * 104 // 1000} KB)"
        return f"payload {size:>7} B"

    if not args.nats:
        from trio_debounce.testing import MemoryBackend, MemoryStore

        for size in sizes:
            store = MemoryStore()

            def memory(name: str, store: MemoryStore = store) -> Any:
                return _yielding(MemoryBackend(store, process_id=name))

            result = trio.run(measure, memory, size, args.pings, args.collect, *extra)
            report("memory", label(size), *result)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.harness.nats_server import NatsServer
    from trio_debounce.nats import NatsConfig, open_nats_backend

    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(Path(tmp))
        server.start()
        try:
            for size in sizes:
                config = NatsConfig(
                    servers=(server.url,), bucket="c" + uuid.uuid4().hex[:10], op_timeout=2.0
                )

                def nats(name: str, config: NatsConfig = config) -> Any:
                    return open_nats_backend(config, process_id=name)

                result = trio.run(measure, nats, size, args.pings, args.collect, *extra)
                report("nats", label(size), *result)
        finally:
            server.stop()


class _yielding(AbstractAsyncContextManager[DebounceBackend]):
    """An already-built backend as an async context manager."""

    def __init__(self, backend: DebounceBackend) -> None:
        self._backend = backend

    async def __aenter__(self) -> DebounceBackend:
        return self._backend

    async def __aexit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
