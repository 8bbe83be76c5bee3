"""A small pure-Python reference model of the debounce rules (the modes, and the window
options: max_count, payload policies, one run at a time per key, order keys).

It knows nothing of Trio: it is fed operations in time order and, before it applies an
operation at time t, it processes every event due by t in time order (a window's
deadline, the end of a ``queue-latest`` run). The property tests drive the same
timelines through the real coordinator on MockClock and compare results and fires with
this model.

The model knows how long each run takes (``run_times``, by run id), since with
``overlap="queue-latest"`` the end of a run is when a waiting window fires.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TRAILING, LEADING, BOTH = "trailing", "leading", "both"
LAST, FIRST, COLLECT = "last", "first", "collect"
FIRE_EARLY, DROP_OLDEST = "fire-early", "drop-oldest"
ALLOW, QUEUE_LATEST = "allow", "queue-latest"
DEFAULT_MAX_ITEMS = 1000


@dataclass(frozen=True)
class ModelFire:
    fired_at: float
    key: tuple[str, str]
    payload: Any
    ping_count: int
    edge: str
    run_id: str
    first_ping_at: float


@dataclass(frozen=True)
class Options:
    """A window's options as the caller passes them (None: the default)."""

    max_count: int | None = None
    payload_policy: str = LAST
    max_items: int | None = None
    overflow: str | None = None
    overlap: str = ALLOW
    run_timeout: float | None = None

    def normalized(self, mode: str, ordered: bool) -> tuple[Any, ...]:
        """The options a window keeps, defaults filled in; ValueError if they clash."""
        accumulates = self.payload_policy not in (LAST, FIRST)
        if not accumulates and (self.max_items is not None or self.overflow is not None):
            raise ValueError("max_items/overflow without collect or a reducer")
        overflow = self.overflow or (FIRE_EARLY if accumulates else None)
        if overflow == DROP_OLDEST and self.payload_policy != COLLECT:
            raise ValueError("drop-oldest needs collect")
        if self.overlap == QUEUE_LATEST and mode != TRAILING:
            raise ValueError("queue-latest needs trailing")
        if self.run_timeout is not None and self.overlap != QUEUE_LATEST:
            raise ValueError("run_timeout needs queue-latest")
        if ordered and accumulates and self.payload_policy != COLLECT:
            raise ValueError("order_key with a reducer")
        max_items = self.max_items or (DEFAULT_MAX_ITEMS if accumulates else None)
        return (
            self.max_count,
            self.payload_policy,
            max_items,
            overflow,
            self.overlap,
            self.run_timeout,
            ordered,
        )


DEFAULT = Options()


@dataclass
class _Window:
    mode: str
    t0: float
    cap: float
    deadline: float
    payload: Any
    count: int
    run_id: str
    pending: bool
    opts: Options = DEFAULT
    key: tuple[Any, ...] = ()  # the normalized options, compared on every ping
    ordered: bool = False
    items: list[tuple[Any, int, Any]] = field(default_factory=list)  # collect
    acc: Any = None  # a reducer's value
    held: int = 0
    seq: int = 1
    best: Any = None  # the order key of ``payload``
    max_order: Any = None
    waiting: bool = False

    @property
    def queue(self) -> bool:
        return self.opts.overlap == QUEUE_LATEST

    def fire_payload(self) -> Any:
        policy = self.opts.payload_policy
        if policy in (LAST, FIRST):
            return self.payload
        if policy == COLLECT:
            return [p for _, _, p in self.items]
        return self.acc


@dataclass
class _Run:
    end: float
    block_until: float


Reducers = dict[str, tuple[Callable[[Any, Any], Any], Callable[[], Any] | None]]


@dataclass
class Model:
    windows: dict[tuple[str, str], _Window] = field(default_factory=dict)
    fires: list[ModelFire] = field(default_factory=list)
    reducers: Reducers = field(default_factory=dict)
    #: How long the handler of each run id takes (queue-latest runs only matter).
    run_times: dict[str, float] = field(default_factory=dict)
    runs: dict[tuple[str, str], _Run] = field(default_factory=dict)
    fired_order: dict[tuple[str, str], Any] = field(default_factory=dict)
    stale: int = 0

    # ---------------------------------------------------------------- events

    def advance(self, t: float) -> None:
        """Process every event due by t, in time order (a reached deadline is due)."""
        while True:
            events: list[tuple[float, int, tuple[str, str]]] = [
                (w.deadline, 0, ident) for ident, w in self.windows.items()
            ]
            events += [(r.end, 1, ident) for ident, r in self.runs.items()]
            if not events:
                return
            at, kind, ident = min(events)
            if at > t:
                return
            if kind == 0:
                self._due(ident, self.windows[ident], at)
            else:
                del self.runs[ident]
                w = self.windows.get(ident)
                if w is not None and w.waiting:
                    self._commit(ident, w, at)

    def _due(self, ident: tuple[str, str], w: _Window, at: float) -> None:
        if w.queue:
            run = self.runs.get(ident)
            if run is not None and at < run.block_until:
                w.waiting = True
                w.deadline = run.block_until
                return
            self._commit(ident, w, at)
            return
        del self.windows[ident]
        if w.pending:
            self._fire(ident, w, at)

    def _commit(self, ident: tuple[str, str], w: _Window, at: float) -> None:
        """A queue-latest window fires at ``at``; its run blocks the key from then."""
        del self.windows[ident]
        w.waiting = False
        w.deadline = at
        self._fire(ident, w, at)
        timeout = w.opts.run_timeout
        self.runs[ident] = _Run(
            at + self.run_times.get(w.run_id, 0.0), math.inf if timeout is None else at + timeout
        )

    def _fire(self, ident: tuple[str, str], w: _Window, at: float) -> None:
        self.fires.append(
            ModelFire(at, ident, w.fire_payload(), w.count, "trailing", w.run_id, w.t0)
        )
        self._note(ident, w.max_order)

    def _note(self, ident: tuple[str, str], order: Any) -> None:
        if order is not None and (ident not in self.fired_order or order > self.fired_order[ident]):
            self.fired_order[ident] = order

    # ------------------------------------------------------------ operations

    def ping(
        self,
        t: float,
        ident: tuple[str, str],
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: str,
        run_id: str,
        opts: Options = DEFAULT,
        order: Any = None,
        drop_stale: bool = False,
    ) -> tuple[str, str, float | None, int]:
        """Returns (outcome, run id, scheduled_at, count); raises ValueError on a clash."""
        self.advance(t)
        if opts.payload_policy not in (LAST, FIRST, COLLECT) and (
            opts.payload_policy not in self.reducers
        ):
            raise ValueError("unknown payload policy")
        if drop_stale and order is None:
            raise ValueError("drop_stale needs an order key")
        key = opts.normalized(mode, order is not None)
        w = self.windows.get(ident)
        if w is not None and (mode != w.mode or key != w.key):
            raise ValueError("mode or options differ from the open window's")
        if drop_stale:
            last = self.fired_order.get(ident)
            if last is not None and order <= last:
                self.stale += 1
                if w is None:
                    return ("stale", "", None, 0)
                return ("stale", w.run_id, self._scheduled(w), w.count)
        if w is None:
            return self._open(t, ident, payload, delay, max_delay, mode, run_id, opts, key, order)
        policy = opts.payload_policy
        if w.key[3] == FIRE_EARLY and w.held >= w.key[2]:
            # The window fires now with what it holds; this ping opens the next one.
            if w.queue:
                self._commit(ident, w, t)
            else:
                del self.windows[ident]
                if w.pending:
                    self._fire(ident, w, t)
            return self._open(t, ident, payload, delay, max_delay, mode, run_id, opts, key, order)
        seq = w.seq
        w.seq += 1
        w.count += 1
        if order is not None and (w.max_order is None or order > w.max_order):
            w.max_order = order
        if policy == LAST:
            if order is None or order >= w.best:
                w.payload, w.best = payload, order
        elif policy == FIRST:
            if order is not None and order < w.best:
                w.payload, w.best = payload, order
        elif policy == COLLECT:
            w.items.append((0 if order is None else order, seq, payload))
            w.items.sort(key=lambda item: (item[0], item[1]))
            if len(w.items) > w.key[2]:
                del w.items[0]
            w.held = len(w.items)
        else:
            w.acc = self.reducers[policy][0](w.acc, payload)
            w.held += 1
        if not w.waiting:
            w.deadline = min(t + delay, w.cap)
            if opts.max_count is not None and w.count >= opts.max_count:
                w.deadline = t
            if w.mode == BOTH:
                w.pending = True
            if w.queue and w.deadline <= t:
                self._due(ident, w, t)
        return ("coalesce", w.run_id, self._scheduled(w), w.count)

    @staticmethod
    def _scheduled(w: _Window) -> float | None:
        return w.deadline if w.pending and not w.waiting else None

    def _open(
        self,
        t: float,
        ident: tuple[str, str],
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: str,
        run_id: str,
        opts: Options,
        key: tuple[Any, ...],
        order: Any,
    ) -> tuple[str, str, float | None, int]:
        cap = math.inf if max_delay is None else t + max_delay
        deadline = min(t + delay, cap)
        if opts.max_count == 1:
            deadline = t
        w = _Window(mode, t, cap, deadline, payload, 1, run_id, mode == TRAILING, opts, key)
        w.best = w.max_order = order
        policy = opts.payload_policy
        if policy == COLLECT:
            w.items = [(0 if order is None else order, 0, payload)]
            w.held = 1
        elif policy not in (LAST, FIRST):
            fn, initial = self.reducers[policy]
            w.acc = payload if initial is None else fn(initial(), payload)
            w.held = 1
        self.windows[ident] = w
        if mode == TRAILING:
            if w.queue and deadline <= t:
                self._due(ident, w, t)
            return ("schedule-trailing", run_id, self._scheduled(w), 1)
        self.fires.append(ModelFire(t, ident, payload, 1, "leading", run_id, t))
        self._note(ident, order)
        return ("fire-immediate", run_id, None, 1)

    def cancel(self, t: float, ident: tuple[str, str]) -> bool:
        self.advance(t)
        return self.windows.pop(ident, None) is not None

    def flush(self, t: float, ident: tuple[str, str]) -> bool:
        self.advance(t)
        w = self.windows.get(ident)
        if w is None:
            return False
        if w.queue:
            if not w.waiting:
                self._due(ident, w, t)
            return True
        del self.windows[ident]
        if not w.pending:
            return False
        self._fire(ident, w, t)
        return True

    def finish(self, t: float, on_exit: str = "wait") -> None:
        """A normal exit at time t.

        "wait": every pending fire happens (at its deadline, or when the run it waits
        for ends); "flush": fires due by t happen at their deadlines, the rest at t (or,
        queue-latest, when the run they wait for ends); "cancel": the rest are dropped.
        """
        self.advance(t)
        if on_exit == "flush":
            for ident in list(self.windows):
                w = self.windows.get(ident)
                if w is not None and w.pending:
                    self.flush(t, ident)
        elif on_exit == "cancel":
            self.windows = {i: w for i, w in self.windows.items() if not w.pending}
        self.advance(math.inf)
