"""The heartbeat of a coordinator with a backend: lease, flush requests, reconcile, sweep.

:func:`maintain` is the task that renews the backend's process lease once per
heartbeat interval (and reads the flush requests left for this process),
reconciles the shared windows (``SharedWindows.reconcile``) at a
slower pace and at once after an outage, and starts a sweep of the store every few
beats, in a task of its own so that a slow sweep never delays a renewal.
"""

from __future__ import annotations

import logging

import trio

from ._backend import DebounceBackend
from ._errors import BackendError
from ._firing import Ledger
from ._shared import SharedWindows

logger = logging.getLogger("trio_debounce")

#: Sweep (one elected process does the work) once every this many heartbeats.
SWEEP_EVERY = 3
#: Reconcile owned windows (each process lists every window) once every this many
#: heartbeats, and at once after an outage or a failed register.
RECONCILE_EVERY = 6


async def maintain(backend: DebounceBackend, shared: SharedWindows, ledger: Ledger) -> None:
    """The heartbeat task: renew the process lease once per interval; reconcile
    owned windows and sweep at a slower pace, and at once after an outage."""
    async with trio.open_nursery() as sweeps:
        await _Heartbeat(backend, shared, ledger, sweeps).run()


class _Heartbeat:
    """The heartbeat loop and its sweep tasks (at most one sweep at a time)."""

    __slots__ = ("_backend", "_ledger", "_shared", "_sweeping", "_sweeps")

    def __init__(
        self,
        backend: DebounceBackend,
        shared: SharedWindows,
        ledger: Ledger,
        sweeps: trio.Nursery,
    ) -> None:
        self._backend = backend
        self._shared = shared
        self._ledger = ledger
        self._sweeps = sweeps
        #: A sweep task is running (at most one at a time).
        self._sweeping = False

    async def run(self) -> None:
        backend = self._backend
        shared = self._shared
        beats = 0
        down = False
        # At start: adopt what dead processes (or a hand-off with no peer alive) left.
        try:
            with trio.fail_after(backend.heartbeat_interval):
                await shared.reconcile()
        except (BackendError, trio.TooSlowError) as exc:
            self._ledger.backend_errors += 1
            logger.warning("backend reconcile at start failed: %s", exc or "no answer")
            down = True
        while True:
            await trio.sleep(backend.heartbeat_interval)
            beats += 1
            try:
                with trio.fail_after(backend.heartbeat_interval):
                    dead = await backend.refresh_lease()
                    if dead:
                        logger.info("processes found dead: %s", ", ".join(sorted(dead)))
                    for workflow, key, run_id in await backend.take_flush_requests():
                        flushed = shared.flush_requested((workflow, key), run_id)
                        logger.info(
                            "flush of %r/%r (run %s) requested from outside: %s",
                            workflow,
                            key,
                            run_id,
                            "firing now" if flushed else "not pending here",
                        )
                    if dead or down or shared.reconcile_soon or beats % RECONCILE_EVERY == 0:
                        shared.reconcile_soon = False
                        await shared.reconcile()
                    if beats % SWEEP_EVERY == 0 and not self._sweeping:
                        # Its own task: a sweep of a big bucket on a loaded machine
                        # may take longer than a heartbeat interval, and must never
                        # make a lease renewal late (nor count as an outage).
                        self._sweeping = True
                        self._sweeps.start_soon(self._sweep_once)
                if down:
                    logger.info("backend reachable again")
                down = False
            except (BackendError, trio.TooSlowError) as exc:
                self._ledger.backend_errors += 1
                if not down:
                    logger.warning(
                        "backend heartbeat failed: %s",
                        exc if str(exc) else "no answer within the heartbeat interval",
                    )
                down = True

    async def _sweep_once(self) -> None:
        """One sweep of the store (see :meth:`DebounceBackend.sweep`), bounded by two
        sweep periods; what it did not reach, the next one does."""
        bound = 2 * SWEEP_EVERY * self._backend.heartbeat_interval
        try:
            with trio.move_on_after(bound) as scope:
                await self._backend.sweep()
            if scope.cancelled_caught:
                logger.info("sweep cut short after %.3g s; the next one goes on", bound)
        except BackendError as exc:
            self._ledger.backend_errors += 1
            logger.info("sweep failed: %s", exc)
        finally:
            self._sweeping = False
