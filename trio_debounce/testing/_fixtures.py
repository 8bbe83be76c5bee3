"""What the pytest plugin's fixtures hand to a test: a fire recorder and simulated processes.

:class:`FireRecorder` is a handler (or one per simulated process) that records every
fire; :class:`Processes` opens coordinators that share one
:class:`~trio_debounce.testing.MemoryStore` as separate processes would share a bucket,
each a :class:`Process` that can :meth:`~Process.die`. Neither needs pytest: the
fixtures ``trio_debounce_fires`` and ``trio_debounce_processes``
(:mod:`trio_debounce.testing._pytest_plugin`) only make them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from .._coordinator import Coordinator, open_coordinator
from .._types import Fire, Handler
from ._memory import MemoryBackend, MemoryStore


class FireRecorder:
    """A fire handler that records what it fired, and which process fired it.

    The recorder itself is a handler (``handlers={"build": fires}``, recorded under the
    process name ``""``); :meth:`handler` makes one per simulated process. ``log`` is
    the list of ``(process, fire)`` of each fire, in the order the handlers started.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, Fire]] = []
        self._waiters: list[tuple[int, trio.Event]] = []

    async def __call__(self, fire: Fire) -> None:
        self._record("", fire)

    def handler(self, process: str = "", *, hold: float = 0.0) -> Handler:
        """A handler that records each fire under ``process``, then sleeps ``hold``
        seconds (a handler that takes time: a process can die while it runs)."""

        async def handle(fire: Fire) -> None:
            self._record(process, fire)
            if hold:
                await trio.sleep(hold)

        return handle

    def _record(self, process: str, fire: Fire) -> None:
        self.log.append((process, fire))
        for n, event in self._waiters:
            if len(self.log) >= n:
                event.set()
        self._waiters = [(n, event) for n, event in self._waiters if not event.is_set()]

    @property
    def fires(self) -> list[Fire]:
        """Every fire recorded, in order."""
        return [fire for _, fire in self.log]

    @property
    def payloads(self) -> list[Any]:
        """The payload of every fire, in order."""
        return [fire.payload for _, fire in self.log]

    @property
    def processes(self) -> list[str]:
        """The process of every fire, in order."""
        return [process for process, _ in self.log]

    def of(self, key: str) -> list[Fire]:
        """The fires of windows on ``key``, in order."""
        return [fire for _, fire in self.log if fire.key == key]

    async def wait_for(self, n: int = 1) -> None:
        """Wait until at least ``n`` fires are recorded (at once if they are)."""
        if len(self.log) >= n:
            return
        event = trio.Event()
        self._waiters.append((n, event))
        await event.wait()


@dataclass
class Process:
    """One simulated process: its coordinator, its backend on the shared store, and the
    cancel scope around its coordinator's ``async with``."""

    name: str
    coordinator: Coordinator
    backend: MemoryBackend
    scope: trio.CancelScope

    def die(self) -> None:
        """The process dies at once: it no longer reaches the store (no lease renewal,
        no release, no hand-off) and its tasks stop; its block ends quietly.

        Cancels the scope around the process's block, so whatever runs inside that
        block stops too: a process that dies while others go on must be opened (with
        :meth:`Processes.process`) inside their blocks, not around them.
        """
        self.backend.faults.partitioned = True
        self.scope.cancel()


class Processes:
    """Coordinators on one shared :class:`MemoryStore`, each as a separate process.

    Args:
      fires (FireRecorder): records the fires of the ``workflows`` of every process.
      store (MemoryStore | None): the shared store; a fresh one when None.
      process_lease (float): the default lease of each process, in seconds; short, so
        that a takeover (which waits for a dead owner's lease to lapse) takes little
        virtual time.
    """

    def __init__(
        self,
        fires: FireRecorder,
        store: MemoryStore | None = None,
        *,
        process_lease: float = 6.0,
    ) -> None:
        self.fires = fires
        self.store: MemoryStore = MemoryStore() if store is None else store
        self.process_lease = process_lease

    @asynccontextmanager
    async def process(
        self,
        name: str,
        *,
        workflows: Iterable[str] = (),
        handlers: Mapping[str, Handler] | None = None,
        hold: float = 0.0,
        process_lease: float | None = None,
        clock_skew: float = 0.0,
        max_clock_skew: float = 1.0,
        **coordinator_options: Any,
    ) -> AsyncIterator[Process]:
        """Open one process named ``name`` (its ``process_id``) for the ``async with``.

        Each of ``workflows`` gets the handler ``fires.handler(name, hold=hold)``;
        ``handlers`` adds (or overrides) handlers of its own. ``process_lease``
        (:attr:`process_lease` when None), ``clock_skew`` and ``max_clock_skew`` go to
        its :class:`MemoryBackend`, the other keyword arguments to
        :func:`~trio_debounce.open_coordinator`.
        """
        backend = MemoryBackend(
            self.store,
            process_id=name,
            process_lease=self.process_lease if process_lease is None else process_lease,
            clock_skew=clock_skew,
            max_clock_skew=max_clock_skew,
        )
        handler = self.fires.handler(name, hold=hold)
        all_handlers = {workflow: handler for workflow in workflows}
        all_handlers.update(handlers or {})
        with trio.CancelScope() as scope:
            async with open_coordinator(
                handlers=all_handlers, backend=backend, **coordinator_options
            ) as coordinator:
                yield Process(name, coordinator, backend, scope)

    @asynccontextmanager
    async def open(self, *names: str, **options: Any) -> AsyncIterator[tuple[Process, ...]]:
        """Open a process for each of ``names``, with the same options (those of
        :meth:`process`), for the ``async with``; they close in reverse order."""
        async with AsyncExitStack() as stack:
            yield tuple(
                [await stack.enter_async_context(self.process(name, **options)) for name in names]
            )
