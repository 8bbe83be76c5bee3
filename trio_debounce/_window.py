"""The local side of a debounce window: the engine's state plus its task's state.

A window is a plain slotted object owned by the local table; its task (see
``LocalWindows._run_window``) only sleeps until the window is due and then fires it.
A ping that lands in an open window changes it through the engine (``_engine``) and
nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import _engine
from ._engine import WindowState

if TYPE_CHECKING:
    import trio

    from ._options import InitialFactory, Reducer, WindowOptions
    from ._types import FireReason, Handler, Mode

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
        "cause",
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
    #: What made the trailing fire, set where it was made (a flush, the exit,
    #: ``overflow="fire-early"``, the end of a ``queue-latest`` run), or None: judged
    #: by time (see :func:`_engine.trailing_reason`).
    cause: FireReason | None
    reducer: tuple[Reducer, InitialFactory | None]  # (fn, initial factory) of a reducer window
    run: KeyRun[Window] | None  # the run of a committed "queue-latest" fire

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
        window.cause = None
        window.run = None
        return window

    def __repr__(self) -> str:
        return (
            f"<Window {self.ident!r} mode={self.mode.value} pings={self.count} "
            f"deadline={self.deadline!r} state={self.state}>"
        )


#: The kind of window that waits for a key's run: a debounce :class:`Window`, or a
#: flow window (``_flow_local.FlowWindow``).
W = TypeVar("W")


class KeyRun(Generic[W]):
    """A run (a trailing fire's handler) of a ``queue-latest`` key, while it blocks the
    key's next fire: until its handler returns, or until ``block_until``. Debounce
    windows (``_local.KeyState``) and flow windows (``_flow_local.FlowWindows``) keep
    their keys' runs alike."""

    __slots__ = ("block_until", "waiter")

    def __init__(self, block_until: float) -> None:
        #: Trio time after which the run no longer blocks (start + run_timeout), or inf.
        self.block_until = block_until
        #: The window of the key waiting for this run to end, if any.
        self.waiter: W | None = None
