"""The window options: ``max_count``, payload policies, ``overlap`` and ``order_key``.

A window opened with the default options (``payload_policy="last"``, no ``max_count``,
``overlap="allow"``, no ``order_key``) never reaches this module: its pings stay on the
coordinator's fast path. Everything here is for windows that use at least one option.
Like ``mode``, the options belong to the window and are fixed by its first ping; they
are kept as one frozen :class:`WindowOptions`, compared as a whole on every later ping.
This module validates and normalizes them; what they do to a window is the engine's
(``_engine``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from . import _validate
from ._types import DebounceOptions, Mode
from ._types import InitialFactory as InitialFactory
from ._types import Overflow as Overflow
from ._types import Overlap as Overlap
from ._types import Reducer as Reducer

LAST = "last"
FIRST = "first"
COLLECT = "collect"
_BUILTIN_POLICIES = (LAST, FIRST, COLLECT)

FIRE_EARLY = "fire-early"
DROP_OLDEST = "drop-oldest"
_OVERFLOWS = (FIRE_EARLY, DROP_OLDEST)

ALLOW = "allow"
QUEUE_LATEST = "queue-latest"
_OVERLAPS = (ALLOW, QUEUE_LATEST)

#: ``max_items`` of a ``"collect"`` or reducer window when the caller gives none.
DEFAULT_MAX_ITEMS = 1000


@dataclass(frozen=True, slots=True)
class WindowOptions:
    """The options a window's first ping fixed, normalized (defaults filled in)."""

    max_count: int | None = None
    payload_policy: str = LAST
    max_items: int | None = None
    overflow: str | None = None
    overlap: str = ALLOW
    run_timeout: float | None = None
    #: True when the window's pings carry an ``order_key``.
    ordered: bool = False

    @property
    def queue(self) -> bool:
        return self.overlap == QUEUE_LATEST

    @property
    def reducer(self) -> bool:
        return self.payload_policy not in _BUILTIN_POLICIES


DEFAULT = WindowOptions()


def count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return value


def order_key(value: object) -> float:
    """Return ``value`` if it is a usable order key (an int, or a finite float).

    Raises:
      TypeError: ``value`` is not an :class:`int` or :class:`float` (``bool`` is
        refused too).
      ValueError: ``value`` is NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"order_key must be a number (int or float), not {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"order_key must be finite, got {value!r}")
    return value


def window_options(
    mode: Mode,
    max_count: object,
    payload_policy: object,
    max_items: object,
    overflow: object,
    overlap: object,
    run_timeout: object,
    ordered: bool,
    reducers: dict[str, tuple[Reducer, InitialFactory | None]],
) -> WindowOptions:
    """Validate one ping's options and return them normalized.

    Raises:
      TypeError: an option has the wrong type (the message names it).
      ValueError: an option has a bad value, or options that do not go together.
    """
    limit = None if max_count is None else count("max_count", max_count)
    if not isinstance(payload_policy, str):
        raise TypeError(f"payload_policy must be a str, not {payload_policy!r}")
    if payload_policy not in _BUILTIN_POLICIES and payload_policy not in reducers:
        known = ", ".join(repr(n) for n in (*_BUILTIN_POLICIES, *sorted(reducers)))
        raise ValueError(
            f"payload_policy must be one of {known} (a reducer is registered with "
            f"Coordinator.set_reducer()), got {payload_policy!r}"
        )
    accumulates = payload_policy not in (LAST, FIRST)
    items: int | None = None
    if max_items is not None:
        items = count("max_items", max_items)
        if not accumulates:
            raise ValueError(
                f"max_items bounds payload_policy 'collect' or a reducer, not {payload_policy!r}"
            )
    elif accumulates:
        items = DEFAULT_MAX_ITEMS
    how: str | None = None
    if overflow is not None:
        if overflow not in _OVERFLOWS:
            raise ValueError(f"overflow must be 'fire-early' or 'drop-oldest', got {overflow!r}")
        if not accumulates:
            raise ValueError(
                f"overflow applies to payload_policy 'collect' or a reducer, not {payload_policy!r}"
            )
        how = str(overflow)
    elif accumulates:
        how = FIRE_EARLY
    if how == DROP_OLDEST and payload_policy != COLLECT:
        raise ValueError(
            f"overflow='drop-oldest' needs payload_policy='collect': the reducer "
            f"{payload_policy!r} cannot take its oldest input back out"
        )
    refusal = None
    if mode is not Mode.TRAILING:
        refusal = f"overlap='queue-latest' needs mode='trailing', got mode={mode.value!r}"
    overlap, timeout = overlap_of(overlap, run_timeout, refusal)
    if ordered and accumulates and payload_policy != COLLECT:
        raise ValueError(
            f"order_key cannot be combined with the reducer {payload_policy!r}: a reducer "
            "folds payloads in arrival order (put the order key in the payload instead)"
        )
    return WindowOptions(limit, payload_policy, items, how, overlap, timeout, ordered)


def overlap_of(
    overlap: object, run_timeout: object, refusal: str | None
) -> tuple[str, float | None]:
    """``overlap`` and ``run_timeout`` of a window, checked: ``(overlap, run_timeout)``.

    ``refusal``: None if the window may take ``"queue-latest"``, else why not (the
    start of the message: a window with a leading edge commits that fire at ping time
    and cannot wait for a run).

    Raises:
      ValueError: an unknown ``overlap``, ``"queue-latest"`` where ``refusal`` says
        no, a ``run_timeout`` without ``"queue-latest"``.
      TypeError: a ``run_timeout`` that is not a number.
    """
    if overlap not in _OVERLAPS:
        raise ValueError(f"overlap must be 'allow' or 'queue-latest', got {overlap!r}")
    if overlap == QUEUE_LATEST and refusal is not None:
        raise ValueError(
            f"{refusal}: a leading fire is committed at ping time and cannot wait for a run"
        )
    timeout: float | None = None
    if run_timeout is not None:
        timeout = _validate.positive_duration("run_timeout", run_timeout)
        if overlap != QUEUE_LATEST:
            raise ValueError("run_timeout bounds overlap='queue-latest' runs; pass that too")
    return str(overlap), timeout


_NAMES = frozenset(DebounceOptions.__annotations__)


def check_names(options: Mapping[str, object]) -> None:
    """Raise :exc:`TypeError` for a keyword that is not an option, as Python would."""
    for name in options:
        if name not in _NAMES:
            raise TypeError(f"debounce() got an unexpected keyword argument {name!r}")


def mismatch(ident: tuple[str, str], window: WindowOptions, ping: WindowOptions) -> ValueError:
    """The error for a ping whose options differ from its open window's."""
    if window.ordered != ping.ordered:
        if window.ordered:
            return ValueError(
                f"the open window {ident!r} was opened with an order_key: every ping of "
                "it needs one"
            )
        return ValueError(
            f"the open window {ident!r} was opened without an order_key: its pings cannot carry one"
        )
    for field in fields(WindowOptions):
        mine, theirs = getattr(ping, field.name), getattr(window, field.name)
        if mine != theirs:
            return ValueError(
                f"{field.name} {mine!r} differs from the {field.name} {theirs!r} of the "
                f"open window {ident!r}"
            )
    raise AssertionError("the options do not differ")  # pragma: no cover
