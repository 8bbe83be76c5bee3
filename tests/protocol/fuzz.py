"""Fuzz targets for the KV document decoders and the key codec (hypothesis-based).

Every decoder of a document another process (or something else) may have written into
the bucket must either return a record or raise one of the exceptions its callers
treat as "unreadable" (they log a warning and go on); anything else would escape into
a coordinator's nursery. The key codec must be injective, reversible and produce only
valid NATS KV keys.

The normal suite runs :func:`run` for a few seconds (``tests/protocol/test_fuzz.py``); the chaos
session runs it for longer::

    python -m tests.protocol.fuzz --seconds 60

and prints one line per target with the number of examples tried. It exits with status
1 and the failing example at the first failure.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_debounce import RunState
from trio_debounce._keys import (
    MAX_KEY_BYTES,
    RUN_LEASE_PREFIX,
    RUN_PREFIX,
    parse_prefixed_key,
    parse_window_key,
    process_key,
    run_key,
    run_lease_key,
    window_key,
)
from trio_debounce._protocol import (
    RunMarker,
    WindowDoc,
    _decode_lease,
    _encode_lease,
    _FireRecord,
    _Lease,
)
from trio_debounce._runs._kv_store import decode_lease, decode_run, encode_lease, encode_run
from trio_debounce._runs._store import Lease, StoredRun
from trio_debounce._types import Mode

#: What NATS accepts as a KV key: these characters in non-empty ``.``-separated
#: tokens; ``*`` and ``>`` (wildcards) never.
VALID_KV_KEY = re.compile(r"\A[-/_=A-Za-z0-9]+(\.[-/_=A-Za-z0-9]+)*\Z")

# ------------------------------------------------------------------ documents


def _window_docs() -> list[bytes]:
    base = WindowDoc(
        "proc", "epoch", "run", Mode.TRAILING, 1.0, 5.0, 10.0, 11.0, 12.0, 15.0, 12.0, 2,
        "w1", "w0", '{"a":1}',
    )  # fmt: skip
    return [
        base.encode(),
        WindowDoc(**{**_fields(base), "max_count": 3, "ordered": True, "order": 1.5}).encode(),
        WindowDoc(
            **{
                **_fields(base),
                "payload_policy": "collect",
                "max_items": 4,
                "payload": "[1,2]",
                "ranks": ((0.0, 0), (0.0, 1)),
            }
        ).encode(),
        # version 3: a reducer under fire-early, queue-latest with its running run, and
        # the last fired order key
        WindowDoc(
            **{
                **_fields(base),
                "payload_policy": "sum",
                "max_items": 4,
                "overflow": "fire-early",
                "held": 2,
                "ordered": True,
                "order": 2,
                "max_order": 7.5,
                "fired_order": 1,
                "queue": True,
                "run_timeout": 30.0,
                "running": RunMarker("proc", "epoch", "run0", 40.0),
            }
        ).encode(),
        WindowDoc(
            **{**_fields(base), "fired": True, "running": RunMarker("p", "e", "r", None)}
        ).encode(),
        # opened over a tombstone: the proof of the run before
        WindowDoc(**{**_fields(base), "after": (("run1", "w8"), ("run0", "w9"))}).encode(),
    ]


def _fields(doc: WindowDoc) -> dict[str, Any]:
    return {name: getattr(doc, name) for name in WindowDoc.__slots__}


TEMPLATES: dict[str, list[bytes]] = {
    "window": _window_docs(),
    "lease": [
        _encode_lease(_Lease("proc", "epoch", 100.0)),
        _encode_lease(_Lease("p", "e", 1, True)),
    ],
    "fire": [
        _FireRecord("proc", "epoch", "wf", "key", "run", "[1]", 3, 10.0, 12.0, 1).encode(),
        _FireRecord("p", "e", "w", "k", "r", None, 1, 0.0, 0.0, 2).encode(),
    ],
    "run": [
        encode_run(StoredRun("run", "wf", '{"x":1}', 100.0)),
        encode_run(
            StoredRun(
                "run",
                "wf",
                "null",
                100.0,
                200.0,
                RunState.STARTED,
                "proc",
                3,
                2,
                1,
                4,
                50.0,
                60.0,
                None,
                None,
            )
        ),
    ],
    "run_lease": [encode_lease(Lease("proc", 1, 100.0)), encode_lease(Lease("p", 2, 1.0, True))],
}


@dataclass(frozen=True)
class Decoder:
    """One document decoder and the exceptions its callers take for "unreadable"."""

    name: str
    decode: Callable[[bytes], object]
    unreadable: tuple[type[BaseException], ...]
    #: Writes a decoded record back (every record read may be written back).
    encode: Callable[[Any], bytes]


#: What the debounce backend catches around its decoders (``_protocol/``).
UNREADABLE = (ValueError, KeyError, TypeError)

DECODERS = [
    Decoder("window", WindowDoc.decode, UNREADABLE, WindowDoc.encode),
    Decoder("lease", _decode_lease, UNREADABLE, _encode_lease),
    Decoder("fire", _FireRecord.decode, UNREADABLE, _FireRecord.encode),
    # The run store's _decode catches ValueError and TypeError.
    Decoder("run", lambda raw: decode_run(raw, 1), (ValueError, TypeError), encode_run),
    Decoder("run_lease", lambda raw: decode_lease(raw, 1), (ValueError, TypeError), encode_lease),
]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 2**63, 10**400, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", "nan", "inf", "1e999", "\ud800", "trailing", "first", "collect"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _dumps(obj: Any) -> bytes:
    # Python's json writes NaN, Infinity and huge ints, which other writers may too.
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw: st.DrawFn, templates: list[bytes]) -> bytes:
    """A valid document of the kind, damaged in one or more ways."""
    raw = draw(st.sampled_from(templates))
    obj = json.loads(raw)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["drop", "set", "set", "version", "add"]))
        names = sorted(obj)
        if how == "drop" and names:
            del obj[draw(st.sampled_from(names))]
        elif how == "set" and names:
            obj[draw(st.sampled_from(names))] = draw(json_values)
        elif how == "version":
            obj["v"] = draw(
                st.one_of(st.sampled_from([0, 2, 3, 1.0, "1", True, None]), json_values)
            )
        else:
            obj[draw(st.text(max_size=8))] = draw(json_values)
    return _dumps(obj)


@st.composite
def damaged_bytes(draw: st.DrawFn, templates: list[bytes]) -> bytes:
    """A valid document cut short, spliced with garbage, or replaced by something odd."""
    raw = draw(st.sampled_from(templates))
    how = draw(st.sampled_from(["truncate", "splice", "nest", "huge", "number"]))
    if how == "truncate":
        return raw[: draw(st.integers(0, len(raw)))]
    if how == "splice":
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(max_size=8)) + raw[at:]
    if how == "nest":
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        opener = draw(st.sampled_from([b"[", b'{"v":']))
        return opener * depth
    if how == "huge":
        obj = json.loads(raw)
        obj["payload"] = "x" * draw(st.sampled_from([10_000, 2_000_000]))
        return _dumps(obj)
    digits = draw(st.sampled_from([b"1e999", b"-1e999", b"9" * 5000, b"NaN", b"Infinity"]))
    return (
        raw.replace(b"100.0", digits)
        .replace(b"10.0", digits)
        .replace(b'"count":2', b'"count":' + digits)
    )


def documents(kind: str) -> st.SearchStrategy[bytes]:
    templates = TEMPLATES[kind]
    return st.one_of(
        st.sampled_from(templates),
        st.just(b""),
        st.binary(max_size=64),
        st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
        json_values.map(_dumps),
        mutated(templates),
        damaged_bytes(templates),
    )


def check_decoder(decoder: Decoder, raw: bytes) -> None:
    """``raw`` decodes to a record that can be written back and read again, or fails
    with one of the decoder's "unreadable" exceptions."""
    try:
        record = decoder.decode(raw)
    except decoder.unreadable:
        return
    again = decoder.decode(decoder.encode(record))
    assert again == record, (record, again)


# ----------------------------------------------------------------------- keys

names = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(alphabet=".*> /\x00\t\n\r=-_$", min_size=1, max_size=20),
    st.sampled_from([".", "*", ">", " ", "/", "..", "a.b", "$KV.x.>", "\x00", "\u2028", "é", "🙂"]),
)


def check_keys(a: tuple[str, str], b: tuple[str, str]) -> None:
    """Window keys of arbitrary names are valid KV keys, reversible and injective;
    process, run and run-lease keys never collide with window keys or each other."""
    encoded: dict[str, object] = {}
    for workflow, key in (a, b):
        try:
            wk = window_key(workflow, key)
        except ValueError as exc:
            # only lone surrogates and lengths beyond the limit are refused
            refused = str(exc)
            assert "surrogate" in refused or "too long" in refused, refused
            continue
        assert VALID_KV_KEY.match(wk), wk
        assert len(wk) <= MAX_KEY_BYTES, wk
        assert parse_window_key(wk) == (workflow, key)
        assert encoded.setdefault(wk, ("w", workflow, key)) == ("w", workflow, key)
        for kind, make, prefix in (
            ("p", process_key, None),
            ("r", run_key, RUN_PREFIX),
            ("rl", run_lease_key, RUN_LEASE_PREFIX),
        ):
            try:
                other = make(workflow)
            except ValueError:
                continue
            assert VALID_KV_KEY.match(other), other
            if prefix is not None:
                assert parse_prefixed_key(prefix, other) == workflow
            assert encoded.setdefault(other, (kind, workflow)) == (kind, workflow)


def check_key_parsers(text: str) -> None:
    """The key parsers accept only canonical keys and fail with ValueError otherwise."""
    try:
        workflow, key = parse_window_key(text)
    except ValueError:
        pass
    else:
        assert window_key(workflow, key) == text
    for prefix, make in ((RUN_PREFIX, run_key), (RUN_LEASE_PREFIX, run_lease_key)):
        try:
            name = parse_prefixed_key(prefix, text)
        except ValueError:
            continue
        assert make(name) == text


# -------------------------------------------------------------------- driver

key_texts = st.one_of(
    st.text(max_size=40),
    st.builds(lambda a, b: f"w.{a}.{b}", st.text(max_size=10), st.text(max_size=10)),
    st.builds(
        lambda w, k: window_key(w, k), st.text("ab", min_size=1), st.text("ab", min_size=1)
    ).map(lambda s: s.replace("=", "") + "="),
)


def targets() -> dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], None]]]:
    """The fuzz targets: name -> (strategy, check of one drawn example)."""
    found: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], None]]] = {}
    for decoder in DECODERS:
        found[f"decode_{decoder.name}"] = (
            documents(decoder.name),
            functools.partial(check_decoder, decoder),
        )
    found["keys"] = (st.tuples(st.tuples(names, names), st.tuples(names, names)), _check_keys)
    found["key_parsers"] = (key_texts, check_key_parsers)
    return found


def _check_keys(pair: tuple[tuple[str, str], tuple[str, str]]) -> None:
    check_keys(*pair)


def run_target(name: str, examples: int, *, derandomize: bool = False) -> None:
    """Run target ``name`` on ``examples`` examples; raises the (shrunk) failure."""
    strategy, check = targets()[name]
    test = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
    )(given(strategy)(lambda example: check(example)))
    test()


def run(seconds: float, *, out: Any = None) -> dict[str, int]:
    """Run every target for about ``seconds`` in all (rounds of 200 random examples);
    returns the examples tried per target. Raises a failing example's error."""
    names = list(targets())
    share = seconds / len(names)
    counts: dict[str, int] = {}
    for name in names:
        tried = 0
        stop = time.monotonic() + share
        while tried == 0 or time.monotonic() < stop:
            run_target(name, 200)
            tried += 200
        counts[name] = tried
        if out is not None:
            print(f"{name:20} {tried:8d} examples", file=out, flush=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.protocol.fuzz", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="total time (default 60)")
    args = parser.parse_args(argv)
    run(args.seconds, out=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
