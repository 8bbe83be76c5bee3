"""Whose turn it is to write a key: the register calls that wait for the write in
flight (group commit), and the finalizes that go before them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import trio

from .._backend import Finalization, Registration
from ._rules import Ping


@dataclass(slots=True, eq=False)
class Call(Ping):
    """One register call, waiting to be written (alone, or merged into a batch)."""

    #: Trio time by which the call must be answered (its arrival + op_timeout).
    deadline: float = 0.0
    result: Registration | BaseException | None = None
    #: The call's task while it waits (parked by :func:`park` or :func:`park_until`),
    #: else None.
    task: trio.lowlevel.Task | None = None
    #: The fires of due windows this ping took before it was applied (returned in
    #: its Registration when no coordinator's hook took them at once).
    taken: list[Finalization] = field(default_factory=list)


def _refuse_abort(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


async def park(call: Call) -> None:
    """Wait until :func:`wake` (``call``'s result, or its turn to lead a write).

    The wait refuses cancellation, like a shielded one (a merged ping cannot be
    withdrawn), without a cancel scope per ping; a cancellation of the call is
    delivered at its next checkpoint after it returns.
    """
    call.task = trio.lowlevel.current_task()
    await trio.lowlevel.wait_task_rescheduled(_refuse_abort)


async def park_until(call: Call, queue: KeyQueue, give_up_at: float) -> bool:
    """:func:`park` for the first call waiting in ``queue``, the one with the
    earliest deadline (arrival order), so that one timer serves every call waiting
    for the key's turn. True once woken; False if ``give_up_at`` (Trio time) came
    while ``call`` was still waiting, not merged into a write: it is then taken out
    of the queue (the caller answers it), and the next call waiting is woken to park
    with its own give-up time. A merged call cannot be withdrawn (its write may be in
    flight): it waits on. Any other cancellation is refused (the scope is shielded),
    as by :func:`park`; so a ping that waits behind its key's writes and finalizes is
    answered in bounded time, and never half-cancelled."""
    call.task = trio.lowlevel.current_task()

    def abort(raise_cancel: Any) -> trio.lowlevel.Abort:
        if call in queue.waiting:  # Call compares by identity (eq=False)
            queue.waiting.remove(call)
            call.task = None
            if queue.waiting:
                wake(queue.waiting[0])  # it parks again, timed
            return trio.lowlevel.Abort.SUCCEEDED
        return trio.lowlevel.Abort.FAILED

    with trio.CancelScope(deadline=give_up_at, shield=True) as scope:
        await trio.lowlevel.wait_task_rescheduled(abort)
    return not scope.cancelled_caught


def wake(call: Call) -> None:
    """Wake ``call`` if it is parked (once: a second wake is a no-op)."""
    task = call.task
    if task is not None:
        call.task = None
        trio.lowlevel.reschedule(task)


def answer(call: Call, result: Registration | BaseException) -> None:
    """Give ``call`` its result and wake it."""
    call.result = result
    wake(call)


@dataclass(slots=True, eq=False)
class KeyQueue:
    """The pings of one key that wait for the write in flight (group commit)."""

    writing: bool = False
    waiting: list[Call] = field(default_factory=list)
    #: Finalizes waiting for the key's turn; they go before the next batch of pings.
    finalizers: list[trio.Event] = field(default_factory=list)


class KeyTurns:
    """One write of a key at a time, from this process: a batch of pings, or a
    finalize (which goes before the next batch, so pings never make its commit
    conflict)."""

    def __init__(self) -> None:
        #: KV key -> the pings waiting to be merged into its next write.
        self._queues: dict[str, KeyQueue] = {}

    def queue(self, kv_key: str) -> KeyQueue:
        """``kv_key``'s queue (made when none waits)."""
        queue = self._queues.get(kv_key)
        if queue is None:
            queue = self._queues[kv_key] = KeyQueue()
        return queue

    def release(self, kv_key: str, queue: KeyQueue) -> None:
        """End a write of ``kv_key``: hand the key's turn to a waiting finalize (it stays
        taken), else to the next batch of pings."""
        if queue.finalizers:
            queue.finalizers.pop(0).set()
            return
        queue.writing = False
        if queue.waiting:
            wake(queue.waiting[0])  # it leads the next write
        elif self._queues.get(kv_key) is queue:
            del self._queues[kv_key]

    @contextlib.asynccontextmanager
    async def turn(self, kv_key: str) -> AsyncIterator[None]:
        """Take ``kv_key``'s turn to write (for a finalize): this process's pings of the
        key wait meanwhile, so they never make its commit conflict."""
        queue = self.queue(kv_key)
        if queue.writing:
            turn = trio.Event()
            queue.finalizers.append(turn)
            try:
                await turn.wait()  # handed over by the write before
            except BaseException:
                if turn.is_set():
                    self.release(kv_key, queue)
                else:
                    queue.finalizers.remove(turn)
                raise
        else:
            queue.writing = True
        try:
            yield
        finally:
            self.release(kv_key, queue)
