"""The flow-control windows of one process (throttle, audit, batch, rate limit), each a
task in the coordinator's nursery.

:class:`FlowWindows` owns the table ``(workflow, key) -> FlowWindow``. Every decision
(what a ping does, when a window ends and what comes after, what a flush fires) is the
engine's (:mod:`._flow`); this table keeps the tasks, the handlers and the counters.
A window's task sleeps until the window's end and settles it there; a ping that comes
at or after the end settles it first, inline (the tie rule), so a ping never depends
on when a task runs.

Under ``overlap="queue-latest"`` (audit and batch) each fire of a key is a run that
blocks the key's next fire until its handler returns or its ``run_timeout`` passes
(a :class:`~._window.KeyRun`, as a debounce key's); a window due meanwhile waits for
it (:func:`._flow.wait_for_run`) and fires when it ends, as a debounce window does
(``_local.KeyState``).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any, Final

import trio
from trio.lowlevel import enable_ki_protection

from . import _flow, _validate
from ._firing import Handlers, Ledger, closed_error
from ._flow import Absorbed, FlowFire, FlowSpec, FlowState
from ._types import DebounceResult, Edge, Fire, FireReason, Handler, Outcome
from ._window import KeyRun

_DROPPED: Final = Outcome.DROPPED


class FlowWindow:
    """One flow window: its rules' state, its parameters, its run id and its task."""

    __slots__ = ("closed", "ident", "on_fire", "params", "run_id", "scope", "spec", "state")

    def __init__(
        self,
        ident: tuple[str, str],
        spec: FlowSpec,
        state: FlowState,
        run_id: str,
        on_fire: Handler | None,
        params: tuple[Any, ...] = (),
    ) -> None:
        self.ident = ident
        self.spec = spec
        #: The raw arguments of the ping that opened it, as the coordinator's method
        #: passed them: a later ping with the very same ones skips building and
        #: comparing a FlowSpec (see FlowWindows.ping_open).
        self.params = params
        self.state = state
        #: The run id of the window's fires (a rate-limit fire has its own).
        self.run_id = run_id
        #: The window's own handler (the latest non-None ``on_fire`` of its pings).
        self.on_fire = on_fire
        #: The cancel scope of the task's sleep (None while it does not sleep).
        self.scope: trio.CancelScope | None = None
        #: Set once the window is over (fired, cancelled or ended): its task ends.
        self.closed = False


class FlowWindows:
    """The in-process flow windows of a coordinator.

    Args:
      nursery: the coordinator's nursery (window tasks and handlers run in it).
      now: Trio's clock, bound.
      ledger: the coordinator's counters.
      handlers: the fire handlers and the error policy.
      debounce_open: is a debounce window open for a key? Such a key cannot take a
        flow ping (and the other way round: see ``LocalWindows.other_open``).
      fencing: fires carry the coordinator's fire counter as their fencing token (else
        0).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        now: Callable[[], float],
        ledger: Ledger,
        handlers: Handlers,
        debounce_open: Callable[[tuple[str, str]], bool],
        *,
        fencing: bool,
    ) -> None:
        self._nursery = nursery
        self._now = now
        self._ledger = ledger
        self._handlers = handlers
        self._debounce_open = debounce_open
        self._fencing = fencing
        self.windows: dict[tuple[str, str], FlowWindow] = {}
        #: The blocking run of each key whose windows are ``queue-latest``.
        self._runs: dict[tuple[str, str], KeyRun[FlowWindow]] = {}

    # ------------------------------------------------------------------- pings

    def ping(
        self,
        spec: FlowSpec,
        workflow: str,
        key: str,
        payload: Any,
        run_id: str | None,
        on_fire: Handler | None,
        size: int = 0,
        params: tuple[Any, ...] = (),
    ) -> DebounceResult:
        """A ping of a flow window (``spec`` validated by the caller; ``size``: a batch
        item's serialized bytes, checked against ``max_bytes`` by the caller;
        ``params``: the method's raw arguments, kept by a window it opens)."""
        if self._ledger.closed:
            raise closed_error()
        _validate.name("workflow", workflow)
        _validate.name("key", key)
        if run_id is not None:
            _validate.run_id(run_id)
        if on_fire is not None:
            _validate.handler("on_fire", on_fire)
        ident = (workflow, key)
        if self._debounce_open(ident):
            raise ValueError(
                f"{ident!r} has an open debounce window: a {spec.flow.value} ping cannot "
                f"join it (a key's window has one mode at a time)"
            )
        if on_fire is None and workflow not in self._handlers.by_workflow:
            raise self._handlers.missing(workflow)
        now = self._now()
        window = self._settled(ident, now)
        if window is None:
            return self._open(ident, spec, now, payload, run_id, on_fire, size, params)
        if window.spec != spec:
            raise ValueError(
                f"{_flow.describe(spec)} differs from {_flow.describe(window.spec)} of the open "
                f"window {ident!r} (run {window.run_id})"
            )
        return self._absorb(window, now, payload, run_id, on_fire, size)

    def ping_open(
        self,
        params: tuple[Any, ...],
        workflow: str,
        key: str,
        payload: Any,
        run_id: str | None,
        on_fire: Handler | None,
    ) -> DebounceResult | None:
        """The fast path of a ping into the open window of ``(workflow, key)`` opened
        with the very same raw arguments ``params`` (so already validated), before
        its end; None for any other ping (the caller then takes :meth:`ping`)."""
        try:
            window = self.windows.get((workflow, key))
        except TypeError:
            return None
        if (
            window is None
            or window.params != params
            or (run_id is not None and (type(run_id) is not str or not run_id))
            or self._ledger.closed
        ):
            return None
        now = self._now()
        if now >= window.state.end:
            return None  # settled by the slow path first
        if on_fire is not None:
            _validate.handler("on_fire", on_fire)
        return self._absorb(window, now, payload, run_id, on_fire, 0)

    def _absorb(
        self,
        window: FlowWindow,
        now: float,
        payload: Any,
        run_id: str | None,
        on_fire: Handler | None,
        size: int,
    ) -> DebounceResult:
        """A ping at ``now`` into the open ``window`` (checked by the caller)."""
        spec = window.spec
        state = window.state
        was_pending = state.pending
        blocked = self._blocked_until(window.ident) if spec.queue else None
        absorbed, fire = _flow.absorb_flow(spec, state, now, payload, size, blocked)
        ledger = self._ledger
        if absorbed is Absorbed.DROPPED:
            ledger.dropped_pings += 1
            return _result(_DROPPED, window.run_id, _due(window), state.count)
        if absorbed is Absorbed.OVERFLOWED:
            # The batch fired before this item, which opens the next batch.
            assert fire is not None
            self._close(window)
            self._start(window, fire, window.run_id, pending=True)
            return self._open(
                window.ident, spec, now, payload, run_id, on_fire, size, window.params
            )
        ledger.pings += 1
        if on_fire is not None:
            window.on_fire = on_fire
        if absorbed is Absorbed.ABSORBED:
            ledger.coalesced += 1
            if not was_pending:
                ledger.pending_added()
            if state.waiting:
                self._wait(window)
            return _result(Outcome.COALESCE, window.run_id, _due(window), state.count)
        assert fire is not None
        if absorbed is Absorbed.FIRED:  # a rate-limit window's leading fire
            fired_run = run_id if run_id is not None else uuid.uuid4().hex
            self._start(window, fire, fired_run, pending=False)
            return _result(Outcome.FIRE_IMMEDIATE, fired_run, None, 1)
        # Absorbed.COMPLETED: the batch fired with this item, and is over.
        ledger.coalesced += 1
        self._close(window)
        self._start(window, fire, window.run_id, pending=True)
        return _result(Outcome.COALESCE, window.run_id, None, fire.ping_count)

    def _open(
        self,
        ident: tuple[str, str],
        spec: FlowSpec,
        now: float,
        payload: Any,
        run_id: str | None,
        on_fire: Handler | None,
        size: int,
        params: tuple[Any, ...],
    ) -> DebounceResult:
        blocked = self._blocked_until(ident) if spec.queue else None
        state, fire = _flow.open_flow(spec, now, payload, size, blocked)
        if run_id is None:
            run_id = uuid.uuid4().hex
        window = FlowWindow(ident, spec, state, run_id, on_fire, params)
        ledger = self._ledger
        ledger.pings += 1
        if fire is not None:
            # A leading fire (throttle, rate limit), or a batch of one item, fired and over.
            self._start(window, fire, run_id, pending=False)
            if _flow.is_over(state, now):
                return _result(Outcome.FIRE_IMMEDIATE, run_id, None, 1)
        else:
            ledger.pending_added()
        self.windows[ident] = window
        if state.waiting:  # a batch of one item, held back by its key's run
            self._wait(window)
        self._nursery.start_soon(self._run_window, window)
        if fire is not None:
            return _result(Outcome.FIRE_IMMEDIATE, run_id, None, 1)
        return _result(Outcome.SCHEDULE_TRAILING, run_id, _due(window), state.count)

    def _settled(self, ident: tuple[str, str], now: float) -> FlowWindow | None:
        """The window ``ident`` at ``now``, every end reached by ``now`` settled first
        (its trailing fire started, a cool-down opened or the window closed), in time
        order: so a ping at or after an end never depends on when the task runs."""
        window = self.windows.get(ident)
        while window is not None and _flow.is_over(window.state, now):
            if not self._end(window):
                return None
        return window

    def _end(self, window: FlowWindow) -> bool:
        """Settle the window's end: its trailing fire (if any) starts; True if a
        cool-down goes on (under a new run id) or the window now waits for its key's
        ``queue-latest`` run, False if the window closed."""
        state = window.state
        if self._waits(window, state.end):
            return True
        was_pending = state.pending
        fire, goes_on = _flow.end_flow(window.spec, window.state)
        if fire is not None:
            self._start(window, fire, window.run_id, pending=True)
        elif was_pending:  # pragma: no cover - every pending window fires at its end
            self._ledger.pending_dropped()
        if goes_on:
            window.run_id = uuid.uuid4().hex
            return True
        self._close(window)
        return False

    # ----------------------------------------------------------- the fires

    def _blocked_until(self, ident: tuple[str, str]) -> float | None:
        """Until when the key's ``queue-latest`` run blocks its next fire (None: none)."""
        run = self._runs.get(ident)
        return None if run is None else run.block_until

    def _waits(self, window: FlowWindow, at: float) -> bool:
        """A ``queue-latest`` window with a fire pending is due at ``at`` (its end, or
        a flush): if its key's run still blocks it, it waits for that run (True)."""
        if not (window.spec.queue and window.state.pending):
            return False
        if not _flow.wait_for_run(window.state, at, self._blocked_until(window.ident)):
            return False
        self._wait(window)
        return True

    def _wait(self, window: FlowWindow) -> None:
        """The window waits for its key's run (``state.end``: the run's timeout, or
        inf): the run fires it when it returns; its task sleeps until the timeout."""
        self._runs[window.ident].waiter = window
        if window.scope is not None:
            window.scope.deadline = window.state.end

    def _start(self, window: FlowWindow, fire: FlowFire, run_id: str, *, pending: bool) -> None:
        """Start ``fire``'s handler in a task; ``pending``: it was counted as a pending
        fire (it moves from pending to running in one step). A fire of a
        ``queue-latest`` window is its key's run from now on."""
        ledger = self._ledger
        if pending:
            ledger.pending -= 1
        ledger.running += 1
        ledger.fires += 1
        workflow, key = window.ident
        handler = self._handlers.of(window.on_fire, workflow)
        result = Fire(
            workflow,
            key,
            fire.payload,
            run_id,
            fire.ping_count,
            fire.first_ping_at,
            fire.fired_at,
            Edge.LEADING if fire.leading else Edge.TRAILING,
            1,
            ledger.fires if self._fencing else 0,
            fire.reason,
        )
        run: KeyRun[FlowWindow] | None = None
        spec = window.spec
        if spec.queue:
            timeout = spec.run_timeout
            run = KeyRun(math.inf if timeout is None else fire.fired_at + timeout)
            previous = self._runs.get(window.ident)
            if previous is not None and previous.waiter is window:
                previous.waiter = None
            self._runs[window.ident] = run
        self._nursery.start_soon(self._call, handler, result, run)

    @enable_ki_protection
    async def _call(
        self, handler: Handler | None, fire: Fire, run: KeyRun[FlowWindow] | None
    ) -> None:
        try:
            await self._handlers.call(handler, fire)
        finally:
            if run is not None:
                self._run_ended((fire.workflow, fire.key), run)
            self._ledger.handler_ended()

    def _run_ended(self, ident: tuple[str, str], run: KeyRun[FlowWindow]) -> None:
        """A ``queue-latest`` run returned: the window waiting for it fires now
        (reason ``run-end``)."""
        if self._runs.get(ident) is run:
            del self._runs[ident]
        waiter, run.waiter = run.waiter, None
        if (
            waiter is not None
            and not waiter.closed
            and waiter.state.waiting
            and not self._ledger.aborted
        ):
            waiter.state.end = self._now()
            self._end(waiter)

    # ------------------------------------------------------------ the tasks

    @enable_ki_protection
    async def _run_window(self, window: FlowWindow) -> None:
        """The window's task: sleep until its end, settle it; again for a cool-down."""
        try:
            while not window.closed:
                end = window.state.end
                if self._now() < end:
                    with trio.CancelScope(deadline=end) as scope:
                        window.scope = scope
                        await trio.sleep_forever()
                    window.scope = None
                    continue
                if not self._end(window):
                    return
        except trio.Cancelled:
            window.scope = None
            self._decide_after_abort(window)
            raise

    def _decide_after_abort(self, window: FlowWindow) -> None:
        """The coordinator aborted: a fire due by the abort time still starts (as if
        the task had run before the body raised); a pending one not yet due is dropped
        and counted as cancelled."""
        ledger = self._ledger
        if not ledger.aborted or window.closed:
            return
        while _flow.is_over(window.state, ledger.aborted_at):
            if not self._end(window):
                return
        self._close(window)
        if window.state.pending:
            ledger.cancelled += 1
            ledger.pending_dropped()

    def _close(self, window: FlowWindow) -> None:
        """The window is over: out of the table; its task, if asleep, ends."""
        window.closed = True
        if self.windows.get(window.ident) is window:
            del self.windows[window.ident]
        if window.scope is not None:
            window.scope.cancel()

    # ------------------------------------------------------- cancel and flush

    def is_open(self, ident: tuple[str, str]) -> bool:
        """Is a flow window open for ``ident`` now (a cool-down and a rate-limit window
        included: open, with nothing pending, as a leading window is)?"""
        window = self.windows.get(ident)
        return window is not None and not _flow.is_over(window.state, self._now())

    def __len__(self) -> int:
        return len(self.windows)

    def cancel(self, ident: tuple[str, str]) -> bool:
        """Close the window ``ident``, dropping what is pending, with no cool-down (the
        next ping opens a new window, and may fire at once); True if one was open."""
        window = self._settled(ident, self._now())
        if window is None:
            return False
        self._close(window)
        if window.state.pending:
            self._ledger.cancelled += 1
            self._ledger.pending_dropped()
        return True

    def flush(self, ident: tuple[str, str], cause: FireReason = FireReason.FLUSH) -> bool:
        """Fire what the window ``ident`` has pending now (a throttle then starts its
        cool-down); True if a fire was pending. ``cause``: the fire's reason,
        ``"flush"`` or, for the exit's flush, ``"exit"``."""
        now = self._now()
        window = self._settled(ident, now)
        if window is None:
            return False
        if self._waits(window, now):
            return True  # due now, but its key's run blocks it: it waits for the run
        fire, goes_on = _flow.flush_flow(window.spec, window.state, now)
        if fire is None:
            return False
        if cause is not fire.reason:
            fire = fire._replace(reason=cause)
        self._start(window, fire, window.run_id, pending=True)
        if goes_on:
            window.run_id = uuid.uuid4().hex
            if window.scope is not None:
                window.scope.cancel()  # re-arm for the cool-down's end
        else:
            self._close(window)
        return True

    def flush_all(self) -> None:
        """The exit's ``on_exit="flush"``: every pending fire happens now (reason
        ``"exit"``)."""
        for ident in list(self.windows):
            self.flush(ident, FireReason.EXIT)

    def cancel_all(self) -> None:
        """The exit's ``on_exit="cancel"``: every pending fire is dropped."""
        now = self._now()
        for ident in list(self.windows):
            window = self._settled(ident, now)
            if window is not None and window.state.pending:
                self.cancel(ident)

    def clear(self) -> None:
        """Forget every window (the coordinator closed; their tasks are cancelled, and
        each decides its pending fire by the abort time)."""
        self.windows.clear()


def _due(window: FlowWindow) -> float | None:
    """When the window's pending fire happens (its end), or None (none is pending, or
    the window waits for its key's run)."""
    state = window.state
    return state.end if state.pending and not state.waiting else None


def _result(outcome: Outcome, run_id: str, due: float | None, count: int) -> DebounceResult:
    # tuple.__new__: a NamedTuple without its constructor's keyword handling.
    return _new_tuple(DebounceResult, (outcome, run_id, due, count, True, True))


_new_tuple = tuple.__new__
