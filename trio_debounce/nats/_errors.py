"""nats-py's exceptions mapped onto the library's (:mod:`trio_debounce._errors`), and
the JetStream codes and TLS failures the backend tells apart; no I/O, no state."""

from __future__ import annotations

import asyncio
import ssl
from typing import Protocol

import nats.errors
import nats.js.errors

from .._codec import hide_userinfo
from .._errors import (
    BackendAuthError,
    BackendError,
    BackendUnavailableError,
    RevisionConflict,
)


class ConnectionFacts(Protocol):
    """What :func:`map_error` reads of a connection's state (``_connection.State``)."""

    secrets: tuple[str, ...]
    auth_failed: bool
    tls_failure: str


#: JetStream's error codes for a failed ``Nats-Expected-Last-Subject-Sequence`` check.
WRONG_LAST_SEQUENCE = (10071, 10164)

#: JetStream's error code for a message get that found nothing (``no message found``).
NO_MESSAGE = 10037

#: JetStream API error codes of a cluster that is starting, electing or placing a
#: stream: ``no suitable peers for placement`` (10005: the meta leader has not heard
#: from enough peers yet), ``JetStream system temporarily unavailable`` (10008),
#: ``JetStream cluster can not handle request`` (10009: no meta leader),
#: ``JetStream cluster not assigned to this server`` (10007), ``insufficient
#: resources`` (10023), ``stream is offline`` (10118). Opening a bucket retries them.
TRANSIENT_API_CODES = frozenset({10005, 10007, 10008, 10009, 10023, 10118})

#: ``stream name already in use with a different configuration``: another process
#: created the bucket first, with other settings (the stream info shows them).
STREAM_NAME_IN_USE = 10058

#: What nats-py raises when no stream answered a request (no responders, an empty or
#: 503 reply): the stream has no leader (an election after the loss of a node) or the
#: connection's interest has not propagated yet. Nothing was applied, so the store
#: retries it within ``op_timeout``, every :data:`NO_STREAM_RETRY` seconds at first,
#: doubling up to :data:`NO_STREAM_RETRY_MAX`.
NO_STREAM = (
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
NO_STREAM_RETRY = 0.05
NO_STREAM_RETRY_MAX = 0.5

AUTH_MARKERS = (
    "authorization violation",
    "authentication expired",
    "authentication revoked",
)
PERMISSION_MARKER = "permissions violation"

#: TLS errors that are a cut connection (an outage), not a refused handshake.
TLS_CUT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


#: Secrets shorter than this are hidden only where they are credentials of a URL: a
#: short one (a token ``nats``, a password ``ro``) is also a part of ordinary words
#: (``nats: ...``, ``error``), and hiding those would mangle the text and, by what it
#: hides, tell the secret.
REDACT_MIN = 6


def redact(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` without URL credentials, and without any of ``secrets`` of
    :data:`REDACT_MIN` characters or more (a seed, a long token or password that a
    message may echo)."""
    text = hide_userinfo(text)
    for secret in secrets:
        if len(secret) >= REDACT_MIN:
            text = text.replace(secret, "<hidden>")
    return text


def is_auth_failure(exc: BaseException, text: str) -> bool:
    """Whether ``exc`` (whose message is ``text``) is a refused credential."""
    lowered = text.lower()
    return isinstance(exc, nats.errors.AuthorizationError) or any(
        marker in lowered for marker in AUTH_MARKERS
    )


def tls_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS handshake that failed for good: an untrusted
    certificate, a refused or missing client certificate, a protocol mismatch."""
    return isinstance(exc, ssl.SSLError) and not isinstance(exc, TLS_CUT)


def tls_failure(exc: ssl.SSLError) -> str:
    """What a failed TLS handshake means, for a message (never holds a secret)."""
    code: str | None = getattr(exc, "reason", None)
    reason = getattr(exc, "verify_message", None) or code or str(exc) or type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the server's certificate is not trusted (tls_ca): {reason}"
    if code == "WRONG_VERSION_NUMBER":
        return "the server did not answer in TLS (WRONG_VERSION_NUMBER)"
    if code == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return "the server requires a client certificate (tls_cert, tls_key)"
    if code is not None and "ALERT" in code:
        return f"the server refused the handshake or the client certificate: {reason}"
    return str(reason)


_UNAVAILABLE = (
    nats.errors.NoServersError,
    nats.errors.ConnectionClosedError,
    nats.errors.TimeoutError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.FlushTimeoutError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    asyncio.TimeoutError,
    TimeoutError,
    ConnectionError,
    *TLS_CUT,
)


def map_error(exc: BaseException, what: str, state: ConnectionFacts | None = None) -> BackendError:
    """The library's exception for ``exc``, raised by nats-py during ``what``.

    Args:
      exc: the exception nats-py (or the bridge) raised.
      what: the operation, for the message (never holds a secret).
      state: the connection's state, to tell a permission or authorization failure
        from a plain timeout or closed connection.

    Returns:
      :class:`~trio_debounce.RevisionConflict` for a failed compare-and-swap,
      :class:`~trio_debounce.BackendUnavailableError` when the server cannot be
      reached or did not answer, :class:`~trio_debounce.BackendAuthError` for a refused
      credential, permission or TLS handshake, :class:`~trio_debounce.BackendError`
      otherwise.
    """
    if isinstance(exc, BackendError):
        return exc
    secrets = () if state is None else state.secrets
    text = redact(str(exc) or type(exc).__name__, secrets)
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or (
        isinstance(exc, nats.js.errors.APIError) and exc.err_code in WRONG_LAST_SEQUENCE
    ):
        return RevisionConflict(f"{what}: the key's revision is not the expected one ({text})")
    if is_auth_failure(exc, text):
        return BackendAuthError(f"{what}: NATS refused the credentials ({text})")
    if PERMISSION_MARKER in text.lower() or (
        isinstance(exc, nats.js.errors.APIError) and exc.code in (401, 403)
    ):
        return BackendAuthError(f"{what}: NATS denied a permission ({text})")
    if tls_refused(exc):
        assert isinstance(exc, ssl.SSLError)
        return BackendAuthError(f"{what}: the TLS handshake failed: {tls_failure(exc)}")
    if isinstance(exc, _UNAVAILABLE):
        if state is not None and state.auth_failed:
            return BackendAuthError(f"{what}: NATS refused the credentials ({text})")
        if state is not None and state.tls_failure:
            return BackendAuthError(f"{what}: the TLS handshake failed: {state.tls_failure}")
        if isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError, TimeoutError)):
            text += "; it may have been applied"
        return BackendUnavailableError(f"{what}: NATS is unavailable ({text})")
    return BackendError(f"{what}: NATS failed ({type(exc).__name__}: {text})")


def transient_open_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a bucket request, may pass if the request is retried:
    no answer (timeout, no responders), a 503, or a cluster that is not ready
    (:data:`TRANSIENT_API_CODES`)."""
    if isinstance(exc, (*NO_STREAM, nats.errors.TimeoutError, asyncio.TimeoutError)):
        return True
    return isinstance(exc, nats.js.errors.APIError) and (
        exc.code == 503 or exc.err_code in TRANSIENT_API_CODES
    )
