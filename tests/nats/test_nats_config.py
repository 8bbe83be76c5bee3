"""NatsConfig: validation, from_env, and secrets kept out of repr and errors."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

from trio_debounce.nats import NatsConfig


def test_defaults() -> None:
    config = NatsConfig()
    assert config.servers == ("nats://127.0.0.1:4222",)
    assert (config.op_timeout, config.process_lease, config.replicas) == (2.0, 60.0, 1)
    assert repr(config) == "NatsConfig()"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"servers": "nats://a:1"}, TypeError, "sequence of URLs"),
        ({"servers": ()}, ValueError, "at least one"),
        ({"servers": ("http://a",)}, ValueError, "http://a"),
        ({"op_timeout": 0}, ValueError, "op_timeout must be > 0"),
        ({"process_lease": -1.0}, ValueError, "process_lease"),
        ({"connect_timeout": float("nan")}, ValueError, "NaN"),
        ({"bucket": "a.b"}, ValueError, "'a.b'"),
        ({"replicas": 7}, ValueError, "7"),
        ({"replicas": True}, TypeError, "True"),
        ({"token": "t", "user": "u", "password": "p"}, ValueError, "at most one"),
        ({"user": "u"}, ValueError, "user and password"),
        ({"tls_cert": "c"}, ValueError, "tls_cert and tls_key"),
        ({"js_domain": "d", "js_api_prefix": "p"}, ValueError, "not both"),
        ({"max_clock_skew": 0}, ValueError, "max_clock_skew must be > 0"),
        ({"max_clock_skew": -0.5}, ValueError, "max_clock_skew"),
        ({"max_clock_skew": float("inf")}, ValueError, "max_clock_skew"),
        ({"create_bucket": "no"}, TypeError, "create_bucket must be a bool"),
    ],
)
def test_bad_fields(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        NatsConfig(**kwargs)


def test_from_env_reads_only_given_variables() -> None:
    config = NatsConfig.from_env(
        {
            "TRIO_DEBOUNCE_NATS_SERVERS": "nats://a:1, tls://b:2,",
            "TRIO_DEBOUNCE_NATS_USER": "alice",
            "TRIO_DEBOUNCE_NATS_PASSWORD": "hunter2",
            "TRIO_DEBOUNCE_NATS_BUCKET": "builds",
            "TRIO_DEBOUNCE_NATS_REPLICAS": "3",
            "TRIO_DEBOUNCE_NATS_TLS_HANDSHAKE_FIRST": "yes",
            "TRIO_DEBOUNCE_LEASE": "30",
            "TRIO_DEBOUNCE_OP_TIMEOUT": "5.5",
            "UNRELATED": "x",
        }
    )
    assert config == NatsConfig(
        servers=("nats://a:1", "tls://b:2"),
        user="alice",
        password="hunter2",
        bucket="builds",
        replicas=3,
        tls_handshake_first=True,
        process_lease=30.0,
        op_timeout=5.5,
    )
    assert NatsConfig.from_env({}) == NatsConfig()


def test_create_bucket_and_max_clock_skew() -> None:
    config = NatsConfig()
    assert (config.create_bucket, config.max_clock_skew) == (True, 1.0)
    config = NatsConfig(create_bucket=False, max_clock_skew=2)
    assert (config.create_bucket, config.max_clock_skew) == (False, 2.0)
    assert isinstance(config.max_clock_skew, float)
    assert "create_bucket=False" in repr(config)
    for raw, expected in (("0", False), ("no", False), ("1", True), (" TRUE ", True)):
        env = {"TRIO_DEBOUNCE_NATS_CREATE_BUCKET": raw}
        assert NatsConfig.from_env(env).create_bucket is expected
    env = {"TRIO_DEBOUNCE_MAX_CLOCK_SKEW": "0.25"}
    assert NatsConfig.from_env(env).max_clock_skew == 0.25


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"TRIO_DEBOUNCE_LEASE": "soon"}, "TRIO_DEBOUNCE_LEASE"),
        ({"TRIO_DEBOUNCE_NATS_REPLICAS": "three"}, "TRIO_DEBOUNCE_NATS_REPLICAS"),
        ({"TRIO_DEBOUNCE_NATS_TLS_HANDSHAKE_FIRST": "maybe"}, "HANDSHAKE_FIRST"),
        ({"TRIO_DEBOUNCE_NATS_CREATE_BUCKET": "sometimes"}, "NATS_CREATE_BUCKET"),
        ({"TRIO_DEBOUNCE_MAX_CLOCK_SKEW": "1s"}, "TRIO_DEBOUNCE_MAX_CLOCK_SKEW"),
        ({"TRIO_DEBOUNCE_MAX_CLOCK_SKEW": "0"}, "max_clock_skew must be > 0"),
        ({"TRIO_DEBOUNCE_NATS_SERVERS": ""}, "at least one"),
    ],
)
def test_from_env_errors_name_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NatsConfig.from_env(env)


def test_secrets_never_in_repr_or_errors() -> None:
    for config in (
        NatsConfig(token="t0ken-secret"),
        NatsConfig(user="u", password="pa55-secret"),
        NatsConfig(nkey_seed="seed-secret"),
    ):
        assert "secret" not in repr(config)
        assert "<hidden>" in repr(config)
    with pytest.raises(ValueError, match="at most one") as info:
        NatsConfig(token="t0ken-secret", user="u", password="pa55-secret")
    assert "secret" not in str(info.value)


def test_importing_the_library_does_not_load_the_nats_submodule() -> None:
    import subprocess
    import sys

    code = "import sys, trio_debounce; print('trio_debounce.nats' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_extra_gives_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "trio_debounce.nats" or name.startswith("trio_debounce.nats."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nats", None)  # as if nats-py were not installed
    with pytest.raises(ImportError, match=r"needs the nats extra .* pip install '\.\[nats\]'"):
        importlib.import_module("trio_debounce.nats")
