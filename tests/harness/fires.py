"""Fire recorders: :class:`Fires`, what the handlers of several simulated or real
processes ran, in order; :class:`Recorder`, one handler's fires (it can take time to
run)."""

from __future__ import annotations

from typing import Any

import trio

from trio_debounce import Edge, Fire


class Fires:
    """Fires recorded across coordinators, with the process that ran each."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Fire]] = []
        self._first = trio.Event()
        #: Set (and replaced) at each recorded fire.
        self._grew = trio.Event()

    def handler(self, process: str, *, hold: float = 0.0) -> Any:
        """A handler for ``process`` that records each fire, then sleeps ``hold`` s."""

        async def handle(fire: Fire) -> None:
            self.log.append((process, fire))
            self._first.set()
            self._grew.set()
            self._grew = trio.Event()
            if hold:
                await trio.sleep(hold)

        return handle

    def of(self, key: str) -> list[tuple[str, Fire]]:
        return [(p, f) for p, f in self.log if f.key == key]

    async def wait_first(self) -> None:
        """Wait until some handler has run."""
        await self._first.wait()

    async def wait_for(self, n: int) -> None:
        """Wait until ``n`` fires have been recorded."""
        while len(self.log) < n:
            await self._grew.wait()

    def by_edge(self) -> list[tuple[str, str, Any, int, Edge]]:
        """(process, key, payload, ping count, edge) of each fire."""
        return [(p, f.key, f.payload, f.ping_count, f.edge) for p, f in self.log]

    def by_attempt(self) -> list[tuple[str, str, Any, int, int]]:
        """(process, key, payload, ping count, attempt) of each fire."""
        return [(p, f.key, f.payload, f.ping_count, f.attempt) for p, f in self.log]


class Recorder:
    """A fire handler that records every fire and can take time to run."""

    def __init__(self, duration: float = 0.0) -> None:
        self.fires: list[Fire] = []
        self.duration = duration
        self.running = 0
        self.max_running = 0

    async def __call__(self, fire: Fire) -> None:
        self.fires.append(fire)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await trio.sleep(self.duration)
        finally:
            self.running -= 1

    def summary(self) -> list[tuple[float, str, object, int, str]]:
        return [(f.fired_at, f.key, f.payload, f.ping_count, f.edge.value) for f in self.fires]
