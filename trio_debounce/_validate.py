"""Argument checks, in the style of :func:`trio.move_on_after`: the error names the value."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

from ._types import Mode

_MODES = ", ".join(repr(m.value) for m in Mode)


def advisory_seconds(value: object) -> float | None:
    """``value`` as seconds if it is a finite number > 0, else None: for optional
    fields of stored documents that are only hints (a value no duration has is
    ignored, not an unreadable document)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def finite(name: str, value: object, kind: str) -> float:
    """Return ``value`` as a finite float, or raise.

    Raises:
      TypeError: ``value`` is not an :class:`int` or :class:`float` (``bool`` is
        refused too); the message says ``name`` must be ``kind``.
      ValueError: ``value`` is NaN, infinite, or an int too large for a float.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {kind}, not {value!r}")
    try:
        seconds = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got {value!r}") from None
    if math.isnan(seconds):
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    if math.isinf(seconds):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return seconds


def duration(name: str, value: object) -> float:
    """Return ``value`` as a float number of seconds, or raise.

    Raises:
      TypeError: ``value`` is not an :class:`int` or :class:`float` (``bool`` is
        refused too).
      ValueError: ``value`` is negative, NaN or infinite.
    """
    seconds = finite(name, value, "a number of seconds (float)")
    if seconds < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return seconds


#: The longest ``delay`` or ``max_delay`` of a shared window, seconds (about 31.7
#: years): its times are wall-clock epoch seconds, and far beyond that a float no
#: longer tells a heartbeat's interval from nothing (the clock would stand still).
MAX_SHARED_SECONDS = 1e9


def shared_duration(name: str, seconds: float) -> float:
    """Return ``seconds`` (a valid duration) if a shared window can keep it, or raise.

    Raises:
      ValueError: ``seconds`` is above :data:`MAX_SHARED_SECONDS`.
    """
    if seconds > MAX_SHARED_SECONDS:
        raise ValueError(
            f"{name} of a shared window must be at most {MAX_SHARED_SECONDS:g} s (its "
            f"times are wall-clock epoch seconds), got {seconds!r}"
        )
    return seconds


def positive_duration(name: str, value: object) -> float:
    """Return ``value`` as a float number of seconds > 0, or raise (as :func:`duration`,
    and :exc:`ValueError` for 0)."""
    seconds = finite(name, value, "a number of seconds (float)")
    if seconds <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return seconds


def shareable(what: str, value: str) -> str:
    """Return ``value`` if it can leave the process as UTF-8 (no lone surrogate).

    Raises:
      ValueError: ``value`` holds a lone surrogate (the message gives its index).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} {value[:60]!r} is not valid Unicode text (lone surrogate at index "
            f"{exc.start}), so it cannot be shared with other processes"
        ) from None
    return value


def max_delay_below_delay(max_delay: float, delay: float) -> ValueError:
    """The error for a ping whose ``max_delay`` is shorter than its ``delay``."""
    return ValueError(
        f"max_delay must be >= delay, got max_delay={max_delay!r} and delay={delay!r}"
    )


_shareable = shareable  # for handler_map, whose keyword argument shadows it


def name(what: str, value: object) -> str:
    """Return ``value`` if it is a non-empty :class:`str`, else raise.

    Raises:
      TypeError: ``value`` is not a :class:`str`.
      ValueError: ``value`` is empty.
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {value!r}")
    if not value:
        raise ValueError(f"{what} must be a non-empty str, got {value!r}")
    return value


def mode(value: object) -> Mode:
    """Return ``value`` as a :class:`Mode`, accepting the enum or its string value.

    Raises:
      ValueError: ``value`` is not one of the three modes.
    """
    if isinstance(value, Mode):
        return value
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(f"mode must be one of {_MODES}, got {value!r}") from None


def run_id(value: object) -> str | None:
    """Return ``value`` if it is ``None`` or a non-empty :class:`str`, else raise."""
    if value is None:
        return None
    return name("run_id", value)


def handler(what: str, value: Any) -> None:
    """Raise :class:`TypeError` unless ``value`` is ``None`` or may be an async callable.

    Refused here: what is not callable, and builtins (``print``), which never return an
    awaitable. Any other callable may return one (a sync wrapper or a lambda around an
    async function does), so, as in Trio, it is only checked when called: a handler
    that returns no awaitable is reported as a handler error with a
    :class:`TypeError`.
    """
    if value is None:
        return
    if not callable(value) or inspect.isbuiltin(value):
        raise TypeError(f"{what} must be an async callable taking a Fire, not {value!r}")


def handler_map(
    what: str, handlers: Mapping[str, Any] | None, kind: str, *, shareable: bool = False
) -> dict[str, Any]:
    """``handlers`` (``open_coordinator(handlers=)`` or ``run_handlers=``) as a checked
    dict of workflow names to async callables.

    Raises:
      TypeError: not a mapping, a name that is not a str, a handler that is not an
        async callable (or None).
      ValueError: an empty name; with ``shareable``, a name with a lone surrogate.
    """
    try:
        checked = dict(handlers or {})
    except (TypeError, ValueError):
        raise TypeError(
            f"{what} must be a mapping of workflow names to {kind}, not {handlers!r}"
        ) from None
    for workflow, fn in checked.items():
        name("workflow", workflow)
        if shareable:
            _shareable("workflow", workflow)
        handler(f"{what}[{workflow!r}]", fn)
        if fn is None:
            raise TypeError(f"{what}[{workflow!r}] must be an async callable, not None")
    return checked
