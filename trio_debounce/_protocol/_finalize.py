"""The fire of a window: its commit, the proof of a commit whose answer was lost, the
fire records of at-least-once delivery, the end of a ``queue-latest`` run, and the
work queued while the store did not answer (see :doc:`/protocol`, "Finalize")."""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NoReturn

import trio

from .._backend import Delivery, Finalization, Finalized, OrphanFire
from .._errors import (
    BackendError,
    BackendUnavailableError,
    LeaseLapsedError,
    RevisionConflict,
)
from .._keys import window_key
from .._kv import KvEntry
from .._types import FireReason, Mode
from . import _flow_rules, _rules
from ._documents import FIRE_PREFIX, WindowDoc
from ._leases import ProcessLease
from ._proofs import SentCommits
from ._records import FireRecords
from ._rules import Identity
from ._turns import KeyTurns
from ._view import LEADER_READ_AFTER, StoreView

logger = logging.getLogger("trio_debounce.backend")


@dataclass(slots=True)
class _QueuedDelete:
    key: str
    run_id: str
    fired_at: float
    #: A fire record the failed finalize may have written.
    fire_id: str | None = None
    #: The window's ping count as last returned to the owner (0: unknown). The
    #: owner's unconfirmed fire ran a trailing edge only if this count called for one.
    known_count: int = 0


@dataclass(slots=True)
class _Commit:
    """An at-least-once fire commit of this process: its fire record, then its
    tombstone, each a compare-and-swap. Each attempt has its own ids: a record taken
    back after a conflict leaves a delete marker that a second create would conflict
    with."""

    #: The window as the commit decided on it, and the time it fires at.
    window: WindowDoc
    #: The write id of its tombstone (and of its record, ``fire_id``).
    write: str
    fired_at: float
    fire_id: str
    #: Its tombstone was sent. Until then the commit cannot have landed, whatever
    #: became of its record (written, its answer lost).
    closing: bool = False
    #: Made by a ping that found the window full (``overflow="fire-early"``, a
    #: batch's ``max_bytes``): its reason says so.
    early: bool = False

    def reason(self) -> FireReason:
        """Why this commit fires (``_rules.fire_reason``): a lost commit proven later
        runs as its first attempt, with the reason it had, never ``"re-run"``."""
        return _rules.fire_reason(self.window, self.fired_at, early=self.early)

    def landed(self, doc: WindowDoc | None) -> bool | None:
        """``_rules.commit_landed`` for this commit on ``doc``: never True (not even
        "in doubt", a full ``after``) for a commit whose tombstone was not sent."""
        landed = _rules.commit_landed(doc, self.window.run_id, self.write)
        return landed if self.closing or landed is None else False


@dataclass(slots=True)
class _Unproven:
    """An at-least-once fire commit whose tombstone was sent and whose answer was lost,
    that no one ran: a taker's, or an owner's whose lease had lapsed (it must not fire
    unconfirmed). Proven and fired, or taken back, by the next finalize of its run or
    by ``adopt_orphans``."""

    workflow: str
    key: str
    commit: _Commit


class Finalizer:
    """Finalizes windows: decides whether a window fires now, commits its fire (a fire
    record first under at-least-once, then its tombstone, each a compare-and-swap),
    and proves or takes back a commit whose answer was lost. Also completes fire
    records, records the end of ``queue-latest`` runs, and applies what could not
    reach the store (:meth:`apply_queued`, with every lease renewal).

    Args:
      view: the store.
      leases: this process's lease.
      turns: the keys' turns to write (a finalize takes one).
      records: this process's fire records.
      me: this process in this opening.
      op_timeout: seconds a finalize may take, retries included.
      wall: the wall clock.
    """

    def __init__(
        self,
        view: StoreView,
        leases: ProcessLease,
        turns: KeyTurns,
        records: FireRecords,
        me: Identity,
        *,
        op_timeout: float,
        wall: Callable[[], float],
    ) -> None:
        self._view = view
        self._leases = leases
        self._turns = turns
        self._me = me
        self._op_timeout = op_timeout
        self._wall = wall
        self._records = records
        self._queued_deletes: dict[str, _QueuedDelete] = {}
        #: KV key -> the at-least-once commits of it whose answers were lost and that
        #: no one ran (see _Unproven).
        self._unproven: dict[str, list[_Unproven]] = {}
        #: Fire records to delete at the next heartbeat (if still this process's):
        #: those of queued deletes that a later one for the same key replaced, and
        #: leading fire records whose window was not opened (queue_record_delete).
        self._queued_record_deletes: set[str] = set()
        #: The end records of queue-latest runs that could not reach the store, by KV key.
        self._queued_end_runs: dict[str, str] = {}
        #: The at-most-once commits sent and not yet proven, and their proof.
        self._sent = SentCommits(view, leases, op_timeout=op_timeout, wall=wall)

    def queue_record_delete(self, fire_id: str) -> None:
        """Delete fire record ``fire_id`` at the next heartbeat (:meth:`apply_queued`),
        if it is still this process's then."""
        self._queued_record_deletes.add(fire_id)

    def sent_pending(self, kv_key: str, run_id: str) -> bool:
        """Is an at-most-once commit of ``run_id`` sent and not yet proven?"""
        return self._sent.pending(kv_key, run_id)

    def forget_sent(self, kv_key: str, run_id: str) -> None:
        """Nobody will prove the at-most-once commits sent for ``run_id``."""
        self._sent.forget(kv_key, run_id)

    async def finalize(
        self,
        workflow: str,
        key: str,
        run_id: str,
        *,
        take: bool = False,
        force: bool = False,
        delivery: Delivery = "at-least-once",
        early: bool = False,
        fire_at: float | None = None,
    ) -> Finalization:
        kv_key = window_key(workflow, key)
        try:
            async with self._turns.turn(kv_key):
                return await self.finalize_in_turn(
                    workflow, key, kv_key, run_id, take, force, delivery, early, fire_at=fire_at
                )
        except BackendUnavailableError:
            if delivery != "at-most-once" or not self._sent.pending(kv_key, run_id):
                raise
        # A commit sent, its answer lost: proven by re-reads outside the key's turn, so
        # that this process's pings of the key are not held up meanwhile.
        proven = await self._sent.prove_late(workflow, key, kv_key, run_id)
        if isinstance(proven, Finalization):
            return proven
        window, fired_at, token = proven
        return self._finalization(kv_key, window, fired_at, token, None)

    async def finalize_in_turn(
        self,
        workflow: str,
        key: str,
        kv_key: str,
        run_id: str,
        take: bool,
        force: bool,
        delivery: Delivery,
        early: bool,
        deadline: float = math.inf,
        read: tuple[int, WindowDoc | None] | None = None,
        fire_at: float | None = None,
    ) -> Finalization:
        """Finalize run ``run_id`` of ``kv_key`` while holding the key's turn.

        Decides on the document (re-read unless this process's cached revision is
        current, or ``read`` is given by the register that takes the fire): abandoned
        (not this run's or not ours), rescheduled (not due yet, or waiting for its
        key's ``queue-latest`` run), or fired, by a commit that leaves a tombstone
        (after a fire record under at-least-once). A commit of this run whose answer
        was lost is proven first. Bounded by ``op_timeout`` and ``deadline`` (Trio
        time); see :meth:`_give_up` for what a finalize cut short does.
        """
        error: BackendError | None = None
        if self._leases.taken_by is not None:
            # Fenced (a later coordinator took our process id): never fire on a window
            # remembered from before; the live coordinator adopts it as a dead one's.
            self._view.disown(kv_key, run_id)
            return Finalization(Finalized.ABANDONED)
        # The commit in flight, in case its answer is lost.
        committing: _Commit | None = None
        if delivery == "at-least-once":
            # A commit of this run whose answer was lost before: prove it first.
            committing = self._take_unproven(kv_key, run_id)
        fired_at = self._wall()
        #: Writes that conflicted in a row (see LEADER_READ_AFTER): the key moved past
        #: what we read, or the read came from a replica that lags.
        conflicts = 0
        with trio.move_on_at(min(trio.current_time() + self._op_timeout, deadline)):
            attempt = 0
            while True:
                try:
                    # Commit against the revision this process last read or wrote when
                    # it has one (the compare-and-swap proves it current); any other
                    # decision is made on a fresh read.
                    known = None if committing is not None else self._view.cached(kv_key)
                    if read is not None:
                        # The register that takes this fire has just read the document
                        # (a contended key is not cached): commit against that.
                        known, read = (read if committing is None else None), None
                    if known is not None:
                        revision, doc = known
                        if not _rules.would_commit(
                            doc, run_id, self._me, self._wall(), take=take, force=force, early=early
                        ):
                            known = None
                    if known is None:
                        # A lost commit is decided on the store's authority: a replica
                        # that lags may show the window as the commit found it.
                        current = committing is not None or conflicts >= LEADER_READ_AFTER
                        entry, revision, doc = await self._view.read(kv_key, current=current)
                        if current:
                            conflicts = 0
                        if delivery == "at-most-once":
                            proof = self._sent.proof(kv_key, run_id, entry, doc)
                            if proof is not None:
                                return self._finalization(kv_key, *proof, None, early)
                        if doc is None and not take:
                            self._view.note_deleted(
                                kv_key, entry, self._wall(), self._leases.seconds
                            )
                        elif not take:
                            self._view.note_cancelled(kv_key, doc)
                        if committing is not None:
                            proven = await self._reread_proof(
                                kv_key, entry, doc, committing, delivery
                            )
                            if proven is not None:
                                return proven
                            committing = None
                    if doc is None or doc.fired or doc.run_id != run_id:
                        self._view.disown(kv_key, run_id)
                        if doc is not None and doc.fired and doc.run_id == run_id:
                            self._view.note_run_closed(kv_key, run_id)  # its tombstone
                        return Finalization(Finalized.ABANDONED)
                    if not take and not self._me.owns(doc):
                        self._view.disown(kv_key, run_id)
                        return Finalization(Finalized.ABANDONED)
                    if not take:
                        self._view.own(kv_key, doc)
                    now = self._wall()
                    if doc.queue and doc.running is not None and not early:
                        blocked = await self._leases.run_blocks_until(doc.running, now)
                        if blocked is not None and (force or doc.at <= now):
                            # Due (or flushed) while its key's run blocks: it waits,
                            # and is looked at again when the run may have stopped.
                            if doc.at > now:
                                due = replace(doc, at=now, armed=now)
                                self._view.remember(
                                    kv_key,
                                    await self._view.put(kv_key, due.encode(), last=revision),
                                    due,
                                )
                            return Finalization(
                                Finalized.RESCHEDULE, blocked, doc.count, doc.first, doc.mode
                            )
                    if not force and doc.at > now:
                        if take:
                            if doc.at >= doc.armed:
                                return Finalization(Finalized.ABANDONED)  # the owner wakes
                            self._view.know_count(kv_key, run_id, doc.count)
                            return Finalization(
                                Finalized.RESCHEDULE, doc.at, doc.count, doc.first, doc.mode
                            )
                        if doc.armed != doc.at:
                            # Record when we wake, so a ping that moves the fire earlier
                            # than that knows to take it.
                            armed = replace(doc, armed=doc.at)
                            self._view.remember(
                                kv_key,
                                await self._view.put(kv_key, armed.encode(), last=revision),
                                armed,
                            )
                        self._view.know_count(kv_key, run_id, doc.count)
                        return Finalization(
                            Finalized.RESCHEDULE, doc.at, doc.count, doc.first, doc.mode
                        )
                    if not take and not self._leases.held():
                        # Paused past our own lease: a peer may have taken the window
                        # over. The compare-and-swap below would catch that, but renew
                        # first so that peers stop treating us as dead.
                        await self._leases.refresh(self.apply_queued)
                        self._view.forget(kv_key)
                        continue
                    # A queue-latest window may have waited for a run: one that timed
                    # out (at its `until`), or whose process died or whose end was
                    # recorded late (noticed now).
                    fired_at = _rules.fire_time(doc, now, force, fire_at)
                    write = uuid.uuid4().hex
                    fire_id = FIRE_PREFIX + write
                    committing = _Commit(doc, write, fired_at, fire_id, early=early)
                    # Both modes leave a tombstone naming this commit's write id (the
                    # sweeper removes it a lease later), so a commit whose answer was
                    # lost is proven by a read, never guessed from a gone window (a
                    # peer's fire would look the same).
                    tombstone = _rules.tombstone(doc, write, fired_at, self._me)
                    if delivery == "at-most-once":
                        self._sent.add(kv_key, run_id, write, doc, fired_at, revision)
                        revision = await self._view.put(kv_key, tombstone.encode(), last=revision)
                        self._sent.forget(kv_key, run_id)
                        self._view.remember(kv_key, revision, tombstone)
                        return self._finalization(
                            kv_key, doc, fired_at, self._view.token(revision), None, early
                        )
                    record = self._records.new(workflow, key, doc, fired_at, 1, write)
                    record_revision = await self._view.put(fire_id, record.encode(), last=0)
                    self._records.hold(fire_id, record_revision)
                    committing.closing = True
                    try:
                        closed = await self._view.close_window(kv_key, tombstone, revision)
                    except RevisionConflict:
                        # A ping landed after our read: take the record back, re-read.
                        await self._records.drop(fire_id)
                        raise
                    self._view.remember(kv_key, closed, tombstone)
                    # The token of the commit: the record's revision, later than every
                    # write of the window (its leading fire's included).
                    return self._finalization(
                        kv_key, doc, fired_at, self._view.token(record_revision), fire_id, early
                    )
                except RevisionConflict:
                    self._view.lost_race(kv_key)
                    committing = None
                    conflicts += 1
                except BackendUnavailableError as exc:
                    self._view.forget(kv_key)
                    error = exc
                await self._view.backoff(attempt)
                attempt += 1
        self._give_up(workflow, key, kv_key, run_id, take, delivery, fired_at, committing, error)

    def _give_up(
        self,
        workflow: str,
        key: str,
        kv_key: str,
        run_id: str,
        take: bool,
        delivery: Delivery,
        fired_at: float,
        committing: _Commit | None,
        error: BackendError | None,
    ) -> NoReturn:
        """A finalize that did not complete by its deadline: what it leaves behind (a
        lost commit to prove, a delete to apply once the store answers), and the error
        it raises. ``committing``: the commit in flight when the deadline came, if any.

        Raises:
          LeaseLapsedError: this process's lease lapsed meanwhile (an owner's finalize):
            the owner must not fire on its own view.
          BackendUnavailableError: otherwise; an owner fires unconfirmed (at-least-once).
        """
        if delivery == "at-most-once":
            # Not ours to delete at exit any more: the window stays in the store for
            # our reconcile (or, once we are gone, a peer) unless the fire committed.
            # A commit sent is proven by finalize() outside the key's turn.
            if not self._sent.pending(kv_key, run_id):
                self._view.disown(kv_key, run_id)
            raise BackendUnavailableError(
                f"finalize of {workflow!r}/{key!r} (run {run_id}) could not prove its fire "
                f"within {self._op_timeout} s" + (f": {error}" if error is not None else "")
            )
        lapsed = not take and not self._leases.held()
        told = self._view.known_counts.get(kv_key)
        known_count = told[1] if told is not None and told[0] == run_id else 0
        # A both-edges window that the owner knew with one ping: its unconfirmed fire
        # has no trailing edge, but the commit, if it landed, fired one (peers' pings
        # landed): that fire is the record's to run, not to delete.
        missed_trailing = (
            committing is not None
            and committing.window.mode is Mode.BOTH
            and known_count < 2 <= committing.window.count
        )
        unproven = committing is not None and (take or lapsed or missed_trailing)
        if committing is not None and unproven and committing.closing:
            # No one fires this commit now: it is proven (and fired) or taken back by
            # the next finalize of this run, or by the next adopt_orphans.
            self._unproven.setdefault(kv_key, []).append(_Unproven(workflow, key, committing))
        elif committing is not None and unproven:
            # Its tombstone was never sent, so it did not land: the window is still
            # open for its owner (or a taker) to fire. Its record goes with the next
            # heartbeat's deletes: decided later, under a full ``after``, it would pass
            # for a commit that landed and run the window a second time.
            self._queued_record_deletes.add(committing.fire_id)
        if lapsed:
            raise LeaseLapsedError(
                f"finalize of {workflow!r}/{key!r} (run {run_id}) did not complete within "
                f"{self._op_timeout} s and this process's lease has lapsed: not fired "
                "on its own view" + (f": {error}" if error is not None else "")
            )
        if not take:
            # The owner fires unconfirmed; once the store answers, delete the window
            # (unless pings landed since) and the fire record this call may have left
            # (unless it is the proof of a fire the unconfirmed one did not run).
            replaced = self._queued_deletes.get(kv_key)
            if replaced is not None and replaced.fire_id is not None:
                # Its record still goes, with the next heartbeat's deletes.
                self._queued_record_deletes.add(replaced.fire_id)
            self._queued_deletes[kv_key] = _QueuedDelete(
                kv_key,
                run_id,
                fired_at,
                committing.fire_id if committing is not None and not unproven else None,
                known_count,
            )
        raise BackendUnavailableError(
            f"finalize of {workflow!r}/{key!r} (run {run_id}) did not complete within "
            f"{self._op_timeout} s" + (f": {error}" if error is not None else "")
        )

    def _take_unproven(self, kv_key: str, run_id: str) -> _Commit | None:
        """Remove and return the lost commit of run ``run_id`` of ``kv_key``, if any."""
        pending = self._unproven.get(kv_key)
        if not pending:
            return None
        for i, unproven in enumerate(pending):
            if unproven.commit.window.run_id == run_id:
                del pending[i]
                if not pending:
                    del self._unproven[kv_key]
                return unproven.commit
        return None

    async def prove_lost_commits(self) -> list[OrphanFire]:
        """Decide the lost commits that no finalize proved since (see _Unproven): a
        fire whose record is still this process's and whose window is gone (or is our
        tombstone) committed, and is returned to be run (its first attempt); a window
        still open, or fired by another write, means it did not: the record is taken
        back. Skipped while our lease has lapsed (a peer may adopt the records)."""
        fires: list[OrphanFire] = []
        if not self._unproven or not self._leases.held():
            return fires
        for kv_key in list(self._unproven):
            # The key's turn: a finalize of it cannot commit between our two reads.
            async with self._turns.turn(kv_key):
                while self._unproven.get(kv_key):
                    unproven = self._unproven[kv_key].pop(0)
                    try:
                        fire = await _prove_one(self._view, self._records, kv_key, unproven)
                    except BaseException:
                        self._unproven.setdefault(kv_key, []).insert(0, unproven)
                        raise
                    if fire is not None:
                        fires.append(fire)
                if kv_key in self._unproven and not self._unproven[kv_key]:
                    del self._unproven[kv_key]
        return fires

    async def _reread_proof(
        self,
        kv_key: str,
        entry: KvEntry | None,
        doc: WindowDoc | None,
        committing: _Commit,
        delivery: Delivery,
    ) -> Finalization | None:
        """After a commit whose answer was lost: the fire, if the re-read proves it."""
        window, fire_id = committing.window, committing.fire_id
        if delivery == "at-most-once":
            # Proven by SentCommits.proof on the same read, if at all: never fire on a guess
            # (the caller decides again from the read; the write stays remembered).
            return None
        # at-least-once: our fire record decides (read from the store's authority).
        read = await self._records.read(fire_id, current=True)
        if read is None:
            return None  # the record never landed: start over
        record, mine = read
        if not self._records.own(mine):
            # A peer took us for dead and adopted the record: it runs the fire.
            return Finalization(Finalized.ABANDONED)
        self._records.hold(fire_id, record.revision)
        landed = committing.landed(doc)
        if landed is False:
            # The run was closed by another write (a peer took the fire; its tombstone
            # or a newer window's after names it, or the tombstone is gone): ours
            # never landed.
            await self._records.drop(fire_id)
            return None
        if landed is None:
            assert doc is not None  # the run's window, still open
            if doc.write != window.write:
                # A ping landed after our read, so our commit cannot have: take the
                # record back and decide again.
                await self._records.drop(fire_id)
                return None
            assert entry is not None
            self._view.forget(kv_key)
            tombstone = _rules.tombstone(window, committing.write, committing.fired_at, self._me)
            committing.closing = True
            try:  # the record landed, the window's commit did not: finish it
                closed = await self._view.close_window(kv_key, tombstone, entry.revision)
            except RevisionConflict:
                # The key moved since the read: perhaps the lost commit itself landed
                # only now (a server that held it). Decide again on a new read.
                entry = await self._view.get_current(kv_key)
                if committing.landed(self._view.parse(entry)) is not True:
                    await self._records.drop(fire_id)
                    return None
                self._view.forget(kv_key)
            else:
                self._view.remember(kv_key, closed, tombstone)
        token = self._view.token(record.revision)
        return self._finalization(
            kv_key, window, committing.fired_at, token, fire_id, committing.early
        )

    def _finalization(
        self,
        kv_key: str,
        doc: WindowDoc,
        fired_at: float,
        token: int,
        fire_id: str | None,
        early: bool = False,
    ) -> Finalization:
        """The fire of ``doc`` at ``fired_at``; ``early``: by a ping that found the
        window full (``overflow="fire-early"``, a batch's ``max_bytes``)."""
        self._view.disown(kv_key, doc.run_id)
        self._view.note_run_closed(kv_key, doc.run_id)
        mode, count, first = _flow_rules.fire_shape(doc)
        return Finalization(
            Finalized.FIRE,
            fired_at,
            count,
            first,
            mode,
            doc.last,
            _rules.load_payload(self._me.serializer, doc.payload),
            token,
            fire_id,
            doc.queue,
            doc.run_id,
            _rules.fire_reason(doc, fired_at, early=early),
        )

    async def end_run(self, workflow: str, key: str, run_id: str) -> str | None:
        kv_key = window_key(workflow, key)
        ended_at = self._wall()  # the run's end: a window that waited for it fires then
        self._leases.run_ended(run_id)
        try:
            with trio.move_on_after(self._op_timeout):
                # This process's pings of the key wait meanwhile (they would make the
                # compare-and-swap conflict).
                async with self._turns.turn(kv_key):
                    attempt = 0
                    while True:
                        try:
                            return await self._end_run(kv_key, run_id, ended_at)
                        except RevisionConflict:
                            self._view.lost_race(kv_key)
                        except BackendUnavailableError:
                            self._view.forget(kv_key)
                        await self._view.backoff(attempt)
                        attempt += 1
        except BackendError:
            self._view.forget(kv_key)
        # Retried by heartbeats; meanwhile peers see the run blocking until its
        # run_timeout or until they look again (see docs/protocol.rst).
        self._queued_end_runs[kv_key] = run_id
        logger.warning("could not record the end of run %s of %s; retrying", run_id, kv_key)
        return None

    async def _end_run(self, kv_key: str, run_id: str, ended_at: float) -> str | None:
        # Written against the remembered document when it names this run (the
        # compare-and-swap proves it current); any other decision on a fresh read.
        known = self._view.cached(kv_key)
        if known is None or not self._me.names_run(known[1], run_id):
            # From the store's authority: on a replica that lags, a window that names
            # the run may look as if it did not, and the end would never be written.
            _, revision, doc = await self._view.read(kv_key, current=True)
        else:
            revision, doc = known
        if doc is None or not self._me.names_run(doc, run_id):
            self._leases.run_end_recorded(run_id)
            return None
        # Kept, tombstone and all (the sweeper removes it a lease after its last ping):
        # a register whose opening write's answer was lost recognises its window by
        # it (deleted sooner, the window's run could be opened a second time).
        waiting = not doc.fired and doc.queue and doc.at <= ended_at
        # A window that waited for this run is due at the run's end (its fire time).
        ended = replace(doc, running=None, at=ended_at if waiting else doc.at)
        self._view.remember(kv_key, await self._view.close_window(kv_key, ended, revision), ended)
        self._leases.run_end_recorded(run_id)
        if waiting:
            return doc.run_id  # waiting for this run: it fires now
        return None

    async def apply_queued(self) -> None:
        """Apply deletes queued by finalizes that could not reach the store.

        Several calls may run at once (the heartbeat's, and those of finalizes that
        renew a lapsed lease): each entry is dropped only by the call that finds it
        still queued, and never when a newer finalize has queued another delete for
        the same key meanwhile."""
        for kv_key, queued in list(self._queued_deletes.items()):
            if self._queued_deletes.get(kv_key) is not queued:
                continue  # applied by a concurrent call, or replaced
            # From the store's authority: a replica that lags may not show the window
            # yet, and the delete would be dropped with the window still open.
            entry = await self._view.get_current(kv_key)
            doc = self._view.parse(entry)
            if (
                doc is not None
                and not doc.fired
                and doc.run_id == queued.run_id
                and self._me.owns(doc)
            ):
                assert entry is not None
                # A both-edges window that the owner knew with one ping had no
                # trailing fire; if peers' pings landed, it still needs one.
                missed_trailing = doc.mode is Mode.BOTH and queued.known_count < 2 <= doc.count
                if doc.last <= queued.fired_at and not missed_trailing:
                    self._view.forget(kv_key)
                    self._view.disown(kv_key, queued.run_id)  # our delete, not a foreign one
                    try:
                        await self._view.close_window(kv_key, doc.closed(), entry.revision)
                    except RevisionConflict:
                        continue  # a ping landed: try again next heartbeat
                    logger.info("applied the queued delete of %s (run %s)", kv_key, queued.run_id)
                # else: pings landed after the unconfirmed fire (or a trailing fire
                # was missed); the window stays and the owner's reconcile re-arms it,
                # so they are not lost.
            if queued.fire_id is not None:
                await self._records.delete_own(queued.fire_id)
            if self._queued_deletes.get(kv_key) is queued:
                del self._queued_deletes[kv_key]
        for fire_id in list(self._queued_record_deletes):
            await self._records.delete_own(fire_id)
            self._queued_record_deletes.discard(fire_id)
        await self._records.retry_completions()
        for kv_key, run_id in list(self._queued_end_runs.items()):
            # Read first: the heartbeat does not take the key's turn.
            self._view.forget(kv_key)
            try:
                # Recorded late: a window that waited for the run fires now.
                await self._end_run(kv_key, run_id, self._wall())
            except RevisionConflict:
                self._view.forget(kv_key)
                continue
            del self._queued_end_runs[kv_key]


async def _prove_one(
    view: StoreView, records: FireRecords, kv_key: str, unproven: _Unproven
) -> OrphanFire | None:
    """Decide one lost commit of this process (see Finalizer.prove_lost_commits): its
    fire to run if it landed; otherwise its record is taken back."""
    commit = unproven.commit
    # Both reads from the store's authority: on a replica that lags, a landed
    # commit's window may still look open, and its record absent.
    read = await records.read(commit.fire_id, current=True)
    if read is None:
        return None  # the record never landed (nor, then, the commit)
    entry, record = read
    if not records.own(record):
        return None  # a peer took us for dead and adopted it: it runs it
    doc = view.parse(await view.get_current(kv_key))
    if not commit.landed(doc):
        # Still open (its owner fires it), or closed by another write.
        with contextlib.suppress(RevisionConflict):
            await records.remove(commit.fire_id, entry.revision)
        return None
    records.hold(commit.fire_id, entry.revision)
    logger.info(
        "fire %s of %s (run %s) committed though its answer was lost; running it",
        commit.fire_id,
        kv_key,
        commit.window.run_id,
    )
    return records.orphan_fire(
        commit.fire_id, record, record.attempt, entry.revision, commit.reason()
    )
