"""Simulated processes on the in-memory backend: coordinators in one ``trio.run`` that
share a :class:`~trio_debounce.testing.MemoryStore`, as separate processes share a NATS
bucket (the protocol code is the one the NATS backend runs).

Every process gets a :class:`~trio_debounce.testing.MemoryBackend` with the lease and
skew margin below (:func:`backend`), and a handler of workflow ``"wf"`` that records its
fires in a :class:`~tests.harness.fires.Fires` under the process's name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from tests.harness.fires import Fires
from trio_debounce import Coordinator, open_coordinator
from trio_debounce.testing import MemoryBackend, MemoryStore

#: The process lease of every simulated process, in seconds.
LEASE = 6.0
#: Their ``max_clock_skew``.
SKEW = 1.0
#: Their heartbeat interval (a third of the lease).
BEAT = LEASE / 3
#: The workflow of their recording handler.
WF = "wf"


def near(t: float) -> Any:
    """Shared times pass through the wall clock (epoch seconds, about 2e-7 s apart as
    floats), and a ping that meets a heartbeat or a finalize backs off a few ms."""
    return pytest.approx(t, abs=0.02)


def backend(store: MemoryStore, name: str, **kwargs: Any) -> MemoryBackend:
    """The backend of process ``name`` on ``store``: lease :data:`LEASE` and skew margin
    :data:`SKEW` unless ``kwargs`` say otherwise (they go to :class:`MemoryBackend`)."""
    kwargs.setdefault("process_lease", LEASE)
    kwargs.setdefault("max_clock_skew", SKEW)
    return MemoryBackend(store, process_id=name, **kwargs)


@asynccontextmanager
async def processes(
    store: MemoryStore,
    fires: Fires,
    names: Sequence[str],
    *,
    backend_options: Mapping[str, Any] | None = None,
    **coordinator_options: Any,
) -> AsyncIterator[list[Coordinator]]:
    """A coordinator for each of ``names`` (one process each, in that order), open for
    the ``async with``; ``backend_options`` go to :func:`backend`, the other keyword
    arguments to :func:`~trio_debounce.open_coordinator`. They close in reverse order."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                open_coordinator(
                    handlers={WF: fires.handler(name)},
                    backend=backend(store, name, **(backend_options or {})),
                    **coordinator_options,
                )
            )
            for name in names
        ]


@asynccontextmanager
async def process(
    store: MemoryStore, fires: Fires, name: str, *, hold: float = 0.0, **kwargs: Any
) -> AsyncIterator[tuple[Coordinator, MemoryBackend, trio.CancelScope]]:
    """A simulated process that can die: its coordinator, its backend and the cancel
    scope around its block (kill it with :func:`die`). Its handler holds each fire
    ``hold`` seconds; ``kwargs`` go to :func:`~trio_debounce.open_coordinator`."""
    b = backend(store, name)
    with trio.CancelScope() as scope:
        async with open_coordinator(
            handlers={WF: fires.handler(name, hold=hold)}, backend=b, **kwargs
        ) as c:
            yield c, b, scope


def die(b: MemoryBackend, scope: trio.CancelScope) -> None:
    """The process dies at once: it can no longer reach the store (no lease renewal,
    no release, no hand-off) and its tasks stop."""
    b.faults.partitioned = True
    scope.cancel()
