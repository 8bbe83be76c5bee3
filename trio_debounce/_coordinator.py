"""The in-memory debounce coordinator and :func:`open_coordinator`."""

from __future__ import annotations

import inspect
import logging
import math
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal, NoReturn

import trio
from trio.lowlevel import disable_ki_protection, enable_ki_protection

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from . import _validate
from ._types import (
    CoordinatorStatistics,
    DebounceResult,
    Edge,
    ErrorCallback,
    Fire,
    Handler,
    Mode,
    Outcome,
)
from ._window import CLOSED, FLUSHED, OPEN, Window

logger = logging.getLogger("trio_debounce")

#: The values of ``open_coordinator(on_exit=...)``.
OnExit = Literal["wait", "flush", "cancel"]
_ON_EXIT = ("wait", "flush", "cancel")

_INF = math.inf
_TRAILING = Mode.TRAILING
_LEADING = Mode.LEADING
_BOTH = Mode.BOTH
_COALESCE = Outcome.COALESCE
_SCHEDULE_TRAILING = Outcome.SCHEDULE_TRAILING
_FIRE_IMMEDIATE = Outcome.FIRE_IMMEDIATE
_new_tuple = tuple.__new__


class _NoPublicConstructor(type):
    """Metaclass that refuses ``Cls(...)``; the library builds instances via ``_create``."""

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor; "
            "use trio_debounce.open_coordinator()"
        )

    def _create(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


@disable_ki_protection
async def _invoke(handler: Handler, fire: Fire) -> None:
    """Run a user's handler without the coordinator's KI protection."""
    result: object = handler(fire)
    if not inspect.isawaitable(result):
        raise TypeError(
            f"the handler {handler!r} returned {result!r}, not an awaitable: handlers are "
            "async functions (async def handler(fire): ...)"
        )
    await result


@disable_ki_protection
def _report(on_error: ErrorCallback, fire: Fire, exc: Exception) -> None:
    """Run a user's on_error callback without the coordinator's KI protection."""
    on_error(fire, exc)


def _closed_error() -> trio.ClosedResourceError:
    return trio.ClosedResourceError("this coordinator's async with block has exited")


class Coordinator(metaclass=_NoPublicConstructor):
    """Debounce windows keyed by ``(workflow, key)``, each a task in a private nursery.

    Get one from :func:`open_coordinator`; it cannot be constructed directly. All
    methods must be called from the Trio run that opened the coordinator.

    A window opens with the first ping of a burst and is identified by its
    ``(workflow, key)`` pair. Its deadline is kept on the window and checked by the
    window's task when it wakes, so a ping into an open window is a dict lookup and a
    few attribute writes: no task spawn, no cancellation, and no change to Trio's
    deadline heap unless the ping moves the deadline *earlier* (a shorter ``delay``).
    See :doc:`/semantics` for the exact rules.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        handlers: Mapping[str, Handler],
        on_error: ErrorCallback | None,
    ) -> None:
        self._nursery = nursery
        self._handlers: dict[str, Handler] = dict(handlers)
        self._on_error = on_error
        self._windows: dict[tuple[str, str], Window] = {}
        self._closed = False
        # Set when the block raised or was cancelled, and when.
        self._aborted = False
        self._aborted_at = 0.0
        # Set while a normal exit with on_exit="flush"/"cancel" waits: a new pending
        # trailing fire must wake the exit loop, which flushes or cancels it.
        self._wake_exit_on_pending = False
        self._idle_lot = trio.lowlevel.ParkingLot()
        # The run's clock, bound once: trio.current_time() looks the run up in a
        # thread-local on every call, which would double the cost of a ping.
        self._now = trio.lowlevel.current_clock().current_time
        # Counters behind statistics().
        self._pending = 0
        self._running = 0
        self._pings = 0
        self._coalesced = 0
        self._fires = 0
        self._cancelled = 0
        self._handler_errors = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<trio_debounce.Coordinator {state}, {len(self._windows)} windows>"

    # ------------------------------------------------------------------ handlers

    @enable_ki_protection
    def set_handler(self, workflow: str, handler: Handler | None) -> None:
        """Register the handler for ``workflow``'s fires, replacing any previous one.

        The handler is looked up when a window fires, so a replacement applies to
        windows that are already open. A window's own ``on_fire`` (the latest non-None
        one among its pings) takes precedence over the workflow's handler.

        Args:
          workflow (str): the workflow name, a non-empty string.
          handler: ``async def handler(fire: Fire) -> None``, or ``None`` to remove the
            workflow's handler. A window that fires with neither an ``on_fire`` nor a
            workflow handler logs an error, counts a handler error and calls
            ``on_error`` with a :class:`LookupError`.

        Raises:
          TypeError: ``workflow`` is not a str or ``handler`` is not callable.
          ValueError: ``workflow`` is empty.
        """
        _validate.name("workflow", workflow)
        _validate.handler("handler", handler)
        if handler is None:
            self._handlers.pop(workflow, None)
        else:
            self._handlers[workflow] = handler

    # --------------------------------------------------------------------- pings

    @enable_ki_protection
    async def debounce(
        self,
        workflow: str,
        key: str,
        payload: Any = None,
        *,
        delay: float,
        max_delay: float | None = None,
        mode: Mode | str = Mode.TRAILING,
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """Ping the window ``(workflow, key)``: open it, or let it absorb the ping.

        This is a checkpoint: if the calling task is already cancelled it raises
        :exc:`trio.Cancelled` before changing any state; once the ping is taken it
        returns normally (the trailing checkpoint is cancel-shielded). Arguments,
        result and errors are those of :meth:`debounce_nowait`.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        result = self.debounce_nowait(
            workflow,
            key,
            payload,
            delay=delay,
            max_delay=max_delay,
            mode=mode,
            run_id=run_id,
            on_fire=on_fire,
        )
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    @enable_ki_protection
    def debounce_nowait(
        self,
        workflow: str,
        key: str,
        payload: Any = None,
        *,
        delay: float,
        max_delay: float | None = None,
        mode: Mode | str = Mode.TRAILING,
        run_id: str | None = None,
        on_fire: Handler | None = None,
    ) -> DebounceResult:
        """Ping the window ``(workflow, key)`` without checkpointing.

        Let *t* be the current time (:func:`trio.current_time`) and *t0* the time of
        the window's first ping. A ping at *t* sets the window's deadline to
        ``min(t + delay, t0 + max_delay)`` (``t + delay`` without ``max_delay``). A
        ping at or after the deadline of the window in the table opens a new window,
        even if the old window's task has not run yet at that instant.

        Args:
          workflow (str): the workflow name, non-empty.
          key (str): the debounce key, non-empty.
          payload: anything; a trailing fire carries the latest payload of its window
            (it is stored, not copied).
          delay (float): seconds of silence that end the window, finite and >= 0. Per
            ping: a ping with a shorter delay may move the deadline earlier.
          max_delay (float | None): seconds from the window's first ping after which it
            is due whatever the pings do; finite, >= 0 and >= ``delay``. It belongs to
            the window: only the opening ping's value is used, a later ping's value is
            checked and then ignored.
          mode (Mode | str): ``"trailing"``, ``"leading"`` or ``"both"``. It belongs to
            the window: a later ping with another mode raises :exc:`ValueError`.
          run_id (str | None): the run id of the window this ping opens; a uuid4 hex
            is generated if it is ``None``. Ignored when the ping lands in an open
            window, whose run id is kept.
          on_fire: ``async def on_fire(fire: Fire) -> None``. The handler of a fire is
            the latest non-None ``on_fire`` among the window's pings, else the handler
            registered for the workflow at fire time.

        Returns:
          DebounceResult: the outcome, the window's run id, its pending trailing fire
          time (Trio's clock) and its ping count.

        Raises:
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          TypeError: an argument has the wrong type (the message names it).
          ValueError: a bad duration, mode, or empty name, ``max_delay < delay``, or a
            mode that differs from the open window's.
          LookupError: neither this ping, nor the window's earlier pings, give an
            ``on_fire`` and no handler is registered for ``workflow``.
        """
        if self._closed:
            raise _closed_error()
        if type(delay) is not float or not 0.0 <= delay < _INF:
            delay = _validate.duration("delay", delay)
        if max_delay is not None:
            if type(max_delay) is not float or not 0.0 <= max_delay < _INF:
                max_delay = _validate.duration("max_delay", max_delay)
            if max_delay < delay:
                raise ValueError(
                    f"max_delay must be >= delay, got max_delay={max_delay!r} and delay={delay!r}"
                )
        if run_id is not None and (type(run_id) is not str or not run_id):
            _validate.run_id(run_id)
        if on_fire is not None:
            _validate.handler("on_fire", on_fire)

        now = self._now()
        ident = (workflow, key)
        try:
            window = self._windows.get(ident)
        except TypeError:  # unhashable: say which argument is bad
            _validate.name("workflow", workflow)
            _validate.name("key", key)
            raise
        if window is not None and now < window.deadline:
            # The ping lands in an open window: O(1) attribute writes.
            if mode is not window.mode and mode != window.mode:
                raise ValueError(
                    f"mode {_validate.mode(mode).value!r} differs from the mode "
                    f"{window.mode.value!r} of the open window {ident!r}"
                )
            if on_fire is None and window.on_fire is None and workflow not in self._handlers:
                raise self._no_handler(workflow)
            window.count += 1
            window.payload = payload
            if on_fire is not None:
                window.on_fire = on_fire
            deadline = now + delay
            if deadline > window.cap:
                deadline = window.cap
            if deadline < window.deadline and window.scope is not None:
                # The rare move to an earlier time wakes the sleeping task earlier.
                window.scope.deadline = deadline
            window.deadline = deadline
            if window.trailing:
                scheduled_at: float | None = deadline
            elif window.mode is _BOTH:
                window.trailing = True
                self._pending += 1
                if self._wake_exit_on_pending:
                    self._idle_lot.unpark_all()
                scheduled_at = deadline
            else:
                scheduled_at = None
            self._pings += 1
            self._coalesced += 1
            return _new_tuple(
                DebounceResult, (_COALESCE, window.run_id, scheduled_at, window.count)
            )
        return self._open_window(ident, now, payload, delay, max_delay, mode, run_id, on_fire)

    def _open_window(
        self,
        ident: tuple[str, str],
        now: float,
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode | str,
        run_id: str | None,
        on_fire: Handler | None,
    ) -> DebounceResult:
        workflow, key = ident
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        mode = _validate.mode(mode)
        if on_fire is None and workflow not in self._handlers:
            raise self._no_handler(workflow)
        if run_id is None:
            run_id = uuid.uuid4().hex
        cap = _INF if max_delay is None else now + max_delay
        deadline = now + delay
        if deadline > cap:
            deadline = cap
        trailing = mode is _TRAILING
        window = Window(ident, mode, trailing, now, deadline, cap, payload, run_id, on_fire)
        # A due window still in the table (its task has not run at this instant) is
        # replaced here; its task still fires it with its own state.
        self._windows[ident] = window
        self._nursery.start_soon(self._window_task, window)
        self._pings += 1
        if trailing:
            self._pending += 1
            if self._wake_exit_on_pending:
                self._idle_lot.unpark_all()
            return _new_tuple(DebounceResult, (_SCHEDULE_TRAILING, run_id, deadline, 1))
        handler = on_fire if on_fire is not None else self._handlers[workflow]
        fire = Fire(workflow, key, payload, run_id, 1, now, now, Edge.LEADING)
        self._fires += 1
        self._running += 1
        self._nursery.start_soon(self._call_handler, handler, fire)
        return _new_tuple(DebounceResult, (_FIRE_IMMEDIATE, run_id, None, 1))

    def _no_handler(self, workflow: str) -> LookupError:
        return LookupError(
            f"no handler for workflow {workflow!r}: pass on_fire=, or register one with "
            "set_handler() or open_coordinator(handlers=...)"
        )

    # ------------------------------------------------------------ cancel / flush

    @enable_ki_protection
    async def cancel(self, workflow: str, key: str) -> bool:
        """Close the open window ``(workflow, key)`` without firing it.

        A checkpoint, like :meth:`debounce`. The next ping opens a new window (in
        leading mode it fires at once). A leading fire already happened at ping time
        and is not undone. At or after the window's deadline the window is due, not
        open: ``cancel`` returns False and the due fire happens.

        Returns:
          bool: True if a window was open and is now closed.

        Raises:
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          TypeError, ValueError: ``workflow`` or ``key`` is not a non-empty str.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise _closed_error()
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        window = self._windows.get((workflow, key))
        cancelled = window is not None and self._now() < window.deadline
        if cancelled:
            assert window is not None
            self._cancel_window(window)
            self._cancelled += 1
        await trio.lowlevel.cancel_shielded_checkpoint()
        return cancelled

    @enable_ki_protection
    async def flush(self, workflow: str, key: str) -> bool:
        """Fire the pending trailing fire of ``(workflow, key)`` now and close the window.

        A checkpoint, like :meth:`debounce`. The fire carries the window's latest
        payload and ``fired_at`` equal to the current time; its handler runs as a task
        in the coordinator's nursery, not inside this call. A window with no pending
        trailing fire (leading mode, or both-edges with a single ping) is closed and
        False is returned. At or after the window's deadline the window is due, not
        open: ``flush`` returns False and the due fire happens at its deadline.

        Returns:
          bool: True if a trailing fire was pending and is now committed.

        Raises:
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          TypeError, ValueError: ``workflow`` or ``key`` is not a non-empty str.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise _closed_error()
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        now = self._now()
        window = self._windows.get((workflow, key))
        flushed = False
        if window is not None and now < window.deadline:
            flushed = self._flush_window(window, now)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return flushed

    def _cancel_window(self, window: Window) -> None:
        """Close an open window without firing it (pending fire dropped)."""
        del self._windows[window.ident]
        window.state = CLOSED
        if window.trailing:
            window.trailing = False
            self._pending -= 1
            self._check_idle()
        if window.scope is not None:
            window.scope.cancel()

    def _flush_window(self, window: Window, now: float) -> bool:
        """Detach an open window; its task fires it at ``now`` if a fire is pending."""
        del self._windows[window.ident]
        if window.trailing:
            window.state = FLUSHED
            window.flushed_at = now
        else:
            window.state = CLOSED
        if window.scope is not None:
            window.scope.cancel()
        return window.state == FLUSHED

    # ---------------------------------------------------------------- the tasks

    @enable_ki_protection
    async def _window_task(self, window: Window) -> None:
        # Sleep until the window is due. A ping that moves the deadline later only
        # writes window.deadline; we notice when we wake and sleep again.
        try:
            while window.state == OPEN:
                deadline = window.deadline
                if self._now() >= deadline:
                    break
                with trio.CancelScope(deadline=deadline) as scope:
                    window.scope = scope
                    await trio.sleep_forever()
                window.scope = None
        except trio.Cancelled:
            # The coordinator is going down: its nursery was cancelled (an abort, or the
            # final close, when nothing is pending), or an enclosing cancel scope was,
            # which reaches this task before the block's own abort may have run.
            window.scope = None
            if not self._closed:
                self._abort()
            committed = self._settle_after_abort(window)
            if committed is not None:
                self._nursery.start_soon(self._call_handler, *committed)
            raise
        if self._aborted:
            committed = self._settle_after_abort(window)
            if committed is not None:
                await self._call_handler(*committed)
            return
        if window.state == CLOSED:
            return
        if window.state == OPEN:
            # Due at its deadline. A ping at this instant may already have replaced
            # the window in the table.
            fired_at = window.deadline
            if self._windows.get(window.ident) is window:
                del self._windows[window.ident]
        else:
            fired_at = window.flushed_at
        if not window.trailing:
            window.state = CLOSED
            return  # leading-only: the window closes without a fire
        await self._call_handler(*self._start_trailing(window, fired_at))

    def _settle_after_abort(self, window: Window) -> tuple[Handler | None, Fire] | None:
        """Decide, by time, what an abort does to a window's pending trailing fire.

        A fire that was due when the block aborted (its deadline reached) or committed
        by :meth:`flush` still starts, under the cancelled nursery, exactly as if its
        task had run before the body raised; a fire whose time had not come is dropped
        and counted as cancelled. Returns ``(handler, fire)`` for a fire to start.
        """
        if not self._aborted or window.state == CLOSED or not window.trailing:
            return None
        if window.state == FLUSHED:
            return self._start_trailing(window, window.flushed_at)
        if window.deadline <= self._aborted_at:
            return self._start_trailing(window, window.deadline)
        window.state = CLOSED
        window.trailing = False
        self._pending -= 1
        self._cancelled += 1
        self._check_idle()
        return None

    def _start_trailing(self, window: Window, fired_at: float) -> tuple[Handler | None, Fire]:
        """Close a window whose trailing fire is pending and turn it into a running fire.

        Moves the fire from pending to running in one step (so wait_idle never sees
        both at zero in between) and returns ``(handler, fire)`` for _call_handler.
        """
        window.state = CLOSED
        window.trailing = False
        self._pending -= 1
        self._running += 1
        self._fires += 1
        workflow, key = window.ident
        handler = window.on_fire
        if handler is None:
            handler = self._handlers.get(workflow)
        fire = Fire(
            workflow,
            key,
            window.payload,
            window.run_id,
            window.count,
            window.first_ping_at,
            fired_at,
            Edge.TRAILING,
        )
        return handler, fire

    @enable_ki_protection
    async def _call_handler(self, handler: Handler | None, fire: Fire) -> None:
        # KI-protected, so Ctrl-C cannot land between the counters and the try; the
        # handler and on_error run unprotected (see _invoke and _report).
        try:
            if handler is None:
                raise LookupError(
                    f"no handler for workflow {fire.workflow!r} when its window "
                    f"{fire.key!r} fired (run {fire.run_id})"
                )
            await _invoke(handler, fire)
        except Exception as exc:
            self._handler_errors += 1
            logger.error(
                "handler for workflow %r key %r (run %s, %s edge) raised",
                fire.workflow,
                fire.key,
                fire.run_id,
                fire.edge.value,
                exc_info=exc,
            )
            if self._on_error is not None:
                try:
                    _report(self._on_error, fire, exc)
                except Exception as callback_exc:
                    logger.error(
                        "on_error callback raised while reporting run %s",
                        fire.run_id,
                        exc_info=callback_exc,
                    )
        finally:
            self._running -= 1
            self._check_idle()

    def _check_idle(self) -> None:
        if self._pending == 0 and self._running == 0:
            self._idle_lot.unpark_all()

    # -------------------------------------------------------------- inspection

    def has(self, workflow: str, key: str) -> bool:
        """Return True if the window ``(workflow, key)`` is open now.

        Follows the time rule exactly: False at or after the window's deadline, even
        if its task has not run yet. Any pair that names no open window gives False.

        Raises:
          TypeError: ``workflow`` or ``key`` is unhashable (so cannot name a window).
        """
        try:
            window = self._windows.get((workflow, key))
        except TypeError:
            raise TypeError(f"workflow and key must be str, got {workflow!r} and {key!r}") from None
        return window is not None and self._now() < window.deadline

    def __len__(self) -> int:
        """The number of windows in the table.

        This may include a window that is due at this very instant but whose task has
        not run yet (:meth:`has` says False for it).
        """
        return len(self._windows)

    def statistics(self) -> CoordinatorStatistics:
        """Return a :class:`CoordinatorStatistics` snapshot. Works after exit too."""
        return CoordinatorStatistics(
            open_windows=len(self._windows),
            pending_trailing_fires=self._pending,
            running_handlers=self._running,
            pings=self._pings,
            coalesced=self._coalesced,
            fires=self._fires,
            cancelled=self._cancelled,
            handler_errors=self._handler_errors,
        )

    async def wait_idle(self) -> None:
        """Wait until no trailing fire is pending and no handler is running.

        Always a checkpoint. Open leading windows (and both-edges windows with one
        ping) have nothing pending and do not keep this waiting. Returns at once if
        the coordinator is idle; it does not raise after the coordinator has closed.
        Do not call it from a handler: it would wait for that handler to return.
        """
        if self._pending == 0 and self._running == 0:
            await trio.lowlevel.checkpoint()
            return
        while self._pending or self._running:
            await self._idle_lot.park()

    # ------------------------------------------------------------------- exit

    @enable_ki_protection
    async def _drain(self, on_exit: OnExit) -> None:
        """The normal exit of the async with block, per ``on_exit``."""
        self._wake_exit_on_pending = on_exit != "wait"
        while True:
            if on_exit == "flush":
                now = self._now()
                for window in list(self._windows.values()):
                    if window.trailing and now < window.deadline:
                        self._flush_window(window, now)
            elif on_exit == "cancel":
                now = self._now()
                for window in list(self._windows.values()):
                    if window.trailing and now < window.deadline:
                        self._cancelled += 1
                        self._cancel_window(window)
            if self._pending == 0 and self._running == 0:
                break
            await self._idle_lot.park()
        # Nothing is pending and no handler runs: what is left are leading-only
        # windows with nothing to fire. Close them now.
        self._closed = True
        self._windows.clear()
        self._nursery.cancel_scope.cancel()

    @enable_ki_protection
    def _abort(self) -> None:
        """The body raised or was cancelled: cancel everything.

        Each window's task then settles its pending fire by time (see
        _settle_after_abort) as it sees the cancellation. Idempotent: the first call
        fixes the abort time.
        """
        if self._aborted:
            return
        self._closed = True
        self._aborted = True
        self._aborted_at = self._now()
        self._windows.clear()
        self._nursery.cancel_scope.cancel()
        self._check_idle()


@asynccontextmanager
async def open_coordinator(
    *,
    handlers: Mapping[str, Handler] | None = None,
    on_error: ErrorCallback | None = None,
    on_exit: OnExit = "wait",
) -> AsyncIterator[Coordinator]:
    """Open an in-memory :class:`Coordinator` that lives as long as the ``async with``.

    ::

        async with trio_debounce.open_coordinator(handlers={"build": build}) as coord:
            await coord.debounce("build", "docs/", delay=2.0, max_delay=30.0)

    Args:
      handlers (Mapping[str, Handler] | None): the initial handler of each workflow,
        ``{workflow: async def handler(fire: Fire) -> None}``; see
        :meth:`Coordinator.set_handler`.
      on_error: ``def on_error(fire: Fire, exc: Exception) -> object``, called (sync)
        after a handler raised an :class:`Exception` and the error was logged on the
        ``trio_debounce`` logger. If it raises, that is logged too. Handler errors never
        cancel the coordinator or other windows.
      on_exit (str): what a normal exit of the block does with pending trailing fires:
        ``"wait"`` (the default) lets them fire at their scheduled times; ``"flush"``
        fires them at once; ``"cancel"`` drops them. In every case the exit then waits
        for running handlers to finish, and pings made meanwhile (by handlers, say) are
        accepted and treated the same way. Leading windows with nothing left to fire
        are not waited for: they stay open while the exit waits, then close.

    If the block raises, or is cancelled from outside, running handlers are cancelled,
    fires whose deadline had been reached (or that ``flush`` committed) still start,
    and fires whose time had not come are dropped; see :doc:`/semantics`. The block's
    exception propagates as itself, not wrapped in an :class:`ExceptionGroup` (the
    coordinator's own tasks never raise; a :class:`BaseException` escaping a handler,
    such as :exc:`KeyboardInterrupt`, propagates in an exception group, together with
    the block's exception if there is one).

    After the block exits, ``debounce``, ``debounce_nowait``, ``cancel`` and
    ``flush`` raise :exc:`trio.ClosedResourceError`; ``has``, ``len``, ``statistics``
    and ``wait_idle`` keep working.

    Raises:
      ValueError: ``on_exit`` is not one of the three values, or a workflow name in
        ``handlers`` is empty.
      TypeError: a handler or ``on_error`` is not callable, or a workflow name is not
        a str.
    """
    if on_exit not in _ON_EXIT:
        raise ValueError(f"on_exit must be one of 'wait', 'flush', 'cancel', got {on_exit!r}")
    try:
        handler_map = dict(handlers or {})
    except (TypeError, ValueError):
        raise TypeError(
            f"handlers must be a mapping of workflow names to handlers, not {handlers!r}"
        ) from None
    for workflow, handler in handler_map.items():
        _validate.name("workflow", workflow)
        _validate.handler(f"handlers[{workflow!r}]", handler)
        if handler is None:
            raise TypeError(f"handlers[{workflow!r}] must be an async callable, not None")
    if on_error is not None and not callable(on_error):
        raise TypeError(f"on_error must be callable, not {on_error!r}")
    if inspect.iscoroutinefunction(on_error):
        raise TypeError(f"on_error is called synchronously; pass a sync function, not {on_error!r}")

    body_error: BaseException | None = None
    nursery_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            coordinator: Coordinator = Coordinator._create(nursery, handler_map, on_error)
            try:
                yield coordinator
                await coordinator._drain(on_exit)
            except BaseException as exc:
                # From the body, or from the exit wait (cancelled from outside,
                # Ctrl-C): re-raised as itself once the nursery is closed.
                body_error = exc
                coordinator._abort()
    except BaseException as exc:
        # A task raised: a BaseException from a handler, or the cancellations of an
        # outside cancel scope on their way out.
        nursery_error = exc
    try:
        if nursery_error is not None:
            if body_error is None:
                raise nursery_error
            if not _only_cancellations(nursery_error):
                # Keep both, as a plain nursery would.
                raise BaseExceptionGroup(
                    "the coordinator's block and its tasks raised", [body_error, nursery_error]
                )
        if body_error is not None:
            raise body_error
    finally:
        del body_error, nursery_error


def _only_cancellations(exc: BaseException) -> bool:
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return False
