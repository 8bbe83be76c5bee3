"""The local side of a debounce window: the engine's state plus its task's state.

A window is a plain slotted object owned by the coordinator's table; its task (see
``Coordinator._window_task``) only sleeps until the window is due and then fires it.
A ping that lands in an open window changes it through the engine (``_engine``) and
nothing else.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from . import _engine
from ._engine import WindowState

if TYPE_CHECKING:
    import trio

    from ._options import InitialFactory, Reducer, WindowOptions
    from ._types import Handler, Mode

# Window states. ``OPEN`` windows fire when their deadline is reached; ``FLUSHED`` ones
# fire at ``flushed_at`` as soon as their task runs; ``CLOSED`` ones never fire again.
OPEN = 0
FLUSHED = 1
CLOSED = 2


class Window(WindowState):
    """One local debounce window, identified by ``(workflow, key)``.

    The rule state (due time, cap, count, payload and accumulation) is the engine's
    :class:`~trio_debounce._engine.WindowState`; this class adds what the local table
    and the window's task need: the identity, the run id, the handler, the cancel scope
    the task sleeps in and the task's state.
    """

    __slots__ = (
        "flushed_at",
        "ident",
        "on_fire",
        "reducer",
        "run",
        "run_id",
        "scope",
        "state",
    )

    ident: tuple[str, str]
    run_id: str
    on_fire: Handler | None
    scope: trio.CancelScope | None
    state: int
    #: The time a flush committed the fire at (state FLUSHED).
    flushed_at: float
    reducer: tuple[Reducer, InitialFactory | None]  # (fn, initial factory) of a reducer window
    run: KeyRun | None  # the run of a committed "queue-latest" fire

    @classmethod
    def open(
        cls,
        ident: tuple[str, str],
        run_id: str,
        on_fire: Handler | None,
        t: float,
        payload: Any,
        delay: float,
        max_delay: float | None,
        mode: Mode,
        opts: WindowOptions | None = None,
        order: float | None = None,
        value: Any = None,
    ) -> Window:
        """The window a ping at ``t`` opens (see :func:`_engine.open_window`)."""
        window = _engine.open_window(
            t,
            payload,
            delay=delay,
            max_delay=max_delay,
            mode=mode,
            opts=opts,
            order=order,
            value=value,
            state=cls.__new__(cls),
        )
        assert isinstance(window, cls)
        window.ident = ident
        window.run_id = run_id
        #: The latest non-None on_fire among the window's pings.
        window.on_fire = on_fire
        #: The cancel scope the window's task is sleeping in, while it sleeps.
        window.scope = None
        window.state = OPEN
        window.flushed_at = 0.0
        window.run = None
        return window

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


class KeyRun:
    """A run (a trailing fire's handler) of a ``queue-latest`` key, while it blocks the
    key's next fire: until its handler returns, or until ``block_until``."""

    __slots__ = ("block_until", "waiter")

    def __init__(self, block_until: float) -> None:
        #: Trio time after which the run no longer blocks (start + run_timeout), or inf.
        self.block_until = block_until
        #: The window of the key waiting for this run to end, if any.
        self.waiter: Window | None = None
