"""A clean exit that waits for a long run handler must not hold back the exiting
process's other persisted runs: a peer runs them on time (real clocks, a real store).
Used by the SQLite and NATS run-store tests."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from trio_debounce import RunFire, RunOptions, open_coordinator
from trio_debounce.abc import RunStore

#: The lease and heartbeat of both processes, seconds.
LEASE = 1.5
BEAT = 0.5


async def check_peers_run_a_draining_process_runs(
    open_store: Callable[[], AbstractAsyncContextManager[RunStore]], delivery: Any
) -> None:
    """Process A leaves its block while a run handler of its own takes 3 s; its
    persisted run "later" comes due 0.8 s into that wait. Peer B must run it within
    its sweep (a heartbeat interval) of its due time, and A's started run only once."""
    starts: list[tuple[str, str, float]] = []

    def handler(name: str, hold: float) -> Any:
        async def handle(run: RunFire) -> None:
            starts.append((name, run.run_id, trio.current_time()))
            if run.run_id == "busy":
                await trio.sleep(hold)

        return handle

    def options(name: str) -> RunOptions:
        return RunOptions(
            process_id=name, lease=LEASE, heartbeat_interval=BEAT, max_clock_skew=0.25
        )

    with trio.fail_after(20):
        async with (
            open_store() as store_b,
            open_coordinator(
                run_handlers={"wf": handler("b", 0.0)},
                run_store=store_b,
                run_options=options("b"),
                delivery=delivery,
            ),
        ):
            due = None
            async with open_store() as store_a:
                async with open_coordinator(
                    run_handlers={"wf": handler("a", 3.0)},
                    run_store=store_a,
                    run_options=options("a"),
                    delivery=delivery,
                ) as a:
                    t0 = trio.current_time()
                    await a.schedule("wf", "busy", after=0.2, persist=True)
                    await a.schedule("wf", "later", after=1.6, persist=True)
                    await trio.sleep(0.8)
                    assert [(w, r) for w, r, _ in starts] == [("a", "busy")]
                    due = t0 + 1.6
                # A's block has closed: its handler ran to its end meanwhile.
                assert trio.current_time() >= t0 + 3.0
            later = [(w, t) for w, r, t in starts if r == "later"]
            assert [w for w, _ in later] == ["b"], starts
            assert due is not None
            assert later[0][1] - due < BEAT + 0.5, f"{later[0][1] - due:.2f} s late"
            assert [w for w, r, _ in starts if r == "busy"] == ["a"]
