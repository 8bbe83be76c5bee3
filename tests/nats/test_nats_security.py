"""Authenticated and encrypted NATS connections, against real servers configured for them.

Every authentication method of :class:`NatsConfig` (token, user and password, nkey,
creds file with a JWT, TLS with a CA, mutual TLS) connects end to end through
:meth:`NatsConfig.from_env`, :func:`open_nats_backend` and :func:`open_nats_run_store`;
a wrong credential, an untrusted certificate or a missing client certificate fails at
once with :class:`BackendAuthError` (never the connect timeout, never an outage that
the coordinator would fail open on); and no secret shows in a log line at DEBUG, an
exception (with its causes) or a repr. Certificates are made by ``trustme``, nkeys
and JWTs by ``nats-jwt`` (operator, account and user, signed with nkeys).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from nats_jwt.nkeys_ext import create_user_pair
from nats_jwt.v2.operator_claims import OperatorClaims
from nats_jwt.v2.snippets import Operator

from tests.harness.nats_server import NatsServer, NatsServerFactory
from trio_debounce import (
    BackendAuthError,
    BackendConfigError,
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
    Fire,
    open_coordinator,
)
from trio_debounce.abc import StoredRun
from trio_debounce.nats import NatsConfig, _connection, open_nats_backend, open_nats_run_store
from trio_debounce.nats._store import _log_asyncio_error, _map_error, _redact, _secrets

pytestmark = pytest.mark.slow

#: Seconds a refused connection may take: far below the connect timeout below, so a
#: refusal that waited for the timeout fails the test. Not zero: under TLS 1.3 a
#: refused client certificate can first show as a broken pipe (the server closed
#: before the client's CONNECT was written), and the refusal itself then comes with
#: the next attempt, a second later.
REFUSED_WITHIN = 6.0
CONNECT_TIMEOUT = 20.0

#: Env variable of each NatsConfig field these tests set.
ENV = {
    "servers": "TRIO_DEBOUNCE_NATS_SERVERS",
    "token": "TRIO_DEBOUNCE_NATS_TOKEN",
    "user": "TRIO_DEBOUNCE_NATS_USER",
    "password": "TRIO_DEBOUNCE_NATS_PASSWORD",
    "creds_file": "TRIO_DEBOUNCE_NATS_CREDS",
    "nkey_seed": "TRIO_DEBOUNCE_NATS_NKEY_SEED",
    "tls_ca": "TRIO_DEBOUNCE_NATS_TLS_CA",
    "tls_cert": "TRIO_DEBOUNCE_NATS_TLS_CERT",
    "tls_key": "TRIO_DEBOUNCE_NATS_TLS_KEY",
}


@dataclass
class Setup:
    """A server configured for one method, the settings that pass and those that fail.

    ``good`` and ``bad`` are NatsConfig fields (the server URL added later);
    ``secrets`` are strings that must never be shown.
    """

    conf: str
    good: dict[str, str]
    bad: dict[str, dict[str, str]]
    secrets: tuple[str, ...]
    scheme: str = "nats://"
    bad_error: str = "refused the credentials"


def _pem_body(pem: bytes) -> str:
    """The longest base64 line of a PEM block (a fragment of the key material)."""
    return max(pem.decode().splitlines(), key=len)


def _creds(jwt: str, seed: bytes) -> str:
    """A ``.creds`` file as ``nsc`` writes it."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )


def _write(path: Path, text: str | bytes) -> str:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    path.chmod(0o600)
    return str(path)


def _tls_block(tmp: Path, ca: trustme.CA, *, verify: bool) -> str:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_file = _write(tmp / "server.pem", cert.cert_chain_pems[0].bytes())
    key_file = _write(tmp / "server.key", cert.private_key_pem.bytes())
    lines = [f'cert_file: "{cert_file}"', f'key_file: "{key_file}"']
    if verify:
        lines += [f'ca_file: "{_write(tmp / "ca.pem", ca.cert_pem.bytes())}"', "verify: true"]
    return "tls {\n  " + "\n  ".join(lines) + "\n}\n"


def make_setup(method: str, tmp: Path) -> Setup:
    """The server configuration and client settings of ``method``."""
    tmp.mkdir(parents=True, exist_ok=True)
    if method == "token":
        return Setup(
            conf='authorization { token: "t0ken-r1ght-6c1f" }\n',
            good={"token": "t0ken-r1ght-6c1f"},
            bad={"wrong token": {"token": "t0ken-wr0ng-93ab"}},
            secrets=("t0ken-r1ght-6c1f", "t0ken-wr0ng-93ab"),
        )
    if method == "user":
        return Setup(
            conf='authorization { user: alice, password: "pa55-r1ght-77de" }\n',
            good={"user": "alice", "password": "pa55-r1ght-77de"},
            bad={
                "wrong password": {"user": "alice", "password": "pa55-wr0ng-41aa"},
                "unknown user": {"user": "mallory", "password": "pa55-r1ght-77de"},
            },
            secrets=("pa55-r1ght-77de", "pa55-wr0ng-41aa"),
        )
    if method == "nkey":
        user, stranger = create_user_pair(), create_user_pair()
        return Setup(
            conf=f'authorization {{ users: [ {{ nkey: "{user.public_key.decode()}" }} ] }}\n',
            good={"nkey_seed": _write(tmp / "user.nk", user.seed + b"\n")},
            bad={"unknown nkey": {"nkey_seed": _write(tmp / "stranger.nk", stranger.seed)}},
            secrets=(user.seed.decode(), stranger.seed.decode()),
        )
    if method == "creds":
        operator = Operator()
        operator.set_claims(OperatorClaims(operator.key_pair.public_key.decode(), "op"))
        account = operator.create_account("app")
        limits = account.claims.nats.limits
        limits.disk_storage = limits.memory_storage = limits.streams = limits.consumer = -1
        system = operator.create_account("SYS")
        user = account.create_user("alice")
        # signed by an account the server does not know
        stray = operator.create_account("stray").create_user("mallory")
        conf = (
            f'operator: "{operator.jwt}"\n'
            f'system_account: "{system.key_pair.public_key.decode()}"\n'
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f'  {account.key_pair.public_key.decode()}: "{account.jwt}"\n'
            f'  {system.key_pair.public_key.decode()}: "{system.jwt}"\n'
            "}\n"
        )
        user_seed, stray_seed = user.key_pair.seed, stray.key_pair.seed
        user_jwt, stray_jwt = user.jwt, stray.jwt  # each access signs anew
        return Setup(
            conf=conf,
            good={"creds_file": _write(tmp / "user.creds", _creds(user_jwt, user_seed))},
            bad={
                "unknown account": {
                    "creds_file": _write(tmp / "stray.creds", _creds(stray_jwt, stray_seed))
                },
                # a known user's JWT with another user's seed: the signature fails
                "seed of another user": {
                    "creds_file": _write(tmp / "mixed.creds", _creds(user_jwt, stray_seed))
                },
            },
            secrets=(user_seed.decode(), stray_seed.decode(), user_jwt, stray_jwt),
        )
    if method in ("tls", "mtls"):
        ca, stranger_ca = trustme.CA(), trustme.CA()
        ca_file = _write(tmp / "client-ca.pem", ca.cert_pem.bytes())
        untrusted = {"tls_ca": _write(tmp / "stranger-ca.pem", stranger_ca.cert_pem.bytes())}
        if method == "tls":
            return Setup(
                conf=_tls_block(tmp, ca, verify=False),
                good={"tls_ca": ca_file},
                bad={"untrusted server certificate": untrusted, "no CA given": {}},
                secrets=(),
                scheme="tls://",
                bad_error="TLS handshake failed: the server's certificate is not trusted",
            )
        client = ca.issue_cert("client@example.org")
        key_pem = client.private_key_pem.bytes()
        stray = stranger_ca.issue_cert("client@example.org")
        return Setup(
            conf=_tls_block(tmp, ca, verify=True),
            good={
                "tls_ca": ca_file,
                "tls_cert": _write(tmp / "client.pem", client.cert_chain_pems[0].bytes()),
                "tls_key": _write(tmp / "client.key", key_pem),
            },
            bad={
                "missing client certificate": {"tls_ca": ca_file},
                "client certificate of another CA": {
                    "tls_ca": ca_file,
                    "tls_cert": _write(tmp / "stray.pem", stray.cert_chain_pems[0].bytes()),
                    "tls_key": _write(tmp / "stray.key", stray.private_key_pem.bytes()),
                },
            },
            secrets=(_pem_body(key_pem), _pem_body(stray.private_key_pem.bytes())),
            scheme="tls://",
            bad_error="TLS handshake failed",
        )
    raise AssertionError(method)


METHODS = ("token", "user", "nkey", "creds", "tls", "mtls")


def config_from_env(server: NatsServer, scheme: str, fields: dict[str, str]) -> NatsConfig:
    """A config built by ``NatsConfig.from_env`` from the variables of ``fields``."""
    url = server.url.replace("nats://", scheme)
    env = {ENV[name]: value for name, value in fields.items()}
    env |= {
        ENV["servers"]: url,
        "TRIO_DEBOUNCE_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
        "TRIO_DEBOUNCE_OP_TIMEOUT": "3",
    }
    return NatsConfig.from_env(env)


def _texts(exc: BaseException) -> Iterator[str]:
    """str and repr of ``exc`` and of every exception in its cause/context chain."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield str(item)
        yield repr(item)
        todo += [item.__cause__, item.__context__]
        todo += getattr(item, "exceptions", ())  # an exception group's members


def assert_hidden(secrets: tuple[str, ...], *texts: str) -> None:
    for text in texts:
        for secret in secrets:
            assert secret not in text, f"a secret shows in {text[:200]!r}"


@pytest.fixture
def caplog_debug(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    for name in ("trio_debounce", "nats", "asyncio", "trio_asyncio"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


async def fire_once(config: NatsConfig) -> tuple[str, ...]:
    """Open the backend and a coordinator on it, debounce one key, wait for its fire;
    the reprs of what was opened."""
    fired = trio.Event()

    async def handler(fire: Fire) -> None:
        fired.set()

    async with (
        open_nats_backend(config) as backend,
        open_coordinator(backend=backend, handlers={"w": handler}) as coordinator,
    ):
        await coordinator.debounce("w", "k", delay=0.01)
        await fired.wait()
        return (repr(backend), repr(coordinator))


async def round_trip_run(config: NatsConfig) -> tuple[str, ...]:
    """Open the run store, write a run and read it back; the store's repr."""
    async with open_nats_run_store(config) as store:
        run = StoredRun("r1", "wf", '{"n": 1}', time.time() + 3600, created_at=time.time())
        created = await store.create_run(run)
        assert created is not None
        assert await store.get_run("r1") == created
        return (repr(store),)


@pytest.mark.parametrize("method", METHODS)
async def test_each_method_connects_through_from_env(
    method: str,
    nats_server_factory: NatsServerFactory,
    tmp_path: Path,
    caplog_debug: pytest.LogCaptureFixture,
) -> None:
    setup = make_setup(method, tmp_path / "pki")
    server = nats_server_factory(conf=setup.conf)
    config = config_from_env(server, setup.scheme, setup.good)
    with trio.fail_after(20):
        reprs = await fire_once(config)
        reprs += await round_trip_run(config)
    assert_hidden(setup.secrets, repr(config), *reprs, caplog_debug.text)


OPENERS: dict[str, Callable[[NatsConfig], AbstractAsyncContextManager[Any]]] = {
    "backend": open_nats_backend,
    "run store": open_nats_run_store,
}


def _bad_cases() -> Iterator[Any]:
    names = {
        "token": ["wrong token"],
        "user": ["wrong password", "unknown user"],
        "nkey": ["unknown nkey"],
        "creds": ["unknown account", "seed of another user"],
        "tls": ["untrusted server certificate", "no CA given"],
        "mtls": ["missing client certificate", "client certificate of another CA"],
    }
    for method, cases in names.items():
        for case in cases:
            for opener in OPENERS:
                yield pytest.param(method, case, opener, id=f"{method}-{case}-{opener}")


@pytest.mark.realtime
@pytest.mark.parametrize(("method", "case", "opener"), list(_bad_cases()))
async def test_refused_credentials_fail_at_once_and_show_no_secret(
    method: str,
    case: str,
    opener: str,
    nats_server_factory: NatsServerFactory,
    tmp_path: Path,
    caplog_debug: pytest.LogCaptureFixture,
) -> None:
    setup = make_setup(method, tmp_path / "pki")
    assert set(setup.bad) >= {case}
    server = nats_server_factory(conf=setup.conf)
    config = config_from_env(server, setup.scheme, setup.bad[case])
    start = time.monotonic()
    with trio.fail_after(CONNECT_TIMEOUT - 5), pytest.raises(BackendAuthError) as info:
        async with OPENERS[opener](config):
            pytest.fail(f"connected with {case}")  # pragma: no cover
    assert time.monotonic() - start < REFUSED_WITHIN
    assert setup.bad_error in str(info.value)
    assert_hidden(setup.secrets, *_texts(info.value), repr(config), caplog_debug.text)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing client certificate", "the server requires a client certificate"),
        ("client certificate of another CA", "the server refused the handshake"),
        ("good", ""),
    ],
)
async def test_tls_probe_names_the_refusal_a_cut_connection_hides(
    case: str, expected: str, nats_server_factory: NatsServerFactory, tmp_path: Path
) -> None:
    # Under TLS 1.3 nats-py may meet a broken pipe instead of the server's alert (a
    # race it loses under load, seen on 3.14); after such a cut the connect probes,
    # and the probe reads before it writes, so it meets the alert every time.
    setup = make_setup("mtls", tmp_path / "pki")
    server = nats_server_factory(conf=setup.conf)
    config = config_from_env(
        server, setup.scheme, setup.good if case == "good" else setup.bad[case]
    )
    context = _connection.tls_context(config)
    assert context is not None
    with trio.fail_after(10):
        failure = await _connection.probe_tls(config, context)
    if expected:
        assert failure.startswith(expected)
    else:
        assert failure == ""


async def test_plaintext_server_is_refused_when_tls_is_asked_for(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    # a server that does not offer TLS (as one behind an attacker stripping it would)
    ca_file = _write(tmp_path / "ca.pem", trustme.CA().cert_pem.bytes())
    for config in (
        config_from_env(nats_server, "tls://", {}),
        config_from_env(nats_server, "nats://", {"tls_ca": ca_file}),
    ):
        with trio.fail_after(10), pytest.raises(BackendAuthError, match="did not start TLS"):
            async with open_nats_backend(config):
                pytest.fail("connected without TLS")  # pragma: no cover


@pytest.mark.realtime
async def test_credentials_in_the_url_are_hidden(
    nats_server_factory: NatsServerFactory, tmp_path: Path, caplog_debug: pytest.LogCaptureFixture
) -> None:
    setup = make_setup("user", tmp_path / "pki")
    server = nats_server_factory(conf=setup.conf)
    host = server.url.removeprefix("nats://")
    good = NatsConfig(servers=(f"nats://alice:pa55-r1ght-77de@{host}",), op_timeout=3.0)
    bad = NatsConfig(
        servers=(f"nats://alice:pa55-wr0ng-41aa@{host}",), connect_timeout=CONNECT_TIMEOUT
    )
    with trio.fail_after(20):
        reprs = await fire_once(good)
        start = time.monotonic()
        with pytest.raises(BackendAuthError) as info:
            async with open_nats_run_store(bad):
                pytest.fail("connected with a wrong password")  # pragma: no cover
        assert time.monotonic() - start < REFUSED_WITHIN
    assert "<hidden>@" in repr(good)
    assert_hidden(setup.secrets, repr(good), repr(bad), *reprs, *_texts(info.value))
    assert_hidden(setup.secrets, caplog_debug.text)
    with pytest.raises(ValueError, match="must start with") as bad_url:
        NatsConfig(servers=("http://alice:pa55-r1ght-77de@host",))
    assert_hidden(setup.secrets, str(bad_url.value))


def _server_in_bytes(server: NatsServer) -> int:
    assert server.monitor_port is not None
    url = f"http://127.0.0.1:{server.monitor_port}/varz"
    with urllib.request.urlopen(url, timeout=2) as reply:
        in_bytes: int = json.load(reply)["in_bytes"]
        return in_bytes


async def test_a_too_large_payload_never_reaches_a_small_server(
    nats_server_factory: NatsServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A publish over max_payload makes the server close the connection; the backend
    # must refuse it first. The server's own byte count shows nothing large arrived.
    server = nats_server_factory(conf="max_payload: 8192\n")
    config = NatsConfig(servers=(server.url,), op_timeout=3.0)
    fired: list[object] = []
    fired_now = trio.Event()

    async def handler(fire: Fire) -> None:
        fired.append(fire.payload)
        fired_now.set()

    with trio.fail_after(20):
        for mode in ("raise", "fail-open"):
            async with (
                open_nats_backend(config) as backend,
                open_coordinator(
                    backend=backend, handlers={"w": handler}, on_backend_error=mode
                ) as coordinator,
            ):
                before = _server_in_bytes(server)
                with pytest.raises(DocumentTooLargeError):
                    await coordinator.debounce("w", "big", payload="x" * 9000, delay=0.01)
                assert _server_in_bytes(server) - before < 9000
                await coordinator.debounce("w", mode, payload=mode, delay=0.01)
                await fired_now.wait()
                fired_now = trio.Event()
        async with open_nats_run_store(config) as store:
            assert 0 < store.max_payload_bytes < 8192
            before = _server_in_bytes(server)
            run = StoredRun("big", "wf", json.dumps("x" * 9000), 1e9, created_at=1.0)
            with pytest.raises(DocumentTooLargeError):
                await store.create_run(run)
            assert _server_in_bytes(server) - before < 9000
            assert await store.get_run("big") is None
    assert fired == ["raise", "fail-open"]
    assert "disconnected" not in caplog.text


CLI = [sys.executable, "-m", "trio_debounce"]


def cli_env(**extra: str) -> dict[str, str]:
    """A CLI process's environment: no TRIO_DEBOUNCE_* inherited, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_DEBOUNCE_")}
    return env | extra


@pytest.mark.realtime
def test_cli_run_with_mutual_tls_from_the_environment(
    nats_server_factory: NatsServerFactory, tmp_path: Path
) -> None:
    setup = make_setup("mtls", tmp_path / "pki")
    server = nats_server_factory(conf=setup.conf)
    env = cli_env(**{ENV[name]: value for name, value in setup.good.items()})
    url = server.url.replace("nats://", "tls://")
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0.1", "--backend", url],
        input="a\n",
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert [json.loads(line)["key"] for line in proc.stdout.splitlines()] == ["a"]
    # without the client certificate: refused at once, one clear line, exit status 2
    del env[ENV["tls_cert"]], env[ENV["tls_key"]]
    start = time.monotonic()
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0.1", "--backend", url],
        input="a\n",
        capture_output=True,
        text=True,
        timeout=30,
        env=env | {"TRIO_DEBOUNCE_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT)},
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "trio-debounce: error: cannot start the backend: connect: the TLS handshake failed: "
        "the server requires a client certificate (tls_cert, tls_key)\n"
    )
    assert time.monotonic() - start < REFUSED_WITHIN + 3  # plus the interpreter's start


def test_cli_run_hides_a_password_given_in_the_backend_url(
    nats_server_factory: NatsServerFactory, tmp_path: Path
) -> None:
    setup = make_setup("user", tmp_path / "pki")
    server = nats_server_factory(conf=setup.conf)
    host = server.url.removeprefix("nats://")
    proc = subprocess.run(
        [*CLI, "run", "--delay", "0.1", "--backend", f"nats://alice:pa55-wr0ng-41aa@{host}"],
        input="a\n",
        capture_output=True,
        text=True,
        timeout=30,
        env=cli_env(TRIO_DEBOUNCE_CONNECT_TIMEOUT=str(CONNECT_TIMEOUT)),
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        "trio-debounce: error: cannot start the backend: connect: NATS refused the credentials\n"
    )


async def test_credentials_refused_after_a_restart_are_not_failed_open(
    nats_server_factory: NatsServerFactory, caplog_debug: pytest.LogCaptureFixture
) -> None:
    # The server comes back requiring another token: once the client's reconnect has
    # been refused, pings raise BackendAuthError even under fail-open (a refusal is no
    # outage), and no window is opened locally in their place.
    server = nats_server_factory(conf='authorization { token: "t0ken-r1ght-6c1f" }\n')
    config = NatsConfig(servers=(server.url,), token="t0ken-r1ght-6c1f", op_timeout=1.0)
    fired: list[str] = []
    first = trio.Event()

    async def handler(fire: Fire) -> None:
        fired.append(fire.key)
        first.set()

    with trio.fail_after(30):
        async with (
            open_nats_backend(config) as backend,
            open_coordinator(
                backend=backend, handlers={"w": handler}, on_backend_error="fail-open"
            ) as coordinator,
        ):
            await coordinator.debounce("w", "before", delay=0.01)
            await first.wait()
            server.conf = 'authorization { token: "t0ken-r0tated-5e2a" }\n'
            server.restart()
            for _ in range(200):  # the client reconnects within a second or two
                if "NATS refused the credentials" in caplog_debug.text:
                    break
                await trio.sleep(0.05)
            else:
                pytest.fail("the reconnect was never refused")
            for n in range(3):
                with pytest.raises(BackendAuthError, match="refused the credentials"):
                    await coordinator.debounce("w", f"after-{n}", delay=0.01)
            await trio.sleep(0.5)  # a window opened locally would have fired by now
    assert fired == ["before"]
    assert_hidden(("t0ken-r1ght-6c1f", "t0ken-r0tated-5e2a"), caplog_debug.text)


def test_config_repr_and_errors_hide_url_credentials() -> None:
    config = NatsConfig(
        servers=("nats://alice:pa55-r1ght-77de@a:4222", "nats://t0ken-r1ght-6c1f@b:4222")
    )
    assert repr(config) == (
        "NatsConfig(servers=('nats://<hidden>@a:4222', 'nats://<hidden>@b:4222'))"
    )
    for servers in ("nats://alice:pa55-r1ght-77de@a", ["ftp://alice:pa55-r1ght-77de@a"]):
        with pytest.raises((TypeError, ValueError)) as info:
            NatsConfig(servers=servers)  # type: ignore[arg-type]
        assert "<hidden>@a" in str(info.value)
        assert_hidden(("pa55-r1ght-77de",), str(info.value))
    env = {"TRIO_DEBOUNCE_NATS_SERVERS": "http://alice:pa55-r1ght-77de@a"}
    with pytest.raises(ValueError, match="must start with") as from_env:
        NatsConfig.from_env(env)
    assert_hidden(("pa55-r1ght-77de",), str(from_env.value))


def test_secrets_of_a_config_include_urls_seeds_and_jwts(tmp_path: Path) -> None:
    setup = make_setup("creds", tmp_path)
    user_seed, _, user_jwt, _ = setup.secrets
    config = NatsConfig(
        servers=("nats://alice:pa55-r1ght-77de@a:1", "nats://t0ken-r1ght-6c1f@b:2", "nats://c:3"),
        creds_file=setup.good["creds_file"],
    )
    found = _secrets(config)
    assert set(found) == {"pa55-r1ght-77de", "t0ken-r1ght-6c1f", user_seed, user_jwt}
    assert "alice" not in found  # a user name is no secret (and would mangle messages)
    seed_file = tmp_path / "seed.nk"
    seed_file.write_text(f"\n{user_seed}\n")
    assert _secrets(NatsConfig(nkey_seed=str(seed_file))) == (user_seed,)
    assert _secrets(NatsConfig(nkey_seed=str(tmp_path / "missing"))) == ()
    message = _redact(f"bad seed {user_seed} at nats://alice:x@a", found)
    assert message == "bad seed <hidden> at nats://<hidden>@a"


@pytest.mark.parametrize(
    ("exc", "expected", "match"),
    [
        (
            ssl.SSLCertVerificationError(1, "certificate verify failed"),
            BackendAuthError,
            "certificate is not trusted",
        ),
        (ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA]"), BackendAuthError, "TLS handshake"),
        (
            ssl.SSLEOFError(8, "EOF occurred in violation of protocol"),
            BackendUnavailableError,
            "NATS is unavailable",
        ),
    ],
)
def test_tls_errors_map_to_refusals_unless_the_connection_was_cut(
    exc: Exception, expected: type[BackendError], match: str
) -> None:
    mapped = _map_error(exc, "connect")
    assert type(mapped) is expected
    assert match in str(mapped)


@pytest.mark.realtime
async def test_tls_handshake_first(
    nats_server_factory: NatsServerFactory, nats_server: NatsServer, tmp_path: Path
) -> None:
    # TLS before anything else, from the environment; and refused by a plaintext server
    setup = make_setup("tls", tmp_path / "pki")
    conf = setup.conf.replace("tls {", "tls {\n  handshake_first: true")
    server = nats_server_factory(conf=conf)
    env = {
        ENV["servers"]: server.url.replace("nats://", "tls://"),
        ENV["tls_ca"]: setup.good["tls_ca"],
        "TRIO_DEBOUNCE_NATS_TLS_HANDSHAKE_FIRST": "1",
        "TRIO_DEBOUNCE_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT),
    }
    with trio.fail_after(20):
        await fire_once(NatsConfig.from_env(env))
        plain = NatsConfig.from_env(env | {ENV["servers"]: nats_server.url})
        start = time.monotonic()
        with pytest.raises(BackendAuthError, match="server did not answer in TLS"):
            async with open_nats_run_store(plain):
                pytest.fail("connected to a plaintext server")  # pragma: no cover
        assert time.monotonic() - start < REFUSED_WITHIN


def test_asyncio_errors_are_logged_without_secrets(caplog: pytest.LogCaptureFixture) -> None:
    context = {
        "message": "Task exception was never retrieved",
        "exception": OSError("cannot reach nats://alice:pa55-r1ght-77de@a:4222"),
    }
    _log_asyncio_error(("pa55-r1ght-77de",), None, context)  # type: ignore[arg-type]
    (record,) = [r for r in caplog.records if r.name == "trio_debounce.nats"]
    assert record.getMessage() == (
        "asyncio reported: Task exception was never retrieved "
        "(OSError: cannot reach nats://<hidden>@a:4222)"
    )


@pytest.mark.parametrize(
    ("field", "content", "match"),
    [
        ("nkey_seed", "SUn0t-a-seed-s3cr3t\n", "nkey_seed does not hold an nkey seed"),
        ("nkey_seed", "", "nkey_seed does not hold an nkey seed"),
        ("creds_file", "s3cr3t garbage\n", "creds_file is not a creds file"),
        # a seed block and no JWT block: nats-py's reader would loop forever
        ("creds_file", "seed-only", "creds_file is not a creds file"),
        ("creds_file", "jwt-only", "creds_file is not a creds file"),
    ],
)
async def test_malformed_credential_files_are_refused_before_connecting(
    field: str, content: str, match: str, tmp_path: Path, nats_server: NatsServer
) -> None:
    user = create_user_pair()
    seed = user.seed.decode()
    if content == "seed-only":
        content = _creds("x", user.seed).split("*", 1)[1]
    elif content == "jwt-only":
        content = _creds("a.b.c", b"SUn0t-a-seed-s3cr3t")
    path = _write(tmp_path / "credentials", content)
    config = NatsConfig(servers=(nats_server.url,), **{field: path})  # type: ignore[arg-type]
    for opener in OPENERS.values():
        with trio.fail_after(5), pytest.raises(BackendConfigError, match=match) as info:
            async with opener(config):
                pytest.fail("connected with a malformed file")  # pragma: no cover
        assert_hidden((seed, "s3cr3t", path), *_texts(info.value))


async def test_a_credential_path_that_is_a_fifo_is_refused_not_opened(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    fifo = tmp_path / "seed.fifo"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    for field in ("nkey_seed", "creds_file"):
        config = NatsConfig(servers=(nats_server.url,), **{field: str(fifo)})  # type: ignore[arg-type]
        with trio.fail_after(5), pytest.raises(BackendConfigError, match="readable file"):
            async with open_nats_backend(config):
                pytest.fail("connected")  # pragma: no cover


def test_a_short_secret_is_hidden_only_in_a_url() -> None:
    # Found by a review: a token "nats" hidden everywhere turned nats-py's "nats: ..."
    # into "<hidden>: ...", which told the token (and a password "ro" made "connection
    # error" unreadable). Secrets under 6 characters are hidden where they are
    # credentials (URLs); longer ones wherever a message echoes them.
    from trio_debounce.nats._errors import redact

    assert redact("nats: unexpected EOF", ("nats",)) == "nats: unexpected EOF"
    assert redact("NATS connection error at nats://ro:ro@h:4222", ("ro", "ro")) == (
        "NATS connection error at nats://<hidden>@h:4222"
    )
    secret = "s3cret-t0ken-77"
    assert redact(f"refused {secret}: nats://{secret}@h", (secret,)) == (
        "refused <hidden>: nats://<hidden>@h"
    )
