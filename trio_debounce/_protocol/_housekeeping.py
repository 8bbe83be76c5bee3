"""Upkeep and the whole-process steps: the sweeper, adoption of a dead process's
windows and fire records, cancel, status, and the two ways out (hand-off, release)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Collection
from dataclasses import replace

import trio

from .._backend import Orphans, OwnedWindow, WindowStatus
from .._errors import BackendError, BackendUnavailableError, RevisionConflict
from .._events import LeadingReRunSkipped
from .._keys import parse_window_key, window_key
from .._kv import KvEntry
from . import _rules
from ._control import window_status
from ._documents import (
    FIRE_PREFIX,
    LEASE_PREFIX,
    SWEEPER_KEY,
    WINDOW_KEY_PREFIX,
    FireRecord,
    Lease,
    WindowDoc,
    decode_lease,
    encode_lease,
)
from ._finalize import Finalizer
from ._leases import ProcessLease
from ._records import FireRecords
from ._rules import Identity
from ._view import StoreView

logger = logging.getLogger("trio_debounce.backend")

#: A tombstone that keeps a key's last fired order key (for ``drop_stale``) is swept
#: this many process leases after the key's last ping.
_ORDER_LEASES = 10


class Housekeeping:
    """The steps that look at the whole store, or end this process's part in it.

    Args:
      view: the store.
      leases: this process's lease and the lease table.
      records: this process's fire records.
      finalizer: proves lost commits and applies queued deletes.
      me: this process in this opening.
      op_timeout: seconds a cancel, hand-off or release may take.
      lease_seconds: how long a process lease lasts unrenewed.
      skew: the largest wall-clock difference between hosts, seconds.
      wall: the wall clock.
    """

    def __init__(
        self,
        view: StoreView,
        leases: ProcessLease,
        records: FireRecords,
        finalizer: Finalizer,
        me: Identity,
        *,
        op_timeout: float,
        lease_seconds: float,
        skew: float,
        wall: Callable[[], float],
    ) -> None:
        self._view = view
        self._leases = leases
        self._records = records
        self._finalizer = finalizer
        self._me = me
        self._op_timeout = op_timeout
        self._lease_seconds = lease_seconds
        self._skew = skew
        self._wall = wall
        self._released = False
        # Counters, see KvDebounceBackend.
        self.takeovers = 0
        self.adopted_fires = 0
        #: Leading fire records of dead processes not run again: a later fire of their
        #: key had committed (see _rules.leading_refire).
        self.skipped_refires = 0

    async def cancel(self, workflow: str, key: str) -> bool:
        kv_key = window_key(workflow, key)
        with trio.move_on_after(self._op_timeout):
            attempt = 0
            while True:
                entry = await self._view.get(kv_key)
                doc = self._view.parse(entry)
                if entry is None or entry.value is None or (doc is not None and doc.fired):
                    return False
                self._view.forget(kv_key)
                # Ours to delete: a read racing this write must not take it for a
                # foreign delete of a window this process owns.
                owned_run = self._view.owned.get(kv_key)
                if owned_run is not None:
                    self._view.disown(kv_key, owned_run)
                try:
                    tombstone = None if doc is None else doc.cancel_tombstone()
                    await self._view.close_window(kv_key, tombstone, entry.revision)
                except RevisionConflict:
                    self._view.lost_race(None)
                    await self._view.backoff(attempt)
                    attempt += 1
                    continue
                return True
        raise BackendUnavailableError(
            f"cancel of {workflow!r}/{key!r} did not complete within {self._op_timeout} s"
        )

    async def owned_windows(self) -> list[OwnedWindow]:
        owned = []
        for entry in await self._view.entries(WINDOW_KEY_PREFIX):
            doc = self._view.parse(entry)
            if doc is None or doc.fired or not self._me.owns(doc):
                continue
            try:
                workflow, key = parse_window_key(entry.key)
            except ValueError:
                continue
            self._view.own(entry.key, doc)
            self._view.remember(entry.key, entry.revision, doc)
            owned.append(
                OwnedWindow(workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count)
            )
        return owned

    async def _delete_late_opening(self, kv_key: str, doc: WindowDoc, revision: int) -> None:
        """Delete (revision-checked) a second window of a run that a late create of
        this process opened once its key was empty again: its pings were written
        again and fired. A ping written into it since changes its revision: it is then
        kept, and fires (so that ping is not lost). The note stays (until the horizon):
        another write of the same batch may land late too."""
        logger.warning(
            "window %s (run %s) was opened again by a write of this process that landed "
            "late (its pings were written again); deleting it",
            kv_key,
            doc.run_id,
        )
        with contextlib.suppress(RevisionConflict):
            await self._view.close_window(kv_key, None, revision)

    async def _proves_a_record(self, doc: WindowDoc) -> bool:
        """Does a fire record whose commit tombstone ``doc`` proves (its own write's, or
        one in its ``after``) still exist? Read from the store's authority: a listing
        may come from a replica that lags, and sweeping the proof of a committed
        record would have it taken back (a lost fire)."""
        for write in (doc.write, *(proof_write for _, proof_write in doc.after)):
            entry = await self._view.get_current(FIRE_PREFIX + write)
            if entry is not None and entry.value is not None:
                return True
        return False

    async def sweep(self) -> int:
        now = self._wall()
        entry = await self._view.get(SWEEPER_KEY)
        holder: Lease | None = None
        if entry is not None and entry.value is not None:
            try:
                holder = decode_lease(entry.value)
            except (ValueError, KeyError, TypeError):
                holder = None
        if (
            holder is not None
            and holder.process != self._me.process_id
            and now <= holder.expires + self._skew
        ):
            return 0
        lock = Lease(self._me.process_id, self._me.epoch, now + 3 * self._lease_seconds)
        try:
            await self._view.put(
                SWEEPER_KEY,
                encode_lease(lock),
                last=0 if entry is None else entry.revision,
            )
        except RevisionConflict:
            return 0  # another process won the election
        removed = 0
        windows = await self._view.entries(WINDOW_KEY_PREFIX)
        # Listed after the windows: a record whose commit made a tombstone listed
        # above was written before it, so it is in this listing unless completed.
        records = await self._view.entries(FIRE_PREFIX)
        recorded = set()  # the window keys that fire records name
        for item in records:
            if item.value is not None:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    record = FireRecord.decode(item.value)
                    recorded.add(window_key(record.workflow, record.key))
        for item in windows:
            marker = item.revision if item.value is None else None
            if marker is None:
                doc = self._view.parse(item)
                if (
                    doc is None
                    or not doc.fired
                    or (doc.last if doc.cancelled else max(doc.last, doc.armed))
                    > now - self._lease_seconds
                ):
                    # Kept a lease past its last ping and its owner's wake time: the
                    # owner then finds the tombstone, never the key gone, so a key
                    # gone sooner was deleted by someone (StoreView.note_deleted). A
                    # cancel's tombstone only a lease past its last ping: an owner
                    # that wakes to find it gone counts the cancel all the same.
                    continue
                if (
                    doc.fired_order is not None
                    and doc.last > now - _ORDER_LEASES * self._lease_seconds
                ):
                    continue  # drop_stale still reads its last fired order key
                if doc.cool_until is not None and doc.cool_until > now:
                    continue  # a throttle's cool-down: the next ping reads it
                if item.key in recorded:
                    continue  # the proof that decides a fire record of the key
                if doc.running is not None and await self._leases.run_blocks_until(
                    doc.running, now
                ):
                    continue  # its run still blocks the key
                if await self._proves_a_record(doc):
                    # The same, for a record the listing missed: kept until the record
                    # is completed or taken back. Last: up to five leader reads.
                    continue
                # An at-most-once tombstone a lease old: its proof is no longer needed.
                self._view.forget(item.key)
                try:
                    marker = await self._view.delete(item.key, last=item.revision)
                except RevisionConflict:
                    continue
            known = self._view.known(item.key)
            if known is not None and known[0] == marker:
                self._view.forget(item.key)  # purged: the key is created anew
            if await self._view.purge_marker(item.key, revision=marker):
                removed += 1
        for item in records:
            if item.value is None and await self._view.purge_marker(
                item.key, revision=item.revision
            ):
                removed += 1
        # A lease that expired long ago (ten leases) belongs to a dead process.
        grave = now - 10 * self._lease_seconds - self._skew
        for item in await self._view.entries(LEASE_PREFIX):
            if item.value is None:
                if await self._view.purge_marker(item.key, revision=item.revision):
                    removed += 1
                continue
            try:
                lease = decode_lease(item.value)
            except (ValueError, KeyError, TypeError):
                continue
            if lease.expires < grave:
                try:
                    marker = await self._view.delete(item.key, last=item.revision)
                except RevisionConflict:
                    continue
                if await self._view.purge_marker(item.key, revision=marker):
                    removed += 1
                self._leases.table.pop(lease.process, None)
        return removed

    async def _note_deleted(self, listing: list[KvEntry], now: float) -> None:
        """Owned windows that ``listing`` shows cancelled (a cancel's tombstone of their
        run) or gone (absent or a delete marker: each read again from the store's
        authority, since a listing may lag): note a foreign close (see
        StoreView.note_cancelled and note_deleted)."""
        listed = {entry.key: entry for entry in listing}
        for kv_key in list(self._view.owned):
            entry = listed.get(kv_key)
            if entry is not None and entry.value is not None:
                run_id = self._view.note_cancelled(kv_key, self._view.parse(entry))
                if run_id is not None:
                    self._view.disown(kv_key, run_id)
                continue
            entry = await self._view.get_current(kv_key)
            if self._view.note_deleted(kv_key, entry, now, self._lease_seconds) is not None:
                self._view.disown(kv_key, self._view.owned[kv_key])

    async def adopt_orphans(self, workflows: Collection[str]) -> Orphans:
        self._leases.check_not_taken()
        orphans = Orphans([], await self._finalizer.prove_lost_commits(), [])
        adopting = self._view.can_take_over()
        now = self._wall()
        listing = await self._view.entries(WINDOW_KEY_PREFIX)
        await self._note_deleted(listing, now)
        for entry in listing:
            doc = self._view.parse(entry)
            if doc is None or doc.fired:
                continue
            try:
                workflow, key = parse_window_key(entry.key)
            except ValueError:
                continue
            if self._me.owns(doc):
                if self._view.is_late_opening(entry.key, doc, now):
                    await self._delete_late_opening(entry.key, doc, entry.revision)
                    continue
                self._view.own(entry.key, doc)
                self._view.remember(entry.key, entry.revision, doc)
                orphans.owned.append(
                    OwnedWindow(workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count)
                )
                continue
            if not adopting or workflow not in workflows or await self._leases.owner_live(doc, now):
                continue
            # The owner died with the window open: take it over as it is (no ping).
            new = replace(
                doc,
                owner=self._me.process_id,
                epoch=self._me.epoch,
                armed=doc.at,
                write=uuid.uuid4().hex,
            )
            try:
                revision = await self._view.put(entry.key, new.encode(), last=entry.revision)
            except RevisionConflict:
                continue  # a peer adopted it, or a ping took it over
            self._view.remember(entry.key, revision, new)
            self.takeovers += 1
            self._view.own(entry.key, new)
            logger.info(
                "adopted window %s (run %s) of dead process %s", entry.key, doc.run_id, doc.owner
            )
            adopted_window = OwnedWindow(
                workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count
            )
            orphans.windows.append(adopted_window)
            orphans.owned.append(adopted_window)
        if not adopting:
            return orphans._replace(deferred=True)  # the grace after an outage
        for entry in await self._view.entries(FIRE_PREFIX):
            if entry.value is None:
                continue
            try:
                record = FireRecord.decode(entry.value)
            except (ValueError, KeyError, TypeError):
                logger.warning("fire record %s is unreadable; leaving it", entry.key)
                continue
            if record.workflow not in workflows or await self._leases.live(
                record.owner, record.epoch, now
            ):
                continue
            if (
                record.owner == self._me.process_id
                and self._leases.replaced is not None
                and self._leases.replaced.live(now, self._skew)
            ):
                # An earlier coordinator with our process id, whose lease we replaced,
                # may still be running this fire (a twin runs until its next heartbeat
                # fences it, and completes what it started): adopted once its lease
                # lapsed, as any process's, so a live twin's fire never runs twice.
                continue
            # Decided on the store's authority: a replica that lags may show a window
            # whose commit landed as still open, or not yet opened.
            window = self._view.parse(
                await self._view.get_current(window_key(record.workflow, record.key))
            )
            if record.leading and record.write is not None:
                refire = _rules.leading_refire(window, record.run_id, record.write)
                if refire is None:
                    self.skipped_refires += 1
                    if self._view.on_event is not None:
                        self._view.on_event(
                            LeadingReRunSkipped(
                                record.workflow, record.key, record.run_id, trio.current_time()
                            )
                        )
                    logger.info(
                        "leading fire %s (run %s) of dead process %s is not run again: a "
                        "later fire of its key has committed",
                        entry.key,
                        record.run_id,
                        record.owner,
                    )
                if not refire:
                    with contextlib.suppress(RevisionConflict):
                        await self._records.remove(entry.key, entry.revision)
                    continue
            elif (
                window is not None
                and not window.fired
                and window.run_id == record.run_id
                and window.first == record.first
            ):
                # The owner died between writing the record and deleting the window:
                # the fire never committed, and the window (adopted, or to be) fires
                # it. Running the record too would run the burst twice.
                with contextlib.suppress(RevisionConflict):
                    await self._records.remove(entry.key, entry.revision)
                continue
            elif (
                record.write is not None
                and _rules.commit_landed(window, record.run_id, record.write) is False
            ):
                # The run's proof names another commit (a peer took the fire), or is
                # gone (see _rules.commit_landed): this record's commit never landed.
                with contextlib.suppress(RevisionConflict):
                    await self._records.remove(entry.key, entry.revision)
                continue
            adopted = replace(
                record, owner=self._me.process_id, epoch=self._me.epoch, attempt=record.attempt + 1
            )
            try:
                revision = await self._view.put(entry.key, adopted.encode(), last=entry.revision)
            except RevisionConflict:
                continue
            self.adopted_fires += 1
            self._records.hold(entry.key, revision)
            logger.info(
                "adopted interrupted fire %s (run %s, attempt %d) of dead process %s",
                entry.key,
                record.run_id,
                adopted.attempt,
                record.owner,
            )
            # The token: this attempt's commit, later than the first's.
            orphans.fires.append(
                self._records.orphan_fire(entry.key, record, adopted.attempt, revision)
            )
        return orphans

    async def window_status(self, workflow: str, key: str) -> WindowStatus | None:
        entry = await self._view.get(window_key(workflow, key))
        doc = self._view.parse(entry)
        if doc is None or doc.fired:
            return None
        assert entry is not None
        now = self._wall()
        waiting = (
            doc.queue
            and doc.running is not None
            and doc.at <= now
            and await self._leases.run_blocks_until(doc.running, now) is not None
        )
        owner_live = await self._leases.owner_live(doc, now)
        token = self._view.token(entry.revision)
        return window_status(doc, entry.revision, token, owner_live, waiting)

    async def mark_draining(self) -> None:
        await self._leases.write_draining(self._finalizer.apply_queued)

    async def handoff(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            with trio.move_on_after(self._op_timeout):
                await self._leases.write_released()
        except BackendError as exc:
            logger.warning(
                "hand-off could not mark the lease released (%s); peers take over %d "
                "windows once it lapses",
                exc,
                len(self._view.owned),
            )

    async def release(
        self, runs: Collection[str] | None = None, *, own_only: Collection[str] = ()
    ) -> frozenset[str]:
        deleted: set[str] = set()
        if self._released:
            return frozenset(deleted)
        self._released = True
        try:
            with trio.move_on_after(self._op_timeout) as scope:
                await self._finalizer.apply_queued()
                for kv_key, run_id in list(self._view.owned.items()):
                    only_own = run_id in own_only
                    if runs is not None and run_id not in runs and not only_own:
                        continue  # left for a peer to adopt once our lease is gone
                    entry = await self._view.get(kv_key)
                    doc = self._view.parse(entry)
                    if (
                        doc is not None
                        and not doc.fired
                        and doc.run_id == run_id
                        and self._me.owns(doc)
                    ):
                        assert entry is not None
                        peers_pings = doc.count - self._view.own_count(kv_key, run_id)
                        if only_own and peers_pings > 0:
                            # Peers' pings are in it: deleting it would lose them.
                            logger.info(
                                "release leaves %s (run %s) for a peer: %d of its %d "
                                "pings came from other processes",
                                kv_key,
                                run_id,
                                peers_pings,
                                doc.count,
                            )
                            continue
                        self._view.forget(kv_key)
                        self._view.disown(kv_key, run_id)  # our delete, not a foreign one
                        try:
                            await self._view.close_window(kv_key, doc.closed(), entry.revision)
                            deleted.add(run_id)
                        except RevisionConflict:
                            logger.warning("release of %s lost a race to another write", kv_key)
                    self._view.disown(kv_key, run_id)
                if self._view.owned:
                    # Windows left for peers: a released lease hands them off at the
                    # peers' next look (even a peer that never saw this process live).
                    await self._leases.write_released()
                else:
                    await self._leases.delete()
            if scope.cancelled_caught:
                logger.warning("release did not finish within %.3g s", self._op_timeout)
        except BackendError as exc:
            logger.warning(
                "release could not reach the backend (%s); %d windows stay until a ping "
                "takes them over",
                exc,
                len(self._view.owned),
            )
        return frozenset(deleted)
