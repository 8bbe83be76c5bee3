"""Opening the KV bucket: bind it (creating it if allowed and absent), check its
settings, and retry the answers of a JetStream cluster that is not ready yet."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.js.errors
import trio
from nats.aio.client import Client
from nats.js import api
from nats.js.kv import KeyValue

from .._errors import BackendAuthError, BackendConfigError, BackendUnavailableError
from ._bridge import Host, cross
from ._config import NatsConfig
from ._connection import State
from ._errors import (
    NO_STREAM_RETRY,
    NO_STREAM_RETRY_MAX,
    STREAM_NAME_IN_USE,
    map_error,
    redact,
    transient_open_error,
)

logger = logging.getLogger("trio_debounce.nats")

T = TypeVar("T")


def api_prefix(config: NatsConfig) -> str:
    """The JetStream API prefix the config names (domain, prefix, or the default)."""
    if config.js_domain is not None:
        return f"$JS.{config.js_domain}.API"
    if config.js_api_prefix is not None:
        return config.js_api_prefix.rstrip(".")
    return api.DEFAULT_PREFIX


def validate_bucket(config: NatsConfig, info: api.StreamInfo) -> None:
    """Refuse a bucket that keeps history or expires entries (BackendConfigError)."""
    stream = info.config
    bucket = config.bucket
    if stream.max_msgs_per_subject != 1:
        raise BackendConfigError(
            f"KV bucket {bucket!r} keeps history {stream.max_msgs_per_subject}; "
            "trio_debounce needs history 1"
        )
    if stream.max_age:
        raise BackendConfigError(
            f"KV bucket {bucket!r} expires entries (TTL / max age {stream.max_age} s); "
            "trio_debounce needs no TTL"
        )


async def open_bucket(
    config: NatsConfig, nc: Client, state: State, host: Host
) -> tuple[KeyValue, api.StreamInfo]:
    """Bind (and create, if allowed and absent) the bucket, within ``2 * op_timeout``
    seconds (Trio clock); Trio side.

    A JetStream cluster answers a bucket request it cannot serve yet with an error
    that passes: right after start-up the meta leader may not know enough peers to
    place three replicas, a stream just created may be "not found" by a server that
    has not applied its assignment, and a stream or meta leader election leaves
    requests unanswered. Such requests (:func:`transient_open_error`, and "stream not
    found" after a create) are retried, every :data:`NO_STREAM_RETRY` seconds at
    first, doubling up to :data:`NO_STREAM_RETRY_MAX`; creating is idempotent (the
    same settings again succeed), so a create whose answer was lost is sent again.
    Each request waits at most ``op_timeout / 4`` for its answer: one sent during an
    election is never answered, and the next, sent after it, may be.

    Returns:
      the bucket's nats-py handle and its stream info.

    Raises:
      BackendUnavailableError: the bucket did not open within the bound (the message
        holds the last answer).
      BackendConfigError: the bucket is absent and ``create_bucket`` is False, the
        server refused to create it for good, or it has settings we cannot work with.
      BackendAuthError: a permission the open needs was denied (at once).
      BackendError: any other failure.
    """
    what = f"open bucket {config.bucket!r}"
    bound = 2 * config.op_timeout
    js = nc.jetstream(timeout=config.op_timeout, domain=config.js_domain, prefix=api_prefix(config))
    # A request sent while a leader is being elected is never answered: each open
    # request waits a quarter of op_timeout, so several fit in the bound.
    open_js = nc.jetstream(
        timeout=config.op_timeout / 4, domain=config.js_domain, prefix=api_prefix(config)
    )
    stream = f"KV_{config.bucket}"
    started = time.monotonic()
    last: BaseException | None = None
    attempts = 0

    async def request(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return await cross(host, functools.partial(fn, *args, **kwargs))

    with trio.move_on_after(bound):
        pause = NO_STREAM_RETRY
        while True:
            attempts += 1
            try:
                try:
                    info = await request(open_js.stream_info, stream)
                except nats.js.errors.NotFoundError as exc:
                    if not config.create_bucket:
                        raise BackendConfigError(
                            f"KV bucket {config.bucket!r} does not exist and create_bucket "
                            "is False: create it (history 1, no TTL), or let a coordinator "
                            "create it (create_bucket=True)"
                        ) from None
                    if attempts > 1:  # created (or being created) but not found yet
                        last = exc
                    try:
                        await request(
                            open_js.create_key_value,
                            bucket=config.bucket,
                            history=1,
                            ttl=None,
                            storage=api.StorageType.FILE,
                            replicas=config.replicas,
                            direct=True,
                        )
                    except nats.js.errors.APIError as refused:
                        if refused.err_code == STREAM_NAME_IN_USE:
                            pass  # created by another process: the stream info tells
                        elif transient_open_error(refused) or refused.code in (401, 403):
                            raise
                        else:  # e.g. replicas > 1 on a server that is not clustered
                            text = redact(str(refused), state.secrets)
                            raise BackendConfigError(
                                f"{what}: NATS refused to create the bucket with "
                                f"{config.replicas} replica(s) ({text})"
                            ) from None
                    info = await request(open_js.stream_info, stream)
            except Exception as exc:
                if state.permission_denied_at >= started:
                    raise BackendAuthError(
                        f"{what}: NATS denied a permission ({state.permission_message})"
                    ) from exc
                if not (transient_open_error(exc) or isinstance(exc, nats.js.errors.NotFoundError)):
                    raise map_error(exc, what, state) from exc
                last = exc
                logger.debug(
                    "%s: retrying a transient answer (%s)",
                    what,
                    redact(str(exc) or type(exc).__name__, state.secrets),
                )
            else:
                validate_bucket(config, info)
                kv = KeyValue(
                    name=config.bucket,
                    stream=stream,
                    pre=f"$KV.{config.bucket}.",
                    js=js,
                    direct=bool(info.config.allow_direct),
                )
                return kv, info
            await trio.sleep(pause)
            pause = min(2 * pause, NO_STREAM_RETRY_MAX)
    if state.permission_denied_at >= started:
        raise BackendAuthError(f"{what}: NATS denied a permission ({state.permission_message})")
    answer = "no answer"
    if last is not None:
        answer = redact(str(last) or type(last).__name__, state.secrets)
    raise BackendUnavailableError(
        f"{what}: JetStream did not serve the bucket within {bound} s ({attempts} "
        f"attempt(s); last: {answer})"
    )
