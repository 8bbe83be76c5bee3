"""The state of one open debounce window.

A window is a plain slotted object owned by the coordinator's table; its task (see
``Coordinator._window_task``) only sleeps until the window is due and then fires it.
A ping that lands in an open window writes a few attributes here and nothing else.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import trio

    from ._options import KeyRun, Reducer, WindowOptions
    from ._types import Handler, Mode

# Window states. ``OPEN`` windows fire when their deadline is reached; ``FLUSHED`` ones
# fire at ``flushed_at`` as soon as their task runs; ``CLOSED`` ones never fire again.
OPEN = 0
FLUSHED = 1
CLOSED = 2


class Window:
    """One debounce window, identified by ``(workflow, key)``."""

    __slots__ = (
        "acc",
        "best",
        "cap",
        "count",
        "deadline",
        "first_ping_at",
        "flushed_at",
        "held",
        "ident",
        "max_order",
        "mode",
        "on_fire",
        "opts",
        "payload",
        "reducer",
        "run",
        "run_id",
        "scope",
        "seq",
        "state",
        "trailing",
        "waiting",
    )

    # Set by _options.start() on windows opened with options (``opts`` is not None);
    # a default window never has them.
    acc: Any  # "collect": [(order key, arrival, payload)]; a reducer: its value
    best: float | None  # the order key of ``payload`` ("last" and "first")
    held: int  # payloads accumulated ("collect" and reducers), for max_items
    max_order: float | None  # the highest order key of the window's pings
    reducer: tuple[Reducer, Any]  # (fn, initial factory) of a reducer window
    run: KeyRun | None  # the run of a committed "queue-latest" fire
    seq: int  # the arrival number of the next ping
    waiting: bool  # a due "queue-latest" window waiting for its key's run to end

    def __init__(
        self,
        ident: tuple[str, str],
        mode: Mode,
        trailing: bool,
        now: float,
        deadline: float,
        cap: float,
        payload: Any,
        run_id: str,
        on_fire: Handler | None,
    ) -> None:
        self.ident = ident
        self.mode = mode
        #: True while a trailing fire is pending: always in trailing mode, from the
        #: second ping in both mode, never in leading mode.
        self.trailing = trailing
        self.first_ping_at = now
        #: When the window is due, on Trio's clock: min(t + delay, first_ping_at + cap).
        self.deadline = deadline
        #: first_ping_at + max_delay, or inf.
        self.cap = cap
        self.payload = payload
        self.count = 1
        self.run_id = run_id
        #: The latest non-None on_fire among the window's pings.
        self.on_fire = on_fire
        #: The cancel scope the window's task is sleeping in, while it sleeps.
        self.scope: trio.CancelScope | None = None
        self.state = OPEN
        self.flushed_at = 0.0
        #: The window's options (issue 8), or None for the defaults (the fast path).
        self.opts: WindowOptions | None = None

    def __repr__(self) -> str:
        return (
            f"<Window {self.ident!r} mode={self.mode.value} pings={self.count} "
            f"deadline={self.deadline!r} state={self.state}>"
        )


class SharedWindow:
    """This process's local side of a window shared through a backend.

    The owner's task sleeps until the window is due and then asks the backend to
    finalize it; a *taker* (a non-owner whose ping moved the fire earlier than the
    owner armed) does the same with ``take=True``. Times are on Trio's clock.
    """

    __slots__ = (
        "confirmed_at",
        "count",
        "deadline",
        "finalizing",
        "first_ping_at",
        "ident",
        "mode",
        "on_fire",
        "payload",
        "run_id",
        "scope",
        "state",
        "taker",
        "trailing",
    )

    def __init__(
        self,
        ident: tuple[str, str],
        run_id: str,
        mode: Mode,
        deadline: float,
        first_ping_at: float,
        count: int,
        payload: Any,
        on_fire: Handler | None,
        taker: bool,
    ) -> None:
        self.ident = ident
        self.run_id = run_id
        self.mode = mode
        self.deadline = deadline
        self.first_ping_at = first_ping_at
        self.count = count
        #: The latest payload of this process's pings (the owner's latest local one).
        self.payload = payload
        self.on_fire = on_fire
        self.taker = taker
        #: When (Trio's clock) the backend last said this window is ours to fire.
        self.confirmed_at = -math.inf
        #: True while the task's finalize is in flight (its commit may land any time).
        self.finalizing = False
        #: True while this window is counted as a pending trailing fire.
        self.trailing = False
        self.scope: trio.CancelScope | None = None
        self.state = OPEN

    def __repr__(self) -> str:
        role = "taker" if self.taker else "owner"
        return (
            f"<SharedWindow {self.ident!r} {role} run={self.run_id} pings={self.count} "
            f"deadline={self.deadline!r} state={self.state}>"
        )
