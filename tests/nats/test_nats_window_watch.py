"""``open_window_watch`` on the NATS backend against a real nats-server (real clock):
a server restart interrupts the watch, which is opened again and reports only what
changed meanwhile. (The CLI's ``windows --follow`` is tested in tests/cli.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from tests.harness.nats_server import NatsServer, store_config
from trio_debounce import BackendUnavailableError, Mode, WindowChange
from trio_debounce._protocol._watch import WindowFollower
from trio_debounce.abc import DebounceBackend
from trio_debounce.nats import open_nats_backend

pytestmark = pytest.mark.slow


async def ping(backend: DebounceBackend, key: str) -> None:
    """One ping of ``("wf", key)`` (a minute's delay), retried while the server is away."""
    while True:
        try:
            await backend.register(
                "wf", key, mode=Mode.TRAILING, delay=60.0, max_delay=None, run_id=f"run-{key}"
            )
            return
        except BackendUnavailableError:
            await trio.sleep(0.1)


async def next_change(changes: AsyncIterator[WindowChange], bound: float) -> WindowChange:
    with trio.fail_after(bound):
        return await changes.__anext__()


@pytest.mark.realtime
async def test_a_restart_interrupts_the_watch_and_it_lists_again(nats_server: NatsServer) -> None:
    config = store_config(nats_server)
    with trio.fail_after(60):
        async with (
            open_nats_backend(config, process_id="writer") as writer,
            open_nats_backend(config, process_id="tool") as tool,
        ):
            await writer.refresh_lease()
            await ping(writer, "kept")
            await ping(writer, "pinged")
            async with tool.open_window_watch("wf") as changes:
                assert isinstance(changes, WindowFollower)
                listed = [await next_change(changes, 5), await next_change(changes, 5)]
                assert [(c.change, c.key) for c in listed] == [
                    ("listed", "kept"),
                    ("listed", "pinged"),
                ]
                await ping(writer, "new")
                opened = await next_change(changes, 5)
                assert (opened.change, opened.key) == ("opened", "new")
                assert opened.window is not None
                assert opened.window.owner == "writer"

                nats_server.stop()
                await trio.sleep(0.2)  # let the clients read the EOF
                nats_server.restart()
                # The consumer died with the server: only a new watch sees these.
                await ping(writer, "pinged")
                await ping(writer, "after")
                got = [await next_change(changes, 20), await next_change(changes, 5)]
                assert changes.snapshots >= 2
                seen = sorted((c.change, c.key, c.window and c.window.ping_count) for c in got)
                assert seen == [("opened", "after", 1), ("updated", "pinged", 2)]
                # And it follows again, nothing repeated.
                await ping(writer, "kept")
                again = await next_change(changes, 5)
                assert (again.change, again.key) == ("updated", "kept")
                assert again.window is not None
                assert again.window.ping_count == 2
