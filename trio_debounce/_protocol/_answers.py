"""The answers of a register's write (see :doc:`/protocol`, "Group commit"): each
ping's Registration, and whether a write whose answer was lost had landed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .._backend import Registered, Registration
from . import _rules
from ._documents import FIRE_PREFIX, WRITES_KEEP, WindowDoc
from ._leases import ProcessLease
from ._rules import Identity
from ._turns import Call, answer
from ._view import StoreView


@dataclass(slots=True, frozen=True)
class SentWrite:
    """A write of a batch whose answer may be lost: what decides and answers it."""

    #: Its pings and their outcomes.
    pings: list[tuple[Call, Registered]]
    #: The document it wrote, and the run id of the one it was written over (None:
    #: the key held no window).
    doc: WindowDoc
    prior_run: str | None
    #: The take time of its coalesced pings, and until when the window it wrote waits
    #: for its key's queue-latest run.
    take_at: float | None
    waits: float | None


def unresolved_message(
    workflow: str, key: str, op_timeout: float, sent: SentWrite | None, write: str
) -> str:
    """The error of the pings of ``sent``, write ``write``, whose landing a re-read
    could not tell (:meth:`Answers.landed` was None): it names what the write was, the
    opening of its window or a join of an existing one (a takeover's, a peer's)."""
    run = sent.doc.run_id if sent is not None else ""
    if sent is not None and sent.doc.opened_by == write:
        what = f"the window its write opened (run {run})"
    else:
        what = f"its write into the window it joined (run {run})"
    return (
        f"register of {workflow!r}/{key!r} did not complete within {op_timeout} s, and a "
        f"re-read could not tell whether {what} landed: it is not written again"
    )


@dataclass(slots=True)
class LeadingRecord:
    """The record of the leading fire a batch's opening write is for, once written."""

    fire_id: str | None = None
    #: Its revision: the fencing token of a leading fire whose window has closed
    #: before the opening write's answer came (later than the key's writes before
    #: the opening, earlier than every write after it).
    revision: int = 0
    #: The batch's answer carries it (the window it was for was opened).
    used: bool = False


class Answers:
    """Answers the pings of a register's writes, and tracks what this process owns.

    Args:
      view: the store.
      leases: this process's lease (its length and the skew margin).
      me: this process in this opening.
      wall: the wall clock.
    """

    def __init__(
        self,
        view: StoreView,
        leases: ProcessLease,
        me: Identity,
        wall: Callable[[], float],
    ) -> None:
        self._view = view
        self._leases = leases
        self._me = me
        self._wall = wall
        #: Pings that took a dead owner's window over (see KvDebounceBackend).
        self.takeovers = 0

    def landed(self, doc: WindowDoc | None, write: str, sent: SentWrite) -> bool | None:
        """Did ``sent``, write ``write``, land, judged by its key's document ``doc`` as
        re-read? True, False, or None if a re-read cannot tell (see
        :func:`~._rules.opening_landed`)."""
        if doc is not None and ((write == doc.write and not doc.fired) or write in doc.writes):
            # Its revision, or pings of this process's since, or of a peer's on top
            # of it, or its window's commit, or newer windows of the key: each keeps the
            # key's last ping write ids (``writes``).
            return True
        if sent.doc.opened_by == write:
            return _rules.opening_landed(
                doc, sent.doc, sent.prior_run, self._wall(), self._leases.seconds, self._leases.skew
            )
        if any(outcome is Registered.FIRED for _, outcome in sent.pings):
            # A rate-limit fire: writing it again could fire its run twice.
            return None
        if doc is not None and len(doc.writes) >= WRITES_KEEP:
            # The key has had more writes since than it keeps ids of: writing its
            # pings again might count them twice.
            return None
        # A write into an open window (or a takeover) that no id the key keeps names:
        # it did not land (unless a writer that predates ``writes`` wrote since: then
        # its pings may be counted twice, once in each window; no run fires twice).
        return False

    def answer_landed(
        self,
        kv_key: str,
        sent: SentWrite,
        doc: WindowDoc | None,
        revision: int,
        leading: LeadingRecord,
    ) -> None:
        """Answer the pings of ``sent``, a write that landed though its answer was lost,
        from the key's document ``doc`` (at ``revision``) as re-read."""
        if doc is not None and not doc.fired and doc.run_id == sent.doc.run_id:
            # Its window is open: as it is now.
            self.answer_batch(kv_key, sent.pings, doc, sent.take_at, revision, sent.waits, leading)
            return
        # Its window has closed since (a peer took its fire, maybe opened newer windows
        # over it): its pings are in that fire. Answered as the write left the window,
        # not owned (its finalize finds it closed); a leading fire the opening owes
        # carries its record's revision as fencing token (0 without one: a later fire
        # of the key has committed), never a later write's.
        self.answer_batch(
            kv_key,
            sent.pings,
            sent.doc,
            sent.take_at,
            revision,
            sent.waits,
            leading,
            closed=True,
        )

    def answer_batch(
        self,
        kv_key: str,
        pings: list[tuple[Call, Registered]],
        doc: WindowDoc,
        take_at: float | None,
        revision: int,
        waits: float | None = None,
        leading: LeadingRecord | None = None,
        *,
        closed: bool = False,
    ) -> None:
        """Answer the pings of a write that landed; tracks what this process owns.
        ``leading``: the record of a leading fire, given to the ping that opened the
        window when this write opened it. ``closed``: the window ``doc`` has closed
        since (see answer_landed).

        Every ping of the write reports the window as that write left it (count, due
        time, payload), whatever order their tasks wake in; each its own outcome. A
        window that ``waits`` for its key's ``queue-latest`` run reports ``waiting``,
        and that time as ``scheduled_at`` (when the owner looks again).
        """
        if doc.payload_policy != "last" or doc.ordered:
            # The window's payload, not a ping's.
            payload = _rules.load_payload(self._me.serializer, doc.payload)
        else:
            payload = pings[-1][0].own  # the last ping's: the one stored
        if self._me.owns(doc) and not closed:
            self._view.own(kv_key, doc)
            self._view.know_count(kv_key, doc.run_id, doc.count)
            self._view.count_own(kv_key, doc.run_id, len(pings))
        else:
            self._view.disown(kv_key, doc.run_id)
        token = self._view.token(revision)
        fire_id = None
        if (
            leading is not None
            and leading.fire_id is not None
            and doc.opened_by == (leading.fire_id[len(FIRE_PREFIX) :])
        ):
            fire_id, leading.used = leading.fire_id, True
        if closed:
            token = 0 if leading is None or fire_id is None else self._view.token(leading.revision)
        # The pings of one outcome share one (immutable) result: the coordinator
        # recognises a merged ping's by it and skips repeating its local bookkeeping.
        results: dict[Registered, Registration] = {}
        for ping, outcome in pings:
            if outcome is Registered.TOOK_OVER:
                self.takeovers += 1
            result = results.get(outcome)
            if result is None:
                result = results[outcome] = Registration(
                    outcome,
                    # A rate-limit fire is a run of its own (alone in its write).
                    ping.run_id if outcome is Registered.FIRED else doc.run_id,
                    doc.mode,
                    doc.at if waits is None else waits,
                    # A rate-limit fire's time is its own ping's.
                    (ping.now or doc.last) if outcome is Registered.FIRED else doc.first,
                    doc.count,
                    True,
                    take_at if outcome is Registered.COALESCED else None,
                    payload,
                    token,
                    waiting=waits is not None,
                    fire_id=fire_id if outcome is Registered.OPENED else None,
                )
            if ping.taken:
                # Its own result: the fires it took are the caller's to run.
                answer(ping, result._replace(taken=tuple(ping.taken)))
                continue
            answer(ping, result)
