"""An operator's steering of a persisted run from outside any coordinator (what
``trio-debounce runs cancel`` and ``runs retry`` do): each step is a compare-and-swap
on the revision just read, as a coordinator's own steps are, so a live owner that has
the run armed finds the record changed at its next step and never acts on the old one.

Cancel
  A *pending* run is deleted at the revision read, as
  :meth:`Coordinator.cancel_run <trio_debounce.Coordinator.cancel_run>` does. A run
  whose handler started (``started``) or that finished (``done``) is left as it is.
Retry
  A tombstone whose outcome is ``"failed"`` (under at-least-once delivery: its last
  allowed attempt raised) is written back to ``pending`` with no owner, so that the
  claim sweep of any live process with a handler for its workflow claims it (as it
  claims a released run) and starts it. The fields, from the tombstone:

  * ``state`` pending; ``owner`` None and ``epoch`` 0 (unclaimed: claimable by any
    process, whose claim writes its own id and epoch);
  * ``scheduled_at`` the time of the retry: it runs at once, and ``misfire_grace``
    counts from the retry, not from the old due time (which would drop it at once);
  * ``outcome`` and ``finished_at`` None (it is no tombstone, and no purge of old
    tombstones lists it);
  * ``attempt`` kept, so the next start is ``attempt + 1``; ``token`` + 1, as a claim
    adds (a change of hands): every later claim and start writes a higher token than
    any attempt before the retry;
  * ``version`` + 1, as a re-schedule adds (its time changed);
  * ``payload`` (a failed tombstone keeps it), ``expires_at``, ``created_at`` and
    ``started_at`` (when the last attempt started) kept.

  A run whose ``expires_at`` has passed is not retried: its next owner would drop it
  as expired at once. An outcome of ``"ran"`` is never retried, even if the handler
  failed under at-most-once delivery (which writes ``"ran"`` before the handler).

The holder of the failed attempt has written its tombstone and holds nothing; a
process that still had the old record armed (none should: a tombstone is never armed)
would lose its compare-and-swap against the retry's revision.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import BackendUnavailableError
from ._store import RunState, RunStore, StoredRun

#: Reads and compare-and-swaps one steering tries before it gives up under contention.
ATTEMPTS = 50


@dataclass(frozen=True, slots=True)
class Steered:
    """What one steering did.

    Attributes:
      done (bool): the change was written.
      run (StoredRun | None): when done, the record as written (for a cancel: the one
        deleted); when not, the record as last read, whose state refused the change,
        or None when the store has no record of the run.
    """

    done: bool
    run: StoredRun | None


def retry_refusal(run: StoredRun, wall: float) -> str | None:
    """Why ``run`` cannot be retried at wall time ``wall``; None if it can.

    Returns:
      str | None: a reason for people (``"it is pending, not failed"``, ...).
    """
    if run.state is not RunState.DONE:
        return f"it is {run.state.value}, not failed"
    if run.outcome != "failed":
        return f"its outcome is {run.outcome!r}, not 'failed'"
    if run.expires_at is not None and run.expires_at <= wall:
        return "its expiry has passed (its next owner would drop it as expired)"
    return None


async def cancel_pending_run(store: RunStore, run_id: str) -> Steered:
    """Delete the run ``run_id`` if it is pending, by compare-and-swap.

    Returns:
      Steered: done with the deleted record; or not done, with the record whose
      state refused it (started or done), or None when there is no such run.

    Raises:
      BackendUnavailableError: the run changed under every one of :data:`ATTEMPTS`
        compare-and-swaps, or the store is unreachable.
      BackendError: as raised by the store.
    """
    for _ in range(ATTEMPTS):
        current = await store.get_run(run_id)
        if current is None or current.state is not RunState.PENDING:
            return Steered(False, current)
        if await store.delete_run(run_id, revision=current.revision):
            return Steered(True, current)
    raise BackendUnavailableError(f"run {run_id!r}: could not be cancelled under contention")


async def retry_failed_run(store: RunStore, run_id: str) -> Steered:
    """Write the failed run ``run_id`` back to pending, unclaimed and due now (see the
    module for every field), by compare-and-swap; the time is the store's
    :meth:`~trio_debounce.abc.RunStore.wall_time`.

    Returns:
      Steered: done with the record written; or not done, with the record that
      :func:`retry_refusal` refuses, or None when there is no such run.

    Raises:
      BackendUnavailableError: the run changed under every one of :data:`ATTEMPTS`
        compare-and-swaps, or the store is unreachable.
      BackendError: as raised by the store.
    """
    for _ in range(ATTEMPTS):
        current = await store.get_run(run_id)
        wall = store.wall_time()
        if current is None or retry_refusal(current, wall) is not None:
            return Steered(False, current)
        retried = current.replace(
            state=RunState.PENDING,
            owner=None,
            epoch=0,
            scheduled_at=wall,
            outcome=None,
            finished_at=None,
            token=current.token + 1,
            version=current.version + 1,
        )
        written = await store.update_run(retried)
        if written is not None:
            return Steered(True, written)
    raise BackendUnavailableError(f"run {run_id!r}: could not be retried under contention")
