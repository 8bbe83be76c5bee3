"""Encoding of window identities into NATS JetStream KV keys.

A KV key may only use ``[-/_=.A-Za-z0-9]``, is split into tokens at ``.``, and must
not start or end with ``.``. Workflow names and debounce keys are arbitrary non-empty
Unicode strings, so each is encoded as the unpadded base64url of its UTF-8 bytes
(alphabet ``A-Za-z0-9-_``): no ``.``, ``*`` or ``>`` can appear inside a token, no token
is empty, and the encoding is injective and reversible. A window's key is
``w.<workflow>.<key>``; other record kinds (process leases, deferred runs) use other
first tokens, so no two kinds share a key.
"""

from __future__ import annotations

import base64
import binascii

#: The longest encoded KV key accepted, in bytes. The subject that carries it
#: (``$KV.<bucket>.<key>``, plus a reply inbox) must stay well under the server's
#: 4 KiB control-line limit: a longer one makes the server close the whole connection.
MAX_KEY_BYTES = 1024

WINDOW_PREFIX = "w"
PROCESS_PREFIX = "p"


def _encode_token(what: str, value: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {value!r}")
    if not value:
        raise ValueError(f"{what} must be a non-empty str, got {value!r}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} {value[:60]!r} is not valid Unicode text (lone surrogate at index {exc.start})"
        ) from None
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _decode_token(token: str) -> str:
    padded = token + "=" * (-len(token) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded.encode("ascii"))
        text = raw.decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        raise ValueError(f"not an encoded name: {token[:60]!r}") from None
    if not text or _encode_token("name", text) != token:
        # reject non-canonical spellings, so decode(encode(x)) is a bijection
        raise ValueError(f"not an encoded name: {token[:60]!r}")
    return text


def window_key(workflow: str, key: str) -> str:
    """The KV key of the window ``(workflow, key)``.

    Raises:
      TypeError: ``workflow`` or ``key`` is not a str.
      ValueError: either is empty or holds a lone surrogate, or the encoded key would
        be longer than :data:`MAX_KEY_BYTES`.
    """
    encoded = ".".join(
        (WINDOW_PREFIX, _encode_token("workflow", workflow), _encode_token("key", key))
    )
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(
            f"workflow and key are too long for a KV key: {len(encoded)} bytes encoded, "
            f"at most {MAX_KEY_BYTES} (about {MAX_KEY_BYTES * 3 // 4 - 3} bytes of "
            "UTF-8 for both together)"
        )
    return encoded


def window_prefix(workflow: str | None) -> str:
    """The KV key prefix of every window (``workflow`` None), or of ``workflow``'s.

    Raises:
      TypeError, ValueError: as :func:`window_key`, for a bad ``workflow``.
    """
    if workflow is None:
        return WINDOW_PREFIX + "."
    return f"{WINDOW_PREFIX}.{_encode_token('workflow', workflow)}."


def parse_window_key(encoded: str) -> tuple[str, str]:
    """The ``(workflow, key)`` that :func:`window_key` encoded into ``encoded``.

    Raises:
      ValueError: ``encoded`` is not a window key made by :func:`window_key`.
    """
    parts = encoded.split(".")
    if len(parts) != 3 or parts[0] != WINDOW_PREFIX:
        raise ValueError(f"not a window key: {encoded[:80]!r}")
    return _decode_token(parts[1]), _decode_token(parts[2])


def process_key(process_id: str) -> str:
    """The KV key of the lease of process ``process_id``: ``p.<base64url>``.

    Raises:
      TypeError, ValueError: ``process_id`` is not a non-empty str of valid Unicode,
        or is too long for a KV key.
    """
    encoded = PROCESS_PREFIX + "." + _encode_token("process_id", process_id)
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(f"process_id is too long for a KV key: {len(encoded)} bytes encoded")
    return encoded


#: The prefix of the per-process control keys (``c.<process>``: requests for a
#: process's heartbeat, such as the flushes ``trio-debounce flush`` asks for).
CONTROL_PREFIX = "c"


def control_key(process_id: str) -> str:
    """The KV key of the control requests to process ``process_id``: ``c.<base64url>``.

    Raises:
      TypeError, ValueError: as :func:`process_key`.
    """
    encoded = CONTROL_PREFIX + "." + _encode_token("process_id", process_id)
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(f"process_id is too long for a KV key: {len(encoded)} bytes encoded")
    return encoded


RUN_PREFIX = "r"
RUN_LEASE_PREFIX = "rl"


def run_key(run_id: str) -> str:
    """The KV key of the deferred run ``run_id``: ``r.<base64url>``.

    Raises:
      TypeError, ValueError: ``run_id`` is not a non-empty str of valid Unicode, or is
        too long for a KV key.
    """
    encoded = RUN_PREFIX + "." + _encode_token("run_id", run_id)
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(f"run_id is too long for a KV key: {len(encoded)} bytes encoded")
    return encoded


def run_lease_key(process_id: str) -> str:
    """The KV key of the run-store lease of process ``process_id``: ``rl.<base64url>``."""
    encoded = RUN_LEASE_PREFIX + "." + _encode_token("process_id", process_id)
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(f"process_id is too long for a KV key: {len(encoded)} bytes encoded")
    return encoded


def parse_prefixed_key(prefix: str, encoded: str) -> str:
    """The name that :func:`run_key` or :func:`run_lease_key` encoded (by ``prefix``).

    Raises:
      ValueError: ``encoded`` is not such a key.
    """
    parts = encoded.split(".")
    if len(parts) != 2 or parts[0] != prefix:
        raise ValueError(f"not a {prefix!r} key: {encoded[:80]!r}")
    return _decode_token(parts[1])
