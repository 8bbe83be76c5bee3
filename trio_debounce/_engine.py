"""The window engine: every rule of one debounce window, as pure functions.

This module is the one home of the window rules of ``docs/semantics.rst``: when a
window is due and why, what a ping at time *t* does to it, what a ping at the due
instant means, when ``max_count`` is reached, what a fire carries. It knows nothing of
Trio, of I/O or of a clock: every time is a plain float on whatever clock the caller
uses (Trio's for the local window table, the wall clock for a shared document), and
every function returns or mutates only the :class:`WindowState` it is given.

The callers keep only what is theirs:

* the local window table (``_coordinator``) keeps the window's task, its cancel scope
  and its handler, and calls :func:`open_window`, :func:`absorb` and friends for every
  decision (one hand-inlined copy of :func:`absorb` for the plain coalescing ping stays
  on ``debounce_nowait``'s hot path; ``tests/engine/test_engine.py`` checks that it equals
  :func:`absorb` on every input);
* the shared protocol keeps ownership, leases, proofs, tombstones and fire records;
* the replay drives the real coordinator.

The tie rule is :func:`is_due`: a window whose due time has been reached is due, and a
ping at that instant belongs to the next window. ``tests/harness/model.py`` is an independent
reference model of the same rules; the property tests compare this engine, the local
coordinator and coordinators sharing a backend with it.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Final

from ._options import COLLECT, DEFAULT, FIRE_EARLY, FIRST, LAST, InitialFactory, Reducer
from ._options import WindowOptions as WindowOptions
from ._types import FireReason, Mode

INF: Final = math.inf

#: Why a window is due (:func:`due_reason`): the reasons of a trailing fire in
#: :class:`~trio_debounce.FireStarted`.
DUE_DELAY: Final = FireReason.DELAY
DUE_CAP: Final = FireReason.MAX_DELAY
DUE_COUNT: Final = FireReason.MAX_COUNT


class WindowState:
    """The state of one debounce window that the rules read and write.

    Times are floats on the caller's clock. ``opts`` is None for a window with the
    default options (``payload_policy="last"`` and nothing else): such a window keeps
    only ``payload`` and never touches the accumulation slots (``best``, ``acc``,
    ``held``, ``max_order``), which are set by :func:`open_window` only for windows
    with options.
    """

    __slots__ = (
        "acc",
        "best",
        "cap",
        "count",
        "deadline",
        "first_ping_at",
        "held",
        "max_order",
        "mode",
        "opts",
        "payload",
        "trailing",
        "waiting",
    )

    #: "collect": ``[(order key or 0, arrival, payload)]`` sorted; a reducer: its value.
    acc: Any
    #: The order key of ``payload`` ("last" and "first"), or None.
    best: float | None
    #: Payloads accumulated ("collect" and reducers), for ``max_items``.
    held: int
    #: The highest order key among the window's pings, or None.
    max_order: float | None

    def __init__(
        self,
        mode: Mode,
        t: float,
        deadline: float,
        cap: float,
        payload: Any,
        trailing: bool,
        opts: WindowOptions | None = None,
    ) -> None:
        self.mode = mode
        #: The time of the window's first ping.
        self.first_ping_at = t
        #: When the window is due: ``min(t + delay, cap)`` of its latest ping, or the
        #: time of the ping that reached ``max_count``.
        self.deadline = deadline
        #: ``first_ping_at + max_delay``, or :data:`INF`.
        self.cap = cap
        #: The latest payload ("last"), the first ("first"), or the latest ping's.
        self.payload = payload
        #: The window's pings so far, across every process that shares it.
        self.count = 1
        #: True while a trailing fire is pending: always in trailing mode, from the
        #: second ping in both mode, never in leading mode.
        self.trailing = trailing
        #: The options the first ping fixed, or None for the defaults.
        self.opts = opts
        #: True while a due ``queue-latest`` window waits for its key's run to end.
        self.waiting = False


# ---------------------------------------------------------------- time rules


def cap_of(t: float, max_delay: float | None) -> float:
    """The cap of a window opened at ``t``: ``t + max_delay``, or :data:`INF`."""
    return INF if max_delay is None else t + max_delay


def deadline_of(t: float, delay: float, cap: float) -> float:
    """The due time a ping at ``t`` with ``delay`` sets: ``min(t + delay, cap)``."""
    deadline = t + delay
    return cap if deadline > cap else deadline


def is_due(state: WindowState, t: float) -> bool:
    """Is the window due at ``t``? The tie rule: a reached due time is due, so a ping
    at exactly ``state.deadline`` belongs to the next window (a waiting ``queue-latest``
    window is due too: it absorbs pings until its run ends, see :func:`absorbs`)."""
    return t >= state.deadline


def absorbs(state: WindowState, t: float) -> bool:
    """Does a ping at ``t`` join this open window (rather than open the next one)?

    Yes while it is not due, and while it waits for its key's ``queue-latest`` run.
    """
    return t < state.deadline or state.waiting


def joins(deadline: float, t: float, waiting: bool) -> bool:
    """:func:`absorbs` on a window's due time and waiting state alone (for a caller
    that holds them in a document of its own)."""
    return t < deadline or waiting


def due_reason(state: WindowState, t: float) -> str | None:
    """Why the window is due at ``t`` (:data:`DUE_COUNT`, :data:`DUE_CAP` or
    :data:`DUE_DELAY`), or None if it is not."""
    if t < state.deadline:
        return None
    return reason_of(state, t)


def trailing_reason(
    fired_at: float,
    deadline: float,
    cap: float,
    count: int,
    max_count: int | None,
    cause: FireReason | None = None,
) -> FireReason:
    """Why a trailing fire at ``fired_at`` of a window due at ``deadline`` fired:
    ``cause`` when the caller gives one (what made the fire, known where it was
    made: :data:`~FireReason.OVERFLOW`, :data:`~FireReason.EXIT`,
    :data:`~FireReason.RUN_END`...); else ``"flush"`` before its due time;
    else :data:`DUE_COUNT` once ``count`` reached ``max_count``, :data:`DUE_CAP` when
    the due time is the cap (``cap``: :data:`INF` without a ``max_delay``),
    :data:`DUE_DELAY` otherwise."""
    if cause is not None:
        return cause
    if fired_at < deadline:
        return FireReason.FLUSH
    if max_count is not None and count >= max_count:
        return DUE_COUNT
    if deadline >= cap:
        return DUE_CAP
    return DUE_DELAY


def reason_of(state: WindowState, fired_at: float, cause: FireReason | None = None) -> FireReason:
    """:func:`trailing_reason` of the window's trailing fire at ``fired_at``."""
    opts = state.opts
    max_count = None if opts is None else opts.max_count
    return trailing_reason(fired_at, state.deadline, state.cap, state.count, max_count, cause)


#: Causes that name a fire only if it came before its due time (:func:`caused`).
EARLY_CAUSES: Final = frozenset((FireReason.FLUSH, FireReason.EXIT))


def caused(reason: FireReason, cause: FireReason | None) -> FireReason:
    """The reason of a fire that another layer judged by time (``reason``: a
    backend's, see ``_protocol._rules.fire_reason``), given what its caller knows made
    it (``cause``, or None). An exit's flush (:data:`~FireReason.EXIT`) names only a
    fire that came before its due time (judged ``"flush"``): one that was due anyway
    keeps its reason. A later cause (:data:`~FireReason.RUN_END`,
    :data:`~FireReason.ADOPTION`) names the fire whatever its time says."""
    if cause is None or (cause in EARLY_CAUSES and reason is not FireReason.FLUSH):
        return reason
    return cause


def scheduled_at(state: WindowState) -> float | None:
    """The time of the window's pending trailing fire, or None (no trailing fire
    pending, or waiting for its key's run)."""
    if state.trailing and not state.waiting:
        return state.deadline
    return None


# ---------------------------------------------------------------- payload rules


def first_value(reducer: tuple[Reducer, InitialFactory | None], payload: Any) -> Any:
    """A reducer window's accumulated value after its first ping: a fresh initial
    value per window (``initial()``), folded with ``payload``; ``payload`` itself
    without an initial factory. May raise whatever the reducer raises."""
    fn, initial = reducer
    if initial is None:
        return payload
    return fn(initial(), payload)


def is_full(state: WindowState) -> bool:
    """Does the window hold ``max_items`` payloads under ``overflow="fire-early"``?
    A ping that finds it so makes it due at once, and opens the next window itself."""
    opts = state.opts
    return opts is not None and opts.overflow == FIRE_EARLY and state.held >= (opts.max_items or 0)


def fire_payload(state: WindowState) -> Any:
    """The payload a trailing fire of the window carries, per its payload policy:
    the kept payload ("last", "first"), the list of payloads in order ("collect"),
    or the reducer's value."""
    opts = state.opts
    if opts is None or opts.payload_policy in (LAST, FIRST):
        return state.payload
    if opts.payload_policy == COLLECT:
        return [item[2] for item in state.acc]
    return state.acc


def trailing_pending(mode: Mode, count: int) -> bool:
    """Does a window of ``mode`` with ``count`` pings have a trailing fire to come?
    Always in trailing mode, from the second ping in both mode, never in leading."""
    return mode is Mode.TRAILING or (mode is Mode.BOTH and count >= 2)


def leading(mode: Mode) -> bool:
    """Does the first ping of a window in ``mode`` fire at once (a leading edge)?"""
    return mode is not Mode.TRAILING


# ---------------------------------------------------------------- transitions


def open_window(
    t: float,
    payload: Any,
    *,
    delay: float,
    max_delay: float | None,
    mode: Mode,
    opts: WindowOptions | None = None,
    order: float | None = None,
    value: Any = None,
    state: WindowState | None = None,
) -> WindowState:
    """The window a ping at ``t`` opens (arguments validated by the caller).

    Args:
      opts: the window's options, or None (or :data:`DEFAULT`) for the defaults.
      order: the ping's order key, or None.
      value: a reducer window's first accumulated value (:func:`first_value`,
        computed by the caller before any state changed, since the reducer may raise).
      state: an uninitialised object of a :class:`WindowState` subclass to fill in
        (``WindowState.__new__(cls)``), so that callers can keep their own slots on the
        same object; a new :class:`WindowState` when None.

    Returns:
      WindowState: the new window. Its first ping is counted; in leading and both
      mode that ping is the leading fire (:func:`leading`), which carries ``payload``
      as passed, whatever the policy.
    """
    if opts is DEFAULT:
        opts = None
    cap = cap_of(t, max_delay)
    deadline = deadline_of(t, delay, cap)
    if opts is not None and opts.max_count == 1:
        deadline = t
    if state is None:
        state = WindowState.__new__(WindowState)
    WindowState.__init__(state, mode, t, deadline, cap, payload, mode is Mode.TRAILING, opts)
    if opts is not None:
        state.best = order
        state.max_order = order
        if opts.payload_policy == COLLECT:
            state.acc = [(0 if order is None else order, 0, payload)]
            state.held = 1
        elif opts.reducer:
            state.acc = value
            state.held = 1
        else:
            state.held = 0
    return state


def absorb(
    state: WindowState,
    t: float,
    payload: Any,
    *,
    delay: float,
    order: float | None = None,
    value: Any = None,
    latest: float | None = None,
) -> bool:
    """A ping at ``t`` joins the open window (the caller checked :func:`absorbs`,
    :func:`is_full` and the ping's mode and options).

    Counts the ping, keeps its payload per the policy and moves the due time to
    ``min(t + delay, cap)``; the ping that brings the window to ``max_count`` makes it
    due at ``t``. A waiting ``queue-latest`` window absorbs the ping and keeps its time.
    In both mode the second ping makes a trailing fire pending.

    Args:
      value: a reducer window's new accumulated value, ``fn(state.acc, payload)``,
        computed by the caller before any state changed (the reducer may raise).
      latest: the time of the window's latest ping so far, where pings can arrive out
        of time order (across processes, a ping's write may land after a later
        ping's). A ping older than it leaves the due time as the latest ping set it,
        as if the pings had arrived in time order; one that reaches ``max_count``
        makes the window due at the later of the two times. None: pings arrive in
        time order (the local table).

    Returns:
      bool: True if this ping made a trailing fire pending (the second ping of a
      both-edges window), else False.
    """
    count = state.count
    state.count = count + 1
    opts = state.opts
    in_order = latest is None or t >= latest
    if opts is None:
        state.payload = payload
        if in_order:
            state.deadline = deadline_of(t, delay, state.cap)
        return _both_pending(state)
    if order is not None and (state.max_order is None or order > state.max_order):
        state.max_order = order
    policy = opts.payload_policy
    if policy == LAST:
        # The latest: the highest order key, ties broken by arrival (the later wins).
        if order is None or state.best is None or order >= state.best:
            state.payload = payload
            state.best = order
    elif policy == FIRST:
        # The first: the lowest order key, ties broken by arrival (the earlier wins).
        if order is not None and state.best is not None and order < state.best:
            state.payload = payload
            state.best = order
    elif policy == COLLECT:
        # (order key, arrival) is unique, so payloads themselves are never compared;
        # the arrival of the n-th ping is n - 1.
        item = (0 if order is None else order, count, payload)
        if order is None:
            state.acc.append(item)
        else:
            bisect.insort(state.acc, item, key=_rank)
        if len(state.acc) > (opts.max_items or 0):
            del state.acc[0]  # drop-oldest: the lowest (order key, arrival)
        state.held = len(state.acc)
    else:
        state.acc = value
        state.held += 1
    if state.waiting:
        return False
    deadline = deadline_of(t, delay, state.cap) if in_order else state.deadline
    if opts.max_count is not None and state.count >= opts.max_count:
        deadline = t if in_order or latest is None else latest
    state.deadline = deadline
    return _both_pending(state)


def _both_pending(state: WindowState) -> bool:
    """From its second ping a both-edges window has a trailing fire pending."""
    if state.trailing or state.mode is not Mode.BOTH:
        return False
    state.trailing = True
    return True


def _rank(item: tuple[Any, int, Any]) -> tuple[Any, int]:
    return item[0], item[1]


def wait_for_run(state: WindowState, at: float, blocked_until: float | None) -> bool:
    """A ``queue-latest`` window is due at ``at``; its key's run blocks its next fire
    until ``blocked_until`` (None: no run blocks). If the run still blocks at ``at``
    the window waits (True): it absorbs pings and is due at ``blocked_until``, or when
    the run ends, whichever comes first. Else it fires at ``at`` (False)."""
    if blocked_until is not None and at < blocked_until:
        state.waiting = True
        state.deadline = blocked_until
        return True
    return False


def commit(state: WindowState, at: float) -> None:
    """The window's trailing fire is committed at ``at`` (its deadline, a flush, the end
    of the run it waited for): it is due from ``at``, and waits no more."""
    state.deadline = at
    state.waiting = False


def is_stale(order: float, fired_order: float | None) -> bool:
    """``drop_stale``: is a ping with order key ``order`` stale, given the highest order
    key fired for its key so far (None: none)?"""
    return fired_order is not None and order <= fired_order


def fired_order_after(fired_order: float | None, order: float | None) -> float | None:
    """The key's highest fired order key once a fire with (highest) order key
    ``order`` is committed."""
    if order is None or (fired_order is not None and fired_order >= order):
        return fired_order
    return order
