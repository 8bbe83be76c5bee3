"""Parsing of JSON-lines event input for the ``trio-debounce`` CLI."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .._codec import strict_loads

#: Times at or beyond 2**53 are not exact as floats: integer times would be rounded.
_EXACT_LIMIT = 2.0**53


class EventError(ValueError):
    """A line of event input is malformed; ``str()`` names the line and the reason.

    Attributes:
      line_number (int): 1-based line number in the input.
      reason (str): what is wrong with the line.
    """

    def __init__(self, line_number: int, reason: str) -> None:
        super().__init__(f"line {line_number}: {reason}")
        self.line_number = line_number
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Event:
    """One parsed event: its time (input's unit), key, the whole object, and line."""

    ts: float
    key: str
    payload: Any
    line_number: int


def _describe(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def decode_line(raw: bytes, line_number: int) -> str:
    """One input line as text: UTF-8, without a trailing ``\r``; else :class:`EventError`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EventError(line_number, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    return text.removesuffix("\r")


def parse_json_object(text: str, line_number: int) -> dict[str, Any]:
    """Parse one line as a strict JSON object, or raise :class:`EventError`.

    Strict: ``NaN``, ``Infinity`` and floats beyond the float range are refused, so
    whatever is accepted can be written back out as valid JSON.
    """
    try:
        value = strict_loads(text)
    except json.JSONDecodeError as exc:
        raise EventError(line_number, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError as exc:  # NaN, Infinity, 1e999, too long an integer, too deep
        raise EventError(line_number, f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise EventError(line_number, f"expected a JSON object, got {_describe(value)}")
    return value


def event_key(obj: dict[str, Any], key_field: str, line_number: int) -> str:
    """Return ``obj[key_field]`` if it is a non-empty JSON string, else raise."""
    if key_field not in obj:
        raise EventError(line_number, f"missing key field {key_field!r}")
    key = obj[key_field]
    if not isinstance(key, str):
        raise EventError(
            line_number, f"key field {key_field!r} must be a JSON string, got {_describe(key)}"
        )
    if not key:
        raise EventError(line_number, f"key field {key_field!r} is an empty string")
    return key


def event_time(obj: dict[str, Any], time_field: str, line_number: int) -> float:
    """Return ``obj[time_field]`` if it is a finite JSON number, else raise."""
    if time_field not in obj:
        raise EventError(line_number, f"missing time field {time_field!r}")
    ts = obj[time_field]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise EventError(
            line_number, f"time field {time_field!r} must be a JSON number, got {_describe(ts)}"
        )
    try:
        seconds = float(ts)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds):
        raise EventError(line_number, f"time field {time_field!r} must be finite, got {ts!r}")
    if abs(seconds) >= _EXACT_LIMIT:
        raise EventError(
            line_number,
            f"time field {time_field!r} is {ts!r}: times must be below 2**53 in magnitude "
            "to be exact as float seconds (use a coarser unit)",
        )
    return seconds


def parse_event(text: str, line_number: int, *, key_field: str, time_field: str) -> Event:
    """Parse one JSON-lines event with a string key and a numeric time."""
    obj = parse_json_object(text, line_number)
    key = event_key(obj, key_field, line_number)
    ts = event_time(obj, time_field, line_number)
    return Event(ts, key, obj, line_number)
