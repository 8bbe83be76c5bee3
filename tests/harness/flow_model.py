"""A small pure-Python reference model of the flow-control modes: throttle (leading and
trailing, leading only, trailing only: "audit"), batch and rate limit.

It is written from the specification of issue 20, not from the engine, so that the
property tests compare two independent implementations. Like :mod:`tests.harness.model`
it knows nothing of Trio: it is fed operations in time order and, before it applies an
operation at time t, it processes every window end due by t in time order (a reached end
is due: an end at t happens before a ping at t).

One window per key ``ident = (workflow, key)``; every parameter is fixed by the window's
first ping (a throttle cool-down keeps its window's parameters). A ping whose mode or
parameters differ from the open window's raises ValueError and changes nothing.

Every window counts, in ``count``, the accepted pings its pending fire accounts for, so
that over a run: the sum of ``ping_count`` over the fires, plus :meth:`FlowModel.
pending_pings`, plus ``dropped``, plus the pings a cancel discarded, is every accepted
or dropped ping.

``overlap="queue-latest"`` (audit and batch, issue 20's rule 6): every fire of such a
window is a *run* that blocks its key's next fire until it ends (the model is told how
long each run takes: ``run_time``, from the fire's payload) or until its
``run_timeout``. A window that comes due (its end, a batch's ``max_items``-th item, a
flush) while a run blocks *waits*: it takes pings, and fires when the run stops
blocking (reason "run-end"). A waiting batch stays bounded: an item it cannot hold
(it holds ``max_items`` items, or the item would pass ``max_bytes``) fires it at once
(reason "max-items" or "max-bytes"), its run then the key's run, and opens the next
batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

THROTTLE, BATCH, RATE = "throttle", "batch", "rate-limit"
FIRE_IMMEDIATE, SCHEDULE_TRAILING = "fire-immediate", "schedule-trailing"
COALESCE, DROPPED = "coalesce", "dropped"
LEADING, TRAILING = "leading", "trailing"
INTERVAL, MAX_ITEMS, MAX_BYTES = "interval", "max-items", "max-bytes"
MAX_WAIT, FLUSH, RUN_END = "max-wait", "flush", "run-end"
DEFAULT_MAX_ITEMS = 1000

Ident = tuple[str, str]


@dataclass(frozen=True)
class FlowFire:
    """One fire: when, of which key, what it carries and how many pings it accounts for.

    ``edge`` is "leading" or "trailing"; ``reason`` one of "leading", "interval",
    "max-items", "max-bytes", "max-wait", "flush", "run-end".
    """

    fired_at: float
    ident: Ident
    payload: Any
    ping_count: int
    edge: str
    reason: str


@dataclass
class FlowWindow:
    """The open window of one key (a throttle cool-down is one too).

    ``params`` are the normalized parameters, compared on every ping; ``count`` the
    accepted pings the pending fire accounts for (0: nothing pending); ``payload`` the
    latest of them (throttle, audit); ``items`` and ``sizes`` a batch's items and their
    sizes; ``fired`` the fires of a rate-limit window; ``queue`` and ``run_timeout``
    its ``overlap="queue-latest"``; ``waiting``: it came due while its key's run
    blocked (``end`` is then when the run stops blocking at the latest).
    """

    kind: str
    params: tuple[Any, ...]
    opened: float
    end: float
    payload: Any = None
    count: int = 0
    items: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    fired: int = 0
    queue: bool = False
    run_timeout: float | None = None
    waiting: bool = False

    @property
    def total(self) -> int:
        """A batch's size in bytes (the sum of its items' sizes)."""
        return sum(self.sizes)


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _at_least_one(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass
class Run:
    """A queue-latest run: it ends at ``end`` and blocks its key until ``block_until``."""

    end: float
    block_until: float


def _overlap(overlap: str, run_timeout: float | None, leading: bool) -> tuple[bool, Any]:
    if overlap not in ("allow", "queue-latest"):
        raise ValueError(f"bad overlap {overlap!r}")
    queue = overlap == "queue-latest"
    if queue and leading:
        raise ValueError("queue-latest with a leading edge")
    if run_timeout is not None:
        if not queue:
            raise ValueError("run_timeout without queue-latest")
        run_timeout = _positive("run_timeout", run_timeout)
    return queue, run_timeout


def _no_time(payload: Any) -> float:
    return 0.0


@dataclass
class FlowModel:
    """The windows of every key, the fires so far and the count of dropped pings;
    ``run_time``: how long the handler of a fire with this payload runs (only
    queue-latest runs matter)."""

    windows: dict[Ident, FlowWindow] = field(default_factory=dict)
    fires: list[FlowFire] = field(default_factory=list)
    dropped: int = 0
    #: The latest time an operation was applied at (operations come in time order).
    now: float = -math.inf
    run_time: Callable[[Any], float] = _no_time
    #: The blocking run of each key (queue-latest windows only).
    runs: dict[Ident, Run] = field(default_factory=dict)

    # ---------------------------------------------------------------- events

    def advance(self, t: float) -> None:
        """Process every event <= t in time order: window ends, then (at one instant)
        the ends of runs (ties: by ident)."""
        if t < self.now:
            raise AssertionError(f"time went backwards: {t} < {self.now}")
        self.now = t
        while True:
            events = [(w.end, 0, ident) for ident, w in self.windows.items()]
            events += [(r.end, 1, ident) for ident, r in self.runs.items()]
            if not events:
                return
            at, kind, ident = min(events)
            if at > t:
                return
            if kind == 0:
                self._end(ident, self.windows[ident])
            else:
                del self.runs[ident]
                w = self.windows.get(ident)
                if w is not None and w.waiting:
                    del self.windows[ident]
                    self._fire_held(ident, w, at, RUN_END)

    def _waits(self, ident: Ident, w: FlowWindow, at: float) -> bool:
        """``w`` is due at ``at``: does its key's run block it? Then it waits."""
        run = self.runs.get(ident)
        if w.queue and run is not None and at < run.block_until:
            w.waiting = True
            w.end = run.block_until
            return True
        return False

    def _end(self, ident: Ident, w: FlowWindow) -> None:
        """A window's end: a pending trailing fire happens (or waits for its key's
        run); the window closes."""
        if w.count == 0:
            del self.windows[ident]
            return  # nothing pending (a rate-limit window, a throttle with no ping)
        if self._waits(ident, w, w.end):
            return
        del self.windows[ident]
        if w.waiting:  # the run's timeout
            self._fire_held(ident, w, w.end, RUN_END)
        elif w.kind == THROTTLE:
            self._fire_held(ident, w, w.end, INTERVAL)
            if w.params[1]:  # leading: a cool-down follows the trailing fire
                self._cool_down(ident, w, w.end)
        else:  # a batch at open + max_wait
            self._fire_held(ident, w, w.end, MAX_WAIT)

    def _fire_held(self, ident: Ident, w: FlowWindow, at: float, reason: str) -> None:
        """The pending (trailing-edge) fire of ``w`` happens at ``at``; a queue-latest
        window's fire is its key's run from then."""
        payload = list(w.items) if w.kind == BATCH else w.payload
        self.fires.append(FlowFire(at, ident, payload, w.count, TRAILING, reason))
        if w.queue:
            timeout = math.inf if w.run_timeout is None else at + w.run_timeout
            self.runs[ident] = Run(at + self.run_time(payload), timeout)
        w.count = 0
        w.payload = None
        w.items = []
        w.sizes = []
        w.waiting = False

    def _cool_down(self, ident: Ident, w: FlowWindow, at: float) -> None:
        """After a throttle's trailing fire at ``at``: a window [at, at + interval)."""
        self.windows[ident] = FlowWindow(THROTTLE, w.params, at, at + w.params[0])

    def _leading(self, t: float, ident: Ident, payload: Any) -> None:
        self.fires.append(FlowFire(t, ident, payload, 1, LEADING, LEADING))

    def _check_mode(self, ident: Ident, kind: str, params: tuple[Any, ...]) -> FlowWindow | None:
        """The open window of ``ident``; ValueError if its mode or parameters differ."""
        w = self.windows.get(ident)
        if w is not None and (w.kind != kind or w.params != params):
            raise ValueError(
                f"{kind} {params!r} differs from the open window's {w.kind} {w.params!r}"
            )
        return w

    # ------------------------------------------------------------ operations

    def throttle(
        self,
        t: float,
        ident: Ident,
        payload: Any,
        *,
        interval: float,
        leading: bool = True,
        trailing: bool = True,
        overlap: str = "allow",
        run_timeout: float | None = None,
    ) -> str:
        """A throttle ping; returns its outcome. ValueError (nothing changed) on a bad
        parameter or a clash with the open window."""
        interval = _positive("interval", interval)
        if not leading and not trailing:
            raise ValueError("leading=False and trailing=False: a throttle must fire")
        queue, timeout = _overlap(overlap, run_timeout, leading)
        params = (interval, bool(leading), bool(trailing), queue, timeout)
        self.advance(t)
        w = self._check_mode(ident, THROTTLE, params)
        if w is None:
            w = FlowWindow(THROTTLE, params, t, t + interval, queue=queue, run_timeout=timeout)
            self.windows[ident] = w
            if leading:
                self._leading(t, ident, payload)
                return FIRE_IMMEDIATE
            w.payload, w.count = payload, 1  # audit: the fire at open + interval
            return SCHEDULE_TRAILING
        if not trailing:
            self.dropped += 1
            return DROPPED
        w.payload = payload
        w.count += 1
        return COALESCE

    def batch(
        self,
        t: float,
        ident: Ident,
        item: Any,
        *,
        size: int,
        max_wait: float,
        max_items: int | None = None,
        max_bytes: int | None = None,
        overlap: str = "allow",
        run_timeout: float | None = None,
    ) -> str:
        """A batch item of ``size`` bytes; returns its outcome. ValueError (nothing
        changed) on a bad parameter, a clash, or an item alone larger than max_bytes."""
        max_wait = _positive("max_wait", max_wait)
        n = DEFAULT_MAX_ITEMS if max_items is None else _at_least_one("max_items", max_items)
        if max_bytes is not None:
            _at_least_one("max_bytes", max_bytes)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"an item of {size} bytes exceeds max_bytes={max_bytes}")
        queue, timeout = _overlap(overlap, run_timeout, False)
        params = (max_wait, n, max_bytes, queue, timeout)
        self.advance(t)
        w = self._check_mode(ident, BATCH, params)
        outcome = COALESCE
        full = w is not None and w.count >= n  # a waiting batch, full
        if w is not None and (full or (max_bytes is not None and w.total + size > max_bytes)):
            # The current batch fires first; this item opens the next one.
            del self.windows[ident]
            self._fire_held(ident, w, t, MAX_ITEMS if full else MAX_BYTES)
            w = None
        if w is None:
            w = FlowWindow(BATCH, params, t, t + max_wait, queue=queue, run_timeout=timeout)
            self.windows[ident] = w
            outcome = SCHEDULE_TRAILING
        w.items.append(item)
        w.sizes.append(size)
        w.count += 1
        if w.count >= n:
            if self._waits(ident, w, t):
                return outcome  # full, and held back by its key's run
            del self.windows[ident]
            self._fire_held(ident, w, t, MAX_ITEMS)
            if outcome == SCHEDULE_TRAILING:
                return FIRE_IMMEDIATE  # the item alone completed its batch
        return outcome

    def rate_limit(
        self,
        t: float,
        ident: Ident,
        payload: Any,
        *,
        limit: int,
        period: float,
        overlap: str = "allow",
    ) -> str:
        """A rate-limited ping: it fires at once while fewer than ``limit`` have fired in
        the window (a fixed one, from its first ping, ``period`` long), else is dropped.
        Every fire is a leading edge: ``overlap="queue-latest"`` is refused."""
        limit = _at_least_one("limit", limit)
        period = _positive("period", period)
        _overlap(overlap, None, True)
        params = (limit, period)
        self.advance(t)
        w = self._check_mode(ident, RATE, params)
        if w is None:
            w = FlowWindow(RATE, params, t, t + period)
            self.windows[ident] = w
        if w.fired >= limit:
            self.dropped += 1
            return DROPPED
        w.fired += 1
        self._leading(t, ident, payload)
        return FIRE_IMMEDIATE

    def flush(self, t: float, ident: Ident) -> bool:
        """Fire what is pending now (reason "flush"); False if nothing was (no change).

        A throttle then starts a cool-down [t, t + interval); audit and batch close.
        A queue-latest window whose key's run blocks waits for it instead (True)."""
        self.advance(t)
        w = self.windows.get(ident)
        if w is None or w.count == 0:
            return False
        if self._waits(ident, w, t):
            return True
        del self.windows[ident]
        self._fire_held(ident, w, t, FLUSH)
        if w.kind == THROTTLE and w.params[1]:
            self._cool_down(ident, w, t)
        return True

    def cancel(self, t: float, ident: Ident) -> bool:
        """Drop what is pending and close the window, with no cool-down; True if there
        was one (a cool-down or a rate-limit window included)."""
        self.advance(t)
        return self.windows.pop(ident, None) is not None

    def pending(self, t: float, ident: Ident) -> bool:
        """Whether a fire is pending for ``ident`` at t (``has()``)."""
        self.advance(t)
        w = self.windows.get(ident)
        return w is not None and w.count > 0

    def open_windows(self, t: float) -> int:
        """The windows with a fire pending at t (``len()``)."""
        self.advance(t)
        return sum(1 for w in self.windows.values() if w.count > 0)

    def pending_pings(self, t: float, ident: Ident | None = None) -> int:
        """The accepted pings no fire has accounted for yet, at t (of one key, or all)."""
        self.advance(t)
        if ident is not None:
            w = self.windows.get(ident)
            return 0 if w is None else w.count
        return sum(w.count for w in self.windows.values())
