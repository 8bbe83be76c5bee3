"""A coordinator's lease on its run store: opened at start (after the twin watch),
renewed by the heartbeat, released at exit, fenced when another coordinator takes the
process id."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .._errors import BackendError
from .._process import Look, TwinWatch, taken_error
from ._calls import Counters, StoreCalls
from ._store import Lease, StoredRun
from ._types import RunOptions

logger = logging.getLogger("trio_debounce.runs")


class RunLease:
    """The lease of one process id on a run store: one coordinator's liveness.

    :meth:`open` writes the next epoch (after :meth:`wait_process_id_free`),
    :meth:`keep_alive` renews it every heartbeat interval until another coordinator
    takes the process id (:attr:`fenced`), and :meth:`release` lets peers take this
    one's runs over at once.

    Attributes:
      process_id (str): the process id.
      lease (Lease | None): the lease as last written (None until opened).
      fenced (bool): another coordinator took the process id: this one claims no
        more runs.
    """

    def __init__(
        self,
        call: StoreCalls,
        options: RunOptions,
        wall: Callable[[], float],
        stats: Counters,
    ) -> None:
        assert options.process_id is not None
        assert options.heartbeat_interval is not None
        self.process_id: str = options.process_id
        self._call = call
        self._store = call.store
        self._options = options
        self._interval: float = options.heartbeat_interval
        self._wall = wall
        self._stats = stats
        self.lease: Lease | None = None
        self.fenced = False
        #: The process id's lease was watched for a live twin (see _watch_live_lease).
        self._id_checked = False

    def owns(self, run: StoredRun) -> bool:
        """Whether ``run`` is claimed by this process id, in the current epoch."""
        lease = self.lease
        return lease is not None and run.owner == self.process_id and run.epoch == lease.epoch

    async def open(self) -> None:
        """Write the lease of the next epoch (fencing the previous incarnation).

        Raises:
          ProcessIdTakenError: a live coordinator holds the process id.
          BackendError: the store failed, or the write lost every time.
        """
        store = self._store
        await self.wait_process_id_free()
        for _ in range(20):
            old = await self._call("get_lease", store.get_lease, self.process_id)
            lease = Lease(
                self.process_id,
                (old.epoch + 1) if old is not None else 1,
                self._wall() + self._options.lease,
                revision=old.revision if old is not None else 0,
                heartbeat_interval=self._interval,
            )
            written = await self._call("put_lease", store.put_lease, lease)
            if written is not None:
                self.lease = written
                logger.debug("process %r opened epoch %d", self.process_id, written.epoch)
                return
        raise BackendError(f"could not open the lease of process {self.process_id!r}: contention")

    async def wait_process_id_free(self) -> None:
        """Before :meth:`open`: if the store holds a live lease of our process id, watch
        it for a renewal (see :meth:`_watch_live_lease`). Once per lease.

        Raises:
          ProcessIdTakenError: a live coordinator holds the process id.
          BackendError: the store failed a read.
        """
        if not self._id_checked:
            await self._watch_live_lease()
            self._id_checked = True
        await trio.lowlevel.checkpoint()

    async def _watch_live_lease(self) -> Lease | None:
        """Before the first lease write: if a live lease of our process id (an earlier
        epoch) is in the store, watch it for a renewal, for its holder's heartbeat
        interval (ours if it did not record one, capped at our lease) plus the skew
        margin. Returns the lease as last read (the epoch to bump).

        Raises:
          ProcessIdTakenError: it was renewed (its revision moved, or another epoch
            replaced it): a live coordinator holds the process id. Nothing written.
          BackendError: the store failed a read.
        """
        store = self._store
        options = self._options
        skew = options.max_clock_skew
        old = await self._call("get_lease", store.get_lease, self.process_id)
        wall, now = self._wall(), trio.current_time()
        if old is None or old.released or old.expires_at + skew < wall:
            return old
        # A live twin, or a predecessor that crashed (or stalls) before its lease
        # lapsed: only a renewal tells them apart.
        watch = TwinWatch.start(
            epoch=str(old.epoch),
            revision=old.revision,
            expires=old.expires_at,
            heartbeat=old.heartbeat_interval,
            own_heartbeat=self._interval,
            lease=options.lease,
            skew=skew,
            wall_now=wall,
            trio_now=now,
        )
        logger.info(
            "process id %r: the run lease of epoch %d is live; watching it for %.3g s for a "
            "renewal before this coordinator starts",
            self.process_id,
            old.epoch,
            watch.until - now,
        )
        while True:
            await trio.sleep_until(watch.next_look(trio.current_time()))
            current = await self._call("get_lease", store.get_lease, self.process_id)
            if current is None or current.released:
                return current  # left meanwhile: free
            look = watch.look(
                revision=current.revision, expires=current.expires_at, now=trio.current_time()
            )
            if look is Look.RENEWED:
                logger.error(
                    "process id %r is held by a live coordinator (run lease epoch %d was "
                    "renewed): this one is refused; two live coordinators must never share "
                    "a process id",
                    self.process_id,
                    current.epoch,
                )
                raise taken_error(self.process_id, f"run lease epoch {current.epoch}", "this one")
            if look is Look.OVER:
                logger.warning(
                    "process id %r: the run lease of epoch %d was not renewed for %.3g s; "
                    "taking the process id over (that coordinator crashed or stalls; if it "
                    "resumes, it is fenced at its next heartbeat)",
                    self.process_id,
                    current.epoch,
                    watch.until - now,
                )
                return current

    async def mark_draining(self) -> None:
        """At the start of a normal exit: mark the lease *draining* (one write, within
        ``op_timeout``), so peers claim this process's pending runs at their next sweep
        while it waits for its running handlers; the heartbeat keeps renewing it,
        draining, until :meth:`release`. A failure is logged: peers then wait for the
        release, as before the mark existed."""
        lease = self.lease
        if lease is None or self.fenced or lease.draining:
            return
        try:
            with trio.move_on_after(self._options.op_timeout):
                written = await self._store.put_lease(lease.replace(draining=True))
                if written is not None:
                    self.lease = written
                    logger.debug("process %r is draining", self.process_id)
                    return
        except BackendError as exc:
            logger.warning(
                "could not mark the lease of %r draining (%s): peers take its pending runs "
                "over once it is released",
                self.process_id,
                exc,
            )
            return
        logger.info(
            "the draining mark of %r did not land (the heartbeat's write came first, or "
            "the store was slow): peers take its pending runs over once it is released",
            self.process_id,
        )

    async def release(self) -> None:
        """Mark the lease released, within ``op_timeout``; a failure is logged (peers
        then take the runs over when the lease lapses). Nothing to do if the lease was
        never opened, or was fenced."""
        lease = self.lease
        if lease is None or self.fenced:
            return
        try:
            with trio.move_on_after(self._options.op_timeout):
                if await self._store.put_lease(lease.replace(released=True)) is None:
                    current = await self._store.get_lease(self.process_id)
                    if current is not None and current.epoch == lease.epoch:
                        await self._store.put_lease(current.replace(released=True))
        except BackendError as exc:
            logger.warning(
                "could not release the lease of %r (%s): peers take its runs over when it lapses",
                self.process_id,
                exc,
            )

    async def keep_alive(self) -> None:
        """Renew the lease every heartbeat interval; failures are logged and retried at
        the next beat. Returns once :attr:`fenced` (the caller stops its runs)."""
        while True:
            await trio.sleep(self._interval)
            try:
                await self._heartbeat()
            except BackendError as exc:
                logger.warning("heartbeat of %r failed: %s", self.process_id, exc)
            except Exception:
                # A store implementation's bug must not take the coordinator down.
                self._stats["store_errors"] += 1
                logger.exception("heartbeat of %r failed", self.process_id)
            if self.fenced:
                return

    async def _heartbeat(self) -> None:
        assert self.lease is not None
        lease = self.lease
        renewed = lease.replace(expires_at=self._wall() + self._options.lease)
        written = await self._call("put_lease", self._store.put_lease, renewed)
        if written is None:
            current = await self._call("get_lease", self._store.get_lease, self.process_id)
            if current is not None and current.epoch == lease.epoch and not current.released:
                # Our last write landed but its answer was lost: adopt its revision.
                written = await self._call(
                    "put_lease",
                    self._store.put_lease,
                    renewed.replace(revision=current.revision),
                )
            if written is None:
                self._fence(current)
                return
        self.lease = written
        self._stats["heartbeats"] += 1

    def _fence(self, current: Lease | None) -> None:
        logger.error(
            "process id %r was taken by another coordinator (lease now %r): this one stops "
            "claiming runs",
            self.process_id,
            current,
        )
        self.fenced = True
