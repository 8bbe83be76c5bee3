"""A small pure-Python reference model of the debounce rules (the foundation issue).

It knows nothing of Trio: it is fed operations in time order and closes every window
whose deadline has been reached before it applies the operation at that time. The
property tests drive the same timelines through the real coordinator on MockClock and
compare results and fires with this model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

TRAILING, LEADING, BOTH = "trailing", "leading", "both"


@dataclass(frozen=True)
class ModelFire:
    fired_at: float
    key: tuple[str, str]
    payload: Any
    ping_count: int
    edge: str
    run_id: str
    first_ping_at: float


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


@dataclass
class Model:
    windows: dict[tuple[str, str], _Window] = field(default_factory=dict)
    fires: list[ModelFire] = field(default_factory=list)

    def advance(self, t: float) -> None:
        """Close every window whose deadline is <= t (a reached deadline is due)."""
        for ident, w in sorted(self.windows.items(), key=lambda kv: kv[1].deadline):
            if w.deadline <= t:
                del self.windows[ident]
                if w.pending:
                    self.fires.append(
                        ModelFire(w.deadline, ident, w.payload, w.count, "trailing", w.run_id, w.t0)
                    )

    def ping(
        self,
        t: float,
        ident: tuple[str, str],
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: str,
        run_id: str,
    ) -> tuple[str, str, float | None, int]:
        """Returns (outcome, run id, scheduled_at, count); raises ValueError on a mode clash."""
        self.advance(t)
        w = self.windows.get(ident)
        if w is not None:
            if mode != w.mode:
                raise ValueError("mode differs from the open window's")
            w.count += 1
            w.payload = payload
            w.deadline = min(t + delay, w.cap)
            if w.mode == BOTH:
                w.pending = True
            return ("coalesce", w.run_id, w.deadline if w.pending else None, w.count)
        cap = math.inf if max_delay is None else t + max_delay
        deadline = min(t + delay, cap)
        w = _Window(mode, t, cap, deadline, payload, 1, run_id, pending=mode == TRAILING)
        self.windows[ident] = w
        if mode == TRAILING:
            return ("schedule-trailing", run_id, deadline, 1)
        self.fires.append(ModelFire(t, ident, payload, 1, "leading", run_id, t))
        return ("fire-immediate", run_id, None, 1)

    def cancel(self, t: float, ident: tuple[str, str]) -> bool:
        self.advance(t)
        return self.windows.pop(ident, None) is not None

    def flush(self, t: float, ident: tuple[str, str]) -> bool:
        self.advance(t)
        w = self.windows.pop(ident, None)
        if w is None or not w.pending:
            return False
        self.fires.append(ModelFire(t, ident, w.payload, w.count, "trailing", w.run_id, w.t0))
        return True

    def finish(self, t: float, on_exit: str = "wait") -> None:
        """A normal exit at time t.

        "wait": every pending fire happens at its deadline; "flush": fires due by t
        happen at their deadlines, the rest at t; "cancel": the rest are dropped.
        """
        if on_exit == "wait":
            self.advance(math.inf)
            return
        self.advance(t)
        for ident, w in list(self.windows.items()):
            del self.windows[ident]
            if w.pending and on_exit == "flush":
                self.fires.append(
                    ModelFire(t, ident, w.payload, w.count, "trailing", w.run_id, w.t0)
                )
