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
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import trio

from .. import _validate
from .._backend import (
    DebounceBackend,
    Delivery,
    Finalization,
    Finalized,
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
    RevisionConflict,
)
from .._keys import parse_window_key, window_key
from .._kv import KvStore
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
from ._finalize import Finalizer
from ._leases import ProcessLease
from ._records import FireRecords
from ._turns import Call, KeyTurns, answer, park
from ._view import KNOWN_LIMIT, StoreView

logger = logging.getLogger("trio_debounce.backend")

#: A tombstone that keeps a key's last fired order key (for ``drop_stale``) is swept
#: this many process leases after the key's last ping.
_ORDER_LEASES = 10
#: Looks at a live lease of our process id (another epoch) while it is watched for a
#: renewal at start, besides the first (the KV interface has no watch to wait on).
_TWIN_LOOKS = 4


#: Payload types that JSON gives back as they are (exact types: not subclasses).
_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


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
        self._turns = KeyTurns()
        self._records = FireRecords(self._view, self._me, op_timeout=self._op_timeout)
        self._finalizer = Finalizer(
            self._view,
            self._leases,
            self._turns,
            self._records,
            self._me,
            op_timeout=self._op_timeout,
            wall=wall_time,
        )
        #: KV keys whose last register write was answered since a ping next led one.
        self._answered: set[str] = set()
        #: (workflow, key) -> KV key, for the keys pinged lately (at most KNOWN_LIMIT).
        self._window_keys: dict[tuple[str, str], str] = {}
        #: The default serializer: a scalar payload is what it reads back.
        self._json = type(self._serializer) is JsonSerializer
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
        return await self._leases.refresh(self._finalizer.apply_queued)

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
        ping = Call(
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
        queue = self._turns.queue(kv_key)
        queue.waiting.append(ping)
        # Merged, the ping cannot be withdrawn: its write may be in flight. Its waits
        # refuse cancellation (_park), and a write goes out under a shield.
        while ping.result is None:
            if queue.writing:
                await park(ping)
                continue
            queue.writing = True
            batch: list[Call] = []
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
                            answer(other, exc)
                    raise
                finally:
                    self._turns.release(kv_key, queue)
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

    async def _commit(self, workflow: str, key: str, kv_key: str, batch: list[Call]) -> list[Call]:
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
        rest: list[Call] = []
        #: The pings of the write whose answer was lost, their outcomes, its take time,
        #: and until when the window it wrote waits for its key's queue-latest run.
        sent: tuple[list[tuple[Call, Registered]], float | None, float | None] | None = None
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
                        for ping, refused in applied.answers:
                            answer(ping, refused)
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
                            answer(sent[0][0][0], exc)
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
                                answer(ping, exc)
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
                answer(
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
            answer(
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
        ping: Call,
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
            answer was lost is proven or taken back later, see ``Finalizer``).
          BackendError: any other failure of the store.
        """
        # Shielded from the batch's deadline scope: the finalize keeps its own (the
        # same deadline), so that a commit cut short is recorded as unproven.
        try:
            with trio.CancelScope(shield=True):
                result = await self._finalizer.finalize_in_turn(
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

    def _settle_batch(
        self,
        kv_key: str,
        pings: list[tuple[Call, Registered]],
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
                answer(ping, result._replace(taken=tuple(ping.taken)))
                continue
            answer(ping, result)

    def _load(self, text: str | None) -> Any:
        return _rules.load_payload(self._serializer, text)

    # ---------------------------------------------------------------- finalize

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
        return await self._finalizer.finalize(
            workflow, key, run_id, take=take, force=force, delivery=delivery, early=early
        )

    async def end_run(self, workflow: str, key: str, run_id: str) -> str | None:
        return await self._finalizer.end_run(workflow, key, run_id)

    async def complete(self, fire_id: str) -> None:
        await self._records.complete(fire_id)

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
        orphans = Orphans([], await self._finalizer.prove_lost_commits(), [])
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
                    await self._records.remove(entry.key, entry.revision)
                continue
            if (
                record.write is not None
                and _rules.commit_landed(window, record.run_id, record.write) is False
            ):
                # The run's proof names another commit (a peer took the fire), or is
                # gone (see _commit_landed): this record's commit never landed.
                with contextlib.suppress(RevisionConflict):
                    await self._records.remove(entry.key, entry.revision)
                continue
            adopted = replace(
                record, owner=self._process_id, epoch=self._epoch, attempt=record.attempt + 1
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
                await self._finalizer.apply_queued()
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
