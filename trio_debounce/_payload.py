"""How payloads cross processes: the serializer that shared windows store them with."""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _encode_str
from typing import Any, Protocol


class PayloadSerializer(Protocol):
    """Turns payloads into text stored in a shared window's document, and back.

    Every process that shares a store must use the same serializer. ``loads(dumps(x))``
    is what every handler receives, in every process, so a payload looks the same
    whoever fires it.
    """

    def dumps(self, value: Any) -> str:
        """The text of ``value``; raises :exc:`TypeError` or :exc:`ValueError` naming
        it when it cannot be stored."""

    def loads(self, text: str) -> Any:
        """The value ``text`` was made from."""


class JsonSerializer:
    """Payloads as strict JSON text: the default :class:`PayloadSerializer`.

    ``NaN``, infinities and objects that JSON cannot hold are refused (JSON has no
    such values, and another process could not read them back). Strings are escaped to
    ASCII, so any Python ``str`` (lone surrogates included) round-trips. Tuples come
    back as lists, and dict keys as strings, as JSON has it.
    """

    def __init__(self) -> None:
        # One encoder for every call: json.dumps with options builds one per call,
        # which costs more than encoding a small payload.
        self._encoder = json.JSONEncoder(allow_nan=False, separators=(",", ":"))

    def dumps(self, value: Any) -> str:
        """Raises:
        TypeError: ``value`` holds an object JSON cannot represent.
        ValueError: ``value`` holds NaN or an infinity.
        """
        kind = type(value)
        if kind is int:
            return int.__repr__(value)  # what the encoder writes, without building one
        if kind is str:
            return _encode_str(value)
        try:
            return self._encoder.encode(value)
        except TypeError as exc:
            raise TypeError(f"payload {_short(value)} cannot be stored as JSON: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"payload {_short(value)} cannot be stored as JSON: {exc}") from None
        except RecursionError:
            raise ValueError(f"payload {_short(value)} is nested too deeply for JSON") from None

    def loads(self, text: str) -> Any:
        return json.loads(text)

    def __repr__(self) -> str:
        return "JsonSerializer()"


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= 80 else text[:77] + "..."
