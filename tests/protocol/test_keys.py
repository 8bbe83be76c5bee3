"""KV key encoding of windows: injective, reversible, and always a valid KV key."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_debounce._keys import MAX_KEY_BYTES, parse_window_key, window_key

# What NATS accepts as a KV key: these characters, no empty token, no leading or
# trailing dot; and never a wildcard.
VALID_KV_KEY = re.compile(r"\A[-/_=A-Za-z0-9]+(\.[-/_=A-Za-z0-9]+)*\Z")

names = st.text(min_size=1, max_size=60).filter(
    lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)
)


@given(names, names)
def test_round_trip_and_valid_kv_key(workflow: str, key: str) -> None:
    encoded = window_key(workflow, key)
    assert VALID_KV_KEY.match(encoded)
    assert "*" not in encoded
    assert ">" not in encoded
    assert parse_window_key(encoded) == (workflow, key)


@given(names, names, names, names)
def test_injective(w1: str, k1: str, w2: str, k2: str) -> None:
    if (w1, k1) != (w2, k2):
        assert window_key(w1, k1) != window_key(w2, k2)


@pytest.mark.parametrize(
    ("workflow", "key"),
    [("a.b", "c"), ("a", "b.c"), ("*", ">"), ("$KV", "x y"), ("é", "\u0000"), ("a", "🙂")],
)
def test_tricky_names(workflow: str, key: str) -> None:
    encoded = window_key(workflow, key)
    assert VALID_KV_KEY.match(encoded)
    assert parse_window_key(encoded) == (workflow, key)


@pytest.mark.parametrize(
    ("workflow", "key", "error", "match"),
    [
        ("", "k", ValueError, "workflow must be a non-empty"),
        ("w", "", ValueError, "key must be a non-empty"),
        ("w", 5, TypeError, "5"),
        ("w\ud800", "k", ValueError, "lone surrogate"),
        ("w", "k" * 800, ValueError, f"at most {MAX_KEY_BYTES}"),
    ],
)
def test_bad_names_are_refused_before_anything_is_sent(
    workflow: str, key: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        window_key(workflow, key)  # type: ignore[arg-type]


def test_longest_accepted_key_is_within_the_limit() -> None:
    budget = MAX_KEY_BYTES * 3 // 4 - 3
    encoded = window_key("w" * (budget // 2), "k" * (budget - budget // 2))
    assert len(encoded) <= MAX_KEY_BYTES


@pytest.mark.parametrize(
    "encoded",
    [
        "",
        "w",
        "w.YQ",
        "x.YQ.Yg",
        "w.YQ.Yg.Yw",
        "w..Yg",
        "w.YQ=.Yg",
        "w.YR.Yg",
        "w.!!.Yg",
        "w.gA.Yg",
    ],
)
def test_parse_refuses_what_encode_cannot_make(encoded: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        parse_window_key(encoded)
