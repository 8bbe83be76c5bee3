"""The cross-process debounce protocol over a revisioned key-value store.

:class:`KvDebounceBackend` implements :class:`~trio_debounce.abc.DebounceBackend` on
any :class:`~trio_debounce._kv.KvStore`: NATS JetStream KV in production, the
in-memory fake in tests. The rules are in :doc:`/protocol`; in short:

* One JSON document per window (``w.<workflow>.<key>``), one lease per process
  (``p.<process>``), one sweeper lock (``s.sweeper``).
* Every change is a compare-and-swap on the revision this process last read or wrote
  (remembered per key, so an owner's ping is one request); a conflict re-reads,
  re-applies the ping and retries with jittered backoff until the operation deadline.
* Pings of one key that arrive while its write is in flight are merged, in arrival
  order, into the next single write (group commit; ``_apply_ping`` applied per ping).
* A window is owned by a live process while that process's lease (read through a
  local table, so checking a known live owner costs no request) has not expired, give
  or take ``max_clock_skew``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from .. import _validate
from .._backend import (
    DebounceBackend,
    Delivery,
    Finalization,
    Finalized,
    OrphanFire,
    Orphans,
    OwnedWindow,
    Registered,
    Registration,
    WindowStatus,
)
from .._errors import (
    BackendError,
    BackendUnavailableError,
    DocumentTooLargeError,
    LeaseLapsedError,
    RevisionConflict,
)
from .._keys import parse_window_key, window_key
from .._kv import KvEntry, KvStore
from .._options import InitialFactory, Reducer
from .._payload import JsonSerializer, PayloadSerializer
from .._types import Mode
from . import _rules
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
from ._leases import ProcessLease
from ._rules import Ping
from ._view import KNOWN_LIMIT, StoreView

logger = logging.getLogger("trio_debounce.backend")

#: A tombstone that keeps a key's last fired order key (for ``drop_stale``) is swept
#: this many process leases after the key's last ping.
_ORDER_LEASES = 10
#: Looks at a live lease of our process id (another epoch) while it is watched for a
#: renewal at start, besides the first (the KV interface has no watch to wait on).
_TWIN_LOOKS = 4


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
class _Unproven:
    """An at-least-once fire commit whose answer was lost, that no one ran: a taker's,
    or an owner's whose lease had lapsed (it must not fire unconfirmed). Proven and
    fired, or taken back, by the next finalize of its run or by ``adopt_orphans``."""

    workflow: str
    key: str
    window: WindowDoc
    write: str
    fired_at: float
    fire_id: str


#: Payload types that JSON gives back as they are (exact types: not subclasses).
_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


@dataclass(slots=True, eq=False)
class _Call(Ping):
    """One register call, waiting to be written (alone, or merged into a batch)."""

    #: Trio time by which the call must be answered (its arrival + op_timeout).
    deadline: float = 0.0
    result: Registration | BaseException | None = None
    #: The call's task while it waits (parked by :func:`_park`), else None.
    task: trio.lowlevel.Task | None = None
    #: The fires of due windows this ping took before it was applied (returned in
    #: its Registration when no coordinator's hook took them at once).
    taken: list[Finalization] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _KeyQueue:
    """The pings of one key that wait for the write in flight (group commit)."""

    writing: bool = False
    waiting: list[_Call] = field(default_factory=list)
    #: Finalizes waiting for the key's turn; they go before the next batch of pings.
    finalizers: list[trio.Event] = field(default_factory=list)


def _refuse_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


async def _park(ping: _Call) -> None:
    """Wait until :func:`_wake` (``ping``'s result, or its turn to lead a write).

    The wait refuses cancellation, like a shielded one (a merged ping cannot be
    withdrawn), without a cancel scope per ping; a cancellation of the call is
    delivered at its next checkpoint after it returns.
    """
    ping.task = trio.lowlevel.current_task()
    await trio.lowlevel.wait_task_rescheduled(_refuse_abort)


def _wake(ping: _Call) -> None:
    """Wake ``ping``'s call if it is parked (once: a second wake is a no-op)."""
    task = ping.task
    if task is not None:
        ping.task = None
        trio.lowlevel.reschedule(task)


def _settle(ping: _Call, result: Registration | BaseException) -> None:
    """Give ``ping`` its result and wake its call."""
    ping.result = result
    _wake(ping)


class KvDebounceBackend(DebounceBackend):
    """The debounce protocol over a :class:`~trio_debounce._kv.KvStore`.

    Args:
      store: the shared store.
      process_id (str | None): this process's id; a uuid4 hex when None. Two live
        coordinators must never share one.
      process_lease (float): seconds this process's lease lasts unrenewed (> 0).
      op_timeout (float): seconds a register or finalize may take, retries included.
      max_clock_skew (float): the largest wall-clock difference between hosts that the
        lease arithmetic tolerates, seconds: an owner is dead only once its lease
        expired more than this long ago.
      wall_time: the wall clock, ``() -> float`` epoch seconds (:func:`time.time`).
      serializer (PayloadSerializer | None): how payloads are stored
        (:class:`~trio_debounce.JsonSerializer` when None); every process sharing the
        store must use the same one.
    """

    _register_uncancellable = True

    def __init__(
        self,
        store: KvStore,
        *,
        process_id: str | None = None,
        process_lease: float = 60.0,
        op_timeout: float = 2.0,
        max_clock_skew: float = 1.0,
        wall_time: Callable[[], float] = time.time,
        serializer: PayloadSerializer | None = None,
    ) -> None:
        if process_id is None:
            process_id = uuid.uuid4().hex
        if not isinstance(process_id, str) or not process_id:
            raise ValueError(f"process_id must be a non-empty str, got {process_id!r}")
        self._serializer: PayloadSerializer = JsonSerializer() if serializer is None else serializer
        self._process_id = process_id
        self._epoch = uuid.uuid4().hex
        self._lease_seconds = _validate.positive_duration("process_lease", process_lease)
        self._op_timeout = _validate.positive_duration("op_timeout", op_timeout)
        self._skew = _validate.positive_duration("max_clock_skew", max_clock_skew)
        self._wall = wall_time
        self._view = StoreView(store, heartbeat_interval=self._lease_seconds / 3, skew=self._skew)
        self._me = _rules.Identity(process_id, self._epoch, self._serializer, store.max_value_bytes)
        self._leases = ProcessLease(
            self._view, self._me, seconds=self._lease_seconds, skew=self._skew, wall=wall_time
        )
        self._queued_deletes: dict[str, _QueuedDelete] = {}
        #: KV key -> the at-least-once commits of it whose answers were lost and that
        #: no one ran (see _Unproven).
        self._unproven: dict[str, list[_Unproven]] = {}
        #: KV key -> the pings waiting to be merged into its next write.
        self._queues: dict[str, _KeyQueue] = {}
        #: KV keys whose last register write was answered since a ping next led one.
        self._answered: set[str] = set()
        #: (workflow, key) -> KV key, for the keys pinged lately (at most KNOWN_LIMIT).
        self._window_keys: dict[tuple[str, str], str] = {}
        #: The default serializer: a scalar payload is what it reads back.
        self._json = type(self._serializer) is JsonSerializer
        #: Fire records this process wrote or adopted: id -> revision.
        self._fire_records: dict[str, int] = {}
        #: Fire records whose delete could not reach the store: retried by heartbeats.
        self._queued_completions: set[str] = set()
        #: Fire records of queued deletes that a later one for the same key replaced.
        self._queued_record_deletes: set[str] = set()
        #: The end records of queue-latest runs that could not reach the store, by KV key.
        self._queued_end_runs: dict[str, str] = {}
        self._released = False
        # Counters, see statistics().
        self.unstored_coalesces = 0
        self.takeovers = 0
        self.adopted_fires = 0
        #: Fires of due windows taken by pings (see _take_due).
        self.taken_fires = 0

    # ----------------------------------------------------------------- basics

    @property
    def requests(self) -> int:
        """Requests made to the store."""
        return self._view.requests

    @property
    def conflicts(self) -> int:
        """Compare-and-swaps lost (and retried)."""
        return self._view.conflicts

    @property
    def process_id(self) -> str:
        return self._process_id

    @property
    def epoch(self) -> str:
        """This opening's epoch: a fresh uuid4 hex, so a restart under the same
        process id does not inherit its predecessor's windows."""
        return self._epoch

    @property
    def heartbeat_interval(self) -> float:
        return self._leases.heartbeat_interval

    def wall_time(self) -> float:
        return self._wall()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} process={self._process_id!r} store={self._view.store!r}>"

    # ------------------------------------------------------------ store calls

    # ------------------------------------------------------------------ leases

    def _mine(self, doc: WindowDoc) -> bool:
        return self._me.owns(doc)

    def lease_held(self) -> bool:
        """Is this process's own lease still live, by its own clock, with the skew
        margin? If not, a peer may have taken its windows over."""
        return self._leases.held()

    async def wait_process_id_free(self) -> None:
        await self._leases.wait_process_id_free()

    async def refresh_lease(self) -> set[str]:
        return await self._leases.refresh(self._apply_queued_deletes)

    # ---------------------------------------------------------------- register

    async def register(
        self,
        workflow: str,
        key: str,
        *,
        mode: Mode,
        delay: float,
        max_delay: float | None,
        run_id: str,
        payload: Any = None,
        max_count: int | None = None,
        payload_policy: str = "last",
        order_key: float | None = None,
        max_items: int | None = None,
        overflow: str | None = None,
        reducer: tuple[Reducer, InitialFactory | None] | None = None,
        overlap: str = "allow",
        run_timeout: float | None = None,
        drop_stale: bool = False,
    ) -> Registration:
        self._leases.check_not_taken()
        now = self._wall()  # the ping's time, kept through merges and retries
        try:
            kv_key = self._window_keys[workflow, key]
        except (KeyError, TypeError):  # TypeError: unhashable, window_key names it
            kv_key = window_key(workflow, key)
            if len(self._window_keys) >= KNOWN_LIMIT:
                self._window_keys.clear()
            self._window_keys[workflow, key] = kv_key
        text = self._serializer.dumps(payload)
        limit = self._view.store.max_value_bytes
        if len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
            # Refused before anything is sent, naming the payload (the store's own
            # check would name only the document's key, and only after the fold).
            raise DocumentTooLargeError(
                f"payload of {workflow!r}/{key!r} is {len(text.encode('utf-8', 'surrogatepass'))}"
                f" bytes serialized, more than the {limit} bytes a window's document may hold"
            )
        if self._json and type(payload) in _JSON_SCALARS:
            own = payload  # what JSON gives back, without parsing it again
        else:
            own = self._serializer.loads(text)
        deadline = trio.current_time() + self._op_timeout
        if not self._leases.revision:
            # Peers must see our lease before a document names us as owner.
            with trio.CancelScope(shield=True), trio.move_on_at(deadline):
                await self.refresh_lease()
            if not self._leases.revision:
                raise BackendUnavailableError(
                    f"could not write the lease of process {self._process_id!r} within "
                    f"{self._op_timeout} s"
                )
        ping = _Call(
            mode=mode,
            delay=delay,
            max_delay=max_delay,
            run_id=run_id,
            text=text,
            own=own,
            max_count=max_count,
            payload_policy=payload_policy,
            order_key=order_key,
            max_items=max_items,
            overflow=overflow,
            reducer=reducer,
            queue=overlap == "queue-latest",
            run_timeout=run_timeout,
            drop_stale=drop_stale,
            now=now,
            deadline=deadline,
        )
        # Group commit: the pings of a key that arrive while a write of it is in flight
        # wait for it, then go out together, in arrival order, in the next write (led
        # by whichever of their calls runs first).
        queue = self._queues.get(kv_key)
        if queue is None:
            queue = self._queues[kv_key] = _KeyQueue()
        queue.waiting.append(ping)
        # Merged, the ping cannot be withdrawn: its write may be in flight. Its waits
        # refuse cancellation (_park), and a write goes out under a shield.
        while ping.result is None:
            if queue.writing:
                await _park(ping)
                continue
            queue.writing = True
            batch: list[_Call] = []
            with trio.CancelScope(shield=True):
                try:
                    if kv_key in self._answered:
                        # Right after a write of the key: two scheduling rounds first
                        # (no timer), so that the calls it answered that ping again
                        # join this write instead of waiting for the next one. They
                        # run in the round after their answer, maybe after this task.
                        self._answered.discard(kv_key)
                        await trio.lowlevel.cancel_shielded_checkpoint()
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    batch, queue.waiting = queue.waiting, []
                    queue.waiting[:0] = await self._commit(workflow, key, kv_key, batch)
                except BaseException as exc:
                    for other in batch:
                        if other.result is None:
                            _settle(other, exc)
                    raise
                finally:
                    self._release_turn(kv_key, queue)
                    if len(self._answered) >= KNOWN_LIMIT:
                        self._answered.clear()
                    self._answered.add(kv_key)
        result = ping.result
        if isinstance(result, BaseException):
            if ping.taken:
                # The fires it took are committed: never lost with the ping. Without a
                # coordinator's hook, they are logged for the caller to find in the
                # store (a fire record it holds, under at-least-once).
                logger.warning(
                    "register %s failed after taking %d due fire(s): %s",
                    kv_key,
                    len(ping.taken),
                    result,
                )
            raise result
        assert result is not None
        return result

    async def _commit(
        self, workflow: str, key: str, kv_key: str, batch: list[_Call]
    ) -> list[_Call]:
        """Write the pings of ``batch`` (one key, arrival order) by one compare-and-swap.

        Settles each ping it writes or refuses (its ``result``: a Registration or the
        exception its call raises) and returns the pings left for the next write. The
        batch is bounded by its oldest ping's deadline; a write whose answer was lost
        then gets one more ``op_timeout`` to be recognised by a re-read of its write id
        (see :doc:`/protocol`, "Group commit").
        """
        write = uuid.uuid4().hex
        deadline = batch[0].deadline
        last_doc: WindowDoc | None = None
        last_live = False
        error: BackendError | None = None
        rest: list[_Call] = []
        #: The pings of the write whose answer was lost, their outcomes, its take time,
        #: and until when the window it wrote waits for its key's queue-latest run.
        sent: tuple[list[tuple[_Call, Registered]], float | None, float | None] | None = None
        base = -1  # the revision that write expected
        in_flight = ambiguous = resolving = False
        while True:
            with trio.move_on_at(deadline):
                attempt = 0
                while True:
                    try:
                        known = None if ambiguous else self._view.cached(kv_key)
                        if known is None:
                            _, revision, doc = await self._view.read(kv_key)
                            if ambiguous:
                                ambiguous = False
                                assert sent is not None
                                if doc is not None and (
                                    write == doc.opened_by or (not doc.fired and write == doc.write)
                                ):
                                    # The write had landed (the window it opened, even
                                    # if peers have written since, or fired it: its
                                    # pings are in that fire; or its revision). Writing
                                    # again would open a second window of the run.
                                    self._settle_batch(
                                        kv_key, sent[0], doc, sent[1], revision, sent[2]
                                    )
                                    return rest
                                if resolving and revision == base:
                                    break  # it did not land, and the deadline has passed
                        else:
                            revision, doc = known
                        now = self._wall()
                        live = (
                            doc is not None
                            and not doc.fired
                            and await self._leases.owner_live(doc, now)
                        )
                        last_doc, last_live = doc, live
                        # Until when the key's queue-latest run blocks its next fire.
                        blocked = None
                        if doc is not None and doc.running is not None:
                            blocked = await self._leases.run_blocks_until(doc.running, now)
                        applied = _rules.apply_batch(
                            doc,
                            live,
                            now,
                            [ping for ping in batch if ping.result is None],
                            write,
                            known is not None,
                            blocked,
                            self._me,
                            takeover=self._view.can_take_over(),
                        )
                        if applied is None:
                            # Refused, stale or full on a remembered document: re-read.
                            self._view.forget(kv_key)
                            continue
                        for ping, answer in applied.answers:
                            _settle(ping, answer)
                        pings, new, take_at = applied.pings, applied.doc, applied.take_at
                        rest = applied.rest
                        if not pings and rest:
                            # The first ping is at or after the window's due time: it
                            # never joins it. Take its fire (a compare-and-swap, as a
                            # taker), then apply the pings again: they open the next
                            # window (or, if the take lost, meet what a peer wrote).
                            assert new is not None
                            taker, rest = rest[0], []
                            await self._take_due(
                                workflow, key, kv_key, new, revision, taker, deadline
                            )
                            continue
                        if not pings:
                            return rest  # every ping was refused, dropped or overflowed
                        assert new is not None
                        waits = None
                        if blocked is not None and new.queue and new.at <= now:
                            waits = blocked  # the owner looks again then
                        sent, base = (pings, take_at, waits), revision
                        in_flight = True
                        new_revision = await self._view.put(kv_key, new.encode(), last=revision)
                        in_flight = False
                    except RevisionConflict:
                        in_flight = False
                        self._view.lost_race(kv_key)
                        logger.debug("register %s: revision conflict, retrying", kv_key)
                    except DocumentTooLargeError as exc:
                        in_flight = False
                        assert sent is not None
                        if len(sent[0]) == 1:
                            _settle(sent[0][0][0], exc)
                            return rest
                        # Too large merged: write its pings one at a time.
                        for ping, _ in sent[0]:
                            ping.alone = True
                        return [ping for ping, _ in sent[0]] + rest
                    except BackendUnavailableError as exc:
                        self._view.forget(kv_key)
                        ambiguous = ambiguous or in_flight  # the write may have landed
                        in_flight = False
                        error = exc
                    except BackendError as exc:
                        # Refused permissions, a misconfigured store: every ping raises it.
                        for ping in batch:
                            if ping.result is None:
                                _settle(ping, exc)
                        return rest
                    else:
                        self._view.remember(kv_key, new_revision, new)
                        self._settle_batch(kv_key, pings, new, take_at, new_revision, waits)
                        return rest
                    await self._view.backoff(attempt)
                    attempt += 1
            if in_flight:  # the deadline cut the write short: it may have landed
                in_flight = False
                ambiguous = True
                self._view.forget(kv_key)
            if ambiguous and not resolving:
                # Never fail open beside a write that may have landed: re-read first.
                resolving = True
                deadline = trio.current_time() + self._op_timeout
                continue
            break
        waiting = [ping for ping in batch if ping.result is None and ping not in rest]
        if (
            error is None
            and last_doc is not None
            and _rules.absorbs_unstored(last_doc, last_live, self._me, waiting)
        ):
            # Contention until the deadline, but a live owner has a fire pending that
            # comes after these pings' arrival: absorbed without a write.
            self.unstored_coalesces += len(waiting)
            logger.warning(
                "register %s: no write won within %.3g s; coalesced %d pings into the live "
                "window of process %s without storing them",
                kv_key,
                self._op_timeout,
                len(waiting),
                last_doc.owner,
            )
            for ping in waiting:
                _settle(
                    ping,
                    Registration(
                        Registered.COALESCED,
                        last_doc.run_id,
                        last_doc.mode,
                        last_doc.at,
                        last_doc.first,
                        last_doc.count,
                        stored=False,
                        payload=ping.own,
                    ),
                )
            return rest
        for ping in waiting:
            _settle(
                ping,
                BackendUnavailableError(
                    f"register of {workflow!r}/{key!r} did not complete within "
                    f"{self._op_timeout} s" + (f": {error}" if error is not None else "")
                ),
            )
        return rest

    async def _take_due(
        self,
        workflow: str,
        key: str,
        kv_key: str,
        doc: WindowDoc,
        revision: int,
        ping: _Call,
        deadline: float,
    ) -> bool:
        """Take the fire of ``doc``, a window that ``ping`` found due at its time (see
        :doc:`/protocol`, "A ping at or after the due time"), while this call holds
        the key's turn: the finalize of a taker (fire record first under
        at-least-once, then the tombstone, each a compare-and-swap), bounded by the
        batch's ``deadline``. A fire it commits goes to the coordinator's hook at once
        (else into ``ping.taken``). Returns True if it fired; False if the window was
        gone or changed (the caller re-reads and applies the pings again).

        Raises:
          BackendUnavailableError: the store did not answer in time (a commit whose
            answer was lost is proven or taken back later, see ``_Unproven``).
          BackendError: any other failure of the store.
        """
        # Shielded from the batch's deadline scope: the finalize keeps its own (the
        # same deadline), so that a commit cut short is recorded as unproven.
        try:
            with trio.CancelScope(shield=True):
                result = await self._finalize(
                    workflow,
                    key,
                    kv_key,
                    doc.run_id,
                    True,
                    False,
                    self._ping_delivery,
                    False,
                    deadline=deadline,
                    read=(revision, doc),
                )
        except DocumentTooLargeError as exc:
            # Its fire record cannot be stored (a window written by something else, or
            # a payload near the store's limit): no one can commit this fire, so the
            # ping joins the window (as its owner or a takeover) instead of failing.
            logger.warning("register %s: cannot take the due fire (%s); joining it", kv_key, exc)
            ping.joins_due = True
            self._view.forget(kv_key)
            return False
        if result.outcome is not Finalized.FIRE:
            self._view.forget(kv_key)
            return False
        self.taken_fires += 1
        hook = self._taken_hook
        if hook is not None:
            hook(workflow, key, result)
        else:
            ping.taken.append(result)
        return True

    def _release_turn(self, kv_key: str, queue: _KeyQueue) -> None:
        """End a write of ``kv_key``: hand the key's turn to a waiting finalize (it stays
        taken), else to the next batch of pings."""
        if queue.finalizers:
            queue.finalizers.pop(0).set()
            return
        queue.writing = False
        if queue.waiting:
            _wake(queue.waiting[0])  # it leads the next write
        elif self._queues.get(kv_key) is queue:
            del self._queues[kv_key]

    @contextlib.asynccontextmanager
    async def _turn(self, kv_key: str) -> AsyncIterator[None]:
        """Take ``kv_key``'s turn to write (for a finalize): this process's pings of the
        key wait meanwhile, so they never make its commit conflict."""
        queue = self._queues.get(kv_key)
        if queue is None:
            queue = self._queues[kv_key] = _KeyQueue()
        if queue.writing:
            turn = trio.Event()
            queue.finalizers.append(turn)
            try:
                await turn.wait()  # handed over by the write before
            except BaseException:
                if turn.is_set():
                    self._release_turn(kv_key, queue)
                else:
                    queue.finalizers.remove(turn)
                raise
        else:
            queue.writing = True
        try:
            yield
        finally:
            self._release_turn(kv_key, queue)

    def _settle_batch(
        self,
        kv_key: str,
        pings: list[tuple[_Call, Registered]],
        doc: WindowDoc,
        take_at: float | None,
        revision: int,
        waits: float | None = None,
    ) -> None:
        """Answer the pings of a write that landed; tracks what this process owns.

        Every ping of the write reports the window as that write left it (count, due
        time, payload), whatever order their tasks wake in; each its own outcome. A
        window that ``waits`` for its key's ``queue-latest`` run reports ``waiting``,
        and that time as ``scheduled_at`` (when the owner looks again).
        """
        if doc.payload_policy != "last" or doc.ordered:
            payload = self._load(doc.payload)  # the window's payload, not a ping's
        else:
            payload = pings[-1][0].own  # the last ping's: the one stored
        if self._mine(doc):
            self._view.owned[kv_key] = doc.run_id
            self._view.know_count(kv_key, doc.run_id, doc.count)
        else:
            self._view.disown(kv_key, doc.run_id)
        token = self._view.token(revision)
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
                    doc.run_id,
                    doc.mode,
                    doc.at if waits is None else waits,
                    doc.first,
                    doc.count,
                    True,
                    take_at if outcome is Registered.COALESCED else None,
                    payload,
                    token,
                    waiting=waits is not None,
                )
            if ping.taken:
                # Its own result: the fires it took are the caller's to run.
                _settle(ping, result._replace(taken=tuple(ping.taken)))
                continue
            _settle(ping, result)

    def _load(self, text: str | None) -> Any:
        return _rules.load_payload(self._serializer, text)

    # ---------------------------------------------------------------- finalize

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
    ) -> Finalization:
        kv_key = window_key(workflow, key)
        async with self._turn(kv_key):
            return await self._finalize(workflow, key, kv_key, run_id, take, force, delivery, early)

    async def _finalize(
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
    ) -> Finalization:
        error: BackendError | None = None
        if self._leases.taken_by is not None:
            # Fenced (a later coordinator took our process id): never fire on a window
            # remembered from before; the live coordinator adopts it as a dead one's.
            self._view.disown(kv_key, run_id)
            return Finalization(Finalized.ABANDONED)
        # The commit in flight, in case its answer is lost: (window, write id, time,
        # fire record id). Each attempt has its own ids: a record taken back after a
        # conflict leaves a delete marker that a second create would conflict with.
        committing: tuple[WindowDoc, str, float, str] | None = None
        if delivery == "at-least-once":
            # A commit of this run whose answer was lost before: prove it first.
            committing = self._take_unproven(kv_key, run_id)
        fired_at = self._wall()
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
                        entry, revision, doc = await self._view.read(kv_key)
                        if committing is not None:
                            proven = await self._proven(kv_key, entry, doc, committing, delivery)
                            if proven is not None:
                                return proven
                            committing = None
                    if doc is None or doc.fired or doc.run_id != run_id:
                        self._view.disown(kv_key, run_id)
                        return Finalization(Finalized.ABANDONED)
                    if not take and not self._mine(doc):
                        self._view.disown(kv_key, run_id)
                        return Finalization(Finalized.ABANDONED)
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
                        await self.refresh_lease()
                        self._view.forget(kv_key)
                        continue
                    # A queue-latest window may have waited for a run: one that timed
                    # out (at its `until`), or whose process died or whose end was
                    # recorded late (noticed now).
                    fired_at = _rules.fire_time(doc, now, force)
                    write = uuid.uuid4().hex
                    fire_id = FIRE_PREFIX + write
                    committing = (doc, write, fired_at, fire_id)
                    # Both modes leave a tombstone naming this commit's write id (the
                    # sweeper removes it a lease later), so a commit whose answer was
                    # lost is proven by a read, never guessed from a gone window (a
                    # peer's fire would look the same).
                    tombstone = _rules.tombstone(doc, write, fired_at, self._me)
                    if delivery == "at-most-once":
                        revision = await self._view.put(kv_key, tombstone.encode(), last=revision)
                        self._view.remember(kv_key, revision, tombstone)
                        return self._fire(kv_key, doc, fired_at, self._view.token(revision), None)
                    record = self._fire_record(workflow, key, doc, fired_at, 1, write)
                    record_revision = await self._view.put(fire_id, record.encode(), last=0)
                    self._fire_records[fire_id] = record_revision
                    try:
                        closed = await self._view.close_window(kv_key, tombstone, revision)
                    except RevisionConflict:
                        # A ping landed after our read: take the record back, re-read.
                        await self._drop_record(fire_id)
                        raise
                    self._view.remember(kv_key, closed, tombstone)
                    # The token of the commit: the record's revision, later than every
                    # write of the window (its leading fire's included).
                    return self._fire(
                        kv_key, doc, fired_at, self._view.token(record_revision), fire_id
                    )
                except RevisionConflict:
                    self._view.lost_race(kv_key)
                    committing = None
                except BackendUnavailableError as exc:
                    self._view.forget(kv_key)
                    error = exc
                await self._view.backoff(attempt)
                attempt += 1
        if delivery == "at-most-once":
            # Not ours to delete at exit any more: the window stays in the store for
            # our reconcile (or, once we are gone, a peer) unless the fire committed.
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
            and committing[0].mode is Mode.BOTH
            and known_count < 2 <= committing[0].count
        )
        unproven = committing is not None and (take or lapsed or missed_trailing)
        if committing is not None and unproven:
            # No one fires this commit now: it is proven (and fired) or taken back by
            # the next finalize of this run, or by the next adopt_orphans.
            window, write, at, fire_id = committing
            self._unproven.setdefault(kv_key, []).append(
                _Unproven(workflow, key, window, write, at, fire_id)
            )
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
                committing[3] if committing is not None and not unproven else None,
                known_count,
            )
        raise BackendUnavailableError(
            f"finalize of {workflow!r}/{key!r} (run {run_id}) did not complete within "
            f"{self._op_timeout} s" + (f": {error}" if error is not None else "")
        )

    def _take_unproven(self, kv_key: str, run_id: str) -> tuple[WindowDoc, str, float, str] | None:
        """Remove and return the lost commit of run ``run_id`` of ``kv_key``, if any."""
        pending = self._unproven.get(kv_key)
        if not pending:
            return None
        for i, unproven in enumerate(pending):
            if unproven.window.run_id == run_id:
                del pending[i]
                if not pending:
                    del self._unproven[kv_key]
                return unproven.window, unproven.write, unproven.fired_at, unproven.fire_id
        return None

    async def _settle_unproven(self) -> list[OrphanFire]:
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
            async with self._turn(kv_key):
                while self._unproven.get(kv_key):
                    unproven = self._unproven[kv_key].pop(0)
                    try:
                        fire = await self._settle_one(kv_key, unproven)
                    except BaseException:
                        self._unproven.setdefault(kv_key, []).insert(0, unproven)
                        raise
                    if fire is not None:
                        fires.append(fire)
                if kv_key in self._unproven and not self._unproven[kv_key]:
                    del self._unproven[kv_key]
        return fires

    def _orphan(self, fire_id: str, record: FireRecord, attempt: int, revision: int) -> OrphanFire:
        """Fire record ``fire_id`` as a fire to run (``attempt``), whose fencing token
        is the record's write at ``revision``."""
        return OrphanFire(
            fire_id,
            record.workflow,
            record.key,
            record.run_id,
            self._load(record.payload),
            record.count,
            record.first,
            record.at,
            attempt,
            self._view.token(revision),
        )

    async def _settle_one(self, kv_key: str, unproven: _Unproven) -> OrphanFire | None:
        read = await self._read_record(unproven.fire_id)
        if read is None:
            return None  # the record never landed (nor, then, the commit)
        entry, record = read
        if not self._own_record(record):
            return None  # a peer took us for dead and adopted it: it runs it
        doc = self._view.parse(await self._view.get(kv_key))
        run_id = unproven.window.run_id
        if not _rules.commit_landed(doc, run_id, unproven.write):
            # Still open (its owner fires it), or closed by another write.
            with contextlib.suppress(RevisionConflict):
                await self._remove_record(unproven.fire_id, entry.revision)
            return None
        self._fire_records[unproven.fire_id] = entry.revision
        logger.info(
            "fire %s of %s (run %s) committed though its answer was lost; running it",
            unproven.fire_id,
            kv_key,
            run_id,
        )
        return self._orphan(unproven.fire_id, record, record.attempt, entry.revision)

    async def _proven(
        self,
        kv_key: str,
        entry: KvEntry | None,
        doc: WindowDoc | None,
        committing: tuple[WindowDoc, str, float, str],
        delivery: Delivery,
    ) -> Finalization | None:
        """After a commit whose answer was lost: the fire, if the re-read proves it."""
        window, write, fired_at, fire_id = committing
        if delivery == "at-most-once":
            if entry is not None and doc is not None and doc.fired and doc.write == write:
                return self._fire(kv_key, window, fired_at, self._view.token(entry.revision), None)
            return None  # not proven: never fire on a guess (the caller re-reads)
        # at-least-once: our fire record decides.
        read = await self._read_record(fire_id)
        if read is None:
            return None  # the record never landed: start over
        record, mine = read
        if not self._own_record(mine):
            # A peer took us for dead and adopted the record: it runs the fire.
            return Finalization(Finalized.ABANDONED)
        self._fire_records[fire_id] = record.revision
        landed = _rules.commit_landed(doc, window.run_id, write)
        if landed is False:
            # The run was closed by another write (a peer took the fire; its tombstone
            # or a newer window's after names it, or the tombstone is gone): ours
            # never landed.
            await self._drop_record(fire_id)
            return None
        if landed is None:
            assert doc is not None  # the run's window, still open
            if doc.write != window.write:
                # A ping landed after our read, so our commit cannot have: take the
                # record back and decide again.
                await self._drop_record(fire_id)
                return None
            assert entry is not None
            self._view.forget(kv_key)
            tombstone = _rules.tombstone(window, write, fired_at, self._me)
            try:  # the record landed, the window's commit did not: finish it
                closed = await self._view.close_window(kv_key, tombstone, entry.revision)
            except RevisionConflict:
                await self._drop_record(fire_id)
                return None
            self._view.remember(kv_key, closed, tombstone)
        return self._fire(kv_key, window, fired_at, self._view.token(record.revision), fire_id)

    def _fire_record(
        self, workflow: str, key: str, doc: WindowDoc, fired_at: float, attempt: int, write: str
    ) -> FireRecord:
        return FireRecord(
            self._process_id,
            self._epoch,
            workflow,
            key,
            doc.run_id,
            doc.payload,
            doc.count,
            doc.first,
            fired_at,
            attempt,
            write,
        )

    async def _read_record(self, fire_id: str) -> tuple[KvEntry, FireRecord] | None:
        """Fire record ``fire_id`` as stored, or None if it is gone or unreadable."""
        entry = await self._view.get(fire_id)
        if entry is None or entry.value is None:
            return None
        try:
            return entry, FireRecord.decode(entry.value)
        except (ValueError, KeyError, TypeError):
            return None

    def _own_record(self, record: FireRecord) -> bool:
        """Is ``record`` this process's, in this opening (not adopted by a peer)?"""
        return record.owner == self._process_id and record.epoch == self._epoch

    async def _remove_record(self, fire_id: str, revision: int) -> None:
        """Remove fire record ``fire_id`` at ``revision``, leaving no delete marker:
        fire ids are never reused, so markers would only pile up in the bucket.

        Raises:
          RevisionConflict: the record had moved on (a peer adopted it) or was gone.
        """
        if not await self._view.purge(fire_id, last=revision):
            raise RevisionConflict(f"fire record {fire_id} is no longer at revision {revision}")

    async def _drop_record(self, fire_id: str) -> None:
        revision = self._fire_records.pop(fire_id, None)
        if revision is not None:
            with contextlib.suppress(RevisionConflict):
                await self._remove_record(fire_id, revision)

    def _fire(
        self,
        kv_key: str,
        doc: WindowDoc,
        fired_at: float,
        token: int,
        fire_id: str | None,
    ) -> Finalization:
        self._view.disown(kv_key, doc.run_id)
        return Finalization(
            Finalized.FIRE,
            fired_at,
            doc.count,
            doc.first,
            doc.mode,
            doc.last,
            self._load(doc.payload),
            token,
            fire_id,
            doc.queue,
            doc.run_id,
        )

    async def end_run(self, workflow: str, key: str, run_id: str) -> str | None:
        kv_key = window_key(workflow, key)
        self._leases.run_ended(run_id)
        try:
            with trio.move_on_after(self._op_timeout):
                # This process's pings of the key wait meanwhile (they would make the
                # compare-and-swap conflict).
                async with self._turn(kv_key):
                    attempt = 0
                    while True:
                        try:
                            return await self._end_run(kv_key, run_id)
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

    async def _end_run(self, kv_key: str, run_id: str) -> str | None:
        # Written against the remembered document when it names this run (the
        # compare-and-swap proves it current); any other decision on a fresh read.
        known = self._view.cached(kv_key)
        if known is None or not self._names_run(known[1], run_id):
            _, revision, doc = await self._view.read(kv_key)
        else:
            revision, doc = known
        if doc is None or not self._names_run(doc, run_id):
            self._leases.run_end_recorded(run_id)
            return None
        ended: WindowDoc | None = None
        if not doc.fired or doc.fired_order is not None or doc.after:
            ended = replace(doc, running=None)
        self._view.remember(kv_key, await self._view.close_window(kv_key, ended, revision), ended)
        self._leases.run_end_recorded(run_id)
        if not doc.fired and doc.queue and doc.at <= self._wall():
            return doc.run_id  # waiting for this run: it fires now
        return None

    def _names_run(self, doc: WindowDoc | None, run_id: str) -> bool:
        """Does ``doc`` hold ``run_id`` as its key's ``queue-latest`` run of this process?"""
        marker = None if doc is None else doc.running
        return (
            marker is not None
            and marker.run_id == run_id
            and (marker.process, marker.epoch) == (self._process_id, self._epoch)
        )

    async def _delete_own_record(self, fire_id: str) -> None:
        """Delete fire record ``fire_id`` if it exists and is still this process's."""
        read = await self._read_record(fire_id)
        if read is None:
            return
        entry, record = read
        if self._own_record(record):
            with contextlib.suppress(RevisionConflict):
                await self._remove_record(fire_id, entry.revision)
        self._fire_records.pop(fire_id, None)

    async def complete(self, fire_id: str) -> None:
        revision = self._fire_records.get(fire_id)
        if revision is None:
            return
        try:
            with trio.move_on_after(self._op_timeout) as scope:
                await self._remove_record(fire_id, revision)
        except RevisionConflict:
            # Adopted by a peer that thought us dead: it runs the fire again (documented).
            logger.warning("fire record %s was taken over before its handler finished", fire_id)
        except BackendUnavailableError:
            self._queued_completions.add(fire_id)
            return
        else:
            if scope.cancelled_caught:
                self._queued_completions.add(fire_id)
                return
        self._fire_records.pop(fire_id, None)
        self._queued_completions.discard(fire_id)

    async def _apply_queued_deletes(self) -> None:
        """Apply deletes queued by finalizes that could not reach the store.

        Several calls may run at once (the heartbeat's, and those of finalizes that
        renew a lapsed lease): each entry is dropped only by the call that finds it
        still queued, and never when a newer finalize has queued another delete for
        the same key meanwhile."""
        for kv_key, queued in list(self._queued_deletes.items()):
            if self._queued_deletes.get(kv_key) is not queued:
                continue  # applied by a concurrent call, or replaced
            entry = await self._view.get(kv_key)
            doc = self._view.parse(entry)
            if (
                doc is not None
                and not doc.fired
                and doc.run_id == queued.run_id
                and self._mine(doc)
            ):
                assert entry is not None
                # A both-edges window that the owner knew with one ping had no
                # trailing fire; if peers' pings landed, it still needs one.
                missed_trailing = doc.mode is Mode.BOTH and queued.known_count < 2 <= doc.count
                if doc.last <= queued.fired_at and not missed_trailing:
                    self._view.forget(kv_key)
                    try:
                        await self._view.close_window(kv_key, doc.closed(), entry.revision)
                    except RevisionConflict:
                        continue  # a ping landed: try again next heartbeat
                    logger.info("applied the queued delete of %s (run %s)", kv_key, queued.run_id)
                # else: pings landed after the unconfirmed fire (or a trailing fire
                # was missed); the window stays and the owner's reconcile re-arms it,
                # so they are not lost.
            if queued.fire_id is not None:
                await self._delete_own_record(queued.fire_id)
            if self._queued_deletes.get(kv_key) is queued:
                del self._queued_deletes[kv_key]
        for fire_id in list(self._queued_record_deletes):
            await self._delete_own_record(fire_id)
            self._queued_record_deletes.discard(fire_id)
        for fire_id in list(self._queued_completions):
            await self.complete(fire_id)
        for kv_key, run_id in list(self._queued_end_runs.items()):
            # Read first: the heartbeat does not take the key's turn.
            self._view.forget(kv_key)
            try:
                await self._end_run(kv_key, run_id)
            except RevisionConflict:
                self._view.forget(kv_key)
                continue
            del self._queued_end_runs[kv_key]

    # ---------------------------------------------------------- cancel & co

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
                try:
                    tombstone = None if doc is None else doc.closed()
                    await self._view.close_window(kv_key, tombstone, entry.revision)
                except RevisionConflict:
                    self._view.lost_race(None)
                    await self._view.backoff(attempt)
                    attempt += 1
                    continue
                self._view.owned.pop(kv_key, None)
                return True
        raise BackendUnavailableError(
            f"cancel of {workflow!r}/{key!r} did not complete within {self._op_timeout} s"
        )

    async def owned_windows(self) -> list[OwnedWindow]:
        owned = []
        for entry in await self._view.entries(WINDOW_KEY_PREFIX):
            doc = self._view.parse(entry)
            if doc is None or doc.fired or not self._mine(doc):
                continue
            try:
                workflow, key = parse_window_key(entry.key)
            except ValueError:
                continue
            self._view.owned[entry.key] = doc.run_id
            self._view.remember(entry.key, entry.revision, doc)
            owned.append(
                OwnedWindow(workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count)
            )
        return owned

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
            and holder.process != self._process_id
            and now <= holder.expires + self._skew
        ):
            return 0
        lock = Lease(self._process_id, self._epoch, now + 3 * self._lease_seconds)
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
                if doc is None or not doc.fired or doc.last > now - self._lease_seconds:
                    continue
                if (
                    doc.fired_order is not None
                    and doc.last > now - _ORDER_LEASES * self._lease_seconds
                ):
                    continue  # drop_stale still reads its last fired order key
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

    async def adopt_orphans(self, workflows: Collection[str]) -> Orphans:
        self._leases.check_not_taken()
        orphans = Orphans([], await self._settle_unproven(), [])
        adopting = self._view.can_take_over()
        now = self._wall()
        for entry in await self._view.entries(WINDOW_KEY_PREFIX):
            doc = self._view.parse(entry)
            if doc is None or doc.fired:
                continue
            try:
                workflow, key = parse_window_key(entry.key)
            except ValueError:
                continue
            if self._mine(doc):
                self._view.owned[entry.key] = doc.run_id
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
                owner=self._process_id,
                epoch=self._epoch,
                armed=doc.at,
                write=uuid.uuid4().hex,
            )
            try:
                revision = await self._view.put(entry.key, new.encode(), last=entry.revision)
            except RevisionConflict:
                continue  # a peer adopted it, or a ping took it over
            self._view.remember(entry.key, revision, new)
            self.takeovers += 1
            self._view.owned[entry.key] = doc.run_id
            logger.info(
                "adopted window %s (run %s) of dead process %s", entry.key, doc.run_id, doc.owner
            )
            adopted_window = OwnedWindow(
                workflow, key, doc.run_id, doc.mode, doc.at, doc.first, doc.count
            )
            orphans.windows.append(adopted_window)
            orphans.owned.append(adopted_window)
        if not adopting:
            return orphans  # the grace after an outage: no takeover yet
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
                record.owner == self._process_id
                and self._leases.replaced is not None
                and self._leases.replaced.live(now, self._skew)
            ):
                # An earlier coordinator with our process id, whose lease we replaced,
                # may still be running this fire (a twin runs until its next heartbeat
                # fences it, and completes what it started): adopted once its lease
                # lapsed, as any process's, so a live twin's fire never runs twice.
                continue
            window = self._view.parse(await self._view.get(window_key(record.workflow, record.key)))
            if (
                window is not None
                and not window.fired
                and window.run_id == record.run_id
                and window.first == record.first
            ):
                # The owner died between writing the record and deleting the window:
                # the fire never committed, and the window (adopted, or to be) fires
                # it. Running the record too would run the burst twice.
                with contextlib.suppress(RevisionConflict):
                    await self._remove_record(entry.key, entry.revision)
                continue
            if (
                record.write is not None
                and _rules.commit_landed(window, record.run_id, record.write) is False
            ):
                # The run's proof names another commit (a peer took the fire), or is
                # gone (see _commit_landed): this record's commit never landed.
                with contextlib.suppress(RevisionConflict):
                    await self._remove_record(entry.key, entry.revision)
                continue
            adopted = replace(
                record, owner=self._process_id, epoch=self._epoch, attempt=record.attempt + 1
            )
            try:
                revision = await self._view.put(entry.key, adopted.encode(), last=entry.revision)
            except RevisionConflict:
                continue
            self.adopted_fires += 1
            self._fire_records[entry.key] = revision
            logger.info(
                "adopted interrupted fire %s (run %s, attempt %d) of dead process %s",
                entry.key,
                record.run_id,
                adopted.attempt,
                record.owner,
            )
            # The token: this attempt's commit, later than the first's.
            orphans.fires.append(self._orphan(entry.key, record, adopted.attempt, revision))
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
        return WindowStatus(
            doc.run_id,
            doc.mode,
            doc.owner,
            await self._leases.owner_live(doc, now),
            doc.first,
            doc.last,
            None if waiting else doc.at,
            doc.cap,
            doc.count,
            entry.revision,
            self._view.token(entry.revision),
        )

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

    async def release(self, runs: Collection[str] | None = None) -> None:
        if self._released:
            return
        self._released = True
        try:
            with trio.move_on_after(self._op_timeout) as scope:
                await self._apply_queued_deletes()
                for kv_key, run_id in list(self._view.owned.items()):
                    if runs is not None and run_id not in runs:
                        continue  # left for a peer to adopt once our lease is gone
                    entry = await self._view.get(kv_key)
                    doc = self._view.parse(entry)
                    if (
                        doc is not None
                        and not doc.fired
                        and doc.run_id == run_id
                        and self._mine(doc)
                    ):
                        assert entry is not None
                        self._view.forget(kv_key)
                        try:
                            await self._view.close_window(kv_key, doc.closed(), entry.revision)
                        except RevisionConflict:
                            logger.warning("release of %s lost a race to another write", kv_key)
                    del self._view.owned[kv_key]
                    self._view.known_counts.pop(kv_key, None)
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
