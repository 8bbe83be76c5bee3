"""This process's lease (``p.<process>``), the table of its peers' leases, and the
watch for a live twin: another coordinator that uses our process id."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Awaitable, Callable

import trio

from .._errors import BackendError, BackendUnavailableError, ProcessIdTakenError, RevisionConflict
from .._events import LeaseLapsed, LeaseRenewed
from .._keys import process_key
from .._kv import KvEntry
from .._process import Look, TwinWatch, taken_error
from ._documents import LEASE_PREFIX, Lease, RunMarker, WindowDoc, decode_lease, encode_lease
from ._rules import Identity
from ._view import StoreView

logger = logging.getLogger("trio_debounce.backend")


async def read_leases(view: StoreView) -> dict[str, Lease]:
    """Every readable process lease of the store, by process id (a lease stored under
    another process's key is skipped: it is evidence of neither)."""
    table: dict[str, Lease] = {}
    for entry in await view.entries(LEASE_PREFIX):
        if entry.value is None:
            continue
        try:
            lease = decode_lease(entry.value)
        except (ValueError, KeyError, TypeError):
            continue
        if entry.key != process_key(lease.process):
            continue
        table[lease.process] = lease
    return table


class ProcessLease:
    """This process's lease and what it knows of its peers' (the lease table).

    A process is live while its lease has not expired, give or take ``skew``. Before
    its first lease write, an opening watches a live lease of another epoch of its
    process id for a renewal: a renewed one is a live twin, and this opening is
    refused (:exc:`ProcessIdTakenError`). Once a later coordinator has taken the
    process id, this one is fenced: :meth:`check_not_taken` raises.

    Args:
      view: the store.
      me: this process in this opening.
      seconds: how long the lease lasts unrenewed.
      skew: the largest wall-clock difference between hosts, seconds.
      wall: the wall clock.
    """

    def __init__(
        self,
        view: StoreView,
        me: Identity,
        *,
        seconds: float,
        skew: float,
        wall: Callable[[], float],
    ) -> None:
        self._view = view
        self._me = me
        self._seconds = seconds
        self._skew = skew
        self._wall = wall
        self._process_key = process_key(me.process_id)
        #: The revision of our lease as last written (0: not written yet).
        self.revision = 0
        #: Wall time our lease expires at, as last written.
        self.expires = -math.inf
        #: process id -> its lease as last read (the local lease table).
        self.table: dict[str, Lease] = {}
        #: (process, epoch) of the leases that were live at the last reload.
        self._live_at_last_look: set[tuple[str, str]] = set()
        self._seen_released: set[tuple[str, str]] = set()
        self._seen_draining: set[tuple[str, str]] = set()
        #: This process is leaving by a hand-off and waits for its running handlers:
        #: every lease write says so (see write_draining).
        self.draining = False
        #: The expiry of the last lapse reported as a LeaseLapsed (once per lapse).
        self._lapse_noted = -math.inf
        #: The lease of the coordinator that took our process id (we are fenced).
        self.taken_by: Lease | None = None
        #: The lease of another epoch of our process id that our first write replaced:
        #: until it lapses, that coordinator may still run a fire (a stalled holder is
        #: fenced only at its next heartbeat), so its fire records are not adopted.
        self.replaced: Lease | None = None
        #: Before this opening's first lease write: the live lease of another epoch
        #: of our process id being watched for a renewal (a live twin), if any.
        self._twin_watch: TwinWatch | None = None
        #: The process id was found free (no live lease of another epoch, or one not
        #: renewed for its holder's heartbeat interval plus the skew margin).
        self._id_cleared = False
        #: One lease refresh at a time: concurrent ones (the heartbeat and finalizes
        #: after a stall) would lose compare-and-swaps to each other.
        self._lock = trio.Lock()
        #: Lease writes that landed; deaths found by refreshes not yet returned.
        self._writes = 0
        self._dead_unreported: set[str] = set()
        #: queue-latest runs of this process whose handlers returned, while their end
        #: is not yet recorded in the store: they block nothing here.
        self._ended_runs: set[str] = set()

    @property
    def heartbeat_interval(self) -> float:
        return self._seconds / 3

    def run_ended(self, run_id: str) -> None:
        """This process's ``queue-latest`` run ``run_id`` returned: it blocks nothing
        here, while its end is not yet recorded in the store."""
        self._ended_runs.add(run_id)

    def run_end_recorded(self, run_id: str) -> None:
        """The end of run ``run_id`` is in the store (or nothing there names it)."""
        self._ended_runs.discard(run_id)

    @property
    def seconds(self) -> float:
        """The process lease, seconds."""
        return self._seconds

    @property
    def skew(self) -> float:
        """The tolerated wall-clock difference between hosts, seconds."""
        return self._skew

    async def owner_live(self, doc: WindowDoc, now: float) -> bool:
        """Is the document's owner process live, and keeping its windows (not draining:
        a process leaving by a hand-off gives them up at once)? Known live owners cost
        no request."""
        if not await self.live(doc.owner, doc.epoch, now):
            return False
        if doc.owner == self._me.process_id and doc.epoch == self._me.epoch:
            return not self.draining
        lease = self.table.get(doc.owner)
        return lease is None or not lease.draining

    async def live(self, owner: str, epoch: str, now: float) -> bool:
        """Is process ``owner`` in its opening ``epoch`` live, by its lease?"""
        if owner == self._me.process_id and epoch == self._me.epoch:
            return True
        lease = self.table.get(owner)
        if lease is not None and lease.epoch == epoch and lease.live(now, self._skew):
            return True
        # Unknown, another epoch, or expired in the table: read the lease itself, from
        # the store's authority. The table and a plain get may come from a replica that
        # lags (docs/protocol.rst, "Stale reads"): a lease that looks lapsed there may
        # have been renewed, and counting its process dead would take its windows over.
        entry: KvEntry | None = await self._view.get_current(process_key(owner))
        lease = None
        if entry is not None and entry.value is not None:
            try:
                lease = decode_lease(entry.value)
            except (ValueError, KeyError, TypeError):
                logger.warning("lease %s is unreadable; its process counts as dead", entry.key)
        if lease is None:
            self.table.pop(owner, None)
            return False
        self.table[owner] = lease
        return lease.epoch == epoch and lease.live(now, self._skew)

    def held(self) -> bool:
        """Is this process's own lease still live, by its own clock, with the skew
        margin? If not, a peer may have taken its windows over."""
        return self.taken_by is None and self._wall() < self.expires - self._skew

    def check_not_taken(self) -> None:
        """Raise :exc:`ProcessIdTakenError` once another coordinator took our id."""
        if self.taken_by is not None:
            raise ProcessIdTakenError(
                f"process id {self._me.process_id!r} was taken by another coordinator "
                f"(epoch {self.taken_by.epoch}); this one (epoch {self._me.epoch}) is fenced: "
                f"two live coordinators must never share a process id"
            )

    def _foreign(self, entry: KvEntry | None) -> Lease | None:
        """The lease in ``entry`` if it is another epoch's (of our process id)."""
        if entry is None or entry.value is None:
            return None
        try:
            lease = decode_lease(entry.value)
        except (ValueError, KeyError, TypeError):
            return None
        return lease if lease.epoch != self._me.epoch else None

    async def _check_twin(self) -> bool:
        """Before this opening's first lease write: may it write now?

        True when the process id is free: no lease, a released or lapsed one, or a
        live one of another epoch that was not renewed while watched for its holder's
        heartbeat interval plus the skew margin (a crashed or stalled predecessor; a
        stalled one is fenced at its next heartbeat). False while the watch goes on
        (the first call starts it; each call re-reads the lease once).

        Raises:
          ProcessIdTakenError: the watched lease was renewed (its revision moved): a
            live coordinator holds the process id. Nothing was written; this backend
            stays fenced.
          BackendError: the store failed the read.
        """
        self.check_not_taken()
        if self._id_cleared:
            return True
        entry = await self._view.get(self._process_key)
        foreign = self._foreign(entry)
        wall = self._wall()
        now = trio.current_time()
        if entry is None or foreign is None or not foreign.live(wall, self._skew):
            self._twin_watch = None
            self._id_cleared = True
            return True
        watch = self._twin_watch
        if watch is None:
            # A live lease of another epoch: a live twin, or a predecessor that crashed
            # (or stalls) before its lease lapsed. Only a renewal tells them apart.
            self._twin_watch = watch = TwinWatch.start(
                epoch=foreign.epoch,
                revision=entry.revision,
                expires=foreign.expires,
                heartbeat=foreign.heartbeat,
                own_heartbeat=self.heartbeat_interval,
                lease=self._seconds,
                skew=self._skew,
                wall_now=wall,
                trio_now=now,
            )
            logger.info(
                "process id %r: the lease of epoch %s is live; watching it for %.3g s for "
                "a renewal before this opening (epoch %s) starts",
                self._me.process_id,
                foreign.epoch,
                watch.until - now,
                self._me.epoch,
            )
            return False
        look = watch.look(revision=entry.revision, expires=foreign.expires, now=now)
        if look is Look.RENEWED:
            self._twin_watch = None
            self.taken_by = foreign
            logger.error(
                "process id %r is held by a live coordinator (epoch %s renewed its lease): "
                "this one (epoch %s) is refused; two live coordinators must never share a "
                "process id",
                self._me.process_id,
                foreign.epoch,
                self._me.epoch,
            )
            raise taken_error(
                self._me.process_id, f"epoch {foreign.epoch}", f"this one (epoch {self._me.epoch})"
            )
        if look is Look.WATCHING:
            return False
        logger.warning(
            "process id %r: the lease of epoch %s was not renewed while watched; taking the "
            "process id over (that coordinator crashed or stalls; if it resumes, it is "
            "fenced at its next heartbeat)",
            self._me.process_id,
            watch.epoch,
        )
        self._twin_watch = None
        self._id_cleared = True
        return True

    async def wait_process_id_free(self) -> None:
        self.check_not_taken()
        while not await self._check_twin():
            watch = self._twin_watch
            assert watch is not None
            await trio.sleep_until(watch.next_look(trio.current_time()))
        await trio.lowlevel.checkpoint()

    async def refresh(self, apply_queued: Callable[[], Awaitable[None]]) -> set[str]:
        self.check_not_taken()
        seen = self._writes
        async with self._lock:
            if self._writes != seen and self.held():
                # Renewed by another caller while this one waited: that is enough.
                dead, self._dead_unreported = self._dead_unreported, set()
                return dead
            self._note_lapse()  # (nothing without an event hook)
            try:
                self._dead_unreported |= await self._write(apply_queued)
            except BaseException:
                self._note_lapse()
                raise
            dead, self._dead_unreported = self._dead_unreported, set()
            return dead

    def _note_lapse(self) -> None:
        """Report a lapse of our lease (once per lapse): it no longer counts as held
        (its expiry, less the skew margin, has passed by our clock)."""
        hook = self._view.on_event
        held_until = self.expires - self._skew
        if hook is None or not math.isfinite(held_until) or self._lapse_noted == self.expires:
            return
        overdue = self._wall() - held_until
        if overdue >= 0:
            self._lapse_noted = self.expires
            hook(LeaseLapsed(trio.current_time(), overdue))

    async def _write(self, apply_queued: Callable[[], Awaitable[None]]) -> set[str]:
        """Write our lease (see :meth:`refresh`); holds ``_lock``."""
        self.check_not_taken()
        if not math.isfinite(self.expires) and not await self._check_twin():
            # Never written in this opening, and a live lease of another epoch is being
            # watched (the start could not wait: the store did not answer then).
            assert self._twin_watch is not None
            raise BackendUnavailableError(
                f"process id {self._me.process_id!r}: the live lease of epoch "
                f"{self._twin_watch.epoch} is watched for a renewal for "
                f"{max(self._twin_watch.until - trio.current_time(), 0.0):.3g} s more "
                f"before this opening writes its own"
            )
        now = self._wall()
        lease = Lease(
            self._me.process_id,
            self._me.epoch,
            now + self._seconds,
            heartbeat=self.heartbeat_interval,
            draining=self.draining,
            seconds=self._seconds,
        )
        value = encode_lease(lease)
        for attempt in range(5):
            try:
                self.revision = await self._view.put(self._process_key, value, last=self.revision)
                break
            except RevisionConflict:
                # Swept (absent), our own write whose answer was lost, or another
                # epoch's lease: a predecessor's (before our first write landed) or,
                # once one had, a later coordinator started with our id: we are fenced.
                entry = await self._view.get(self._process_key)
                foreign = self._foreign(entry)
                if foreign is not None and math.isfinite(self.expires):
                    self.taken_by = foreign
                    logger.error(
                        "process id %r was taken by another coordinator (epoch %s): this "
                        "one (epoch %s) is fenced and refuses pings; two live coordinators "
                        "must never share a process id",
                        self._me.process_id,
                        foreign.epoch,
                        self._me.epoch,
                    )
                    self.check_not_taken()
                if foreign is not None and (
                    self.replaced is None or foreign.expires > self.replaced.expires
                ):
                    self.replaced = foreign
                if foreign is not None and foreign.live(now, self._skew):
                    logger.warning(
                        "process id %r: replacing the live lease of epoch %s (a restart "
                        "before its lease lapsed; if that coordinator still runs, it is "
                        "fenced at its next heartbeat)",
                        self._me.process_id,
                        foreign.epoch,
                    )
                self.revision = 0 if entry is None else entry.revision
                await self._view.backoff(attempt)
        else:
            raise BackendError(f"could not renew the lease of process {self._me.process_id!r}")
        self.expires = lease.expires
        self._writes += 1
        if self._view.on_event is not None:
            self._view.on_event(LeaseRenewed(trio.current_time(), self._seconds, lease.draining))
        dead = await self._reload()
        self.table[self._me.process_id] = lease
        await apply_queued()
        return dead

    async def _reload(self) -> set[str]:
        """Re-read every process lease into the local table.

        Returns the processes that were live in the previous table and are now gone or
        lapsed (beyond the skew).
        """
        now = self._wall()
        table = await read_leases(self._view)
        live = {
            (lease.process, lease.epoch) for lease in table.values() if lease.live(now, self._skew)
        }
        released = {(lease.process, lease.epoch) for lease in table.values() if lease.released}
        draining = {(lease.process, lease.epoch) for lease in table.values() if lease.draining}
        # Dead since the last look: lapsed or gone, or handed off (a process may have
        # come and gone between two looks: its released lease still says so), or
        # draining (its windows are for peers now).
        dead = {
            process
            for process, _ in (self._live_at_last_look - live)
            | (released - self._seen_released)
            | (draining - self._seen_draining)
        }
        self._live_at_last_look = live
        self._seen_released = released
        self._seen_draining = draining
        self.table = table
        return dead

    async def run_blocks_until(self, marker: RunMarker, now: float) -> float | None:
        """Until when (wall clock) the ``queue-latest`` run ``marker`` surely blocks its
        key's next fire: its ``until``, or its process's lease expiry (plus the skew)
        if that comes first, when it is looked at again; None if it blocks no more
        (timed out, or its process is dead)."""
        if marker.until is not None and now >= marker.until:
            return None
        mine = marker.process == self._me.process_id and marker.epoch == self._me.epoch
        if mine and marker.run_id in self._ended_runs:
            return None
        if not await self.live(marker.process, marker.epoch, now):
            return None
        if marker.process == self._me.process_id and marker.epoch == self._me.epoch:
            expires = self.expires
        else:
            lease = self.table.get(marker.process)
            expires = now if lease is None else lease.expires
        # A live runner renews its lease every heartbeat: look no sooner than that.
        look = max(expires + self._skew, now + self.heartbeat_interval)
        return look if marker.until is None else min(marker.until, look)

    async def write_draining(self, apply_queued: Callable[[], Awaitable[None]]) -> None:
        """Mark our lease *draining* (a renewal that says so; every later renewal says
        so too): peers take this process's windows over at their next heartbeat, while
        it waits for its running handlers; its fire records and queue-latest runs stay
        its own."""
        self.draining = True
        async with self._lock:
            self._dead_unreported |= await self._write(apply_queued)

    async def write_released(self) -> None:
        """Mark our lease released (not deleted), so that peers see the hand-off at
        their next look even if they never saw this process alive; the sweeper deletes
        it ten leases later. A conflict is ignored: the lease is no longer ours."""
        lease = Lease(
            self._me.process_id,
            self._me.epoch,
            self._wall(),
            released=True,
            heartbeat=self.heartbeat_interval,
        )
        with contextlib.suppress(RevisionConflict):
            await self._view.put(self._process_key, encode_lease(lease), last=self.revision)

    async def delete(self) -> None:
        """Delete our lease, if one was written (a conflict: it is no longer ours)."""
        if self.revision:
            with contextlib.suppress(RevisionConflict):
                await self._view.delete(self._process_key, last=self.revision)
