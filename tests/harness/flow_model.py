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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

THROTTLE, BATCH, RATE = "throttle", "batch", "rate-limit"
FIRE_IMMEDIATE, SCHEDULE_TRAILING = "fire-immediate", "schedule-trailing"
COALESCE, DROPPED = "coalesce", "dropped"
LEADING, TRAILING = "leading", "trailing"
INTERVAL, MAX_ITEMS, MAX_BYTES = "interval", "max-items", "max-bytes"
MAX_WAIT, FLUSH = "max-wait", "flush"
DEFAULT_MAX_ITEMS = 1000

Ident = tuple[str, str]


@dataclass(frozen=True)
class FlowFire:
    """One fire: when, of which key, what it carries and how many pings it accounts for.

    ``edge`` is "leading" or "trailing"; ``reason`` one of "leading", "interval",
    "max-items", "max-bytes", "max-wait", "flush".
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
    sizes; ``fired`` the fires of a rate-limit window.
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
class FlowModel:
    """The windows of every key, the fires so far and the count of dropped pings."""

    windows: dict[Ident, FlowWindow] = field(default_factory=dict)
    fires: list[FlowFire] = field(default_factory=list)
    dropped: int = 0
    #: The latest time an operation was applied at (operations come in time order).
    now: float = -math.inf

    # ---------------------------------------------------------------- events

    def advance(self, t: float) -> None:
        """Process every window end <= t, in time order (ties: by ident)."""
        if t < self.now:
            raise AssertionError(f"time went backwards: {t} < {self.now}")
        self.now = t
        while self.windows:
            end, ident = min((w.end, ident) for ident, w in self.windows.items())
            if end > t:
                return
            self._end(ident, self.windows[ident])

    def _end(self, ident: Ident, w: FlowWindow) -> None:
        """A window's end: a pending trailing fire happens; the window closes."""
        del self.windows[ident]
        if w.count == 0:
            return  # nothing pending (a rate-limit window, a throttle with no ping)
        if w.kind == THROTTLE:
            self._fire_held(ident, w, w.end, INTERVAL)
            if w.params[1]:  # leading: a cool-down follows the trailing fire
                self._cool_down(ident, w, w.end)
        else:  # a batch at open + max_wait
            self._fire_held(ident, w, w.end, MAX_WAIT)

    def _fire_held(self, ident: Ident, w: FlowWindow, at: float, reason: str) -> None:
        """The pending (trailing-edge) fire of ``w`` happens at ``at``."""
        payload = list(w.items) if w.kind == BATCH else w.payload
        self.fires.append(FlowFire(at, ident, payload, w.count, TRAILING, reason))
        w.count = 0
        w.payload = None
        w.items = []
        w.sizes = []

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
    ) -> str:
        """A throttle ping; returns its outcome. ValueError (nothing changed) on a bad
        parameter or a clash with the open window."""
        interval = _positive("interval", interval)
        if not leading and not trailing:
            raise ValueError("leading=False and trailing=False: a throttle must fire")
        params = (interval, bool(leading), bool(trailing))
        self.advance(t)
        w = self._check_mode(ident, THROTTLE, params)
        if w is None:
            w = FlowWindow(THROTTLE, params, t, t + interval)
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
        params = (max_wait, n, max_bytes)
        self.advance(t)
        w = self._check_mode(ident, BATCH, params)
        outcome = COALESCE
        if w is not None and max_bytes is not None and w.total + size > max_bytes:
            # The current batch fires first; this item opens the next one.
            del self.windows[ident]
            self._fire_held(ident, w, t, MAX_BYTES)
            w = None
        if w is None:
            w = FlowWindow(BATCH, params, t, t + max_wait)
            self.windows[ident] = w
            outcome = SCHEDULE_TRAILING
        w.items.append(item)
        w.sizes.append(size)
        w.count += 1
        if w.count >= n:
            del self.windows[ident]
            self._fire_held(ident, w, t, MAX_ITEMS)
            if outcome == SCHEDULE_TRAILING:
                return FIRE_IMMEDIATE  # the item alone completed its batch
        return outcome

    def rate_limit(self, t: float, ident: Ident, payload: Any, *, limit: int, period: float) -> str:
        """A rate-limited ping: it fires at once while fewer than ``limit`` have fired in
        the window (a fixed one, from its first ping, ``period`` long), else is dropped."""
        limit = _at_least_one("limit", limit)
        period = _positive("period", period)
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

        A throttle then starts a cool-down [t, t + interval); audit and batch close."""
        self.advance(t)
        w = self.windows.get(ident)
        if w is None or w.count == 0:
            return False
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
