"""A ping: a register call, written by group commit (see :doc:`/protocol`, "Group
commit"). The pings of a key that arrive while a write of it is in flight wait for it,
then go out together, in arrival order, in the next single write."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import trio

from .._backend import Delivery, Finalization, Registered, Registration
from .._errors import BackendError, BackendUnavailableError, DocumentTooLargeError, RevisionConflict
from .._flow import FlowSpec
from .._keys import window_key
from .._options import InitialFactory, Reducer
from .._payload import JsonSerializer
from .._types import Mode
from . import _rules
from ._answers import Answers, LeadingRecord, SentWrite, unresolved_message
from ._documents import FIRE_PREFIX, WindowDoc
from ._finalize import Finalizer
from ._leases import ProcessLease
from ._records import FireRecords
from ._rules import Identity
from ._take import DueFires
from ._turns import Call, KeyTurns, answer, park, park_until
from ._view import KNOWN_LIMIT, LEADER_READ_AFTER, StoreView

logger = logging.getLogger("trio_debounce.backend")

#: Payload types that JSON gives back as they are (exact types: not subclasses).
_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


class Registrar:
    """Registers pings: merges a key's pings into one compare-and-swap, applies them by
    :func:`~._rules.apply_batch`, answers each call, and takes the fire of a window a
    ping finds due (as a taker, through the finalizer) before it opens the next one.

    Args:
      view: the store.
      leases: this process's lease.
      turns: the keys' turns to write.
      finalizer: commits the fire of a due window that a ping takes.
      records: the fire records (an opening leading fire's, under at-least-once).
      me: this process in this opening.
      op_timeout: seconds a register may take, retries included.
      wall: the wall clock.
    """

    def __init__(
        self,
        view: StoreView,
        leases: ProcessLease,
        turns: KeyTurns,
        finalizer: Finalizer,
        records: FireRecords,
        me: Identity,
        *,
        op_timeout: float,
        wall: Callable[[], float],
    ) -> None:
        self._view = view
        self._leases = leases
        self._turns = turns
        self._finalizer = finalizer
        self._records = records
        self._me = me
        self._op_timeout = op_timeout
        self._wall = wall
        #: KV keys whose last register write was answered since a ping next led one.
        self._answered: set[str] = set()
        #: (workflow, key) -> KV key, for the keys pinged lately (at most KNOWN_LIMIT).
        self._window_keys: dict[tuple[str, str], str] = {}
        #: The default serializer: a scalar payload is what it reads back.
        self._json = type(me.serializer) is JsonSerializer
        #: Takes the fires of due windows that pings find (see DueFires).
        self._due = DueFires(view, finalizer)
        self._answers = Answers(view, leases, me, wall)
        # Counters, see KvDebounceBackend.
        self.unstored_coalesces = 0

    @property
    def takeovers(self) -> int:
        """Pings that took a dead owner's window over."""
        return self._answers.takeovers

    @property
    def taken_fires(self) -> int:
        """Fires of due windows taken by pings (see DueFires)."""
        return self._due.taken_fires

    def hand_taken_fires(
        self,
        delivery: Delivery,
        on_taken: Callable[[str, str, Finalization], None] | None,
        on_unproven_take: Callable[[str, str, str], None] | None,
    ) -> None:
        """See :meth:`DueFires.hand`."""
        self._due.hand(delivery, on_taken, on_unproven_take)

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
        flow: FlowSpec | None = None,
        size: int = 0,
        now: float | None = None,
    ) -> Registration:
        self._leases.check_not_taken()
        if now is None:
            now = self._wall()  # the ping's time, kept through merges and retries
        try:
            kv_key = self._window_keys[workflow, key]
        except (KeyError, TypeError):  # TypeError: unhashable, window_key names it
            kv_key = window_key(workflow, key)
            if len(self._window_keys) >= KNOWN_LIMIT:
                self._window_keys.clear()
            self._window_keys[workflow, key] = kv_key
        text = self._me.serializer.dumps(payload)
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
            own = self._me.serializer.loads(text)
        deadline = trio.current_time() + self._op_timeout
        if not self._leases.revision:
            # Peers must see our lease before a document names us as owner.
            with trio.CancelScope(shield=True), trio.move_on_at(deadline):
                await self._leases.refresh(self._finalizer.apply_queued)
            if not self._leases.revision:
                raise BackendUnavailableError(
                    f"could not write the lease of process {self._me.process_id!r} within "
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
            flow=flow,
            size=size,
            now=now,
            deadline=deadline,
        )
        # Group commit: the pings of a key that arrive while a write of it is in flight
        # wait for it, then go out together, in arrival order, in the next write (led
        # by whichever of their calls runs first).
        queue = self._turns.queue(kv_key)
        queue.waiting.append(ping)
        # Merged, the ping cannot be withdrawn: its write may be in flight. Its waits
        # refuse cancellation (park, park_until), and a write goes out under a shield.
        while ping.result is None:
            if queue.writing:
                if not queue.waiting or queue.waiting[0] is not ping:
                    await park(ping)  # the first waiting call keeps the time
                    continue
                # Not merged by 2 * op_timeout after its arrival (the writes and
                # finalizes of its key ahead of it took that long): answered as a
                # timeout, as if its own write had been cut short.
                if not await park_until(ping, queue, ping.deadline + self._op_timeout):
                    answer(
                        ping,
                        BackendUnavailableError(
                            f"register of {workflow!r}/{key!r} did not complete within "
                            f"{2 * self._op_timeout} s: the writes of its key ahead of it "
                            "did not finish"
                        ),
                    )
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
                    queue.waiting[:0] = await self._write_batch(workflow, key, kv_key, batch)
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

    async def _write_batch(
        self, workflow: str, key: str, kv_key: str, batch: list[Call]
    ) -> list[Call]:
        leading = LeadingRecord()
        # The batch's bound: its oldest ping is answered 2 * op_timeout after arriving.
        give_up = batch[0].deadline + self._op_timeout
        try:
            return await self._write_batch_recorded(workflow, key, kv_key, batch, leading)
        finally:
            if leading.fire_id is not None and not leading.used:
                # Written, but the batch did not open the window it was for: take it
                # back (shielded), within what is left of the batch's bound (this task
                # is a ping's, answered when it returns); what does not fit is left to
                # the next heartbeat, which deletes the record if it is still ours.
                dropped = False
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_at(give_up),
                    contextlib.suppress(BackendError),
                ):
                    await self._records.drop(leading.fire_id)
                    dropped = True
                if not dropped:
                    self._finalizer.queue_record_delete(leading.fire_id)

    async def _leading_record(
        self,
        workflow: str,
        key: str,
        new: WindowDoc,
        pings: list[tuple[Call, Registered]],
        leading: LeadingRecord,
    ) -> None:
        """Under at-least-once, before a write that opens a leading or both-edges
        window: its leading fire's record (expecting no entry), so that a survivor runs
        the fire again if this process dies in its handler; its id and revision go
        into ``leading``."""
        if self._due.delivery != "at-least-once" or new.mode is Mode.TRAILING:
            return
        opener = next((call for call, outcome in pings if outcome is Registered.OPENED), None)
        if opener is None:
            return
        if new.payload_policy in ("last", "first"):
            payload = new.payload  # what the leading fire carries, as stored
        else:
            payload = self._me.serializer.dumps(opener.own)
        record = self._records.new_leading(workflow, key, new, payload)
        fire_id = FIRE_PREFIX + new.opened_by
        revision = await self._view.put(fire_id, record.encode(), last=0)
        self._records.hold(fire_id, revision)
        leading.fire_id, leading.revision = fire_id, revision

    async def _write_batch_recorded(
        self, workflow: str, key: str, kv_key: str, batch: list[Call], leading: LeadingRecord
    ) -> list[Call]:
        """Write the pings of ``batch`` (one key, arrival order) by one compare-and-swap
        (see _write_batch; ``leading`` gets the id of a leading fire's record written).

        Answers each ping it writes or refuses (its ``result``: a Registration or the
        exception its call raises) and returns the pings left for the next write. The
        batch is bounded by its oldest ping's deadline; a write whose answer was lost
        then gets one more ``op_timeout`` to be recognised by a re-read of its write id
        (see :doc:`/protocol`, "Group commit").
        """
        write = uuid.uuid4().hex
        deadline = batch[0].deadline
        #: The batch's hard bound: its oldest ping is answered by then, whatever ran
        #: over its first deadline (a shielded step, a call slow to take a cancel).
        give_up = deadline + self._op_timeout
        last_doc: WindowDoc | None = None
        last_live = False
        #: last_doc came from a read of the store in this batch (not the cache).
        last_read = False
        error: BackendError | None = None
        rest: list[Call] = []
        #: The write whose answer may be lost.
        sent: SentWrite | None = None
        base = -1  # the revision that write expected
        in_flight = ambiguous = resolving = False
        #: A re-read could not tell whether the write that opened a window landed.
        unresolved = False
        #: The batch's deadline was moved once, after a take left unproven.
        extended = restart = False
        #: The run of a create whose answer was lost and that a re-read found not
        #: landed (yet): if the pings are written again, it may still land later.
        lost_opening: str | None = None
        #: Writes on fresh reads that conflicted in a row (see LEADER_READ_AFTER).
        conflicts = 0
        while True:
            with trio.move_on_at(deadline):
                attempt = 0
                while True:
                    try:
                        known = None if ambiguous else self._view.cached(kv_key)
                        if known is None:
                            # Whether a write whose answer was lost landed is read from
                            # the store's authority: a replica that lags may not show it.
                            current = ambiguous or conflicts >= LEADER_READ_AFTER
                            entry, revision, doc = await self._view.read(kv_key, current=current)
                            read = True
                            if current:
                                conflicts = 0
                            if doc is None:
                                self._view.note_deleted(
                                    kv_key, entry, self._wall(), self._leases.seconds
                                )
                            else:
                                self._view.note_cancelled(kv_key, doc)
                            if ambiguous:
                                ambiguous = False
                                assert sent is not None
                                landed = self._answers.landed(doc, write, sent)
                                if landed:
                                    # The write had landed. Writing again would open a
                                    # second window of the run, fired twice.
                                    self._answers.answer_landed(
                                        kv_key, sent, doc, revision, leading
                                    )
                                    return rest
                                # (An empty key, before and now, proves nothing: a
                                # swept window's key is purged back to no entry.)
                                if landed is None and (revision != base or base == 0):
                                    unresolved = True
                                    break
                                if resolving and revision == base:
                                    break  # it did not land, and the deadline has passed
                                if base == 0 and sent.doc.opened_by == write:
                                    lost_opening = sent.doc.run_id
                        else:
                            revision, doc = known
                            read = False
                        now = self._wall()
                        live = (
                            doc is not None
                            and not doc.fired
                            and await self._leases.owner_live(doc, now)
                        )
                        last_doc, last_live, last_read = doc, live, read
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
                            unproven = await self._due.take(
                                workflow, key, kv_key, new, revision, taker, deadline
                            )
                            if unproven and not extended and not resolving:
                                # The take spent the batch's time; its proof goes on
                                # outside the key's turn, and the pings get one more
                                # op_timeout to be written (in a new scope: this one's
                                # deadline may have expired during the shielded take).
                                extended = restart = True
                                deadline = min(trio.current_time() + self._op_timeout, give_up)
                                break
                            continue
                        if not pings:
                            return rest  # every ping was refused, dropped or overflowed
                        assert new is not None
                        waits = None
                        if blocked is not None and new.queue and new.at <= now:
                            waits = blocked  # the owner looks again then
                        prior = None if doc is None else doc.run_id
                        sent = SentWrite(pings, new, prior, take_at, waits)
                        base = revision
                        if leading.fire_id is None:
                            await self._leading_record(workflow, key, new, pings, leading)
                        in_flight = True
                        new_revision = await self._view.put(kv_key, new.encode(), last=revision)
                        in_flight = False
                    except RevisionConflict:
                        in_flight = False
                        self._view.lost_race(kv_key)
                        # Written on a fresh read: the key moved past it, or the read
                        # came from a replica that lags, which may stay behind until
                        # the deadline (and the last read answer the pings).
                        if known is None:
                            conflicts += 1
                        logger.debug("register %s: revision conflict, retrying", kv_key)
                        if known is not None:
                            # Written on a remembered document, now stale: read it at
                            # once (no backoff: no peer contends with this write yet).
                            continue
                    except DocumentTooLargeError as exc:
                        in_flight = False
                        assert sent is not None
                        if len(sent.pings) == 1:
                            answer(sent.pings[0][0], exc)
                            return rest
                        # Too large merged: write its pings one at a time.
                        for ping, _ in sent.pings:
                            ping.alone = True
                        return [ping for ping, _ in sent.pings] + rest
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
                        self._answers.answer_batch(
                            kv_key, pings, new, take_at, new_revision, waits, leading
                        )
                        if lost_opening is not None:
                            self._view.note_late_opening(kv_key, lost_opening, write, self._wall())
                        return rest
                    await self._view.backoff(attempt)
                    attempt += 1
            if restart:
                restart = False
                continue  # after a take left unproven, see above
            if in_flight:  # the deadline cut the write short: it may have landed
                in_flight = False
                ambiguous = True
                self._view.forget(kv_key)
            if ambiguous and not resolving and not extended:
                # Never fail open beside a write that may have landed: re-read first
                # (within one more op_timeout; a batch given one after a take left
                # unproven has had it: a ping is answered within 2 * op_timeout).
                resolving = True
                deadline = min(trio.current_time() + self._op_timeout, give_up)
                continue
            break
        waiting = [ping for ping in batch if ping.result is None and ping not in rest]
        if unresolved:
            # Its window may have opened, fired and been swept (or pushed out of a
            # newer window's after), or its join's id pushed out of the key's writes:
            # the pings fail (or fail open, whose reconcile closes a window of the run
            # if the write turns up later).
            for ping in waiting:
                answer(
                    ping,
                    BackendUnavailableError(
                        unresolved_message(workflow, key, self._op_timeout, sent, write)
                    ),
                )
            return rest
        if (
            error is None
            and last_read
            and last_doc is not None
            and _rules.absorbs_unstored(last_doc, last_live, self._me, waiting)
            and self._wall() + self._leases.skew < last_doc.at
        ):
            # Contention until the deadline, but a live owner has a fire pending that
            # comes after these pings' arrival, and it is still to come: absorbed
            # without a write. Only on what a read of this batch showed (a store that
            # stalled answers nothing, and the cache may name a window that fired
            # since) and while the due time is ahead (by the skew margin): otherwise
            # no fire is known to be coming, and the pings fail (or fail open).
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
