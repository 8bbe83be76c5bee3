"""The revisioned key-value store that the coordination protocol runs on.

:class:`KvStore` is the narrow interface between the protocol (``_protocol.py``) and a
storage technology: NATS JetStream KV (``trio_debounce.nats``) and the in-memory fake
(``trio_debounce.testing.MemoryStore``). It has the semantics of a JetStream KV bucket
with history 1:

* Every key has a *revision*: a positive int that grows with every write to the bucket
  (JetStream's stream sequence). Revisions are never reused.
* A delete leaves a *delete marker*: an entry with ``value=None`` and its own revision,
  so a later create can be made conditional on it.
* Every write is a compare-and-swap on the key's latest revision (``last``), ``0``
  meaning "the key has no entry at all".

All methods are Trio-side async functions. Each raises
:class:`~trio_debounce.RevisionConflict` when the expected revision is not the latest,
:class:`~trio_debounce.BackendUnavailableError` when the store cannot be reached or does
not answer within the store's own per-call deadline (the call may still have been
applied), :class:`~trio_debounce.BackendAuthError` on a permission error, and
:class:`~trio_debounce.BackendError` for anything else. None of them lets a client
library's exception escape.
"""

from __future__ import annotations

import abc
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from ._errors import RevisionConflict


@dataclass(frozen=True, slots=True)
class KvEntry:
    """The latest entry of one key.

    Attributes:
      key (str): the key.
      value (bytes | None): the stored bytes, or ``None`` for a delete marker.
      revision (int): the entry's revision, > 0.
    """

    key: str
    value: bytes | None
    revision: int


class KvWatch(abc.ABC):
    """A live watch of the keys under one prefix, made by :meth:`KvStore.open_watch`.

    :meth:`receive_batch` delivers the latest entry of every key under the prefix as
    the watch opens (delete markers included), then one ``None`` (the end of those
    initial values), then every later write and delete as the store applies it, in
    revision order. A *purge* (:meth:`KvStore.purge`, :meth:`KvStore.purge_marker`)
    removes an entry without a write, and no watch sees it.

    A watch is *interrupted* when it may have missed an update (the NATS store's: at
    every disconnect and reconnect, and when its server-side consumer is lost); it
    then delivers nothing more, and its owner should close it and open a new one,
    whose initial values are a fresh snapshot.

    Attributes:
      prefix (str): the watched prefix (``""``: every key).
    """

    prefix: str

    @property
    @abc.abstractmethod
    def interrupted(self) -> bool:
        """Whether the watch may have missed an update (no I/O)."""

    @abc.abstractmethod
    async def wait_interrupted(self) -> None:
        """Return when the watch is interrupted (after a checkpoint if it is)."""

    @abc.abstractmethod
    async def receive_batch(self, max_entries: int = 512) -> list[KvEntry | None]:
        """Wait for the next updates and return them, oldest first: at least one and
        at most ``max_entries`` (int >= 1), each a :class:`KvEntry` (``value=None`` for
        a delete marker) or ``None`` (the end of the initial values, once per watch).

        Waits as long as nothing is written: bound it with a cancel scope; cancelling
        it loses nothing.

        Raises:
          ValueError: ``max_entries`` is below 1.
          BackendError: the watch was stopped (its store closed).
        """


class KvStore(abc.ABC):
    """A revisioned key-value store with compare-and-swap writes (JetStream KV semantics).

    Keys are ASCII strings of ``[-/_=.A-Za-z0-9]`` tokens separated by ``.``.
    """

    #: The largest value, in bytes, that :meth:`put` accepts.
    max_value_bytes: int

    #: When the store (the bucket) was created, wall-clock epoch seconds. Revisions
    #: restart when a bucket is re-created; fencing tokens pair them with this.
    created: float

    @abc.abstractmethod
    async def get(self, key: str) -> KvEntry | None:
        """The latest entry of ``key``: a value, a delete marker (``value=None``), or
        ``None`` if the key has no entry (never written, or purged)."""

    async def get_current(self, key: str) -> KvEntry | None:
        """:meth:`get` from the store's authority: never an older entry than the latest
        write acknowledged to anyone.

        A replicated store may answer :meth:`get` from a replica that lags the writes
        (JetStream's direct get, answered by any replica of the stream); this method
        reads from the stream leader instead, at the cost of a request the leader
        alone serves. The protocol reads a process's lease this way before it counts
        the process as dead (see the protocol's docs, *Stale reads*). The default
        calls :meth:`get`: right for a store whose reads are never stale.
        """
        return await self.get(key)

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, last: int) -> int:
        """Write ``value`` if the key's latest revision is ``last`` (``0``: no entry).

        ``last`` may be the revision of a delete marker. Atomic. Returns the new
        revision. Raises :class:`~trio_debounce.RevisionConflict` if ``last`` is not the
        latest, :class:`~trio_debounce.DocumentTooLargeError` if ``value`` is longer than
        :attr:`max_value_bytes` (before sending anything).
        """

    @abc.abstractmethod
    async def delete(self, key: str, *, last: int) -> int:
        """Leave a delete marker on ``key`` if its latest revision is ``last``.

        Atomic. Returns the marker's revision. Raises
        :class:`~trio_debounce.RevisionConflict` otherwise.
        """

    @abc.abstractmethod
    async def purge_marker(self, key: str, *, revision: int) -> bool:
        """Remove the delete marker ``revision`` of ``key`` if it is still the latest entry.

        Revision-checked: entries written after the marker are never touched. Returns
        True if the marker was removed, False if the key had moved on (nothing done).
        """

    async def purge(self, key: str, *, last: int) -> bool:
        """Remove ``key``'s entry if its latest revision is ``last``, leaving no delete
        marker behind (for keys never written again, such as fire records: a marker
        would stay in the bucket until a sweep).

        Revision-checked: an entry written after ``last`` is never touched. Returns
        True if the entry was removed, False if the key had moved on or had no entry
        (nothing done). This default is a revision-checked delete and the purge of its
        marker (two calls); stores override it with one.
        """
        try:
            marker = await self.delete(key, last=last)
        except RevisionConflict:
            return False
        await self.purge_marker(key, revision=marker)
        return True

    @abc.abstractmethod
    async def entries(self, prefix: str) -> list[KvEntry]:
        """The latest entry of every key that starts with ``prefix`` (delete markers
        included), in no particular order. ``prefix`` ends with ``.``."""

    def open_watch(self, prefix: str) -> AbstractAsyncContextManager[KvWatch]:
        """Watch the keys under ``prefix`` (ending with ``.``; ``""``: every key) for
        the ``async with`` block: see :class:`KvWatch`. Optional: the protocol itself
        never watches; :meth:`~trio_debounce.abc.DebounceBackend.open_window_watch`
        does.

        Raises:
          NotImplementedError: this store cannot watch (the default; raised by the
            call, before the ``async with``).
          ValueError: ``prefix`` is not ``""`` and does not end with ``.``.
          BackendUnavailableError, BackendAuthError, BackendError: opening failed.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot watch its keys")
