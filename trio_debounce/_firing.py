"""What a coordinator's windows share: the handlers they fire, and the ledger they count in.

:class:`Handlers` holds the handler of each workflow and the reducers, and runs a fire's
handler under the error policy of ``docs/semantics.rst`` ("Handlers"): an
:exc:`Exception` is logged, counted and passed to ``on_error``; a
:exc:`BaseException` propagates. :class:`Ledger` holds the counters behind
:meth:`Coordinator.statistics`, the number of pending trailing fires and running
handlers (and the parking lot that :meth:`Coordinator.wait_idle` and the exit wait on),
and the coordinator's lifecycle flags. The local and the shared windows both write to
one ledger and read one handler table; neither calls back into the coordinator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

import trio
from trio.lowlevel import disable_ki_protection

from ._events import (
    BackendEvent,
    CoordinatorEvent,
    EventHook,
    FireFinished,
    FireStarted,
)
from ._invoke import invoke
from ._types import ErrorCallback, Fire, Handler, InitialFactory, Reducer

logger = logging.getLogger("trio_debounce")


class Ledger:
    """The counts and the lifecycle of one coordinator, shared by its parts.

    ``pending`` counts trailing fires that are still to happen, ``running`` the
    handlers that are executing; when both are zero the coordinator is idle and the
    ``idle_lot`` is unparked. The other counters are those of
    :class:`~trio_debounce.CoordinatorStatistics`.
    """

    __slots__ = (
        "aborted",
        "aborted_at",
        "backend_errors",
        "cancelled",
        "closed",
        "coalesced",
        "deleted_externally",
        "dropped",
        "dropped_pings",
        "fail_open",
        "fires",
        "handler_errors",
        "hook",
        "hook_errors",
        "idle_lot",
        "pending",
        "pings",
        "refires",
        "running",
        "stale",
        "takeovers",
        "unconfirmed",
        "unstored",
        "wake_exit_on_pending",
    )

    def __init__(self, hook: EventHook | None = None) -> None:
        #: The ``on_event`` hook, or None; see :meth:`emit`.
        self.hook = hook
        self.hook_errors = 0
        self.pending = 0
        self.running = 0
        self.pings = 0
        self.coalesced = 0
        self.fires = 0
        self.cancelled = 0
        self.stale = 0
        self.handler_errors = 0
        # The shared windows' counters (zero without a backend).
        self.backend_errors = 0
        self.fail_open = 0
        self.unconfirmed = 0
        self.unstored = 0
        self.takeovers = 0
        self.refires = 0
        self.dropped = 0
        self.deleted_externally = 0
        self.dropped_pings = 0
        #: Unparked whenever the coordinator may have become idle (and, while an exit
        #: with on_exit="flush" or "cancel" waits, when a trailing fire becomes pending).
        self.idle_lot = trio.lowlevel.ParkingLot()
        self.wake_exit_on_pending = False
        #: Set once the ``async with`` block has exited (pings then raise).
        self.closed = False
        #: Set when the block raised or was cancelled, and when (Trio's clock).
        self.aborted = False
        self.aborted_at = 0.0

    def emit(self, event: CoordinatorEvent) -> None:
        """Call the ``on_event`` hook with ``event`` (callers test :attr:`hook` first,
        so an unset hook costs one attribute test), without the coordinator's KI
        protection. An :exc:`Exception` from the hook is counted in ``hook_errors``
        and, the first time, logged: a hook never breaks the coordinator."""
        hook = self.hook
        if hook is None:
            return
        try:
            _call_hook(hook, event)
        except Exception as exc:
            self.hook_errors += 1
            if self.hook_errors == 1:
                logger.error(
                    "the on_event hook raised on %s; logged once, every failure is "
                    "counted in statistics().hook_errors",
                    type(event).__name__,
                    exc_info=exc,
                )

    @property
    def idle(self) -> bool:
        """No trailing fire pending, no handler running."""
        return self.pending == 0 and self.running == 0

    def pending_added(self) -> None:
        """A trailing fire became pending (an exit that flushes or cancels must see it)."""
        self.pending += 1
        if self.wake_exit_on_pending:
            self.idle_lot.unpark_all()

    def pending_dropped(self) -> None:
        """A pending trailing fire will not happen (cancelled, or handed off)."""
        self.pending -= 1
        self.check_idle()

    def handler_ended(self) -> None:
        """A handler started by the coordinator returned, raised or was cancelled."""
        self.running -= 1
        self.check_idle()

    def check_idle(self) -> None:
        if self.pending == 0 and self.running == 0:
            self.idle_lot.unpark_all()

    async def wait_idle(self) -> None:
        """Wait until idle; always a checkpoint."""
        if self.idle:
            await trio.lowlevel.checkpoint()
            return
        while self.pending or self.running:
            await self.idle_lot.park()


@disable_ki_protection
def _call_hook(hook: EventHook, event: CoordinatorEvent) -> None:
    """Run a user's ``on_event`` hook without the coordinator's KI protection."""
    hook(event)


@disable_ki_protection
def report(on_error: ErrorCallback, fire: Fire, exc: Exception) -> None:
    """Run a user's ``on_error`` callback without the coordinator's KI protection."""
    on_error(fire, exc)


class BackendEvents:
    """Relays the events of a coordinator's backend to its :class:`Ledger` (and so
    through the hook's error policy); those reported before the ledger exists (the
    start's lease write) are held until :meth:`bind`."""

    def __init__(self) -> None:
        self._ledger: Ledger | None = None
        self._early: list[BackendEvent] = []

    def emit(self, event: BackendEvent) -> None:
        if self._ledger is not None:
            self._ledger.emit(event)
        else:
            self._early.append(event)

    def bind(self, ledger: Ledger) -> None:
        self._ledger = ledger
        early, self._early = self._early, []
        for event in early:
            ledger.emit(event)


class Handlers:
    """The handler of each workflow, the reducers by name, and the error policy.

    Args:
      handlers: workflow name -> ``async def handler(fire: Fire) -> None``.
      on_error: called as ``on_error(fire, exc)`` after a handler raised, or None.
      ledger: where handler errors are counted.
    """

    __slots__ = ("by_workflow", "ledger", "on_error", "reducers")

    def __init__(
        self, handlers: Mapping[str, Handler], on_error: ErrorCallback | None, ledger: Ledger
    ) -> None:
        #: Looked up at fire time (a replacement applies to open windows).
        self.by_workflow: dict[str, Handler] = dict(handlers)
        #: Reducer name -> (fn, initial factory), looked up when a window opens.
        self.reducers: dict[str, tuple[Reducer, InitialFactory | None]] = {}
        self.on_error = on_error
        self.ledger = ledger

    def missing(self, workflow: str) -> LookupError:
        """The error for a ping that would open a window nothing can fire."""
        return LookupError(
            f"no handler for workflow {workflow!r}: pass on_fire=, or register one with "
            "set_handler() or open_coordinator(handlers=...)"
        )

    def of(self, on_fire: Handler | None, workflow: str) -> Handler | None:
        """The handler of a fire: the window's ``on_fire``, else the workflow's now."""
        return on_fire if on_fire is not None else self.by_workflow.get(workflow)

    async def call(self, handler: Handler | None, fire: Fire) -> None:
        """Run ``handler(fire)`` under the error policy (the handler and ``on_error``
        run without KI protection; see ``_invoke.invoke``); the event hook's events
        carry ``fire.reason``.

        Returns once the handler returned or raised an :exc:`Exception` (which is
        logged on the ``trio_debounce`` logger, counted in ``handler_errors`` and
        passed to ``on_error``): the fire is finished. A missing handler is reported
        the same way, as a :exc:`LookupError`.

        Raises:
          BaseException: whatever non-:exc:`Exception` the handler raised (such as
            :exc:`trio.Cancelled` or :exc:`KeyboardInterrupt`); the fire is then not
            finished.
        """
        ledger = self.ledger
        if ledger.hook is not None:
            await self._observed_call(handler, fire)
            return
        await self._call(handler, fire)

    async def _observed_call(self, handler: Handler | None, fire: Fire) -> None:
        """:meth:`call`, between a :class:`FireStarted` and a :class:`FireFinished`."""
        ledger = self.ledger
        reason = fire.reason
        started = trio.current_time()
        ledger.emit(FireStarted(fire, started, started - fire.fired_at, reason))
        try:
            error = await self._call(handler, fire)
        except BaseException as exc:
            ended = trio.current_time()
            ledger.emit(FireFinished(fire, ended, ended - started, "cancelled", exc, reason))
            raise
        ended = trio.current_time()
        outcome: Literal["returned", "raised"] = "returned" if error is None else "raised"
        ledger.emit(FireFinished(fire, ended, ended - started, outcome, error, reason))

    async def _call(self, handler: Handler | None, fire: Fire) -> Exception | None:
        """:meth:`call`; returns the :exc:`Exception` it handled, else None."""
        try:
            if handler is None:
                raise LookupError(
                    f"no handler for workflow {fire.workflow!r} when its window "
                    f"{fire.key!r} fired (run {fire.run_id})"
                )
            await invoke(handler, fire)
        except Exception as exc:
            self.ledger.handler_errors += 1
            logger.error(
                "handler for workflow %r key %r (run %s, %s edge) raised",
                fire.workflow,
                fire.key,
                fire.run_id,
                fire.edge.value,
                exc_info=exc,
            )
            if self.on_error is not None:
                try:
                    report(self.on_error, fire, exc)
                except Exception as callback_exc:
                    logger.error(
                        "on_error callback raised while reporting run %s",
                        fire.run_id,
                        exc_info=callback_exc,
                    )
            return exc
        return None


def closed_error() -> trio.ClosedResourceError:
    """What a call on a coordinator whose ``async with`` block has exited raises."""
    return trio.ClosedResourceError("this coordinator's async with block has exited")
