"""Hostile arguments to the public API, driven by hypothesis.

Every call with random and adversarial arguments (wrong types, NaN, infinities,
negative, huge, empty, very long and odd Unicode strings, lone surrogates, payloads
that cannot be serialized or are too large) either raises a documented exception whose
message names the bad argument or value, or behaves correctly: it never hangs (every
call runs under ``trio.fail_after`` on a MockClock), never crashes the coordinator's
nursery, and a ping or a schedule that was accepted fires.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_debounce import (
    BackendError,
    DocumentTooLargeError,
    Fire,
    JsonSerializer,
    Mode,
    Outcome,
    RunFire,
    RunOptions,
    RunState,
    open_coordinator,
)
from trio_debounce.nats import NatsConfig
from trio_debounce.testing import MemoryBackend, MemoryRunStore, MemoryStore, StoreFaults


class BigStr(str):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"BigStr(<{len(self)} chars>)"


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


ODD_STRINGS = [
    "",
    " ",
    ".",
    "*",
    ">",
    "a.b",
    "a b",
    "$KV.x.>",
    "/",
    "\x00",
    "\n",
    "\u2028",
    "é",
    "🙂",
    "\ud800",
    "x" * 5_000,
]
HOSTILE = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            -0.0,
            math.nan,
            math.inf,
            -math.inf,
            1e308,
            -1e308,
            2**70,
            5e-324,
            b"bytes",
            [],
            {},
            (),
            Mode.TRAILING,
            datetime.datetime(2030, 1, 1),
            datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC),
            datetime.timedelta(seconds=1),
        ]
    ),
    st.sampled_from(ODD_STRINGS),
    st.builds(object),
    st.text(max_size=30),
    st.floats(),
    st.integers(),
)

#: What a call may raise for a bad argument (each documented under its Raises:).
REFUSALS = (TypeError, ValueError, LookupError, NotImplementedError, DocumentTooLargeError)


def assert_names(exc: BaseException, candidates: dict[str, object], note: object = "") -> None:
    """``exc``'s message names one of the arguments ``candidates`` or its value."""
    assert any(names_it(exc, k, v) for k, v in candidates.items()), (note, exc)


def names_it(exc: BaseException, name: str, value: object) -> bool:
    text = str(exc)
    try:
        shown = repr(value)[:20]
    except RuntimeError:
        shown = "<no repr>"
    return name in text or shown in text or type(value).__name__ in text


# ----------------------------------------------------------- constructors


def constructor_cases() -> list[tuple[str, Callable[..., object], dict[str, Any]]]:
    store = MemoryStore()
    return [
        ("RunOptions", RunOptions, {f.name: f.default for f in dataclasses.fields(RunOptions)}),
        (
            "NatsConfig",
            NatsConfig,
            {
                f.name: f.default
                for f in dataclasses.fields(NatsConfig)
                if f.default is not dataclasses.MISSING
            },
        ),
        (
            "MemoryBackend",
            lambda **kw: MemoryBackend(store, **kw),
            {
                "process_id": "p",
                "clock_skew": 0.0,
                "process_lease": 60.0,
                "op_timeout": 2.0,
                "max_clock_skew": 1.0,
            },
        ),
        ("MemoryRunStore", lambda **kw: MemoryRunStore(store, **kw), {"clock_skew": 0.0}),
        (
            "StoreFaults.delay_next",
            lambda **kw: StoreFaults().delay_next(**kw),
            {"seconds": 1.0, "n": 1},
        ),
        ("StoreFaults.fail_next", lambda **kw: StoreFaults().fail_next(**kw), {"n": 1}),
    ]


@pytest.mark.parametrize(
    ("name", "make", "good"), constructor_cases(), ids=[c[0] for c in constructor_cases()]
)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_constructors_refuse_bad_arguments_by_name(
    name: str, make: Callable[..., object], good: dict[str, Any], data: st.DataObject
) -> None:
    field = data.draw(st.sampled_from(sorted(good)), label="field")
    value = data.draw(HOSTILE, label="value")
    try:
        make(**{**good, field: value})
    except REFUSALS as exc:
        # the field or its value, or (a relation between fields) another field
        related = {other.replace("_", " "): None for other in good} | dict(good)
        assert_names(exc, {field: value} | related, f"{name}({field}={value!r})")


# -------------------------------------------------------------- debounce

modes = st.one_of(st.sampled_from(list(Mode)), st.sampled_from([m.value for m in Mode]), HOSTILE)
delays = st.one_of(st.floats(0.0, 1000.0), st.integers(0, 1000), HOSTILE)
payloads = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    HOSTILE,
    st.just(BigStr("x" * 2_000_000)),  # over the memory store's 1 MiB value limit
    st.just({1: {2: [object()]}}),
    st.builds(Unprintable),  # the serializer names it without its repr
)


@st.composite
def ping_args(draw: st.DrawFn) -> dict[str, Any]:
    args: dict[str, Any] = {
        "workflow": draw(st.one_of(st.just("wf"), st.sampled_from(ODD_STRINGS), HOSTILE)),
        "key": draw(st.one_of(st.just("k"), st.sampled_from(ODD_STRINGS), st.text(), HOSTILE)),
        "payload": draw(payloads),
        "delay": draw(delays),
        "mode": draw(modes),
    }
    if draw(st.booleans()):
        args["max_delay"] = draw(st.one_of(st.none(), delays))
    if draw(st.booleans()):
        args["run_id"] = draw(st.one_of(st.none(), st.sampled_from(ODD_STRINGS), HOSTILE))
    if draw(st.booleans()):
        option = draw(st.sampled_from(["max_count", "payload_policy", "order_key", "bogus"]))
        args[option] = draw(st.one_of(st.integers(1, 3), st.just("first"), HOSTILE))
    return args


def is_good_name(value: object) -> bool:
    return isinstance(value, str) and value != ""


async def ping_and_check(coord: Any, args: dict[str, Any], fires: list[Fire]) -> None:
    workflow = args["workflow"]
    if is_good_name(workflow):
        try:
            coord.set_handler(workflow, record(fires))
        except REFUSALS as exc:
            assert_names(exc, {"workflow": workflow})
            return
    before = len(fires)
    try:
        with trio.fail_after(60):
            result = await coord.debounce(**args)
    except REFUSALS as exc:
        bad = {k: v for k, v in args.items() if k not in ("workflow", "key", "payload")}
        bad.update(workflow=workflow, key=args["key"], payload=args["payload"])
        assert_names(exc, bad, args)
        return
    except BackendError as exc:  # refused by the store (an oversized document)
        assert_names(exc, {"bytes": None, "too large": None})
        return
    if result.outcome is Outcome.COALESCE and result.scheduled_at is None:
        # A leading ping into its open window: dropped by design (the window fired
        # its first ping; no trailing edge is pending).
        assert any(f.key == args["key"] and f.workflow == workflow for f in fires)
        return
    # Accepted: the window fires, within its delay (and the backend's deadlines).
    horizon = max(0.0, result.scheduled_at - trio.current_time()) if result.scheduled_at else 0
    if horizon > 3600:
        # Due far ahead (a hostile delay can be 1e308 s): pending, not waited for (a
        # wait by virtual seconds would spin for ever), then cancelled so that the
        # block's exit does not wait for it either.
        assert coord.has(workflow, args["key"])
        assert await coord.cancel(workflow, args["key"])
        return
    with trio.fail_after(horizon + 120):
        await wait_for(lambda: len(fires) > before)
    assert fires[-1].key == args["key"]
    assert fires[-1].workflow == workflow


async def wait_for(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds, checking each virtual second (the handlers
    it watches are plain recorders; MockClock makes the wait instant)."""
    while not condition():  # noqa: ASYNC110 (the condition may be a wall-clock one)
        await trio.sleep(1)


def record(fires: list[Fire]) -> Any:
    async def handler(fire: Fire) -> None:
        fires.append(fire)

    return handler


@pytest.mark.parametrize("shared", [False, True], ids=["in-memory", "memory-backend"])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(calls=st.lists(ping_args(), min_size=1, max_size=4))
def test_debounce_with_hostile_arguments(shared: bool, calls: list[dict[str, Any]]) -> None:
    async def main() -> None:
        fires: list[Fire] = []
        backend = MemoryBackend(MemoryStore(), process_id="a") if shared else None
        with trio.fail_after(1e12):  # the per-call bounds are the real ones
            async with open_coordinator(handlers={"wf": record(fires)}, backend=backend) as coord:
                for args in calls:
                    await ping_and_check(coord, args, fires)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -------------------------------------------------------------- schedule

T0 = 1_700_000_000.0


@st.composite
def schedule_args(draw: st.DrawFn) -> dict[str, Any]:
    args: dict[str, Any] = {
        "workflow": draw(st.one_of(st.just("wf"), HOSTILE)),
        "run_id": draw(st.one_of(st.none(), st.just("r1"), st.sampled_from(ODD_STRINGS), HOSTILE)),
        "payload": draw(payloads),
        "persist": draw(st.booleans()),
    }
    when = draw(st.sampled_from(["at", "after", "both", "neither"]))
    args["at"] = args["after"] = None
    if when in ("at", "both"):
        args["at"] = draw(st.one_of(st.floats(T0 - 10, T0 + 100), HOSTILE))
    if when in ("after", "both"):
        args["after"] = draw(st.one_of(st.floats(0, 100), HOSTILE))
    if draw(st.booleans()):
        args["expires_at"] = draw(st.one_of(st.floats(T0, T0 + 1000), HOSTILE))
    return args


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(calls=st.lists(schedule_args(), min_size=1, max_size=3))
def test_schedule_with_hostile_arguments(calls: list[dict[str, Any]]) -> None:
    async def main() -> None:
        runs: list[RunFire] = []

        async def handler(run: RunFire) -> None:
            runs.append(run)

        store = MemoryRunStore(MemoryStore(max_value_bytes=64_000))
        with trio.fail_after(1e12):  # the per-call bounds are the real ones
            async with open_coordinator(
                run_handlers={"wf": handler},
                run_store=store,
                run_options=RunOptions(process_id="a", retention=1.0),
            ) as coord:
                for args in calls:
                    before = len(runs)
                    try:
                        with trio.fail_after(60):
                            scheduled = await coord.schedule(**args)
                    except REFUSALS as exc:
                        assert_names(exc, args, args)
                        continue
                    if scheduled.outcome == "already-ran":
                        continue
                    expires = args.get("expires_at")
                    due_in = max(0.0, scheduled.scheduled_at - store.wall_time())
                    if due_in > 3600:
                        # Due far ahead (a hostile float can be 10**15 s away): kept
                        # pending, not waited for (heartbeats tick all the way there).
                        info = await coord.get_run(scheduled.run_id)
                        assert info is not None
                        assert info.state is RunState.PENDING
                        continue
                    with trio.fail_after(due_in + 300):
                        # (or expired before it came due: dropped, as documented)
                        await wait_for(
                            lambda: (
                                len(runs) > before  # noqa: B023
                                or (
                                    isinstance(expires, (int, float))  # noqa: B023
                                    and store.wall_time() > expires  # noqa: B023
                                    and not coord.has_run(scheduled.run_id)  # noqa: B023
                                )
                            )
                        )
                    if len(runs) > before:
                        assert runs[-1].run_id == scheduled.run_id
                    # cancel_run/get_run of hostile ids refuse or answer, never crash
                    for bad in (args.get("run_id"), "\ud800", "", 5):
                        try:
                            await coord.cancel_run(bad)  # type: ignore[arg-type]
                            await coord.get_run(bad)  # type: ignore[arg-type]
                        except REFUSALS as exc:
                            assert_names(exc, {"run_id": bad})

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@settings(max_examples=100, deadline=None)
@given(value=st.one_of(HOSTILE, st.recursive(HOSTILE, lambda c: st.lists(c, max_size=3))))
def test_json_serializer_refuses_by_name(value: object) -> None:
    serializer = JsonSerializer()
    try:
        text = serializer.dumps(value)
    except (TypeError, ValueError) as exc:
        assert_names(exc, {"payload": None})
        return
    assert serializer.dumps(serializer.loads(text)) == text


def test_store_faults_take_a_huge_count() -> None:
    # Armed n copies one by one: n=2**70 hung (and filled memory).
    faults = StoreFaults()
    faults.fail_next(2**70, ops=("get",))
    faults.delay_next(1.0, 2, ops=("put",))
    assert faults._take("put") is not None
    assert faults._take("get") is not None
    assert faults._take("put") is not None
    assert faults._take("put") is None


ENV_VARS = [
    "NATS_SERVERS", "NATS_TOKEN", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS",
    "NATS_NKEY_SEED", "NATS_TLS_CA", "NATS_TLS_CERT", "NATS_TLS_KEY",
    "NATS_TLS_HANDSHAKE_FIRST", "NATS_JS_DOMAIN", "NATS_JS_API_PREFIX",
    "NATS_INBOX_PREFIX", "NATS_PING_INTERVAL", "NATS_BUCKET", "NATS_REPLICAS",
    "NATS_CREATE_BUCKET", "LEASE", "OP_TIMEOUT", "CONNECT_TIMEOUT", "MAX_CLOCK_SKEW",
]  # fmt: skip
SECRETS = {"NATS_TOKEN", "NATS_PASSWORD", "NATS_NKEY_SEED"}
env_values = st.one_of(
    st.sampled_from(
        ["", " ", "nan", "inf", "-1", "0", "1e400", "1", "yes", "maybe", "a.b", "*", ">"]
    ),
    st.sampled_from(ODD_STRINGS[:-1]).filter(lambda s: "\x00" not in s and "\ud800" not in s),
    st.text(max_size=20).filter(lambda s: "\x00" not in s),
)


@settings(max_examples=150, deadline=None)
@given(env=st.dictionaries(st.sampled_from(ENV_VARS), env_values, max_size=4))
def test_nats_config_from_env_refuses_by_name_without_secrets(env: dict[str, str]) -> None:
    environ = {"TRIO_DEBOUNCE_" + name: value for name, value in env.items()}
    try:
        config = NatsConfig.from_env(environ)
    except (TypeError, ValueError) as exc:
        fields = {name.lower().removeprefix("nats_"): None for name in env}
        fields |= {"process_lease": None, "servers": None, "replicas": None, "bucket": None}
        named: dict[str, object] = {"TRIO_DEBOUNCE_" + n: v for n, v in env.items()}
        assert_names(exc, named | fields, env)
        message = str(exc)
        assert not [secret for secret in secrets(env) if secret in message], (env, message)
        return
    for secret in secrets(env):
        assert secret not in repr(config), env


def secrets(env: dict[str, str]) -> list[str]:
    """The secret values of ``env`` that no other variable also holds."""
    others = [value for name, value in env.items() if name not in SECRETS]
    return [
        value
        for name, value in env.items()
        if name in SECRETS and len(value) >= 4 and not any(value in o for o in others)
    ]


@settings(max_examples=200, deadline=None)
@given(
    value=st.one_of(st.integers(), st.text(), st.booleans(), st.none(), st.floats(allow_nan=False))
)
def test_json_serializer_writes_scalars_as_json_does_and_reads_them_back_unchanged(
    value: object,
) -> None:
    # dumps has a fast path for int and str; the backend skips parsing back a payload
    # whose exact type is one of these (str, int, float, bool, None), as unchanged.
    serializer = JsonSerializer()
    if value in (math.inf, -math.inf):
        with pytest.raises(ValueError, match="cannot be stored as JSON"):
            serializer.dumps(value)
        return
    text = serializer.dumps(value)
    assert text == json.dumps(value, allow_nan=False, separators=(",", ":"))
    back = serializer.loads(text)
    assert type(back) is type(value)
    assert back == value
