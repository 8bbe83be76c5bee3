"""Reading stored JSON documents strictly, and hiding URL credentials in messages.

Every stored document (window documents, leases, fire records, persisted runs) and
the CLI's event lines are read through :func:`strict_loads` and the typed field readers
here, so that an unreadable document raises :exc:`ValueError`, which the readers'
callers catch, and never a ``RecursionError`` or a NaN that would poison arithmetic
later. Pure: no Trio, no I/O.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

#: The userinfo of a URL (``nats://user:password@host``), up to its ``@``.
_URL_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def hide_userinfo(text: str) -> str:
    """``text`` with the credentials of any URL in it (``nats://user:pass@``,
    ``nats://token@``) replaced by ``<hidden>@``."""
    return _URL_USERINFO.sub("<hidden>@", text)


def _reject_constant(name: str) -> float:
    # Python's json accepts NaN, Infinity and -Infinity; JSON does not.
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range for a float")
    return value


def strict_loads(raw: bytes | str) -> Any:
    """The JSON value of ``raw``.

    Raises:
      ValueError: not UTF-8, not JSON, a NaN or infinity (``NaN``, ``Infinity``, or a
        literal beyond the float range), or nested too deeply to parse.
    """
    try:
        return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("a document nested too deeply") from None


def utf8(name: str, value: str) -> str:
    """``value`` (the field ``name``), refused if no UTF-8 document could hold it.

    A ``"\\ud800"`` escape parses to a lone surrogate, which no document can be
    written back with (the encoders write UTF-8).

    Raises:
      ValueError: ``value`` holds a lone surrogate.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} holds a lone surrogate") from None
    return value


def number(obj: dict[str, Any], name: str) -> int | float:
    """The finite number in field ``name`` of ``obj``, as stored (an int stays an int).

    Raises:
      ValueError: missing or null, not a number (a bool is not one), not finite, or
        beyond the float range.
    """
    value = obj.get(name)
    if value is None:
        raise ValueError(f"{name} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} is not a number: {str(value)[:40]}")
    try:
        finite = math.isfinite(float(value))
    except OverflowError:
        raise ValueError(f"{name} is beyond the float range") from None
    if not finite:
        raise ValueError(f"{name} is not finite")
    return value


def opt_number(obj: dict[str, Any], name: str) -> int | float | None:
    """:func:`number`, or None where the field is missing or null."""
    return None if obj.get(name) is None else number(obj, name)


def string(obj: dict[str, Any], name: str, *, nonempty: bool = False) -> str:
    """The string in field ``name`` of ``obj`` (non-empty if ``nonempty``).

    Raises:
      ValueError: missing or null, not a string, empty where ``nonempty``, or holding
        a lone surrogate.
    """
    value = obj.get(name)
    if value is None:
        raise ValueError(f"{name} is missing")
    if not isinstance(value, str):
        raise ValueError(f"{name} is not a string")
    if nonempty and not value:
        raise ValueError(f"{name} is an empty string")
    return utf8(name, value)


def opt_string(obj: dict[str, Any], name: str) -> str | None:
    """:func:`string`, or None where the field is missing or null."""
    return None if obj.get(name) is None else string(obj, name)
