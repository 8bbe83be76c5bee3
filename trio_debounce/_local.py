"""The local window table: the windows of one process, each a task in the nursery.

:class:`LocalWindows` owns the table ``(workflow, key) -> Window`` and everything that
happens to a local window: a ping opens it or joins it (every time, count and payload
decision is the engine's, ``_engine``), its task sleeps until it is due and fires it,
``cancel`` and ``flush`` close it, an exit flushes or cancels what is pending, and an
abort settles each pending fire by time. ``overlap="queue-latest"`` keeps one run per
key (:class:`~trio_debounce._window.KeyRun`) and a window that waits for it.

The coordinator's ``debounce_nowait`` keeps one hand-inlined copy of the plain
coalescing ping on this table (see ``docs/design.rst``); every other ping comes here.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import trio
from trio.lowlevel import enable_ki_protection

from . import _engine, _options, _validate
from ._firing import Handlers, Ledger, closed_error
from ._types import (
    DebounceResult,
    Edge,
    Fire,
    FireReason,
    Handler,
    InitialFactory,
    Mode,
    ModeName,
    Outcome,
    Reducer,
)
from ._window import CLOSED, FLUSHED, OPEN, KeyRun, Window

_INF = math.inf
_COALESCE = Outcome.COALESCE
_SCHEDULE_TRAILING = Outcome.SCHEDULE_TRAILING
_FIRE_IMMEDIATE = Outcome.FIRE_IMMEDIATE
_STALE = Outcome.STALE
_LEADING = FireReason.LEADING
_FLUSH = FireReason.FLUSH
_EXIT = FireReason.EXIT
_OVERFLOW = FireReason.OVERFLOW
_RUN_END = FireReason.RUN_END
#: ``DebounceResult`` is a NamedTuple: ``tuple.__new__(DebounceResult, values)`` builds
#: one without the keyword handling of its constructor (the hot path's way).
new_tuple = tuple.__new__


def _never(_: tuple[str, str]) -> bool:
    return False


def _abort_sleep(_: Any) -> trio.lowlevel.Abort:
    """The abort function of a window task's sleep: any cancellation ends it."""
    return trio.lowlevel.Abort.SUCCEEDED


def _check_ping(
    delay: object, max_delay: object, run_id: object, on_fire: object
) -> tuple[float, float | None]:
    """Validate a ping's timing, run id and handler; returns ``(delay, max_delay)``
    as floats. The common case (floats, a str run id) costs a few type checks."""
    if type(delay) is not float or not 0.0 <= delay < _INF:
        delay = _validate.duration("delay", delay)
    if max_delay is not None:
        if type(max_delay) is not float or not 0.0 <= max_delay < _INF:
            max_delay = _validate.duration("max_delay", max_delay)
        if max_delay < delay:
            raise _validate.max_delay_below_delay(max_delay, delay)
    if run_id is not None and (type(run_id) is not str or not run_id):
        _validate.run_id(run_id)
    if on_fire is not None:
        _validate.handler("on_fire", on_fire)
    return delay, max_delay


class LocalWindows:
    """The in-process windows of a coordinator.

    Args:
      nursery: the coordinator's nursery: each window's task, and each fire's handler,
        runs in it.
      now: the run's clock, bound (``trio.lowlevel.current_clock().current_time``).
      ledger: the coordinator's counters and lifecycle flags.
      handlers: the coordinator's handlers, reducers and error policy.
      abort: called when a window's task sees the nursery cancelled before the
        coordinator knew it was going down (an enclosing cancel scope).
      fencing: True to give each fire the coordinator's fire counter as its fencing
        token; False (a coordinator with a backend, whose local windows are fail-open
        ones, outside the shared order) gives 0.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        now: Callable[[], float],
        ledger: Ledger,
        handlers: Handlers,
        abort: Callable[[], None],
        *,
        fencing: bool,
    ) -> None:
        self._nursery = nursery
        self._now = now
        self._ledger = ledger
        self._handlers = handlers
        self._abort = abort
        self._fencing = fencing
        #: The open windows (and, for an instant, a due one its task has not fired).
        self.windows: dict[tuple[str, str], Window] = {}
        #: The queue-latest runs and fired order keys of the keys.
        self.keys = KeyState(self.windows, now, ledger)
        #: Is another kind of window (a flow-control one) open for a key? Such a key
        #: cannot open a debounce window.
        self.other_open: Callable[[tuple[str, str]], bool] = _never

    # ------------------------------------------------------------------- pings

    def ping(
        self,
        workflow: str,
        key: str,
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode | ModeName,
        run_id: str | None,
        on_fire: Handler | None,
    ) -> DebounceResult:
        """A ping without options (``debounce_nowait``'s slow path); arguments as
        :meth:`Coordinator.debounce_nowait`'s, validated here."""
        if self._ledger.closed:
            raise closed_error()
        delay, max_delay = _check_ping(delay, max_delay, run_id, on_fire)
        now = self._now()
        ident = (workflow, key)
        try:
            window = self.windows.get(ident)
        except TypeError:  # unhashable: say which argument is bad
            _validate.name("workflow", workflow)
            _validate.name("key", key)
            raise
        if window is not None and (window.opts is not None or _engine.is_due(window, now)):
            if window.opts is not None:
                # A window with options (or a due "queue-latest" one that may wait).
                return self._ping_with(
                    workflow, key, payload, delay, max_delay, mode, run_id, on_fire,
                    None, _options.LAST, None, None, _options.ALLOW, None, None, False,
                )  # fmt: skip
            window = None
        if window is None:
            _validate.name("workflow", workflow)
            _validate.name("key", key)
            return self._open(
                ident, now, payload, delay, max_delay, _validate.mode(mode), run_id, on_fire
            )
        # The ping lands in an open window: O(1) attribute writes.
        if mode is not window.mode and mode != window.mode:
            raise ValueError(
                f"mode {_validate.mode(mode).value!r} differs from the mode "
                f"{window.mode.value!r} of the open window {ident!r}"
            )
        if (
            on_fire is None
            and window.on_fire is None
            and workflow not in self._handlers.by_workflow
        ):
            raise self._handlers.missing(workflow)
        return self._absorb(window, now, payload, delay, on_fire)

    def ping_with_options(
        self,
        workflow: str,
        key: str,
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode | ModeName,
        run_id: str | None,
        on_fire: Handler | None,
        options: Mapping[str, Any],
    ) -> DebounceResult:
        """A ping with keyword options (:class:`~trio_debounce.DebounceOptions`)."""
        _options.check_names(options)
        get = options.get
        return self._ping_with(
            workflow,
            key,
            payload,
            delay,
            max_delay,
            mode,
            run_id,
            on_fire,
            get("max_count"),
            get("payload_policy", _options.LAST),
            get("max_items"),
            get("overflow"),
            get("overlap", _options.ALLOW),
            get("run_timeout"),
            get("order_key"),
            get("drop_stale", False),
        )

    def _ping_with(
        self,
        workflow: str,
        key: str,
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode | ModeName,
        run_id: str | None,
        on_fire: Handler | None,
        max_count: int | None,
        payload_policy: str,
        max_items: int | None,
        overflow: str | None,
        overlap: str,
        run_timeout: float | None,
        order_key: float | None,
        drop_stale: bool,
    ) -> DebounceResult:
        """A ping with options, or any ping into a window with options.

        Everything is validated before any state changes. Never on the fast path.
        """
        if self._ledger.closed:
            raise closed_error()
        delay, max_delay = _check_ping(delay, max_delay, run_id, on_fire)
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        mode = _validate.mode(mode)
        order = None if order_key is None else _options.order_key(order_key)
        if not isinstance(drop_stale, bool):
            raise TypeError(f"drop_stale must be a bool, not {drop_stale!r}")
        if drop_stale and order is None:
            raise ValueError("drop_stale=True needs an order_key on the ping")
        opts = _options.window_options(
            mode,
            max_count,
            payload_policy,
            max_items,
            overflow,
            overlap,
            run_timeout,
            order is not None,
            self._handlers.reducers,
        )
        now = self._now()
        ident = (workflow, key)
        window = self.windows.get(ident)
        if window is not None and window.opts is not None:
            if window.opts.queue:
                self.keys.decide_due_by_time(window, now)  # it may wait, and absorb this ping
            elif window.trailing and _engine.is_due(window, now):
                self.keys.note_fired(window)  # due: it fired at its deadline
        if window is not None and (window.state != OPEN or _engine.is_due(window, now)):
            window = None
        if window is not None:
            if mode is not window.mode:
                raise ValueError(
                    f"mode {mode.value!r} differs from the mode {window.mode.value!r} of "
                    f"the open window {ident!r}"
                )
            window_opts = window.opts or _options.DEFAULT
            if window_opts != opts:
                raise _options.mismatch(ident, window_opts, opts)
            if (
                on_fire is None
                and window.on_fire is None
                and workflow not in self._handlers.by_workflow
            ):
                raise self._handlers.missing(workflow)
        if drop_stale:
            assert order is not None
            if self.keys.is_stale(ident, order):
                self._ledger.stale += 1
                if window is None:
                    return new_tuple(DebounceResult, (_STALE, "", None, 0, True, True))
                scheduled = _engine.scheduled_at(window)
                return new_tuple(
                    DebounceResult, (_STALE, window.run_id, scheduled, window.count, True, True)
                )
        if window is None:
            # The defaults after all: a plain window (opts None).
            plain = order is None and opts == _options.DEFAULT
            return self._open(
                ident, now, payload, delay, max_delay, mode, run_id, on_fire,
                None if plain else opts, order,
            )  # fmt: skip
        if window.opts is None:
            # A default window, and a ping whose options turned out to be the defaults.
            return self._absorb(window, now, payload, delay, on_fire)
        opts = window.opts
        if _engine.is_full(window):
            # overflow="fire-early": the window fires now with what it holds (even
            # while a "queue-latest" run executes), and this ping opens the next one.
            # What may raise (no handler, the reducer) runs before anything changes.
            if on_fire is None and workflow not in self._handlers.by_workflow:
                raise self._handlers.missing(workflow)
            prepared = None
            if opts.reducer:
                reducer = self._handlers.reducers[opts.payload_policy]
                prepared = (reducer, _engine.first_value(reducer, payload))
            self.keys.due_now(window, now)
            return self._open(
                ident, now, payload, delay, max_delay, mode, run_id, on_fire, opts, order, prepared
            )
        folded: Any = None
        if opts.reducer:
            folded = window.reducer[0](window.acc, payload)  # may raise: nothing changed
        return self._absorb(window, now, payload, delay, on_fire, order, folded)

    def _absorb(
        self,
        window: Window,
        now: float,
        payload: Any,
        delay: float,
        on_fire: Handler | None,
        order: float | None = None,
        folded: Any = None,
    ) -> DebounceResult:
        """The ping joins the open ``window`` (everything checked by the caller)."""
        armed = window.deadline
        if _engine.absorb(window, now, payload, delay=delay, order=order, value=folded):
            self._ledger.pending_added()
        if on_fire is not None:
            window.on_fire = on_fire
        if window.deadline < armed and window.scope is not None:
            # The rare move to an earlier time wakes the sleeping task earlier.
            window.scope.deadline = window.deadline
        opts = window.opts
        if opts is not None and opts.queue and not window.waiting and _engine.is_due(window, now):
            self.keys.queue_due(window, now)
        ledger = self._ledger
        ledger.pings += 1
        ledger.coalesced += 1
        return new_tuple(
            DebounceResult,
            (_COALESCE, window.run_id, _engine.scheduled_at(window), window.count, True, True),
        )

    def _open(
        self,
        ident: tuple[str, str],
        now: float,
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode,
        run_id: str | None,
        on_fire: Handler | None,
        opts: _options.WindowOptions | None = None,
        order: float | None = None,
        prepared: tuple[tuple[Reducer, InitialFactory | None], Any] | None = None,
    ) -> DebounceResult:
        """Open a window (arguments validated by the caller; ``prepared``: the reducer
        and its first fold, if the caller computed them)."""
        workflow, key = ident
        if on_fire is None and workflow not in self._handlers.by_workflow:
            raise self._handlers.missing(workflow)
        if self.other_open(ident):
            raise ValueError(f"{ident!r} has an open throttle, batch or rate-limit window")
        value: Any = None
        reducer = None
        if prepared is not None:
            reducer, value = prepared
        elif opts is not None and opts.reducer:
            reducer = self._handlers.reducers[opts.payload_policy]
            value = _engine.first_value(reducer, payload)  # may raise: nothing changed yet
        if run_id is None:
            run_id = uuid.uuid4().hex
        window = Window.open(
            ident, run_id, on_fire, now, payload, delay, max_delay, mode, opts, order, value
        )
        if reducer is not None:
            window.reducer = reducer
        # A due window still in the table (its task has not run at this instant) is
        # replaced here; its task still fires it with its own state.
        self.windows[ident] = window
        self._nursery.start_soon(self._run_window, window)
        ledger = self._ledger
        ledger.pings += 1
        if window.trailing:
            ledger.pending_added()
            if opts is not None and opts.queue and _engine.is_due(window, now):
                self.keys.queue_due(window, now)
            return new_tuple(
                DebounceResult,
                (_SCHEDULE_TRAILING, run_id, _engine.scheduled_at(window), 1, True, True),
            )
        handler = on_fire if on_fire is not None else self._handlers.by_workflow[workflow]
        ledger.fires += 1
        if order is not None:
            self.keys.note_order(ident, order)
        # A leading fire carries its ping's own payload, whatever the policy.
        fire = Fire(
            workflow, key, payload, run_id, 1, now, now, Edge.LEADING, 1, self._token(), _LEADING
        )
        ledger.running += 1
        self._nursery.start_soon(self._call, handler, fire)
        return new_tuple(DebounceResult, (_FIRE_IMMEDIATE, run_id, None, 1, True, True))

    def _token(self) -> int:
        """The fencing token of the fire just counted: the coordinator's fire counter,
        or 0 for a fail-open window (outside the shared order, like an unconfirmed
        fire)."""
        return self._ledger.fires if self._fencing else 0

    # ------------------------------------------------------------- inspection

    def _open_now(self, ident: tuple[str, str]) -> tuple[Window, float] | None:
        """The window ``ident`` and the time, if it is open now (not yet due; a due
        ``queue-latest`` window is first decided by time)."""
        window = self.windows.get(ident)
        if window is None:
            return None
        now = self._now()
        if window.opts is not None:
            self.keys.decide_due_by_time(window, now)
        if _engine.is_due(window, now):
            return None
        return window, now

    def is_open(self, ident: tuple[str, str]) -> bool:
        """Is the window ``ident`` open now (False at or after its due time)?"""
        return self._open_now(ident) is not None

    def __len__(self) -> int:
        return len(self.windows)

    # ------------------------------------------------------- cancel and flush

    def cancel(self, ident: tuple[str, str]) -> bool:
        """Close the open window ``ident`` without firing; True if one was open."""
        found = self._open_now(ident)
        if found is None:
            return False
        self.close(found[0])
        self._ledger.cancelled += 1
        return True

    def flush(self, ident: tuple[str, str]) -> bool:
        """Fire the open window ``ident`` now; True if a trailing fire was pending."""
        found = self._open_now(ident)
        return found is not None and self._flush(*found, _FLUSH)

    def flush_all(self) -> None:
        """The exit's ``on_exit="flush"``: every pending trailing fire happens now."""
        now = self._now()
        for window in list(self.windows.values()):
            if window.trailing and not _engine.is_due(window, now):
                self._flush(window, now, _EXIT)

    def cancel_all(self) -> None:
        """The exit's ``on_exit="cancel"``: every pending trailing fire is dropped."""
        now = self._now()
        for window in list(self.windows.values()):
            if window.trailing and not _engine.is_due(window, now):
                self._ledger.cancelled += 1
                self.close(window)

    def clear(self) -> None:
        """Forget every window (the coordinator closed; their tasks are cancelled)."""
        self.windows.clear()

    def close(self, window: Window) -> None:
        """Close an open window without firing it (its pending fire is dropped)."""
        del self.windows[window.ident]
        window.state = CLOSED
        if window.trailing:
            window.trailing = False
            self._ledger.pending_dropped()
        if window.scope is not None:
            window.scope.cancel()

    def _flush(self, window: Window, now: float, cause: FireReason) -> bool:
        """Detach an open window; its task fires it at ``now`` if a fire is pending,
        with reason ``cause`` (``"flush"``, or ``"exit"`` for the exit's flush).

        A "queue-latest" window is made due at ``now`` instead: it fires at once, or
        waits for its key's run (it stays in the table, absorbing pings, and fires
        with ``"run-end"`` when the run ends).
        """
        if window.opts is not None:
            if window.opts.queue:
                if not window.waiting:
                    self.keys.queue_due(window, now, cause)
                return True
            if window.trailing:
                self.keys.note_fired(window)
        del self.windows[window.ident]
        if window.trailing:
            window.state = FLUSHED
            window.flushed_at = now
            window.cause = cause
        else:
            window.state = CLOSED
        if window.scope is not None:
            window.scope.cancel()
        return window.state == FLUSHED

    # ------------------------------------------------------------- the tasks

    @enable_ki_protection
    async def _run_window(self, window: Window) -> None:
        """The window's task: sleep until it is due, then fire its trailing edge."""
        # A ping that moves the deadline later only writes window.deadline; we notice
        # when we wake and sleep again.
        try:
            while window.state == OPEN:
                deadline = window.deadline
                if _engine.is_due(window, self._now()):
                    if window.opts is not None and window.opts.queue:
                        # Waits (a later deadline) or is committed (FLUSHED).
                        self.keys.queue_due(window, deadline)
                        continue
                    break
                with trio.CancelScope(deadline=deadline) as scope:
                    window.scope = scope
                    # trio.sleep_forever() without its coroutine frame and abort
                    # closure: most of an open window's memory is its sleeping task.
                    await trio.lowlevel.wait_task_rescheduled(_abort_sleep)
                window.scope = None
        except trio.Cancelled:
            # The coordinator is going down: its nursery was cancelled (an abort, or the
            # final close, when nothing is pending), or an enclosing cancel scope was,
            # which reaches this task before the block's own abort may have run.
            window.scope = None
            if not self._ledger.closed:
                self._abort()
            committed = self._decide_after_abort(window)
            if committed is not None:
                self._nursery.start_soon(self._call, *committed)
            raise
        if self._ledger.aborted:
            committed = self._decide_after_abort(window)
            if committed is not None:
                await self._call(*committed)
            return
        if window.state == CLOSED:
            return
        if window.state == OPEN:
            # Due at its deadline. A ping at this instant may already have replaced
            # the window in the table.
            fired_at = window.deadline
            if self.windows.get(window.ident) is window:
                del self.windows[window.ident]
        else:
            fired_at = window.flushed_at
        if not window.trailing:
            window.state = CLOSED
            return  # leading-only: the window closes without a fire
        await self._call(*self._take_trailing_fire(window, fired_at))

    def _decide_after_abort(
        self, window: Window
    ) -> tuple[Handler | None, Fire, KeyRun[Window] | None] | None:
        """Decide, by time, what an abort does to a window's pending trailing fire.

        A fire that was due when the block aborted (its deadline reached) or committed
        by :meth:`flush` still starts, under the cancelled nursery, exactly as if its
        task had run before the body raised; a fire whose time had not come is dropped
        and counted as cancelled. Returns ``(handler, fire, run)`` for a fire to start.
        """
        ledger = self._ledger
        if not ledger.aborted or window.state == CLOSED or not window.trailing:
            return None
        if window.state == FLUSHED:
            return self._take_trailing_fire(window, window.flushed_at)
        if window.deadline <= ledger.aborted_at:
            return self._take_trailing_fire(window, window.deadline)
        window.state = CLOSED
        window.trailing = False
        ledger.cancelled += 1
        ledger.pending_dropped()
        return None

    def _take_trailing_fire(
        self, window: Window, fired_at: float
    ) -> tuple[Handler | None, Fire, KeyRun[Window] | None]:
        """Close a window whose trailing fire is pending and turn it into a running fire.

        Moves the fire from pending to running in one step (so wait_idle never sees
        both at zero in between) and returns ``(handler, fire, run)`` for :meth:`_call`
        (``run``: the "queue-latest" run the fire is, or None).
        """
        window.state = CLOSED
        window.trailing = False
        ledger = self._ledger
        ledger.pending -= 1
        ledger.running += 1
        ledger.fires += 1
        workflow, key = window.ident
        handler = self._handlers.of(window.on_fire, workflow)
        if window.opts is not None:
            self.keys.note_fired(window)
        fire = Fire(
            workflow,
            key,
            _engine.fire_payload(window),
            window.run_id,
            window.count,
            window.first_ping_at,
            fired_at,
            Edge.TRAILING,
            1,
            self._token(),
            _engine.reason_of(window, fired_at, window.cause),
        )
        return handler, fire, None if window.opts is None else window.run

    @enable_ki_protection
    async def _call(
        self,
        handler: Handler | None,
        fire: Fire,
        run: KeyRun[Window] | None = None,
    ) -> None:
        """Run a local fire's handler (counted as running by the caller)."""
        # KI-protected, so Ctrl-C cannot land between the counters and the try; the
        # handler and on_error run unprotected (see _invoke.invoke and _firing.report).
        try:
            await self._handlers.call(handler, fire)
        finally:
            if run is not None:
                # A "queue-latest" run: the window waiting for it fires now.
                self.keys.run_ended((fire.workflow, fire.key), run)
            self._ledger.handler_ended()


class KeyState:
    """What a key keeps across its windows: the ``queue-latest`` run that blocks its
    next fire (and the window that waits for it), and the highest order key fired
    (``drop_stale``). Decides by time when a due ``queue-latest`` window fires.

    Args:
      windows: the local window table (a committed fire leaves it).
      now: the run's clock.
      ledger: the coordinator's lifecycle flags (no waiting window fires once aborted).
    """

    def __init__(
        self, windows: dict[tuple[str, str], Window], now: Callable[[], float], ledger: Ledger
    ) -> None:
        self._windows = windows
        self._now = now
        self._ledger = ledger
        #: The blocking run of each "queue-latest" key.
        self._runs: dict[tuple[str, str], KeyRun[Window]] = {}
        #: The highest order key fired per key.
        self._fired_order: dict[tuple[str, str], float] = {}

    def is_stale(self, ident: tuple[str, str], order: float) -> bool:
        """``drop_stale``: is ``order`` not above the highest order key fired for the key?"""
        return _engine.is_stale(order, self._fired_order.get(ident))

    def note_order(self, ident: tuple[str, str], order: float) -> None:
        fired = _engine.fired_order_after(self._fired_order.get(ident), order)
        if fired is not None:
            self._fired_order[ident] = fired

    def note_fired(self, window: Window) -> None:
        """Remember the highest order key of a window whose trailing fire is committed."""
        if window.opts is not None and window.max_order is not None:
            self.note_order(window.ident, window.max_order)

    def due_now(self, window: Window, now: float) -> None:
        """Make an open window with options due at ``now`` (overflow="fire-early"):
        its fire says ``"overflow"``."""
        assert window.opts is not None
        if window.opts.queue:
            self._commit_queued_fire(window, now, _OVERFLOW)
            return
        window.cause = _OVERFLOW
        if window.trailing:
            self.note_fired(window)
        if window.scope is not None:
            window.scope.deadline = now
        _engine.commit(window, now)

    def decide_due_by_time(self, window: Window, now: float) -> None:
        """Decide by time a due "queue-latest" window whose task has not run yet at
        this instant: it waits (a later deadline, absorbing pings) or is committed."""
        if window.opts is not None and window.opts.queue:
            while window.state == OPEN and _engine.is_due(window, now):
                self.queue_due(window, window.deadline)

    def queue_due(self, window: Window, at: float, cause: FireReason | None = None) -> None:
        """A "queue-latest" window is due at ``at``: it waits while a run of its key
        blocks (absorbing pings until the run ends or times out), else it fires
        (``cause``: what made it due, a flush or the exit; None: its due time)."""
        run = self._runs.get(window.ident)
        if run is not None and _engine.wait_for_run(window, at, run.block_until):
            run.waiter = window
            scope = window.scope
            if scope is not None and window.deadline < scope.deadline:
                # Due now (a flush) but blocked until before the time its task sleeps
                # to: wake it at the block's end.
                scope.deadline = window.deadline
            return
        self._commit_queued_fire(window, at, cause)

    def _commit_queued_fire(
        self, window: Window, at: float, cause: FireReason | None = None
    ) -> None:
        """Commit a "queue-latest" window's fire at ``at``: its run blocks the key's
        next fire from now on, even before the window's task starts the handler.

        Its reason is ``cause`` if given; else ``"run-end"`` for a window that waited
        for its key's run (it fires when the run stopped blocking: its end, or its
        ``run_timeout``), and its due time's reason otherwise."""
        assert window.opts is not None
        if cause is None and window.waiting:
            cause = _RUN_END
        window.cause = cause
        ident = window.ident
        if self._windows.get(ident) is window:
            del self._windows[ident]
        window.state = FLUSHED
        window.flushed_at = at
        _engine.commit(window, at)
        previous = self._runs.get(ident)
        if previous is not None and previous.waiter is window:
            previous.waiter = None
        timeout = window.opts.run_timeout
        run: KeyRun[Window] = KeyRun(_INF if timeout is None else at + timeout)
        self._runs[ident] = run
        window.run = run
        self.note_fired(window)
        if window.scope is not None:
            window.scope.cancel()

    def run_ended(self, ident: tuple[str, str], run: KeyRun[Window]) -> None:
        """A "queue-latest" run returned: the window waiting for it fires now."""
        if self._runs.get(ident) is run:
            del self._runs[ident]
        waiter, run.waiter = run.waiter, None
        if (
            waiter is not None
            and waiter.state == OPEN
            and waiter.waiting
            and not self._ledger.aborted
        ):
            self._commit_queued_fire(waiter, self._now(), _RUN_END)


def ping_any(
    local: LocalWindows,
    workflow: str,
    key: str,
    payload: Any,
    delay: float,
    max_delay: float | None,
    mode: Mode | ModeName,
    run_id: str | None,
    on_fire: Handler | None,
    options: Mapping[str, Any] | None,
) -> DebounceResult:
    """``local``'s :meth:`~LocalWindows.ping_with_options` if there are ``options``, else
    its :meth:`~LocalWindows.ping`: a ping past ``debounce_nowait``'s hot path, or a
    shared ping failed open into a local window."""
    if options:
        return local.ping_with_options(
            workflow, key, payload, delay, max_delay, mode, run_id, on_fire, options
        )
    return local.ping(workflow, key, payload, delay, max_delay, mode, run_id, on_fire)
