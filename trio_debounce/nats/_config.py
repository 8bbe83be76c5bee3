"""Configuration of the NATS JetStream KV backend."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import _validate
from .._codec import hide_userinfo

_BUCKET = re.compile(r"\A[A-Za-z0-9_-]+\Z")
_SCHEMES = ("nats://", "tls://", "ws://", "wss://")
_SECRETS = ("token", "password", "nkey_seed")
_ENV = "TRIO_DEBOUNCE_"
#: The values of :attr:`NatsConfig.asyncio_host`.
ASYNCIO_HOSTS = ("auto", "thread", "trio-asyncio")


@dataclass(frozen=True)
class NatsConfig:
    """How to reach NATS and which bucket to share (immutable).

    Build it with keyword arguments, or from the environment at the edge of your
    program with :meth:`from_env`; nothing else in the library reads the environment.
    Secrets (``token``, ``password``, ``nkey_seed``, and the user and password of a
    server URL such as ``nats://user:pass@host``) never appear in :func:`repr` or in
    the constructor's errors.

    Attributes:
      servers (tuple[str, ...]): server URLs (``nats://``, ``tls://``, ``ws://`` or
        ``wss://``), tried in turn.
      token (str | None): token authentication.
      user (str | None): user name for user and password authentication.
      password (str | None): the password that goes with ``user``.
      creds_file (str | None): path of a ``.creds`` file (a user JWT and its nkey
        seed, as ``nsc`` writes it), for servers in operator (JWT) mode.
      nkey_seed (str | None): path of a file holding a user's nkey seed (``SU...``).
      tls_ca (str | None): path of the PEM CA bundle that verifies the server's
        certificate (the system's CAs when None). Giving it (or ``tls_cert``, a
        ``tls://`` URL or ``tls_handshake_first``) makes TLS required: a server that
        does not start TLS is refused.
      tls_cert (str | None): path of the PEM client certificate (mutual TLS).
      tls_key (str | None): path of the client certificate's PEM key.
      tls_handshake_first (bool): start TLS before the server's INFO (servers run with
        ``handshake_first``).
      js_domain (str | None): JetStream domain (give this or ``js_api_prefix``).
      js_api_prefix (str | None): JetStream API prefix (give this or ``js_domain``).
      inbox_prefix (str | None): prefix of reply subjects, for accounts that restrict
        ``_INBOX.>``.
      ping_interval (float): seconds between client pings, so a stalled server is
        noticed in a few seconds (nats-py's default is 120).
      bucket (str): the KV bucket shared by cooperating coordinators.
      replicas (int): the bucket's replicas when it is created (1 to 5; 3 for a cluster).
      create_bucket (bool): create the bucket when it is absent (the default). When
        False the backend only binds: the bucket must exist (an administrator creates
        it with history 1, file storage and no max age, e.g. ``nats kv add <bucket>
        --history=1``), its settings are still validated, and the credentials need no
        stream-management rights. The minimal permission set is then: publish to
        ``$KV.<bucket>.>`` (writes), ``$JS.API.STREAM.INFO.KV_<bucket>`` (bind and
        validate), ``$JS.API.DIRECT.GET.KV_<bucket>.>`` (reads; or
        ``$JS.API.STREAM.MSG.GET.KV_<bucket>`` if the bucket disallows direct gets),
        ``$JS.API.STREAM.MSG.GET.KV_<bucket>`` (reads from the stream's leader),
        ``$JS.API.STREAM.PURGE.KV_<bucket>`` (removing delete markers),
        ``$JS.API.CONSUMER.CREATE.KV_<bucket>``, ``$JS.API.CONSUMER.CREATE.KV_<bucket>.>``
        and ``$JS.API.CONSUMER.INFO.KV_<bucket>.>`` (listing entries with an ephemeral
        ordered consumer), ``$JS.FC.KV_<bucket>.>`` (the answers to its flow control),
        and subscribe to the inbox prefix (``_INBOX.>`` by default).
        With True, add ``$JS.API.STREAM.CREATE.KV_<bucket>``.
      process_lease (float): seconds a coordinator's process lease lasts unrenewed.
      op_timeout (float): seconds one backend operation may take, retries included.
      connect_timeout (float): seconds to reach a server at start-up.
      max_clock_skew (float): seconds of wall-clock disagreement tolerated between the
        hosts that share the bucket (> 0); wall-clock deadlines written by one host are
        read by another with this much slack.
      asyncio_host (str): where nats-py's asyncio loop runs: ``"thread"`` (a stdlib
        asyncio loop in a thread of the store's own), ``"trio-asyncio"`` (a
        trio-asyncio loop in Trio's thread; not on Python 3.14, where trio-asyncio
        cannot be imported), or ``"auto"`` (the default: the thread host, which
        measured faster; see :doc:`/nats`, *The asyncio host*).

    Raises:
      ValueError, TypeError: from the constructor, naming the bad field.
    """

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    token: str | None = field(default=None, repr=False)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_seed: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_handshake_first: bool = False
    js_domain: str | None = None
    js_api_prefix: str | None = None
    inbox_prefix: str | None = None
    ping_interval: float = 5.0
    bucket: str = "trio_debounce"
    replicas: int = 1
    process_lease: float = 60.0
    op_timeout: float = 2.0
    connect_timeout: float = 5.0
    create_bucket: bool = True
    max_clock_skew: float = 1.0
    asyncio_host: str = "auto"

    def __post_init__(self) -> None:
        servers: object = self.servers
        if isinstance(servers, str):
            raise TypeError(
                f"servers must be a sequence of URLs, not the str {hide_userinfo(servers)!r}"
            )
        if not isinstance(servers, (tuple, list)):
            raise TypeError(
                f"servers must be a sequence of URLs, not {hide_userinfo(repr(servers))}"
            )
        servers = tuple(servers)
        object.__setattr__(self, "servers", servers)
        if not servers:
            raise ValueError("servers must name at least one server")
        for url in servers:
            if not isinstance(url, str) or not url.startswith(_SCHEMES):
                shown = hide_userinfo(repr(url))
                raise ValueError(f"server URL must start with one of {_SCHEMES}, got {shown}")
        for name in (
            "ping_interval",
            "process_lease",
            "op_timeout",
            "connect_timeout",
            "max_clock_skew",
        ):
            value = _validate.positive_duration(name, getattr(self, name))
            object.__setattr__(self, name, value)
        if not isinstance(self.create_bucket, bool):
            raise TypeError(f"create_bucket must be a bool, not {self.create_bucket!r}")
        if not isinstance(self.bucket, str) or not _BUCKET.match(self.bucket):
            raise ValueError(f"bucket must match [A-Za-z0-9_-]+, got {self.bucket!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError(f"replicas must be an int, not {self.replicas!r}")
        if not 1 <= self.replicas <= 5:
            raise ValueError(f"replicas must be from 1 to 5, got {self.replicas!r}")
        methods = [
            name
            for name, given in (
                ("token", self.token is not None),
                ("user", self.user is not None or self.password is not None),
                ("creds_file", self.creds_file is not None),
                ("nkey_seed", self.nkey_seed is not None),
            )
            if given
        ]
        if len(methods) > 1:
            raise ValueError(f"give at most one authentication method, got {methods}")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.js_domain is not None and self.js_api_prefix is not None:
            raise ValueError("give js_domain or js_api_prefix, not both")
        if not isinstance(self.asyncio_host, str):
            raise TypeError(f"asyncio_host must be a str, not {self.asyncio_host!r}")
        if self.asyncio_host not in ASYNCIO_HOSTS:
            raise ValueError(
                f"asyncio_host must be one of {', '.join(map(repr, ASYNCIO_HOSTS))}, "
                f"got {self.asyncio_host!r}"
            )

    def __repr__(self) -> str:
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRETS:
                if value is not None:
                    shown.append(f"{f.name}=<hidden>")
            elif f.name == "servers" and value != f.default:
                shown.append(f"servers={hide_userinfo(repr(value))}")
            elif value != f.default:
                shown.append(f"{f.name}={value!r}")
        return f"NatsConfig({', '.join(shown)})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NatsConfig:
        """Build a config from ``TRIO_DEBOUNCE_*`` variables; unset ones keep defaults.

        ``TRIO_DEBOUNCE_NATS_SERVERS`` (comma-separated URLs), ``..._NATS_TOKEN``,
        ``..._NATS_USER``, ``..._NATS_PASSWORD``, ``..._NATS_CREDS``,
        ``..._NATS_NKEY_SEED``, ``..._NATS_TLS_CA``, ``..._NATS_TLS_CERT``,
        ``..._NATS_TLS_KEY``, ``..._NATS_TLS_HANDSHAKE_FIRST`` (``1``/``0``),
        ``..._NATS_JS_DOMAIN``, ``..._NATS_JS_API_PREFIX``, ``..._NATS_INBOX_PREFIX``,
        ``..._NATS_PING_INTERVAL``, ``..._NATS_BUCKET``, ``..._NATS_REPLICAS``,
        ``..._NATS_CREATE_BUCKET`` (``1``/``0``), ``..._NATS_ASYNCIO_HOST`` (``auto``,
        ``thread`` or ``trio-asyncio``), and ``TRIO_DEBOUNCE_LEASE``,
        ``TRIO_DEBOUNCE_OP_TIMEOUT``, ``TRIO_DEBOUNCE_CONNECT_TIMEOUT``,
        ``TRIO_DEBOUNCE_MAX_CLOCK_SKEW`` (seconds).

        Args:
          environ: the variables to read; :data:`os.environ` when None.

        Raises:
          ValueError: a variable's value is malformed (the message names the variable
            but never echoes a secret).
        """
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {}
        text = {
            "token": "NATS_TOKEN",
            "user": "NATS_USER",
            "password": "NATS_PASSWORD",
            "creds_file": "NATS_CREDS",
            "nkey_seed": "NATS_NKEY_SEED",
            "tls_ca": "NATS_TLS_CA",
            "tls_cert": "NATS_TLS_CERT",
            "tls_key": "NATS_TLS_KEY",
            "js_domain": "NATS_JS_DOMAIN",
            "js_api_prefix": "NATS_JS_API_PREFIX",
            "inbox_prefix": "NATS_INBOX_PREFIX",
            "bucket": "NATS_BUCKET",
        }
        for name, var in text.items():
            if _ENV + var in env:
                kwargs[name] = env[_ENV + var]
        if _ENV + "NATS_SERVERS" in env:
            kwargs["servers"] = tuple(
                s.strip() for s in env[_ENV + "NATS_SERVERS"].split(",") if s.strip()
            )
        numbers = {
            "ping_interval": "NATS_PING_INTERVAL",
            "process_lease": "LEASE",
            "op_timeout": "OP_TIMEOUT",
            "connect_timeout": "CONNECT_TIMEOUT",
            "max_clock_skew": "MAX_CLOCK_SKEW",
        }
        for name, var in numbers.items():
            if _ENV + var in env:
                raw = env[_ENV + var]
                try:
                    kwargs[name] = float(raw)
                except ValueError:
                    raise ValueError(f"{_ENV + var} must be seconds, got {raw!r}") from None
        if _ENV + "NATS_REPLICAS" in env:
            raw = env[_ENV + "NATS_REPLICAS"]
            try:
                kwargs["replicas"] = int(raw)
            except ValueError:
                raise ValueError(f"{_ENV}NATS_REPLICAS must be an int, got {raw!r}") from None
        for name, var in (
            ("tls_handshake_first", "NATS_TLS_HANDSHAKE_FIRST"),
            ("create_bucket", "NATS_CREATE_BUCKET"),
        ):
            if _ENV + var in env:
                raw = env[_ENV + var].strip().lower()
                if raw not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(f"{_ENV}{var} must be 1 or 0, got {raw!r}")
                kwargs[name] = raw in ("1", "true", "yes")
        if _ENV + "NATS_ASYNCIO_HOST" in env:
            raw = env[_ENV + "NATS_ASYNCIO_HOST"]
            if raw.strip().lower() not in ASYNCIO_HOSTS:
                raise ValueError(
                    f"{_ENV}NATS_ASYNCIO_HOST must be one of "
                    f"{', '.join(ASYNCIO_HOSTS)}, got {raw!r}"
                )
            kwargs["asyncio_host"] = raw.strip().lower()
        try:
            return cls(**kwargs)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            # Name where the values came from (the message itself never echoes a
            # secret); a URL's stray whitespace is stripped before it is checked.
            read = ", ".join(sorted(var for var in env if var.startswith(_ENV)))
            raise ValueError(f"{exc} (read from the environment: {read})") from None
