"""The fire records of at-least-once delivery (``f.<id>``) that this process holds:
written before a fire commits, completed when its handler returns, adopted from dead
processes (see :doc:`/protocol`, "Fire records and their proof")."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import trio

from .._backend import OrphanFire
from .._errors import BackendUnavailableError, RevisionConflict
from .._kv import KvEntry
from .._types import Edge, FireReason
from . import _flow_rules, _rules
from ._documents import FireRecord, WindowDoc
from ._rules import Identity
from ._view import StoreView

logger = logging.getLogger("trio_debounce.backend")


class FireRecords:
    """The fire records this process wrote or adopted, by id, with their revisions.

    Args:
      view: the store.
      me: this process in this opening.
      op_timeout: seconds a completion may take.
    """

    def __init__(self, view: StoreView, me: Identity, *, op_timeout: float) -> None:
        self._view = view
        self._me = me
        self._op_timeout = op_timeout
        #: Fire records this process wrote or adopted: id -> revision.
        self._fire_records: dict[str, int] = {}
        #: Fire records whose delete could not reach the store: retried by heartbeats.
        self._queued_completions: set[str] = set()

    def hold(self, fire_id: str, revision: int) -> None:
        """Fire record ``fire_id``, at ``revision``, is this process's to complete (it
        wrote it, or adopted it, or found that its lost commit landed)."""
        self._fire_records[fire_id] = revision

    def orphan_fire(
        self,
        fire_id: str,
        record: FireRecord,
        attempt: int,
        revision: int,
        reason: FireReason | None = None,
    ) -> OrphanFire:
        """Fire record ``fire_id`` as a fire to run (``attempt``), whose fencing token
        is the record's write at ``revision``; ``reason``: why a lost commit of this
        process fired (its first run), None for a re-run."""
        return OrphanFire(
            fire_id,
            record.workflow,
            record.key,
            record.run_id,
            _rules.load_payload(self._me.serializer, record.payload),
            record.count,
            record.first,
            record.at,
            attempt,
            self._view.token(revision),
            Edge.LEADING if record.leading else Edge.TRAILING,
            reason,
        )

    def new_leading(
        self, workflow: str, key: str, doc: WindowDoc, payload: str | None
    ) -> FireRecord:
        """The record of the leading fire of ``doc``, the window its opening write
        ``doc.opened_by`` is about to create, carrying ``payload`` (serialized)."""
        record = self.new(workflow, key, doc, doc.first, 1, doc.opened_by)
        return dataclasses.replace(record, payload=payload, count=1, leading=True)

    def new(
        self, workflow: str, key: str, doc: WindowDoc, fired_at: float, attempt: int, write: str
    ) -> FireRecord:
        """The record of this process's fire of ``doc`` at ``fired_at``, committed by
        write ``write``."""
        _, count, first = _flow_rules.fire_shape(doc)
        return FireRecord(
            self._me.process_id,
            self._me.epoch,
            workflow,
            key,
            doc.run_id,
            doc.payload,
            count,
            first,
            fired_at,
            attempt,
            write,
        )

    async def read(
        self, fire_id: str, *, current: bool = False
    ) -> tuple[KvEntry, FireRecord] | None:
        """Fire record ``fire_id`` as stored, or None if it is gone or unreadable. With
        ``current``, read from the store's authority (a read that decides a proof)."""
        entry = await (self._view.get_current(fire_id) if current else self._view.get(fire_id))
        if entry is None or entry.value is None:
            return None
        try:
            return entry, FireRecord.decode(entry.value)
        except (ValueError, KeyError, TypeError):
            return None

    def own(self, record: FireRecord) -> bool:
        """Is ``record`` this process's, in this opening (not adopted by a peer)?"""
        return record.owner == self._me.process_id and record.epoch == self._me.epoch

    async def remove(self, fire_id: str, revision: int) -> None:
        """Remove fire record ``fire_id`` at ``revision``, leaving no delete marker:
        fire ids are never reused, so markers would only pile up in the bucket.

        Raises:
          RevisionConflict: the record had moved on (a peer adopted it) or was gone.
        """
        if not await self._view.purge(fire_id, last=revision):
            raise RevisionConflict(f"fire record {fire_id} is no longer at revision {revision}")

    async def drop(self, fire_id: str) -> None:
        revision = self._fire_records.pop(fire_id, None)
        if revision is not None:
            with contextlib.suppress(RevisionConflict):
                await self.remove(fire_id, revision)

    async def delete_own(self, fire_id: str) -> None:
        """Delete fire record ``fire_id`` if it exists and is still this process's (read
        from the store's authority: a replica that lags may not show it yet, and a
        record left behind would be run again once this process is gone)."""
        read = await self.read(fire_id, current=True)
        if read is None:
            return
        entry, record = read
        if self.own(record):
            with contextlib.suppress(RevisionConflict):
                await self.remove(fire_id, entry.revision)
        self._fire_records.pop(fire_id, None)

    async def complete(self, fire_id: str) -> None:
        revision = self._fire_records.get(fire_id)
        if revision is None:
            return
        try:
            with trio.move_on_after(self._op_timeout) as scope:
                await self.remove(fire_id, revision)
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

    async def retry_completions(self) -> None:
        """Complete the records whose delete could not reach the store before."""
        for fire_id in list(self._queued_completions):
            await self.complete(fire_id)
