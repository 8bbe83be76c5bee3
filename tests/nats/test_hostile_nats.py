"""Hostile keys and foreign documents against a real nats-server (real clock).

Workflow and key strings with ``.``, ``*``, ``>``, spaces, ``/``, control characters,
separators and other Unicode round-trip through real KV keys without colliding, and
garbage written into the bucket by something else is ignored with a warning.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
import trio

from tests.harness.fires import Fires
from tests.harness.nats_server import NatsServer
from trio_debounce import open_coordinator
from trio_debounce._keys import parse_window_key, process_key, window_key
from trio_debounce._protocol import SWEEPER_KEY
from trio_debounce.nats import NatsConfig, open_nats_backend
from trio_debounce.nats._store import open_nats_store

pytestmark = pytest.mark.slow

ODD = ["a", "a.b", "a b", "*", ">", "a.*", "a.>", "/", "a/b", "\x00", "\t\n", "$KV", "é", "🙂"]
ODD += ["\u2028", "\u200b", "=", "-", "_", "..", "a=", "YQ", "w.YQ.YQ"]
PAIRS = [(w, k) for w in ("wf", "w.f", "*") for k in ODD] + [("a", "b.c"), ("a.b", "c")]


def config(server: NatsServer, **kwargs: Any) -> NatsConfig:
    kwargs.setdefault("bucket", "h" + uuid.uuid4().hex[:12])
    return NatsConfig(
        servers=(server.url,),
        process_lease=1.5,
        max_clock_skew=0.25,
        op_timeout=1.0,
        connect_timeout=3.0,
        ping_interval=1.0,
        **kwargs,
    )


async def test_odd_names_round_trip_and_never_collide(nats_server: NatsServer) -> None:
    cfg = config(nats_server)
    fires = Fires()
    with trio.fail_after(60):
        async with open_nats_store(cfg) as store:
            # Each pair has its own key; reading every key back gives every pair.
            for i, (workflow, key) in enumerate(PAIRS):
                await store.put(window_key(workflow, key), str(i).encode(), last=0)
            entries = await store.entries("w.")
            assert sorted(parse_window_key(e.key) for e in entries) == sorted(PAIRS)
            for entry in entries:
                assert entry.value == str(PAIRS.index(parse_window_key(entry.key))).encode()
            for entry in entries:
                await store.delete(entry.key, last=entry.revision)
        handlers = {w: fires.handler("A") for w in {w for w, _ in PAIRS}}
        async with (
            open_nats_backend(cfg, process_id="A") as backend,
            open_coordinator(handlers=handlers, backend=backend) as coord,
        ):
            for i, (workflow, key) in enumerate(PAIRS):
                await coord.debounce(workflow, key, i, delay=0.2)
            await trio.sleep(1.0)
    fired = sorted((f.workflow, f.key, f.payload) for _, f in fires.log)
    assert fired == sorted((w, k, i) for i, (w, k) in enumerate(PAIRS))


async def test_garbage_in_the_bucket_is_ignored_with_a_warning(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(nats_server)
    garbage = [b"\xff\x00garbage", b"", b'{"v":99}', b"[" * 10_000, b'{"v":1,"owner":']
    keys = [window_key("wf", "k"), process_key("ghost"), "f.ghost", SWEEPER_KEY]
    fires = Fires()
    with trio.fail_after(60):
        async with open_nats_store(cfg) as store:
            for i, key in enumerate(keys):
                await store.put(key, garbage[i % len(garbage)], last=0)
            for i, value in enumerate(garbage):
                await store.put(window_key("wf", f"g{i}"), value, last=0)
        async with (
            open_nats_backend(cfg, process_id="A") as backend,
            open_coordinator(handlers={"wf": fires.handler("A")}, backend=backend) as coord,
        ):
            await trio.sleep(1.0)  # a heartbeat and a reconcile read it all
            await coord.debounce("wf", "k", "mine", delay=0.2)
            await trio.sleep(1.0)
    assert [(f.key, f.payload) for _, f in fires.log] == [("k", "mine")]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(window_key("wf", "k") in message for message in warned)
