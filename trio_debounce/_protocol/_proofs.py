"""The proof of at-most-once fire commits whose answers were lost (see
:doc:`/protocol`, "Delivery guarantees"): every write sent for a run is remembered
until one is proven or none can land, and a finalize cut short by ``op_timeout``
re-reads until it knows, for at most a lease."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from .._backend import Finalization, Finalized
from .._errors import BackendUnavailableError
from .._events import CommitProven
from .._kv import KvEntry
from . import _rules
from ._documents import WindowDoc
from ._leases import ProcessLease
from ._view import StoreView

logger = logging.getLogger("trio_debounce.backend")

#: The proof re-reads: seconds before the first, and the most between two (doubling).
_FIRST_WAIT = 0.1
_MAX_WAIT = 5.0
#: The shortest wait between two proof reads, seconds.
_MIN_WAIT = 0.001


@dataclass(slots=True, frozen=True)
class _Sent:
    """An at-most-once commit (a tombstone write) sent for a run, not yet proven."""

    #: The window as the commit decided on it, and the time it fires at (wall clock).
    window: WindowDoc
    fired_at: float
    #: The revision the write names (it can land only while that is the key's).
    base: int
    #: When it was sent, wall clock.
    sent_at: float


#: A proven commit: the window it fired, its fire time and its fencing token.
Proof = tuple[WindowDoc, float, int]


def _names(doc: WindowDoc, run_id: str, write: str) -> bool:
    """Does ``doc`` name write ``write`` as the commit of ``run_id`` (its own
    tombstone, or an ``after`` entry of a newer window)?"""
    if doc.run_id == run_id:
        return doc.fired and doc.write == write
    return (run_id, write) in doc.after


class SentCommits:
    """The at-most-once commits sent and not yet proven, by (KV key, run id) and
    write id. A write whose answer was lost may land after a re-read saw the old
    document, and the next decision's write then conflicts: the proof must know every
    write sent for the run.

    Args:
      view: the store.
      leases: this process's lease (a proof ends when it is no longer held).
      op_timeout: seconds each proof read may take.
      wall: the wall clock.
    """

    def __init__(
        self,
        view: StoreView,
        leases: ProcessLease,
        *,
        op_timeout: float,
        wall: Callable[[], float],
    ) -> None:
        self._view = view
        self._leases = leases
        self._op_timeout = op_timeout
        self._wall = wall
        self._sent: dict[tuple[str, str], dict[str, _Sent]] = {}

    def add(
        self, kv_key: str, run_id: str, write: str, window: WindowDoc, fired_at: float, base: int
    ) -> None:
        """Remember that tombstone write ``write`` of ``run_id`` is being sent against
        revision ``base``."""
        self._sent.setdefault((kv_key, run_id), {})[write] = _Sent(
            window, fired_at, base, self._wall()
        )

    def forget(self, kv_key: str, run_id: str) -> None:
        """The run's commit is proven (its answer came): forget its writes."""
        self._sent.pop((kv_key, run_id), None)

    def pending(self, kv_key: str, run_id: str) -> bool:
        """Is a commit of ``run_id`` sent and not yet proven or ruled out?"""
        return bool(self._sent.get((kv_key, run_id)))

    def proof(
        self, kv_key: str, run_id: str, entry: KvEntry | None, doc: WindowDoc | None
    ) -> Proof | None:
        """Does ``doc`` (read as ``entry``) prove a commit sent for ``run_id``? Its fire
        then (and the writes are forgotten). Writes that can no longer land (the key
        moved past the revision they name, or the run was closed by another write) are
        forgotten too."""
        sent = self._sent.get((kv_key, run_id))
        if not sent:
            return None
        revision = 0 if entry is None else entry.revision
        for write, one in list(sent.items()):
            landed = _rules.commit_landed(doc, run_id, write)
            if landed and doc is not None and not _names(doc, run_id, write):
                # commit_landed's "in doubt" answer (a full ``after``): at-least-once
                # runs such a record again; at-most-once never fires on a guess.
                landed = None
            if landed and doc is not None:
                del self._sent[kv_key, run_id]
                # The commit's revision: this read's if it is the tombstone; if a newer
                # window over it proves it, one above the revision it named (below
                # every later write of the key, so fencing tokens keep their order).
                direct = doc.run_id == run_id
                return (
                    one.window,
                    one.fired_at,
                    self._view.token(revision if direct else one.base + 1),
                )
            # A read from a replica that lags may show an older revision, or none: only
            # a later revision, or another write's close, rules the write out.
            if revision > one.base or (landed is False and doc is not None):
                del sent[write]
        if not sent:
            del self._sent[kv_key, run_id]
        return None

    async def prove_late(
        self, workflow: str, key: str, kv_key: str, run_id: str
    ) -> Proof | Finalization:
        """See :meth:`_prove_late`; reports the outcome as a :class:`CommitProven`."""
        hook = self._view.on_event
        if hook is None:
            return await self._prove_late(workflow, key, kv_key, run_id)
        try:
            proven = await self._prove_late(workflow, key, kv_key, run_id)
        except BackendUnavailableError:
            hook(CommitProven(workflow, key, run_id, False, trio.current_time()))
            raise
        landed = not isinstance(proven, Finalization)
        hook(CommitProven(workflow, key, run_id, landed, trio.current_time()))
        return proven

    async def _prove_late(
        self, workflow: str, key: str, kv_key: str, run_id: str
    ) -> Proof | Finalization:
        """Re-read ``kv_key`` (from the store's authority) until a read proves a commit
        sent for ``run_id`` (its proof: the fire, attempt 1, at its due time), shows that
        none can land any more (a reschedule to the window's due time, to decide again,
        or abandoned if another write closed it), or this process's lease is no longer
        held, or a lease has passed since the first was sent. Reads back off from 0.1 s
        to 5 s, each bounded by ``op_timeout``. Called outside the key's turn.

        Raises:
          BackendUnavailableError: no read proved or ruled it out in time (the fire is
            dropped: only an outage as long as the lease gets here).
        """
        sent = self._sent[kv_key, run_id]
        until = min(one.sent_at for one in sent.values()) + self._leases.seconds
        wait = _FIRST_WAIT
        error: BaseException | None = None
        while self._leases.held() and self._wall() < until and self.pending(kv_key, run_id):
            # Never past the proof's end (the lease's, or a lease after the first send)
            # by more than a millisecond: a shorter sleep may not move a wall clock of
            # epoch seconds at all (a float's step there is about 0.2 us), and would spin.
            held_until = self._leases.expires - self._leases.skew
            end = min(until, held_until) - self._wall()
            await trio.sleep(max(min(wait, end), _MIN_WAIT))
            wait = min(2 * wait, _MAX_WAIT)
            entry: KvEntry | None = None
            try:
                with trio.move_on_after(self._op_timeout) as scope:
                    entry = await self._view.get_current(kv_key)
            except BackendUnavailableError as exc:
                error = exc
                continue
            if scope.cancelled_caught:
                continue
            doc = self._view.parse(entry)
            proof = self.proof(kv_key, run_id, entry, doc)
            if proof is not None:
                logger.info(
                    "finalize of %s (run %s): its commit, whose answer was lost, is proven",
                    kv_key,
                    run_id,
                )
                return proof
            if self.pending(kv_key, run_id):
                continue  # it may still land
            # None of its writes can land: the window is as this read shows it.
            if doc is not None and not doc.fired and doc.run_id == run_id:
                return Finalization(Finalized.RESCHEDULE, doc.at, doc.count, doc.first, doc.mode)
            self._view.disown(kv_key, run_id)
            return Finalization(Finalized.ABANDONED)
        self.forget(kv_key, run_id)
        self._view.disown(kv_key, run_id)
        raise BackendUnavailableError(
            f"finalize of {workflow!r}/{key!r} (run {run_id}) could not prove its fire "
            f"within its lease" + (f": {error}" if error is not None else "")
        )
