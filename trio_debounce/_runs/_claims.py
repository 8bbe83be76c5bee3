"""The claim sweep: once per heartbeat interval (and when a peer's lease lapses), list
the runs due within the horizon, arm this process's own, claim by compare-and-swap
those of dead, fenced or released processes, and now and then purge old tombstones
and dead leases."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import trio

from .._errors import BackendError
from ._calls import Counters, StoreCalls
from ._delivery import ArmedRuns
from ._lease import RunLease
from ._store import Lease, RunState, StoredRun
from ._types import ACTIVE, RunHandler, RunOptions

logger = logging.getLogger("trio_debounce.runs")

#: Sweeps between two purges of old tombstones and dead leases.
PURGE_EVERY = 10
#: Tombstones and leases removed per purge, at most.
PURGE_BATCH = 500
#: Claims one sweep makes at once.
CLAIM_CONCURRENCY = 16


class ClaimSweep:
    """The claim sweep of one coordinator with a run store.

    Attributes:
      scope (trio.CancelScope): cancelled when the coordinator closes.
    """

    def __init__(
        self,
        *,
        call: StoreCalls,
        lease: RunLease,
        armed: ArmedRuns,
        handlers: Mapping[str, RunHandler],
        options: RunOptions,
        wall: Callable[[], float],
        stats: Counters,
    ) -> None:
        assert options.heartbeat_interval is not None
        self._call = call
        self._store = call.store
        self._lease = lease
        self._armed = armed
        self._handlers = handlers
        self._options = options
        self._interval: float = options.heartbeat_interval
        self._wall = wall
        self._stats = stats
        self.process_id = lease.process_id
        self.scope = trio.CancelScope()
        self._wake = trio.Event()

    def wake(self) -> None:
        """Sweep now (a workflow got a handler: its runs may be claimable)."""
        self._wake.set()

    async def run(self) -> None:
        """Sweep until :attr:`scope` is cancelled or the lease is fenced."""
        with self.scope:
            await self._sweep_forever()

    async def _sweep_forever(self) -> None:
        while not self._lease.fenced:
            wait = self._interval
            try:
                wait = min(wait, await self._sweep())
            except BackendError as exc:
                logger.warning("claim sweep of %r failed: %s", self.process_id, exc)
            except Exception:
                self._stats["store_errors"] += 1
                logger.exception("claim sweep of %r failed", self.process_id)
            with trio.move_on_after(max(wait, 0.0)):
                await self._wake.wait()
            self._wake = trio.Event()

    def _stopped(self) -> bool:
        return self._armed.closing or self._lease.fenced

    def _claimable(self, run: StoredRun, leases: Mapping[str, Lease], wall: float) -> bool:
        if run.owner is None:
            return True
        lease = leases.get(run.owner)
        if lease is None or lease.released or lease.epoch > run.epoch:
            return True
        if lease.draining and lease.epoch == run.epoch and run.state == RunState.PENDING:
            return True  # its owner is leaving and starts no run: never a started one
        return lease.expires_at + self._options.max_clock_skew < wall

    async def _sweep(self) -> float:
        """One claim sweep; returns the seconds until the next one is needed."""
        store = self._store
        sweep = self._armed.begin_sweep()
        wall = self._wall()
        leases = {
            lease.process_id: lease for lease in await self._call("list_leases", store.list_leases)
        }
        runs = await self._call(
            "list_runs",
            lambda: store.list_runs(states=ACTIVE, due_before=wall + self._options.horizon),
        )
        listed: set[str] = set()
        claimable: list[StoredRun] = []
        for run in runs:
            listed.add(run.run_id)
            if self._stopped():
                break
            if self._lease.owns(run):
                # Our own runs need no store call: armed at once, not after the
                # claims (a long list of claims must not hold them up).
                self._armed.arm_listed(run)
            elif run.workflow in self._handlers and self._claimable(run, leases, wall):
                claimable.append(run)
        if claimable:
            # The lease listing may come from an index fed by a watch that lags (a
            # slow consumer): a lease that looks expired or missing there may have
            # been renewed since. Each such owner's lease is read again before its
            # runs are claimed (one read per owner, not per run), so a live owner's
            # started run is never claimed and run twice.
            owners = {run.owner for run in claimable if run.owner is not None}
            for owner in owners:
                fresh = await self._call("get_lease", store.get_lease, owner)
                if fresh is None:
                    leases.pop(owner, None)
                else:
                    leases[owner] = fresh
            claimable = [run for run in claimable if self._claimable(run, leases, wall)]
        await self._claim_all(claimable)
        self._armed.disarm_unlisted(listed, sweep)
        if sweep % PURGE_EVERY == 1:
            await self._purge(leases, wall)
        # Wake when the next live peer's lease lapses (its runs become claimable).
        expiries = [
            lease.expires_at + self._options.max_clock_skew - wall
            for lease in leases.values()
            if lease.process_id != self.process_id and not lease.released
        ]
        upcoming = [e for e in expiries if e > 0]
        return min(upcoming, default=math.inf) + 0.01

    async def _claim_all(self, claimable: list[StoredRun]) -> None:
        """Claim ``claimable``, CLAIM_CONCURRENCY at a time, earliest due first, and
        arm each batch (in due order) as soon as it is claimed: one round trip after
        the other, a dead process's backlog held the sweep, and every run behind it,
        for seconds.

        Raises:
          BackendError: a claim failed (after its batch was armed).
        """
        for start in range(0, len(claimable), CLAIM_CONCURRENCY):
            if self._stopped():
                break
            batch = claimable[start : start + CLAIM_CONCURRENCY]
            results: list[StoredRun | None] = [None] * len(batch)
            failed: list[BackendError] = []
            async with trio.open_nursery() as claims:
                for i, run in enumerate(batch):
                    claims.start_soon(self._claim_into, run, results, i, failed)
            for claimed in results:
                if claimed is not None:
                    self._armed.arm_record(claimed)
            if failed:
                raise failed[0]

    async def _claim_into(
        self,
        run: StoredRun,
        results: list[StoredRun | None],
        i: int,
        failed: list[BackendError],
    ) -> None:
        """:meth:`_claim` as a task of a batch: the claimed record goes to
        ``results[i]``, a store failure to ``failed``."""
        try:
            results[i] = await self._claim(run)
        except BackendError as exc:
            failed.append(exc)

    async def _claim(self, run: StoredRun) -> StoredRun | None:
        lease = self._lease.lease
        assert lease is not None
        claimed = await self._call(
            "update_run",
            self._store.update_run,
            run.replace(owner=self.process_id, epoch=lease.epoch, token=run.token + 1),
        )
        if claimed is None:
            return None  # another process claimed or changed it first
        self._stats["taken_over"] += 1
        logger.info("process %r took over run %r from %r", self.process_id, run.run_id, run.owner)
        return claimed

    async def _purge(self, leases: Mapping[str, Lease], wall: float) -> None:
        """Remove up to PURGE_BATCH tombstones older than the retention, and the leases
        of other processes that expired more than the retention ago."""
        store = self._store
        old = await self._call(
            "list_runs",
            lambda: store.list_runs(
                states={RunState.DONE},
                finished_before=wall - self._options.retention,
                limit=PURGE_BATCH,
            ),
        )
        for run in old:
            await self._call("delete_run", store.delete_run, run.run_id, revision=run.revision)
        for lease in leases.values():
            if (
                lease.process_id != self.process_id
                and lease.expires_at + self._options.retention < wall
            ):
                await self._call(
                    "delete_lease",
                    store.delete_lease,
                    lease.process_id,
                    revision=lease.revision,
                )
