"""Steering a window from outside its owner: ``trio-debounce flush``.

A flush from a process that does not own the window cannot fire it (only the owner's
task does, or a peer's ping that takes a due fire), and owners do not watch their keys.
So :meth:`Control.request_flush` does two writes, each a compare-and-swap:

1. the window's due time becomes now (``at``), so that whoever looks at the window
   next (a ping of any process, the owner's own finalize, or the survivor that adopts
   a dead owner's windows) finds it due and fires it, by the protocol's usual rules;
2. a request naming the window's run goes into the owner's control document
   (``c.<process>``), which the owner's heartbeat reads once per beat
   (:meth:`Control.take_requests`): its window's task then finalizes at once.

Neither write can fire a window twice or lose one: the first is one more write of the
document, which the owner's next compare-and-swap re-reads; the second names a run id,
which matches only the window it was written for. See :doc:`/protocol`, "Steering from outside".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import trio

from .._backend import WindowStatus
from .._engine import trailing_pending
from .._errors import BackendUnavailableError, RevisionConflict
from .._keys import control_key, window_key
from .._kv import KvEntry
from ._documents import FlushRequest, WindowDoc, decode_control, encode_control
from ._leases import ProcessLease
from ._rules import Identity
from ._view import StoreView

logger = logging.getLogger("trio_debounce.backend")


def window_status(
    doc: WindowDoc, revision: int, token: int, owner_live: bool, waiting: bool
) -> WindowStatus:
    """The :class:`~trio_debounce.WindowStatus` of an open window's document."""
    return WindowStatus(
        doc.run_id,
        doc.mode,
        doc.owner,
        owner_live,
        doc.first,
        doc.last,
        None if waiting else doc.at,
        doc.cap,
        doc.count,
        revision,
        token,
    )


class Control:
    """Flush requests: written by an operator's tool, read by the owner's heartbeat.

    Args:
      view: the store.
      leases: the lease table (is the window's owner live?).
      me: this process in this opening (whose control document the heartbeat reads).
      op_timeout: seconds a request may take, retries included.
      wall: the wall clock.
    """

    def __init__(
        self,
        view: StoreView,
        leases: ProcessLease,
        me: Identity,
        *,
        op_timeout: float,
        wall: Callable[[], float],
    ) -> None:
        self._view = view
        self._leases = leases
        self._me = me
        self._op_timeout = op_timeout
        self._wall = wall

    async def request_flush(self, workflow: str, key: str) -> WindowStatus | None:
        """Make window ``(workflow, key)`` due now and ask its owner to fire it; the
        window's status as written, or None when it has no trailing fire pending (no
        open window, or a leading one: nothing to flush)."""
        kv_key = window_key(workflow, key)
        with trio.move_on_after(self._op_timeout):
            attempt = 0
            while True:
                entry = await self._view.get(kv_key)
                doc = self._view.parse(entry)
                if doc is None or doc.fired or not trailing_pending(doc.mode, doc.count):
                    return None
                assert entry is not None
                revision = entry.revision
                now = self._wall()
                try:
                    if doc.at > now:
                        doc = replace(doc, at=now)
                        self._view.forget(kv_key)
                        revision = await self._view.put(kv_key, doc.encode(), last=revision)
                    live = await self._leases.live(doc.owner, doc.epoch, now)
                    if live:
                        await self._add_request(
                            doc.owner, FlushRequest(workflow, key, doc.run_id, now)
                        )
                except RevisionConflict:
                    await self._view.backoff(attempt)
                    attempt += 1
                    continue
                return window_status(doc, revision, self._view.token(revision), live, False)
        raise BackendUnavailableError(
            f"flush of {workflow!r}/{key!r} did not complete within {self._op_timeout} s"
        )

    async def _add_request(self, process_id: str, request: FlushRequest) -> None:
        """Append ``request`` to the control document of ``process_id`` (one
        compare-and-swap; a conflict raises :exc:`RevisionConflict` to the caller's
        retry)."""
        ckey = control_key(process_id)
        entry = await self._view.get(ckey)
        requests = self._decode(entry)
        last = 0 if entry is None else entry.revision
        await self._view.put(ckey, encode_control((*requests, request)), last=last)

    def _decode(self, entry: KvEntry | None) -> tuple[FlushRequest, ...]:
        if entry is None or entry.value is None:
            return ()
        try:
            return decode_control(entry.value)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            logger.warning("control document %s is unreadable; replacing it", entry.key)
            return ()

    async def take_requests(self) -> list[tuple[str, str, str]]:
        """The flush requests to this process, ``(workflow, key, run id)`` each, read
        and removed (a purge checked against the revision read: a request written
        since stays for the next beat). One get per call when there are none."""
        ckey = control_key(self._me.process_id)
        entry = await self._view.get(ckey)
        if entry is None or entry.value is None:
            return []
        requests = self._decode(entry)
        # False when a request came in since: it stays, and the next beat reads it
        # (with those read here again: a request names a run, so applying it twice
        # does nothing more).
        await self._view.purge(ckey, last=entry.revision)
        return [(r.workflow, r.key, r.run_id) for r in requests]
