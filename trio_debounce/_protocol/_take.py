"""The fire of a due window that a ping finds (see :doc:`/protocol`, "A ping at or
after the due time"): taken by the ping's register, as a taker's finalize, and handed
to the coordinator at once; an at-most-once take whose answer was lost is handed over
to be proven outside the key's turn."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from .._backend import Delivery, Finalization, Finalized
from .._errors import BackendUnavailableError, DocumentTooLargeError
from ._documents import WindowDoc
from ._finalize import Finalizer
from ._turns import Call
from ._view import StoreView

logger = logging.getLogger("trio_debounce.backend")


class DueFires:
    """Takes the fires of due windows for the register.

    Args:
      view: the store.
      finalizer: commits each take (a taker's finalize).
    """

    def __init__(self, view: StoreView, finalizer: Finalizer) -> None:
        self._view = view
        self._finalizer = finalizer
        #: What a fire taken by a ping is committed under, and who runs it at once.
        self.delivery: Delivery = "at-least-once"
        self._on_taken: Callable[[str, str, Finalization], None] | None = None
        self._on_unproven_take: Callable[[str, str, str], None] | None = None
        #: Fires of due windows taken by pings.
        self.taken_fires = 0

    def hand(
        self,
        delivery: Delivery,
        on_taken: Callable[[str, str, Finalization], None] | None,
        on_unproven_take: Callable[[str, str, str], None] | None,
    ) -> None:
        """Commit the fires that pings take under ``delivery``, and hand each to
        ``on_taken`` (None: into the ping's Registration); an at-most-once take whose
        answer was lost goes to ``on_unproven_take(workflow, key, run_id)``, which
        proves it (None: it is dropped)."""
        self.delivery = delivery
        self._on_taken = on_taken
        self._on_unproven_take = on_unproven_take

    async def take(
        self,
        workflow: str,
        key: str,
        kv_key: str,
        doc: WindowDoc,
        revision: int,
        ping: Call,
        deadline: float,
    ) -> bool:
        """Take the fire of ``doc`` (read at ``revision``), a window that ``ping`` found
        due at its time, while the caller holds the key's turn: the finalize of a taker
        (fire record first under at-least-once, then the tombstone, each a
        compare-and-swap), bounded by the batch's ``deadline`` (Trio time). A fire it
        commits goes to the coordinator's hook at once (else into ``ping.taken``). The
        caller then re-reads and applies the pings again.

        Returns True if the take was left unproven: an at-most-once commit sent whose
        answer did not come by the deadline, handed to ``on_unproven_take``, which
        proves it by re-reads outside the key's turn for up to a lease, as an owner's
        finalize does (see :doc:`/protocol`, "Delivery guarantees"); False otherwise.

        Raises:
          BackendUnavailableError: the store did not answer in time, and no commit of
            this take is left to prove here (at-least-once proves it by its fire
            record; without a coordinator, nobody does).
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
                    self.delivery,
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
        except BackendUnavailableError:
            if self.delivery != "at-most-once" or not self._finalizer.sent_pending(
                kv_key, doc.run_id
            ):
                raise
            self._view.forget(kv_key)
            hook = self._on_unproven_take
            if hook is None:
                # No coordinator to prove and run it: dropped, as the error says.
                self._finalizer.forget_sent(kv_key, doc.run_id)
                raise
            hook(workflow, key, doc.run_id)
            return True
        if result.outcome is not Finalized.FIRE:
            self._view.forget(kv_key)
            return False
        self.taken_fires += 1
        taken = self._on_taken
        if taken is not None:
            taken(workflow, key, result)
        else:
            ping.taken.append(result)
        return False
