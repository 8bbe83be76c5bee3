"""``open_nats_backend``: the debounce protocol on a NATS JetStream KV bucket."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from .._backend import DebounceBackend
from .._payload import PayloadSerializer
from .._protocol import KvDebounceBackend
from ._config import NatsConfig
from ._store import open_nats_store


@asynccontextmanager
async def open_nats_backend(
    config: NatsConfig | None = None,
    *,
    process_id: str | None = None,
    wall_time: Callable[[], float] = time.time,
    serializer: PayloadSerializer | None = None,
) -> AsyncIterator[DebounceBackend]:
    """Connect to NATS and yield a backend for :func:`~trio_debounce.open_coordinator`.

    ::

        config = NatsConfig.from_env()
        async with open_nats_backend(config) as backend, \\
                   open_coordinator(backend=backend, handlers=...) as coordinator:
            ...

    Opens its own asyncio loop (on the host ``config.asyncio_host`` names: a thread of
    its own, or trio-asyncio) and one nats-py connection (reconnecting forever,
    writes never queued while disconnected), creates the KV bucket if absent (history
    1, file storage, ``config.replicas`` replicas, no max age) or binds an existing one
    and validates its settings; see :doc:`/nats`. Everything is closed on exit.

    Args:
      config (NatsConfig | None): servers, credentials, bucket, lease and deadlines
        (``NatsConfig()`` when None: a local server, bucket ``trio_debounce``).
      process_id (str | None): this process's id in the protocol; a uuid4 hex when
        None. Two live coordinators must never share one.
      wall_time: the wall clock, ``() -> float`` epoch seconds (:func:`time.time`); all
        times shared with other processes are read from it.
      serializer (PayloadSerializer | None): how payloads are stored in the bucket
        (:class:`~trio_debounce.JsonSerializer` when None); every process sharing the
        bucket must use the same one.

    Raises:
      trio_debounce.BackendUnavailableError: no server answered within
        ``config.connect_timeout`` seconds.
      trio_debounce.BackendAuthError: the server refused the credentials, the TLS
        handshake failed (the server's certificate is not trusted, or the client
        certificate is missing or refused), TLS was asked for and the server did not
        start it, or the account lacks a permission the backend needs (raised at
        once, never retried); see :doc:`/nats`, *Security*.
      trio_debounce.BackendConfigError: the bucket exists with settings the protocol
        cannot work with, or is missing with ``create_bucket=False``.
    """
    if config is None:
        config = NatsConfig()
    if not isinstance(config, NatsConfig):
        raise TypeError(f"config must be a NatsConfig, not {config!r}")
    async with open_nats_store(config) as store:
        yield KvDebounceBackend(
            store,
            process_id=process_id,
            process_lease=config.process_lease,
            op_timeout=config.op_timeout,
            max_clock_skew=config.max_clock_skew,
            wall_time=wall_time,
            serializer=serializer,
        )
