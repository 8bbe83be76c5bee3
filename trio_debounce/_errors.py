"""The library's own exceptions for backend failures.

Backends map their client library's exceptions onto these at their boundary, so
users never import a NATS (or other client) exception.
"""

from __future__ import annotations


class BackendError(Exception):
    """A coordination backend failed an operation.

    The base class of every backend error; catch it to handle them all.
    """


class BackendUnavailableError(BackendError):
    """The backend could not be reached, or did not answer within its deadline.

    Raised by ``open_nats_backend`` when no server answers within ``connect_timeout``,
    and by :meth:`Coordinator.debounce` under ``on_backend_error="raise"``. An operation
    that timed out may still have been applied by the server.
    """


class LeaseLapsedError(BackendUnavailableError):
    """A backend call failed while this process's own lease had lapsed.

    Raised by :meth:`DebounceBackend.finalize <trio_debounce.abc.DebounceBackend.finalize>`
    to the coordinator, never to a caller of ``debounce``: a peer may own the window
    now, so the owner must not fire on its own stale view, and calls ``finalize``
    again for the same run once its lease is renewed. A commit whose answer was lost
    is proven (or found not to have landed) by that call, or by the next
    ``adopt_orphans``, so it is neither lost nor run twice.
    """


class BackendAuthError(BackendError):
    """The backend refused the credentials or the permissions it needs.

    Misconfiguration is never failed open: this is raised at once, not retried.
    """


class BackendConfigError(BackendError):
    """The backend's storage exists with settings this library cannot work with
    (for example a KV bucket that keeps history or expires entries)."""


class ProcessIdTakenError(BackendConfigError):
    """Another coordinator holds, or took, this coordinator's process id.

    Two live coordinators must never share a process id. A start that finds a live
    lease of its process id watches it for the holder's heartbeat interval plus the
    clock-skew margin: if the lease is renewed meanwhile, a live coordinator holds the
    id, and :func:`~trio_debounce.open_coordinator` raises this error before writing
    anything (the earlier coordinator runs on). If it is not renewed, the holder crashed
    or stalls, and the start takes the id over; a stalled holder that resumes then
    finds its lease taken at its next heartbeat and is *fenced*: from then on its pings
    raise this error (misconfiguration: never failed open), it takes nothing over, and
    its windows go to the live processes as a dead process's windows do. The message
    names the process id and the epochs (never a secret). See :doc:`/protocol`,
    *Process*.
    """


class DocumentTooLargeError(BackendError, ValueError):
    """A record would exceed the largest message the server accepts.

    Raised before anything is sent: an oversized publish makes a NATS server close the
    whole connection, failing every call in flight.
    """


class RevisionConflict(BackendError):
    """A compare-and-swap lost: the key's revision was not the one expected.

    Internal to the protocol, which re-reads and retries; users see it only from a
    :class:`~trio_debounce.testing.KvStore` they drive directly.
    """
