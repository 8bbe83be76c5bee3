"""In-process load for the cluster and stall tests: coordinators pinging random keys.

:class:`Load` drives several coordinators of one ``trio.run`` (each through its own
backend and connection, as separate processes would) at a limited rate, and logs every
ping, error and handler start and end in the event format of
:mod:`tests.chaos.driver`, so :func:`tests.chaos.checker.check` judges the windows
(lost, fired twice, payloads, hung calls) exactly as it judges the chaos runs. It also
times every store call of the backends it is given (:class:`TimedStore`): no call may
outlast its bound.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

from tests.chaos.checker import Report, check
from tests.chaos.driver import key_shape
from trio_debounce import Coordinator, Fire, RunFire, open_coordinator
from trio_debounce._protocol import KvDebounceBackend
from trio_debounce.abc import KvEntry, KvStore, RunStore
from trio_debounce.nats import NatsConfig, open_nats_backend

WORKFLOW = "wf"
RUN_WORKFLOW = "job"

Event = dict[str, Any]


class TimedStore(KvStore):
    """The backend's real store, with every call's duration (Trio clock) recorded."""

    def __init__(self, store: KvStore, durations: list[tuple[str, float]]) -> None:
        self._store = store
        self._durations = durations
        self.max_value_bytes = store.max_value_bytes
        self.created = store.created

    async def _timed(self, what: str, call: Any) -> Any:
        began = trio.current_time()
        try:
            return await call
        finally:
            self._durations.append((what, trio.current_time() - began))

    async def get(self, key: str) -> KvEntry | None:
        result: KvEntry | None = await self._timed("get", self._store.get(key))
        return result

    async def get_current(self, key: str) -> KvEntry | None:
        result: KvEntry | None = await self._timed("get", self._store.get_current(key))
        return result

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        result: int = await self._timed("put", self._store.put(key, value, last=last))
        return result

    async def delete(self, key: str, *, last: int) -> int:
        result: int = await self._timed("delete", self._store.delete(key, last=last))
        return result

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        result: bool = await self._timed("purge", self._store.purge_marker(key, revision=revision))
        return result

    async def purge(self, key: str, *, last: int) -> bool:
        result: bool = await self._timed("purge", self._store.purge(key, last=last))
        return result

    async def entries(self, prefix: str) -> list[KvEntry]:
        result: list[KvEntry] = await self._timed("entries", self._store.entries(prefix))
        return result


@dataclass
class Load:
    """Coordinators sharing one bucket, pinging at a limited rate; see the module.

    Attributes:
      config (NatsConfig): every coordinator's backend config.
      rng (random.Random): picks keys and pauses.
      keys (int): keys ``k0 .. k<keys-1>``.
      min_delay, max_delay (float): the range of the keys' delays (seconds).
      events (list[Event]): the log, in :mod:`tests.chaos.driver`'s format.
      store_calls (list[tuple[str, float]]): every timed store call and its seconds.
      coordinators (dict[str, Coordinator]): by process name.
      on_backend_error (dict[str, str]): each coordinator's setting.
    """

    config: NatsConfig
    rng: random.Random
    keys: int = 40
    min_delay: float = 0.2
    max_delay: float = 1.0
    events: list[Event] = field(default_factory=list)
    store_calls: list[tuple[str, float]] = field(default_factory=list)
    coordinators: dict[str, Coordinator] = field(default_factory=dict)
    backends: dict[str, KvDebounceBackend] = field(default_factory=dict)
    on_backend_error: dict[str, str] = field(default_factory=dict)
    run_fires: list[tuple[str, RunFire]] = field(default_factory=list)
    late_commits: list[str] = field(default_factory=list)
    _seq: int = 0

    def log(self, kind: str, proc: str, **fields: Any) -> None:
        self.events.append({"ev": kind, "proc": proc, "id": proc, "t": time.time(), **fields})

    def handler(self, proc: str) -> Any:
        async def handle(fire: Fire) -> None:
            fields = {
                "key": fire.key,
                "run": fire.run_id,
                "payload": fire.payload,
                "count": fire.ping_count,
                "attempt": fire.attempt,
                "token": fire.fencing_token,
                "edge": fire.edge.value,
            }
            self.log("start", proc, **fields)
            await trio.sleep(0.02)
            self.log("end", proc, **fields)

        return handle

    def run_handler(self, proc: str) -> Any:
        async def handle(run: RunFire) -> None:
            self.run_fires.append((proc, run))

        return handle

    @asynccontextmanager
    async def open(
        self,
        names: str,
        *,
        delivery: str = "at-least-once",
        on_backend_error: str = "fail-open",
        run_store: RunStore | None = None,
    ) -> AsyncIterator[list[Coordinator]]:
        """Open one coordinator (and backend) per letter of ``names``."""
        async with AsyncExitStack() as stack:
            opened = []
            for name in names:
                backend = await stack.enter_async_context(
                    open_nats_backend(self.config, process_id=name)
                )
                assert isinstance(backend, KvDebounceBackend)
                backend._view.store = TimedStore(backend._view.store, self.store_calls)
                self.backends[name] = backend
                coordinator = await stack.enter_async_context(
                    open_coordinator(
                        handlers={WORKFLOW: self.handler(name)},
                        backend=backend,
                        delivery=delivery,  # type: ignore[arg-type]
                        on_backend_error=on_backend_error,  # type: ignore[arg-type]
                        run_store=run_store,
                        run_handlers=(
                            None if run_store is None else {RUN_WORKFLOW: self.run_handler(name)}
                        ),
                    )
                )
                self.coordinators[name] = coordinator
                self.on_backend_error[name] = on_backend_error
                opened.append(coordinator)
            yield opened

    async def ping(self, proc: str, key: str | None = None) -> None:
        """One ping through ``proc``'s coordinator, logged as the chaos driver does."""
        if key is None:
            key = f"k{self.rng.randrange(self.keys)}"
        self._seq += 1
        payload = f"{proc}:{self._seq}"
        shape = key_shape(key, min_delay=self.min_delay, max_delay=self.max_delay)
        coordinator = self.coordinators[proc]
        t0 = time.time()
        try:
            result = await coordinator.debounce(
                WORKFLOW,
                key,
                payload,
                delay=shape.delay,
                max_delay=shape.max_delay,
                mode=shape.mode,
            )
        except Exception as exc:
            self.log("err", proc, key=key, payload=payload, error=repr(exc), t0=t0)
            return
        assert coordinator._shared is not None  # the load always has a backend
        self.log(
            "ping",
            proc,
            key=key,
            payload=payload,
            mode=shape.mode,
            run=result.active_run_id,
            outcome=result.outcome.value,
            count=result.ping_count,
            owner=result.owner,
            stored=result.stored,
            fail_open=result.active_run_id in coordinator._shared._fail_open_runs,
            t0=t0,
        )

    async def run(
        self,
        rate: float,
        seconds: float = math.inf,
        *,
        until: trio.Event | None = None,
        concurrency: int = 8,
    ) -> None:
        """Ping random keys through random coordinators at about ``rate`` pings a
        second (all coordinators together) for ``seconds`` or until ``until`` is set;
        then wait for the pings in flight."""
        limiter = trio.CapacityLimiter(concurrency)

        async def one(proc: str) -> None:
            async with limiter:
                await self.ping(proc)

        end = trio.current_time() + seconds
        async with trio.open_nursery() as nursery:
            while trio.current_time() < end and not (until is not None and until.is_set()):
                nursery.start_soon(one, self.rng.choice(sorted(self.coordinators)))
                await trio.sleep(self.rng.expovariate(rate))

    def check(self, *, delivery: str = "at-least-once", ping_bound: float) -> Report:
        """The chaos checker's report on the events so far, with one refinement: a
        fire that carries the payload of a ping that raised (its write timed out, may
        have been applied, and did: a late commit) is not a wrong payload. Those runs
        are listed in :attr:`late_commits`."""
        report = check(self.events, delivery=delivery, ping_bound=ping_bound)
        errored = {e["payload"] for e in self.events if e["ev"] == "err"}
        fired = {(e["run"], e["payload"]) for e in self.events if e["ev"] == "start"}
        self.late_commits = sorted(
            run
            for run in report.wrong_payload
            if any(payload in errored for r, payload in fired if r == run)
        )
        report.wrong_payload = [r for r in report.wrong_payload if r not in self.late_commits]
        return report

    async def wait_settled(
        self, patience: float, *, delivery: str = "at-least-once", ping_bound: float
    ) -> Report:
        """Check every half second until no window is lost (or ``patience`` seconds
        pass); return the last report."""
        deadline = trio.current_time() + patience
        while True:
            report = self.check(delivery=delivery, ping_bound=ping_bound)
            if not report.lost or trio.current_time() > deadline:
                return report
            await trio.sleep(0.5)

    def errors(self) -> list[Event]:
        return [e for e in self.events if e["ev"] == "err"]


def xfail_if_known(load: Load, report: Report, store_call_bound: float) -> None:
    """Mark the test as an expected failure when the only broken promises are the
    known, unfixed ones (docs/reliability.rst, "Cluster, stalls and slow replies"):
    when every lease lapses (an election or a stall longer than the 2 s leases), peers
    take windows over while their owners' writes are in doubt; a window can then be
    left unfired past the test (its owner "retrying instead of firing"), or fired
    twice (an adopter fires unconfirmed, without the payload, a window its first
    owner fired). Hung calls, wrong payloads and crashes are never excused.
    """
    slow = [secs for _, secs in load.store_calls if secs > store_call_bound]
    broken = report.hung or slow or report.crashed or report.wrong_payload
    if (report.lost or report.fired_twice) and not broken:
        pytest.xfail(f"known: windows across lapsed leases; {report.summary()}")
