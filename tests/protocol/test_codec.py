"""The strict readers of stored JSON documents and the URL-credential filter
(``trio_debounce._codec``), pure: every reader of a stored document goes through them."""

from __future__ import annotations

from typing import Any

import pytest

from trio_debounce import _codec


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b'{"a": NaN}', "NaN is not a JSON value"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON value"),
        (b'{"a": 1e999}', "out of range for a float"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"\xff", "utf-8|decode"),
        (b"{", "Expecting property name"),
    ],
)
def test_strict_loads_refuses_with_value_error_only(raw: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _codec.strict_loads(raw)


def test_strict_loads_keeps_ints_and_finite_floats() -> None:
    assert _codec.strict_loads(b'{"i": 3, "f": 0.5, "s": "x"}') == {"i": 3, "f": 0.5, "s": "x"}


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "missing"),
        (True, "not a number"),
        ("1", "not a number"),
        pytest.param(10**400, "beyond the float range", id="10**400"),
    ],
)
def test_number_refuses(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=f"n (is )?{match}"):
        _codec.number({"n": value}, "n")


def test_numbers_as_stored_and_optional() -> None:
    assert _codec.number({"n": 3}, "n") == 3
    assert isinstance(_codec.number({"n": 3}, "n"), int)
    assert _codec.opt_number({}, "n") is None
    assert _codec.opt_number({"n": None}, "n") is None
    assert _codec.opt_number({"n": 2.5}, "n") == 2.5


def test_strings() -> None:
    assert _codec.string({"s": ""}, "s") == ""
    with pytest.raises(ValueError, match="s is an empty string"):
        _codec.string({"s": ""}, "s", nonempty=True)
    with pytest.raises(ValueError, match="s is not a string"):
        _codec.string({"s": 1}, "s")
    with pytest.raises(ValueError, match="s is missing"):
        _codec.string({}, "s")
    with pytest.raises(ValueError, match="s holds a lone surrogate"):
        _codec.string(_codec.strict_loads(b'{"s": "\\ud800"}'), "s")
    assert _codec.opt_string({}, "s") is None


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("nats://alice:s3cret@host:4222", "nats://<hidden>@host:4222"),
        ("tls://t0ken@h and ws://u:p@h2/x", "tls://<hidden>@h and ws://<hidden>@h2/x"),
        ("nats://host:4222 refused: mail me at a@b", "nats://host:4222 refused: mail me at a@b"),
    ],
)
def test_hide_userinfo(text: str, shown: str) -> None:
    assert _codec.hide_userinfo(text) == shown
