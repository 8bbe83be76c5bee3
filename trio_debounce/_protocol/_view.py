"""This process's view of the store: its requests, what it last read or wrote, and the
windows it owns."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, NamedTuple, TypeVar

import trio

from .._backend import LATE_WRITE_HORIZON, LATE_WRITES_KEPT
from .._errors import BackendUnavailableError, RevisionConflict
from .._events import BackendEvent, StoreCalled
from .._kv import KvEntry, KvStore, KvWatch
from ._documents import WindowDoc

logger = logging.getLogger("trio_debounce.backend")

T = TypeVar("T")

#: How many keys' last known (revision, document) a backend keeps (least recently used
#: first out); a key not kept costs one read before its next write.
KNOWN_LIMIT = 10_000
#: Writes on fresh reads that conflict in a row before the next read is from the
#: store's authority (a leader read): a replica that lags makes every write on its reads
#: conflict, until a decision is made on a stale read at the deadline. Not after the
#: first conflict: that is the usual contention, and on NATS a leader read (through
#: the JetStream API) cost ten writers on one key 20-40 % of their ping latency.
LEADER_READ_AFTER = 2
#: Fencing tokens are ``(bucket creation time in ms) << _TOKEN_SHIFT | revision``.
_TOKEN_SHIFT = 40


class _LateOpening(NamedTuple):
    """An opening (a create) whose answer was lost and whose pings were then written
    again (see StoreView.note_late_opening)."""

    #: The create's write id, and when it was noted (wall clock).
    write: str
    noted_at: float
    #: The run's window has closed since: fired by this process, or its tombstone seen.
    closed: bool = False


class StoreView:
    """Every request to the store, and what this process knows of it.

    * Requests go through here: counted, and watched for outages. After one, no
      takeover happens for ``grace`` seconds, so that live peers renew their leases
      first (:meth:`can_take_over`).
    * The revision cache: each key's (revision, document) as this process last read or
      wrote it, so a write against it needs no read first (the compare-and-swap proves
      it current). A conflict or an error forgets it; a key that peers write too is
      contended and read before every write.
    * Ownership: the windows this process owns (``owned``) and the highest ping count
      it told its coordinator for each (``known_counts``).

    Args:
      store: the shared store (tests may swap it: requests look it up each time).
      heartbeat_interval, skew: seconds; after an outage, no takeover happens for
        their sum once the store answers again.
    """

    def __init__(self, store: KvStore, *, heartbeat_interval: float, skew: float) -> None:
        self.store = store
        self._heartbeat = heartbeat_interval
        self._skew = skew
        self._token_base = int(store.created * 1000) << _TOKEN_SHIFT
        self._in_outage = False
        #: Trio time before which no takeover happens (after an outage).
        self._takeover_after = -math.inf
        self._rng = random.Random()
        #: KV key -> (revision, window document or None) as this process last read or
        #: wrote it.
        self._known: dict[str, tuple[int, WindowDoc | None]] = {}
        #: KV keys that peers write too (a compare-and-swap lost to them, or a read
        #: found a revision this process did not know): read before every write.
        self._contended: set[str] = set()
        #: KV key -> run id of the windows this process owns, as far as it knows.
        self.owned: dict[str, str] = {}
        #: KV key -> (run id, the highest ping count returned to the coordinator for
        #: it): what the owner knows if its finalize fails; kept with ``owned``.
        self.known_counts: dict[str, tuple[str, int]] = {}
        #: KV key -> the later of the last ping and the owner's wake time (``armed``,
        #: wall clock) that this process knows of the window it owns there: a fire's
        #: tombstone outlives it by a lease (the sweeper's rule).
        self.owned_last: dict[str, float] = {}
        #: Run ids of owned windows that a read found deleted by another writer,
        #: until the coordinator takes them (see note_deleted).
        self.deleted_runs: set[str] = set()
        #: KV key -> (run id, how many of its stored pings this process sent), for the
        #: windows it owns (the pings it sent before it owned one are not counted): an
        #: explicit ``on_exit="cancel"`` deletes only windows that hold no peer's ping.
        self.own_pings: dict[str, tuple[str, int]] = {}
        #: (KV key, run id) -> the openings (creates) whose answer was lost and whose
        #: pings were then written again: a late landing of one, once its key is empty
        #: again, is a stale window (see note_late_opening).
        self.late_openings: dict[tuple[str, str], _LateOpening] = {}
        # Counters, see KvDebounceBackend.
        self.requests = 0
        self.conflicts = 0
        #: The attached coordinator's event sink (its hook's guard), or None: every
        #: part of the backend reports its events through it.
        self.on_event: Callable[[BackendEvent], None] | None = None

    # ---------------------------------------------------------------- requests

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """One store request; tracks outages (and the takeover grace after them)."""
        if self.on_event is not None:
            return await self._observed_call(fn, *args, **kwargs)
        return await self._request(fn, *args, **kwargs)

    async def _observed_call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """:meth:`_call`, reported as a :class:`StoreCalled`."""
        start = trio.current_time()
        outcome: Literal["ok", "conflict", "unavailable", "error"] = "ok"
        try:
            return await self._request(fn, *args, **kwargs)
        except RevisionConflict:
            outcome = "conflict"
            raise
        except (BackendUnavailableError, trio.Cancelled):
            outcome = "unavailable"
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            hook = self.on_event
            if hook is not None:
                end = trio.current_time()
                hook(StoreCalled(fn.__name__, str(args[0]), end - start, outcome, end))

    async def _request(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        self.requests += 1
        try:
            result = await fn(*args, **kwargs)
        except BackendUnavailableError:
            self._in_outage = True
            raise
        if self._in_outage:
            self._in_outage = False
            # Let live peers refresh their leases before anything is taken over.
            self._takeover_after = trio.current_time() + self._heartbeat + self._skew
            logger.info(
                "backend answers again; no takeover for %.3g s", self._heartbeat + self._skew
            )
        return result

    async def get(self, key: str) -> KvEntry | None:
        return await self._call(self.store.get, key)

    async def get_current(self, key: str) -> KvEntry | None:
        """``key`` read from the store's authority (never a replica that lags)."""
        return await self._call(self.store.get_current, key)

    async def put(self, key: str, value: bytes, *, last: int) -> int:
        return await self._call(self.store.put, key, value, last=last)

    async def delete(self, key: str, *, last: int) -> int:
        return await self._call(self.store.delete, key, last=last)

    async def purge(self, key: str, *, last: int) -> bool:
        return await self._call(self.store.purge, key, last=last)

    async def purge_marker(self, key: str, *, revision: int) -> bool:
        return await self._call(self.store.purge_marker, key, revision=revision)

    async def entries(self, prefix: str) -> list[KvEntry]:
        return await self._call(self.store.entries, prefix)

    def open_watch(self, prefix: str) -> AbstractAsyncContextManager[KvWatch]:
        """The store's watch of ``prefix`` (not counted as a request; see
        :meth:`KvStore.open_watch`)."""
        return self.store.open_watch(prefix)

    async def backoff(self, attempt: int) -> None:
        # Full jitter, capped: contention clears in a few rounds.
        await trio.sleep(self._rng.uniform(0, min(0.2, 0.005 * 2**attempt)))

    def can_take_over(self) -> bool:
        """May a dead owner's window be taken over now (not in the grace after an
        outage)?"""
        return trio.current_time() >= self._takeover_after

    def token(self, revision: int) -> int:
        """The fencing token of a step that committed at ``revision``."""
        return self._token_base | revision

    # ----------------------------------------------------------- window documents

    async def read(
        self, kv_key: str, *, current: bool = False
    ) -> tuple[KvEntry | None, int, WindowDoc | None]:
        """Read window ``kv_key``: its entry, revision (0: none) and document (None:
        absent, a delete marker or unreadable), remembered for the next write. With
        ``current``, from the store's authority (a read that decides a proof)."""
        entry = await (self.get_current(kv_key) if current else self.get(kv_key))
        doc = self.parse(entry)
        revision = 0 if entry is None else entry.revision
        known = self._known.get(kv_key)
        if known is not None and known[0] != revision:
            self.contend(kv_key)  # written by someone else since
        self.remember(kv_key, revision, doc)
        return entry, revision, doc

    def parse(self, entry: KvEntry | None) -> WindowDoc | None:
        if entry is None or entry.value is None:
            return None
        try:
            return WindowDoc.decode(entry.value)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            logger.warning(
                "window document %s (revision %d) is unreadable; treating it as absent",
                entry.key,
                entry.revision,
            )
            return None

    async def close_window(self, kv_key: str, tombstone: WindowDoc | None, last: int) -> int:
        """Close a window by a revision-checked delete, or by writing its tombstone;
        returns the revision written (the delete marker's, or the tombstone's)."""
        if tombstone is None:
            return await self.delete(kv_key, last=last)
        return await self.put(kv_key, tombstone.encode(), last=last)

    # ------------------------------------------------------------ revision cache

    def cached(self, kv_key: str) -> tuple[int, WindowDoc | None] | None:
        """The revision and document to write ``kv_key`` against without a read, if
        this process knows them and the key is not contended."""
        if kv_key in self._contended:
            return None
        return self._known.get(kv_key)

    def known(self, kv_key: str) -> tuple[int, WindowDoc | None] | None:
        """What this process last read or wrote of ``kv_key``, contended or not."""
        return self._known.get(kv_key)

    def contend(self, kv_key: str) -> None:
        self.forget(kv_key)
        if len(self._contended) >= KNOWN_LIMIT:
            self._contended.clear()
        self._contended.add(kv_key)

    def lost_race(self, kv_key: str | None) -> None:
        """A compare-and-swap lost: counted, and ``kv_key`` (if given) is contended."""
        if kv_key is not None:
            self.contend(kv_key)
        self.conflicts += 1

    def remember(self, kv_key: str, revision: int, doc: WindowDoc | None) -> None:
        known = self._known
        known.pop(kv_key, None)
        known[kv_key] = (revision, doc)
        if len(known) > KNOWN_LIMIT:
            del known[next(iter(known))]

    def forget(self, kv_key: str) -> None:
        self._known.pop(kv_key, None)

    # --------------------------------------------------------------- ownership

    def note_late_opening(self, kv_key: str, run_id: str, write: str, now: float) -> None:
        """Remember (for :data:`LATE_WRITE_HORIZON` s of wall time from ``now``, at
        most :data:`LATE_WRITES_KEPT`) that write ``write``, which opened run ``run_id``
        at ``kv_key`` with a create, had its answer lost and its pings written again:
        if it lands later, once the key is empty again (the run's window fired and was
        swept), it opens a second window of the run, which :meth:`is_late_opening`
        recognises."""
        late = self.late_openings
        late.pop((kv_key, run_id), None)
        for old, noted in list(late.items()):
            if now - noted.noted_at < LATE_WRITE_HORIZON and len(late) < LATE_WRITES_KEPT:
                break
            del late[old]
        late[kv_key, run_id] = _LateOpening(write, now)

    def note_run_closed(self, kv_key: str, run_id: str) -> None:
        """The window of run ``run_id`` at ``kv_key`` fired here, or its tombstone was
        read: a window of the run that a late opening makes now is a second one."""
        if not self.late_openings:
            return  # every fire passes here: nothing noted is the usual case
        noted = self.late_openings.get((kv_key, run_id))
        if noted is not None:
            self.late_openings[kv_key, run_id] = noted._replace(closed=True)

    def is_late_opening(self, kv_key: str, doc: WindowDoc, now: float) -> bool:
        """Is ``doc``, a window of this process at ``kv_key``, read at wall time
        ``now``, the late landing of an opening noted by :meth:`note_late_opening`
        whose run's window has closed since (:meth:`note_run_closed`), with no ping
        written into it since, and not open here?"""
        noted = self.late_openings.get((kv_key, doc.run_id))
        return (
            noted is not None
            and noted.closed
            and now - noted.noted_at < LATE_WRITE_HORIZON
            and noted.write == doc.opened_by == doc.write
            and self.owned.get(kv_key) != doc.run_id
        )

    def own(self, kv_key: str, doc: WindowDoc) -> None:
        """Record that this process owns window ``kv_key`` as ``doc`` shows it."""
        self.owned[kv_key] = doc.run_id
        self.owned_last[kv_key] = max(doc.last, doc.armed)

    def note_deleted(
        self, kv_key: str, entry: KvEntry | None, now: float, lease: float
    ) -> str | None:
        """A read of window ``kv_key`` found ``entry`` (at wall time ``now``). If the key
        is gone (absent, or a delete marker) while this process owns a window there,
        sooner than the sweeper may remove a fire's tombstone (``lease`` seconds after
        the window's last ping or its owner's wake time, whichever is later, less the
        skew margin), another writer deleted it: a
        peer's cancel, or an operator. Its run id is recorded for the coordinator (see
        ``KvDebounceBackend.take_deleted``), logged once, and returned; else None."""
        if entry is not None and entry.value is not None:
            return None
        run_id = self.owned.get(kv_key)
        last = self.owned_last.get(kv_key)
        if run_id is None or last is None or now >= last + lease - self._skew:
            return None
        return self._note_foreign(kv_key, run_id)

    def note_cancelled(self, kv_key: str, doc: WindowDoc | None) -> str | None:
        """A read of window ``kv_key`` found ``doc``. If it is a cancel's tombstone
        (``WindowDoc.cancel_tombstone``) of the run this process owns there, another
        writer cancelled it: noted as :meth:`note_deleted` does; else None."""
        if doc is None or not doc.cancelled or self.owned.get(kv_key) != doc.run_id:
            return None
        return self._note_foreign(kv_key, doc.run_id)

    def _note_foreign(self, kv_key: str, run_id: str) -> str:
        """Record (for the coordinator), log once, and return the run id of the window
        ``kv_key`` this process owned, closed by another writer."""
        if len(self.deleted_runs) >= KNOWN_LIMIT:
            self.deleted_runs.clear()
        self.deleted_runs.add(run_id)
        logger.warning(
            "window %s (run %s) was closed by another writer (a cancel or an operator's "
            "delete, not a fire): its pending fire, if any, is dropped as cancelled",
            kv_key,
            run_id,
        )
        return run_id

    def disown(self, kv_key: str, run_id: str) -> None:
        """Forget that this process owns window ``kv_key`` under ``run_id`` (and only
        under that run: a stale task's finalize must not forget a newer window)."""
        if self.owned.get(kv_key) == run_id:
            del self.owned[kv_key]
            self.owned_last.pop(kv_key, None)
        if self.known_counts.get(kv_key, ("",))[0] == run_id:
            del self.known_counts[kv_key]
        if self.own_pings.get(kv_key, ("",))[0] == run_id:
            del self.own_pings[kv_key]

    def count_own(self, kv_key: str, run_id: str, n: int) -> None:
        """Record that ``n`` more pings of this process were stored in window
        ``kv_key`` (``run_id``), which it owns."""
        known = self.own_pings.get(kv_key)
        before = known[1] if known is not None and known[0] == run_id else 0
        self.own_pings[kv_key] = (run_id, before + n)

    def own_count(self, kv_key: str, run_id: str) -> int:
        """How many pings of this process window ``kv_key`` (``run_id``) holds."""
        known = self.own_pings.get(kv_key)
        return known[1] if known is not None and known[0] == run_id else 0

    def know_count(self, kv_key: str, run_id: str, count: int) -> None:
        """Record that the coordinator was told window ``kv_key`` (``run_id``) holds
        ``count`` pings."""
        known = self.known_counts.get(kv_key)
        if known is None or known[0] != run_id or known[1] < count:
            self.known_counts[kv_key] = (run_id, count)
