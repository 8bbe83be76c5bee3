"""The in-memory debounce coordinator and :func:`open_coordinator`."""

from __future__ import annotations

import datetime
import inspect
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal, Unpack, final, overload

import trio
from trio.lowlevel import enable_ki_protection

from . import _options, _validate
from ._backend import (
    DebounceBackend,
    Delivery,
    Finalization,
    WindowInfo,
    WindowStatus,
)
from ._errors import (
    BackendError,
    BackendUnavailableError,
)
from ._events import EventHook, PingAnswered, PingRejected
from ._firing import BackendEvents, Handlers, Ledger
from ._firing import closed_error as _closed_error
from ._flow_api import FlowControl
from ._flow_local import FlowWindows
from ._local import LocalWindows, ping_any
from ._options import InitialFactory, Reducer
from ._runs import RunScheduler
from ._runs._store import ANY, RunState, RunStateName, RunStore, _Any
from ._runs._types import (
    ExpiredCallback,
    RunHandler,
    RunInfo,
    RunOptions,
    ScheduledRun,
)
from ._shared import SharedWindows, await_ping
from ._types import (
    CoordinatorStatistics,
    DebounceOptions,
    DebounceResult,
    ErrorCallback,
    Handler,
    Mode,
    ModeName,
    Outcome,
)
from ._upkeep import maintain
from ._util import NoPublicConstructor

logger = logging.getLogger("trio_debounce")

#: The values of ``open_coordinator(on_exit=...)``.
OnExit = Literal["wait", "flush", "cancel", "handoff"]
_ON_EXIT = ("wait", "flush", "cancel", "handoff")
_DELIVERY = ("at-least-once", "at-most-once")

#: The values of ``open_coordinator(on_backend_error=...)``.
OnBackendError = Literal["fail-open", "raise"]
_ON_BACKEND_ERROR = ("fail-open", "raise")

_INF = math.inf
_COALESCE = Outcome.COALESCE
_new_tuple = tuple.__new__


@final
class Coordinator(FlowControl, metaclass=NoPublicConstructor):
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
        backend: DebounceBackend | None,
        on_backend_error: OnBackendError,
        delivery: Delivery,
        runs: RunScheduler,
        on_event: EventHook | None = None,
    ) -> None:
        self._nursery = nursery
        #: The deferred runs (see _runs.py); its task runs in the same nursery.
        self._runs = runs
        self._backend = backend
        self._delivery = delivery
        # The run's clock, bound once: trio.current_time() looks the run up in a
        # thread-local on every call, which would double the cost of a ping.
        self._now = trio.lowlevel.current_clock().current_time
        #: The counters, the idle lot and the lifecycle flags, shared by the parts.
        self._ledger = ledger = Ledger(on_event)
        # debounce_nowait's inlined hot path is only for a local window and no hook.
        self._not_plain = backend is not None or on_event is not None
        #: The handlers, the reducers and the error policy.
        self._fire_handlers = Handlers(handlers, on_error, ledger)
        #: The local windows; without a backend, all of them.
        self._local = LocalWindows(
            nursery, self._now, ledger, self._fire_handlers, self._abort, fencing=backend is None
        )
        #: The flow-control windows (throttle, batch, rate limit): see _flow_api.py.
        self._flow = FlowWindows(
            nursery,
            self._now,
            ledger,
            self._fire_handlers,
            self._local.is_open,
            fencing=backend is None,
        )
        self._local.other_open = self._flow.is_open
        # The tables debounce_nowait's inlined hot path reads (the same objects).
        self._windows = self._local.windows
        self._handlers = self._fire_handlers.by_workflow
        self._reducers = self._fire_handlers.reducers
        # Pings taken by debounce_nowait's inlined hot path: counted in pings and
        # coalesced by statistics() (one increment per ping instead of two).
        self._hot_pings = 0
        #: The windows shared through the backend; None without one.
        self._shared = (
            None
            if backend is None
            else SharedWindows(
                nursery,
                self._now,
                backend,
                delivery,
                on_backend_error,
                ledger,
                self._fire_handlers,
                self._local,
                self._abort,
            )
        )

    def __repr__(self) -> str:
        state = "closed" if self._ledger.closed else "open"
        return f"<trio_debounce.Coordinator {state}, {len(self)} windows>"

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

    @enable_ki_protection
    def set_reducer(
        self, name: str, fn: Reducer | None, *, initial: InitialFactory | None = None
    ) -> None:
        """Register the reducer ``name`` for ``payload_policy=name``, replacing any
        previous one.

        A window with ``payload_policy=name`` folds each ping's payload into its
        accumulated value, ``accumulated = fn(accumulated, payload)``, in arrival order,
        and its trailing fire carries the result. The reducer is looked up when the
        window opens: replacing it does not change windows already open.

        ::

            coordinator.set_reducer("paths", lambda acc, p: acc | {p}, initial=set)
            await coordinator.debounce("build", "docs", path, delay=2.0, payload_policy="paths")

        Args:
          name (str): the policy name, non-empty, not ``"last"``, ``"first"`` or
            ``"collect"``.
          fn: ``fn(accumulated, new) -> accumulated``, a sync callable; ``None`` removes
            the reducer (open windows keep theirs). If it raises, the exception
            propagates from the ping that called it, and that ping is not counted.
          initial: a factory called once per window, ``initial() -> value``, so that a
            mutable initial value never leaks from one window into the next. Without it
            the window's first payload is the initial accumulated value.

        Raises:
          TypeError: ``name`` is not a str, or ``fn`` or ``initial`` is not callable.
          ValueError: ``name`` is empty or names a built-in policy.
        """
        _validate.name("reducer name", name)
        if name in (_options.LAST, _options.FIRST, _options.COLLECT):
            raise ValueError(f"{name!r} is a built-in payload policy, not a reducer name")
        if fn is None:
            self._reducers.pop(name, None)
            return
        if not callable(fn):
            raise TypeError(f"the reducer must be callable, not {fn!r}")
        if initial is not None and not callable(initial):
            raise TypeError(
                f"initial must be a factory (a callable returning a fresh value), not "
                f"{initial!r}; for a list, pass initial=list"
            )
        self._reducers[name] = (fn, initial)

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
        mode: Mode | ModeName = Mode.TRAILING,
        run_id: str | None = None,
        on_fire: Handler | None = None,
        **options: Unpack[DebounceOptions],
    ) -> DebounceResult:
        """Ping the window ``(workflow, key)``: open it, or let it absorb the ping.

        This is a checkpoint: if the calling task is already cancelled it raises
        :exc:`trio.Cancelled` before changing any state; once the ping is taken it
        returns normally (the trailing checkpoint is cancel-shielded). Arguments,
        result and errors are those of :meth:`debounce_nowait`.

        With a backend (``open_coordinator(backend=...)``) the ping is registered in
        the shared window first (see :doc:`/protocol`); the call is shielded from
        cancellation while it does so, and takes at most the backend's operation
        deadline. ``DebounceResult.owner`` says whether this coordinator fires the
        window, ``ping_count`` is the count across processes and ``scheduled_at`` the
        shared fire time converted to Trio's clock.

        Raises:
          trio_debounce.BackendUnavailableError: the backend failed and
            ``on_backend_error="raise"``.
          ValueError: also when ``mode`` or an option differs from the shared window's.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        shared = self._shared
        if shared is not None:
            call = shared.ping(
                workflow, key, payload, delay, max_delay, mode, run_id, on_fire, options or None
            )
            return await await_ping(shared, self._ledger, workflow, key, self._now(), call)
        if options:
            args = (workflow, key, payload, delay, max_delay, mode, run_id, on_fire, options)
            if self._ledger.hook is not None:
                result = self._observed_nowait(*args)
            else:
                result = ping_any(self._local, *args)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return result
        # debounce_nowait's inlined hot path serves the common coalescing ping.
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
        mode: Mode | ModeName = Mode.TRAILING,
        run_id: str | None = None,
        on_fire: Handler | None = None,
        **options: Unpack[DebounceOptions],
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
          mode (Mode | ModeName): ``"trailing"``, ``"leading"`` or ``"both"``. It belongs to
            the window: a later ping with another mode raises :exc:`ValueError`.
          run_id (str | None): the run id of the window this ping opens; a uuid4 hex
            is generated if it is ``None``. Ignored when the ping lands in an open
            window, whose run id is kept.
          on_fire: ``async def on_fire(fire: Fire) -> None``. The handler of a fire is
            the latest non-None ``on_fire`` among the window's pings, else the handler
            registered for the workflow at fire time.

        Keyword Args:
          max_count (int | None): >= 1. The ping that brings the window to this many
            pings makes it due at once: a trailing fire happens at that instant (with
            this ping in it), a leading-only window closes.
          payload_policy (str): what a trailing fire carries: ``"last"`` (the default,
            the latest payload), ``"first"`` (the window's first payload, the leading
            ping's in both mode), ``"collect"`` (the list of all payloads, in order) or
            the name of a reducer registered with :meth:`set_reducer`.
          max_items (int | None): >= 1, only with ``"collect"`` or a reducer (default
            1000): how many payloads a window accumulates before ``overflow`` applies.
          overflow (str | None): only with ``"collect"`` or a reducer.
            ``"fire-early"`` (the default): a ping that finds the window holding
            ``max_items`` payloads makes it fire at once with what it holds, and opens
            the next window. ``"drop-oldest"`` (``"collect"`` only): the oldest payload
            (the lowest in order) is dropped.
          overlap (str): ``"allow"`` (the default): runs of a key may overlap.
            ``"queue-latest"`` (trailing mode only): a window that comes due while a
            run of its key (a fire of a ``"queue-latest"`` window) is executing waits
            for the run to end, absorbing pings (``has()`` True, ``scheduled_at``
            None), then fires once, at the run's end.
          run_timeout (float | None): seconds > 0, only with ``"queue-latest"``: a run
            blocks the next fire of its key at most this long after it started (it is
            not cancelled; the next run then overlaps it).
          order_key (float | None): the event's own order (a timestamp, a sequence
            number: an int or a finite float). "Latest" becomes the highest order key
            (ties: the later arrival), ``"first"`` the lowest (ties: the earlier), and
            ``"collect"`` sorts by order key, then arrival. A window opened with an
            order key requires one on every ping, and a window opened without refuses
            one. Not with a reducer.
          drop_stale (bool): with ``order_key``: drop this ping (outcome ``stale``,
            counted in ``statistics().stale_pings``) if its order key is not above the
            highest order key already fired for ``(workflow, key)``. Decided per ping.

        The options from ``max_count`` to ``order_key`` belong to the window, like
        ``mode``: the first ping fixes them, a later ping with other values raises
        :exc:`ValueError`. A window with only the default options takes the fast path.

        Returns:
          DebounceResult: the outcome, the window's run id, its pending trailing fire
          time (Trio's clock) and its ping count.

        Raises:
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          TypeError: an argument has the wrong type (the message names it).
          ValueError: a bad duration, mode, option or empty name, ``max_delay <
            delay``, options that do not go together, or a mode or option that differs
            from the open window's; with a backend, a ``delay`` or ``max_delay`` above
            1e9 s (about 31.7 years: shared times are wall-clock epoch seconds).
          LookupError: neither this ping, nor the window's earlier pings, give an
            ``on_fire`` and no handler is registered for ``workflow``.
        """
        if options or self._not_plain:
            if self._backend is not None:
                raise RuntimeError(
                    "debounce_nowait() cannot reach the backend (it does no I/O); with "
                    "open_coordinator(backend=...) use await coordinator.debounce()"
                )
            if self._ledger.hook is not None:
                return self._observed_nowait(
                    workflow, key, payload, delay, max_delay, mode, run_id, on_fire, options
                )
            return ping_any(
                self._local,
                workflow,
                key,
                payload,
                delay,
                max_delay,
                mode,
                run_id,
                on_fire,
                options,
            )
        # The hot path, inlined (no second frame): a ping with a float delay and no
        # on_fire into an open pending default window of the same mode (its run_id is
        # checked and, as for any ping into an open window, ignored). It
        # does what LocalWindows.ping does for such a ping, and never touches Trio's
        # deadline heap (see LocalWindows._run_window); every other ping goes there.
        try:
            window = self._windows.get((workflow, key))
        except TypeError:  # unhashable: LocalWindows.ping names the bad argument
            window = None
        if (
            window is not None
            and window.trailing
            and window.opts is None
            and on_fire is None
            and (run_id is None or (type(run_id) is str and run_id))
            and type(delay) is float
            and 0.0 <= delay < _INF
            and (max_delay is None or (type(max_delay) is float and delay <= max_delay < _INF))
            and (mode is window.mode or mode == window.mode)
            and (window.on_fire is not None or workflow in self._handlers)
        ):
            now = self._now()
            due = window.deadline
            if now < due:
                deadline = now + delay
                cap = window.cap
                if deadline > cap:
                    deadline = cap
                if deadline < due and window.scope is not None:
                    # The rare move to an earlier time wakes the sleeping task earlier.
                    window.scope.deadline = deadline
                window.deadline = deadline
                window.payload = payload
                count = window.count + 1
                window.count = count
                self._hot_pings += 1
                return _new_tuple(
                    DebounceResult, (_COALESCE, window.run_id, deadline, count, True, True)
                )
        return self._local.ping(workflow, key, payload, delay, max_delay, mode, run_id, on_fire)

    def _observed_nowait(self, workflow: str, key: str, *args: Any) -> DebounceResult:
        """A ping past :meth:`debounce_nowait`'s hot path, reported to the hook."""
        at = self._now()
        try:
            result = ping_any(self._local, workflow, key, *args)
        except Exception as exc:
            self._ledger.emit(PingRejected(workflow, key, exc, at))
            raise
        self._ledger.emit(PingAnswered(workflow, key, result, at))
        return result

    # ------------------------------------------------------------ cancel / flush

    @enable_ki_protection
    async def cancel(self, workflow: str, key: str) -> bool:
        """Close the open window ``(workflow, key)`` without firing it.

        A checkpoint, like :meth:`debounce`. The next ping opens a new window (in
        leading mode it fires at once). A leading fire already happened at ping time
        and is not undone. At or after the window's deadline the window is due, not
        open: ``cancel`` returns False and the due fire happens.

        With a backend, the shared window is closed whoever owns it (a
        revision-checked write of a cancel tombstone); its owner then counts a cancel.

        Returns:
          bool: True if a window was open and is now closed.

        Raises:
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          TypeError, ValueError: ``workflow`` or ``key`` is not a non-empty str.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._ledger.closed:
            raise _closed_error()
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        cancelled = self._local.cancel((workflow, key)) or self._flow.cancel((workflow, key))
        if self._shared is not None:
            cancelled = await self._shared.cancel(workflow, key) or cancelled
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

        With a backend, only a window this coordinator fires (it owns it, or its ping
        made it due early) can be flushed: its task finalizes it at once with a
        revision-checked delete, and fires unless another process got there first.
        Other processes' windows give False.

        Returns:
          bool: True if a trailing fire was pending and is now committed.

        Raises:
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          TypeError, ValueError: ``workflow`` or ``key`` is not a non-empty str.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._ledger.closed:
            raise _closed_error()
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        flushed = self._local.flush((workflow, key)) or self._flow.flush((workflow, key))
        if self._shared is not None:
            flushed = self._shared.flush((workflow, key)) or flushed
        await trio.lowlevel.cancel_shielded_checkpoint()
        return flushed

    def _hands_off(self, on_exit: OnExit, *, aborted: bool) -> bool:
        """Does leaving the block hand the shared windows off (instead of deleting
        them)? With ``on_exit="handoff"``; under at-least-once also on an exit the user
        did not choose (a cancellation or an error), so that no stored ping is lost.
        An explicit ``on_exit="cancel"`` releases: it deletes the windows that hold
        only this process's pings and leaves the others for a peer."""
        if self._shared is None:
            return False
        if on_exit == "handoff":
            return True
        return self._delivery == "at-least-once" and aborted

    # -------------------------------------------------------------- inspection

    def has(self, workflow: str, key: str) -> bool:
        """Return True if the window ``(workflow, key)`` is open now.

        Follows the time rule exactly: False at or after the window's deadline, even
        if its task has not run yet. Any pair that names no open window gives False.

        Raises:
          TypeError: ``workflow`` or ``key`` is unhashable (so cannot name a window).
        """
        try:
            if self._local.is_open((workflow, key)) or self._flow.is_open((workflow, key)):
                return True
        except TypeError:
            raise TypeError(f"workflow and key must be str, got {workflow!r} and {key!r}") from None
        return self._shared is not None and self._shared.is_open((workflow, key))

    async def window_status(self, workflow: str, key: str) -> WindowStatus | None:
        """The cluster-wide state of the shared window ``(workflow, key)``.

        One read of the store (two if the owner's lease is not in this process's
        table). Times in the result are wall-clock epoch seconds, as stored.

        Returns:
          WindowStatus | None: owner, first and last ping, scheduled time, cap, ping
          count, revision and fencing token; None if no window is open.

        Raises:
          RuntimeError: the coordinator has no backend (use :meth:`has` for in-memory
            windows).
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          trio_debounce.BackendError: the store could not be read.
          TypeError, ValueError: ``workflow`` or ``key`` is not a non-empty str.
        """
        if self._backend is None:
            raise RuntimeError(
                "window_status() reads the shared store: open the coordinator with a "
                "backend (in memory, use has())"
            )
        if self._ledger.closed:
            raise _closed_error()
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        return await self._backend.window_status(workflow, key)

    async def inspect(
        self, workflow: str | None = None, key_prefix: str | None = None
    ) -> list[WindowInfo]:
        """Every window of the shared store, whoever owns it: the operator's view
        (``trio-debounce windows`` prints the same; see :doc:`/cli`). Reads the whole
        store (or the workflow's part of it): a listing grows with the number of keys.

        Args:
          workflow (str | None): only this workflow's windows (the store filters them).
          key_prefix (str | None): only keys that start with it (filtered after
            listing).

        Returns:
          list[WindowInfo]: open windows, and fired ones whose handler still runs (a
          fire record exists, at least once), sorted by workflow and key. Times are
          wall-clock epoch seconds, as stored.

        Raises:
          RuntimeError: the coordinator has no backend (in memory, use :meth:`has`).
          trio.ClosedResourceError: the coordinator's ``async with`` block has exited.
          NotImplementedError: the backend cannot list its store.
          trio_debounce.BackendError: the store could not be read.
          TypeError, ValueError: a bad ``workflow`` or ``key_prefix``.
        """
        if self._backend is None:
            raise RuntimeError(
                "inspect() reads the shared store: open the coordinator with a backend"
            )
        if self._ledger.closed:
            raise _closed_error()
        return await self._backend.inspect(workflow, key_prefix)

    def __len__(self) -> int:
        """The number of windows in the table.

        This may include a window that is due at this very instant but whose task has
        not run yet (:meth:`has` says False for it). With a backend it counts the
        shared windows this coordinator owns or will take, too.
        """
        shared = 0 if self._shared is None else len(self._shared)
        return len(self._windows) + len(self._flow) + shared

    def statistics(self) -> CoordinatorStatistics:
        """Return a :class:`CoordinatorStatistics` snapshot. Works after exit too."""
        ledger = self._ledger
        return CoordinatorStatistics(
            open_windows=len(self),
            pending_trailing_fires=ledger.pending,
            running_handlers=ledger.running,
            pings=ledger.pings + self._hot_pings,
            coalesced=ledger.coalesced + self._hot_pings,
            fires=ledger.fires,
            cancelled=ledger.cancelled,
            handler_errors=ledger.handler_errors,
            backend_errors=ledger.backend_errors,
            fail_open_windows=ledger.fail_open,
            unconfirmed_fires=ledger.unconfirmed,
            unstored_pings=ledger.unstored,
            takeovers=ledger.takeovers,
            refires=ledger.refires,
            dropped_fires=ledger.dropped,
            runs=self._runs.statistics(),
            stale_pings=ledger.stale,
            deleted_externally=ledger.deleted_externally,
            hook_errors=ledger.hook_errors,
            dropped_pings=ledger.dropped_pings,
        )

    async def wait_idle(self) -> None:
        """Wait until no trailing fire is pending and no handler is running.

        Always a checkpoint. Open leading windows (and both-edges windows with one
        ping) have nothing pending and do not keep this waiting. Returns at once if
        the coordinator is idle; it does not raise after the coordinator has closed.
        Do not call it from a handler: it would wait for that handler to return.
        """
        await self._ledger.wait_idle()

    # ------------------------------------------------------------------- deferred runs

    def set_run_handler(self, workflow: str, handler: RunHandler | None) -> None:
        """Set (or with ``None`` remove) the run handler of ``workflow``.

        A coordinator claims only runs of workflows it has a run handler for; see
        :doc:`/runs`.

        Args:
          workflow (str): the workflow name, a non-empty str.
          handler: ``async def handler(run: RunFire) -> None``, or ``None``.

        Raises:
          TypeError: ``workflow`` is not a str, or ``handler`` is not an async callable.
          ValueError: ``workflow`` is empty.
        """
        self._runs.set_handler(workflow, handler)

    @overload
    async def schedule(
        self,
        workflow: str,
        run_id: str | None = None,
        payload: Any = None,
        *,
        at: datetime.datetime | float,
        persist: bool = False,
        expires_at: datetime.datetime | float | None = None,
    ) -> ScheduledRun: ...

    @overload
    async def schedule(
        self,
        workflow: str,
        run_id: str | None = None,
        payload: Any = None,
        *,
        after: float,
        persist: bool = False,
        expires_at: datetime.datetime | float | None = None,
    ) -> ScheduledRun: ...

    async def schedule(
        self,
        workflow: str,
        run_id: str | None = None,
        payload: Any = None,
        *,
        at: datetime.datetime | float | None = None,
        after: float | None = None,
        persist: bool = False,
        expires_at: datetime.datetime | float | None = None,
    ) -> ScheduledRun:
        """Schedule a deferred run of ``workflow`` for a wall-clock time.

        Exactly one of ``at`` and ``after`` is given (the overloads make passing both or
        neither a type error; at run time it is a :exc:`TypeError`). Scheduling an id
        that is pending replaces its time, payload and expiry (bumping its version) and
        keeps its claim; scheduling an id that ran within the retention period
        (:attr:`RunOptions.retention`) changes nothing and returns
        ``outcome="already-ran"``. See :doc:`/runs`.

        Args:
          workflow (str): the workflow; it must have a run handler here.
          run_id (str | None): unique per store, across workflows; a uuid4 hex when None.
          payload (Any): passed to the handler as :attr:`RunFire.payload`. With
            ``persist=True`` it must be JSON-serializable and within the store's
            :attr:`~trio_debounce.abc.RunStore.max_payload_bytes`, and the handler gets
            it JSON round-tripped.
          at (datetime.datetime | float | None): when to run: a timezone-aware
            datetime, or wall-clock epoch seconds. A time in the past runs at once.
          after (float | None): when to run, as seconds from now.
          persist (bool): keep the run in the run store (``open_coordinator(run_store=)``)
            so it survives a restart and is run by a live peer if this process dies.
            Without it the run lives in this coordinator's memory and is dropped (with
            a warning) when the coordinator exits.
          expires_at (datetime.datetime | float | None): a wall time after the run's
            time; if the run comes due after it (a late run), it is dropped, not run
            (counted, logged, and passed to ``on_expired``).

        Returns:
          ScheduledRun: once the run is registered and, with ``persist=True``, written
          and claimed by this coordinator (or, when re-scheduled, by its owner).

        Raises:
          LookupError: ``workflow`` has no run handler here.
          TypeError: ``at``/``after`` are both or neither given, or of the wrong type;
            a persisted payload is not JSON-serializable (the message names the run).
          ValueError: a naive datetime, ``expires_at`` not after the run's time, an
            empty name, ``persist=True`` without a run store, or ``run_id`` scheduled
            for another workflow.
          trio_debounce.DocumentTooLargeError: the persisted payload is over the store's
            limit (nothing was written).
          trio_debounce.BackendError: the store failed (the run may or may not have
            been written; scheduling it again is idempotent).
          trio.ClosedResourceError: the coordinator is closing or closed.
        """
        return await self._runs.schedule(
            workflow,
            run_id,
            payload,
            at=at,
            after=after,
            persist=persist,
            expires_at=expires_at,
        )

    async def cancel_run(self, run_id: str) -> bool:
        """Remove the pending run ``run_id`` wherever it is held.

        A persisted run is deleted from the store by compare-and-swap; its owner's next
        claim-checked step then fails and it does not run. A run whose handler has
        started is not stopped.

        Returns:
          bool: True if a pending run was removed.

        Raises:
          trio_debounce.BackendError: the store could not be reached (the run is not
            cancelled locally only: it would come back after a restart).
          trio.ClosedResourceError: the coordinator is closing or closed.
        """
        return await self._runs.cancel_run(run_id)

    def has_run(self, run_id: str) -> bool:
        """Whether this coordinator holds the pending run ``run_id``: a non-persisted
        run, or a persisted one it has claimed and armed (due within the horizon)."""
        return self._runs.has_run(run_id)

    async def get_run(self, run_id: str) -> RunInfo | None:
        """The store's view of ``run_id`` (this coordinator's for a non-persisted run),
        or None if there is no record of it.

        Raises:
          trio_debounce.BackendError: the store could not be read.
        """
        return await self._runs.get_run(run_id)

    async def list_runs(
        self,
        *,
        workflow: str | None = None,
        state: RunState | RunStateName | None = None,
        owner: str | _Any | None = ANY,
        limit: int | None = None,
    ) -> list[RunInfo]:
        """Runs in the store (and this coordinator's non-persisted ones), earliest due
        first.

        Args:
          workflow (str | None): only this workflow's runs.
          state (RunState | RunStateName | None): only runs in this state (``"pending"``,
            ``"started"``, ``"done"``).
          owner (str | None): only runs claimed by this process id (``None``:
            unclaimed ones); any owner by default.
          limit (int | None): at most this many.

        Raises:
          trio_debounce.BackendError: the store could not be read.
        """
        return await self._runs.list_runs(workflow=workflow, state=state, owner=owner, limit=limit)

    async def drain_runs(self) -> int:
        """Run every pending run this coordinator holds now, and wait for them.

        Covers the non-persisted runs and the persisted runs claimed by this
        coordinator, whatever their time; each runs through the usual claim-checked
        steps (so a run changed elsewhere meanwhile is not run stale).

        Returns:
          int: the number of runs started or dropped (as expired) by the drain.

        Raises:
          trio_debounce.BackendError: the store could not be read.
          trio.ClosedResourceError: the coordinator is closing or closed.
        """
        return await self._runs.drain()

    @property
    def process_id(self) -> str:
        """This coordinator's process id on its run store (:attr:`RunOptions.process_id`)."""
        return self._runs.process_id

    # ------------------------------------------------------------------- exit

    @enable_ki_protection
    async def _drain(self, on_exit: OnExit) -> None:
        """The normal exit of the async with block, per ``on_exit``."""
        ledger = self._ledger
        shared = self._shared
        if shared is not None and self._hands_off(on_exit, aborted=False):
            # A hand-off: give the windows up now, not once the handlers return.
            shared.hand_off_all()
            await self._mark_draining()
        # Deferred runs are not waited for (they may be days away): persisted ones stay
        # in the store for a peer (claimed at once: the run lease is marked draining),
        # non-persisted ones are dropped; running run handlers finish first.
        await self._runs.close()
        ledger.wake_exit_on_pending = on_exit != "wait"
        while True:
            if on_exit == "flush":
                self._local.flush_all()
                self._flow.flush_all()
                if shared is not None:
                    shared.flush_all()
            elif on_exit == "cancel":
                self._local.cancel_all()
                self._flow.cancel_all()
            if shared is not None:
                if self._hands_off(on_exit, aborted=False):
                    shared.hand_off_all()
                elif on_exit == "cancel":
                    shared.cancel_all()
            if ledger.idle:
                break
            await ledger.idle_lot.park()
        # Nothing is pending and no handler runs: what is left are leading-only
        # windows with nothing to fire. Close them now; their documents are deleted by
        # the release, so that peers' next pings open fresh windows.
        ledger.closed = True
        self._local.clear()
        self._flow.clear()
        if shared is not None:
            shared.release_owned()
        self._nursery.cancel_scope.cancel()

    async def _mark_draining(self) -> None:
        """Mark the backend's lease draining (bounded by a heartbeat interval; a
        failure is logged: peers then take the windows at the hand-off)."""
        backend = self._backend
        assert backend is not None
        try:
            with trio.move_on_after(backend.heartbeat_interval) as scope:
                await backend.mark_draining()
            if scope.cancelled_caught:
                logger.warning(
                    "the draining mark did not land in time; peers wait for the hand-off"
                )
        except BackendError as exc:
            self._ledger.backend_errors += 1
            logger.warning(
                "could not mark the lease draining (%s); peers wait for the hand-off", exc
            )

    @enable_ki_protection
    def _abort(self) -> None:
        """The body raised or was cancelled: cancel everything.

        Each local window's task then decides its pending fire by time (see
        LocalWindows._decide_after_abort) as it sees the cancellation; a shared
        window's task drops its fire (the release or a hand-off deals with the
        document). Idempotent: the first call fixes the abort time.
        """
        ledger = self._ledger
        if ledger.aborted:
            return
        ledger.closed = True
        ledger.aborted = True
        ledger.aborted_at = self._now()
        self._local.clear()
        self._flow.clear()
        if self._shared is not None:
            # Without a hand-off, the release deletes the shared windows open here
            # (their pending fires are dropped).
            self._shared.release_owned()
        self._nursery.cancel_scope.cancel()
        ledger.check_idle()


@asynccontextmanager
async def open_coordinator(
    *,
    handlers: Mapping[str, Handler] | None = None,
    on_error: ErrorCallback | None = None,
    on_exit: OnExit = "wait",
    backend: DebounceBackend | None = None,
    on_backend_error: OnBackendError = "fail-open",
    delivery: Delivery = "at-least-once",
    run_handlers: Mapping[str, RunHandler] | None = None,
    run_store: RunStore | None = None,
    run_options: RunOptions | None = None,
    on_expired: ExpiredCallback | None = None,
    on_event: EventHook | None = None,
) -> AsyncIterator[Coordinator]:
    """Open a :class:`Coordinator` that lives as long as the ``async with``.

    Without ``backend`` the windows live in this process's memory. With one (for
    example from :func:`trio_debounce.nats.open_nats_backend`), windows are shared with
    every coordinator on the same store; see :doc:`/protocol`.

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
        fires them at once; ``"cancel"`` drops them (with a backend under at-least-once
        delivery, a shared window that holds a peer's ping is left for that peer to
        fire); ``"handoff"`` (with a backend only)
        leaves the shared windows in the store, where a live peer that handles the
        workflow takes each over at once and fires it on time (or, with no peer alive,
        the next coordinator that handles it does). In every case the exit then waits
        for running handlers to finish, and pings made meanwhile (by handlers, say) are
        accepted and treated the same way. Leading windows with nothing left to fire
        are not waited for: they stay open while the exit waits, then close.
      backend (trio_debounce.abc.DebounceBackend | None): share windows across
        processes through this backend. One backend serves one coordinator at a time.
        The coordinator renews the backend's process lease from a heartbeat task in
        its nursery, adopts the windows of dead processes, and when the block is left
        (shielded, bounded by the backend's operation deadline) either hands its
        windows off (see ``on_exit`` and ``delivery``) or releases: it deletes the
        windows it closed without firing them (so peers' later pings open fresh
        windows) and its lease, and leaves any other window it owns for a peer to
        adopt.
      on_backend_error (str): what a ping does when the backend fails:
        ``"fail-open"`` (the default) opens a local window, logged and counted in
        :meth:`Coordinator.statistics`, with the in-memory guarantees only (it dies
        with the process, and another process may fire the same burst);
        ``"raise"`` makes :meth:`Coordinator.debounce` raise
        :exc:`~trio_debounce.BackendUnavailableError`. Misconfiguration
        (:exc:`~trio_debounce.BackendAuthError`, an oversized record) is never failed
        open.
      delivery (str): what a shared window promises when a process dies, see
        :doc:`/protocol`. ``"at-least-once"`` (the default): a window whose ping was
        stored is never lost; the owner writes a fire record before it runs the handler,
        and a survivor runs the fire again (``Fire.attempt`` 2) if its process died in
        the handler; leaving the block by cancellation or by an error hands the shared
        windows off instead of deleting them, and ``on_exit="cancel"`` deletes only
        the windows that hold this process's pings alone.
        ``"at-most-once"``: a window never fires twice; the owner fires only after a
        compare-and-swap it can prove, and drops the fire otherwise (counted in
        ``statistics().dropped_fires``). Without a backend both behave alike (a
        process's windows die with it). Deferred runs follow the same option: see
        :doc:`/runs` for their exact failure points.
      run_handlers (Mapping[str, RunHandler] | None): the initial run handler of each
        workflow, ``{workflow: async def handler(run: RunFire) -> None}``; see
        :meth:`Coordinator.set_run_handler`.
      run_store (trio_debounce.abc.RunStore | None): where persisted deferred runs
        are kept (:class:`~trio_debounce.SqliteRunStore`, the NATS run store, or
        :class:`~trio_debounce.testing.MemoryRunStore`). With one, the coordinator
        writes its process lease at start (raising
        :exc:`~trio_debounce.BackendError` if it cannot), renews it from a heartbeat
        task, claims the runs of dead processes, and releases its lease at exit so
        peers take its runs over at once. Without one, ``schedule(persist=True)``
        raises :exc:`ValueError`.
      run_options (RunOptions | None): process id, lease, heartbeat, horizon,
        retention, misfire grace, concurrency and retries of deferred runs
        (``RunOptions()`` when None).
      on_expired: ``def on_expired(run: RunFire, reason: DropReason) -> object``, called (sync)
        when a run is dropped unrun because it came due after its ``expires_at``
        (``reason="expired"``) or later than ``misfire_grace`` (``"misfired"``).
      on_event: ``def on_event(event: CoordinatorEvent) -> object``, called (sync,
        inline: a slow hook slows pings) with each :data:`CoordinatorEvent` as it
        happens: pings taken, rejected or failed open, fires started and finished
        (with their lateness), shared windows taken over; see :doc:`/observability`.
        An exception it raises is logged the first time and counted in
        ``statistics().hook_errors``, never passed on. None (the default) costs
        nothing measurable.

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
      ValueError: ``on_exit`` or ``delivery`` is not one of its values, ``on_exit`` is
        ``"handoff"`` without a backend, or a workflow name in
        ``handlers`` is empty.
      ProcessIdTakenError: a live coordinator holds the backend's or the run store's
        process id (its lease was renewed while this start watched it, for up to the
        holder's heartbeat interval plus the clock-skew margin; see :doc:`/protocol`,
        *Process*). Nothing was written for that id.
      TypeError: a handler, ``on_error`` or ``on_event`` is not callable (or is a
        coroutine function), or a workflow name is not a str.
    """
    if on_exit not in _ON_EXIT:
        raise ValueError(
            f"on_exit must be one of 'wait', 'flush', 'cancel', 'handoff', got {on_exit!r}"
        )
    if on_exit == "handoff" and backend is None:
        raise ValueError("on_exit='handoff' needs a backend: there is no peer to hand off to")
    if delivery not in _DELIVERY:
        raise ValueError(f"delivery must be 'at-least-once' or 'at-most-once', got {delivery!r}")
    if on_backend_error not in _ON_BACKEND_ERROR:
        raise ValueError(
            f"on_backend_error must be 'fail-open' or 'raise', got {on_backend_error!r}"
        )
    if backend is not None and not isinstance(backend, DebounceBackend):
        raise TypeError(f"backend must be a trio_debounce.abc.DebounceBackend, not {backend!r}")
    handler_map: dict[str, Handler] = _validate.handler_map("handlers", handlers, "handlers")
    # Run records leave the process, so run workflow names must be valid Unicode.
    run_handler_map: dict[str, RunHandler] = _validate.handler_map(
        "run_handlers", run_handlers, "run handlers", shareable=True
    )
    if run_store is not None and not isinstance(run_store, RunStore):
        raise TypeError(f"run_store must be a trio_debounce.abc.RunStore, not {run_store!r}")
    if run_options is None:
        run_options = RunOptions()
    elif not isinstance(run_options, RunOptions):
        raise TypeError(f"run_options must be a RunOptions, not {run_options!r}")
    if on_expired is not None and not callable(on_expired):
        raise TypeError(f"on_expired must be callable, not {on_expired!r}")
    if inspect.iscoroutinefunction(on_expired):
        raise TypeError(
            f"on_expired is called synchronously; pass a sync function, not {on_expired!r}"
        )
    if on_error is not None and not callable(on_error):
        raise TypeError(f"on_error must be callable, not {on_error!r}")
    if inspect.iscoroutinefunction(on_error):
        raise TypeError(f"on_error is called synchronously; pass a sync function, not {on_error!r}")
    if on_event is not None and not callable(on_event):
        raise TypeError(f"on_event must be callable, not {on_event!r}")
    if inspect.iscoroutinefunction(on_event):
        raise TypeError(f"on_event is called synchronously; pass a sync function, not {on_event!r}")

    # Makes no I/O: created before the start, so its lease watch runs with the backend's.
    scheduler = RunScheduler(
        store=run_store,
        handlers=run_handler_map,
        options=run_options,
        delivery=delivery,
        on_expired=on_expired,
    )
    # A ping that finds a due window takes its fire: under this delivery, and run by
    # this coordinator at once (see DebounceBackend.attach).
    opened: list[SharedWindows] = []

    def on_taken(workflow: str, key: str, result: Finalization) -> None:
        for shared in opened:
            shared.ping_took(workflow, key, result)

    def on_unproven_take(workflow: str, key: str, run_id: str) -> None:
        for shared in opened:
            shared.prove_taken(workflow, key, run_id)

    relay = BackendEvents()
    if backend is not None:
        # Only with a hook: a backend that predates on_event keeps working without one.
        hook = {} if on_event is None else {"on_event": relay.emit}
        backend.attach(
            delivery=delivery, on_taken=on_taken, on_unproven_take=on_unproven_take, **hook
        )
    try:
        await _wait_process_ids_free(backend, scheduler, on_backend_error)
    except BaseException:
        if backend is not None:
            backend.detach()
        raise
    if backend is not None:
        try:
            with trio.move_on_after(backend.heartbeat_interval) as lease_scope:
                await backend.refresh_lease()
            if lease_scope.cancelled_caught:
                raise BackendUnavailableError(
                    f"the process lease could not be written within "
                    f"{backend.heartbeat_interval:.3g} s (the heartbeat interval)"
                )
        except BackendError as exc:
            if on_backend_error == "raise" or not isinstance(exc, BackendUnavailableError):
                backend.detach()
                raise
            logger.warning("backend unavailable at start (%s); failing open until it answers", exc)
    body_error: BaseException | None = None
    nursery_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            coordinator: Coordinator = Coordinator._create(
                nursery,
                handler_map,
                on_error,
                backend,
                on_backend_error,
                delivery,
                scheduler,
                on_event,
            )
            relay.bind(coordinator._ledger)
            if backend is not None:
                assert coordinator._shared is not None
                opened.append(coordinator._shared)
                nursery.start_soon(maintain, backend, coordinator._shared, coordinator._ledger)
            started = False
            try:
                # Writes the run store's lease (if any): a failure raises from here.
                await nursery.start(scheduler.run)
                started = True
                yield coordinator
                await coordinator._drain(on_exit)
            except BaseException as exc:
                # From the body, or from the exit wait (cancelled from outside,
                # Ctrl-C): re-raised as itself once the nursery is closed. Or from the
                # scheduler's start, before the block ran.
                body_error = exc
                coordinator._abort()
                if not started:
                    nursery.cancel_scope.cancel()
    except BaseException as exc:
        # A task raised: a BaseException from a handler, or the cancellations of an
        # outside cancel scope on their way out.
        nursery_error = exc
    if backend is not None:
        aborted = body_error is not None or nursery_error is not None
        with trio.CancelScope(shield=True):
            if coordinator._hands_off(on_exit, aborted=aborted):
                await backend.handoff()
            else:
                shared = coordinator._shared
                assert shared is not None
                deleted = await backend.release(shared.release_runs, own_only=shared.cancel_runs)
                # An explicit cancel's windows count as cancelled once deleted (those
                # left to a peer fire there).
                coordinator._ledger.cancelled += len(
                    shared.cancel_runs if deleted is None else shared.cancel_runs & set(deleted)
                )
        backend.detach()
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


async def _wait_process_ids_free(
    backend: DebounceBackend | None, scheduler: RunScheduler, on_backend_error: OnBackendError
) -> None:
    """Before the first lease writes: watch the backend's and the run store's leases of
    their process ids, at once (a restart after a crash waits once, not once per store).

    A live lease of another opening of a process id is a live twin (refused with
    :exc:`~trio_debounce.ProcessIdTakenError`) or a crashed or stalled predecessor (taken
    over once it was not renewed for its holder's heartbeat interval plus the skew);
    each watch bounds itself. The first error that fails the start cancels the other
    watch and is raised as itself. A backend that cannot be read under fail-open is left
    to its first lease write, which watches the same way without blocking.
    """
    failed: list[Exception] = []

    async with trio.open_nursery() as nursery:

        async def watch(wait: Callable[[], Awaitable[None]], fail_open: bool) -> None:
            try:
                await wait()
            except Exception as exc:
                if fail_open and isinstance(exc, BackendUnavailableError):
                    return  # left to the first lease write (and its fail-open)
                failed.append(exc)
                nursery.cancel_scope.cancel()

        if backend is not None:
            nursery.start_soon(watch, backend.wait_process_id_free, on_backend_error == "fail-open")
        nursery.start_soon(watch, scheduler.wait_process_id_free, False)
    if failed:
        raise failed[0]


def _only_cancellations(exc: BaseException) -> bool:
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return False
