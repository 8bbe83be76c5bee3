"""Four real processes on one hot key against a real ``nats-server``.

Each process is ``tests/nats/hotkey_driver.py``: 25 tasks pinging key ``"hot"`` as fast as
they can for 2 s (``delay=0.2``, ``max_delay=0.5``, so a window fires every half
second while the pings go on). From the reports alone, per window (run id): it fires
exactly once (every process lives and reaches the store, so both delivery modes
promise that), with the count of its last stored write and the payload of that
write's last ping (group commit merges a process's pings in arrival order); every fire
is of a window some ping was stored in; nothing failed open. Throughput is printed, not
asserted.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.harness.env import ROOT
from tests.harness.nats_server import NatsServer

pytestmark = [pytest.mark.slow, pytest.mark.realtime]

logger = logging.getLogger(__name__)

#: The driver, run as a module so that it imports the tests package first (which
#: applies ``TRIO_DEBOUNCE_TEST_AUTO_HOST``: tests/__init__.py).
DRIVER = ("-m", "tests.nats.hotkey_driver")
PROCESSES = 4
SECONDS = 2.0


@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
def test_four_processes_on_one_hot_key(
    nats_server: NatsServer, tmp_path: Path, delivery: str
) -> None:
    bucket = "h" + uuid.uuid4().hex[:12]
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    for i in range(PROCESSES):
        name = f"p{i}"
        out = tmp_path / f"{name}.jsonl"
        with open(out, "wb") as stdout, open(tmp_path / f"{name}.err", "wb") as stderr:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    *DRIVER,
                    *("--url", nats_server.url, "--bucket", bucket, "--process-id", name),
                    *("--delivery", delivery, "--seconds", str(SECONDS)),
                ],
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                cwd=ROOT,
            )
        procs.append((name, proc, out))
    try:
        # Every process is started and connected (it wrote "ready"): all start pinging
        # at one wall-clock time, a moment from now.
        deadline = time.monotonic() + 30.0
        while not all(out.read_bytes().startswith(b'["ready"]') for _, _, out in procs):
            for name, proc, _ in procs:
                assert proc.poll() is None, f"{name} exited early: {proc.returncode}"
            assert time.monotonic() < deadline, "the drivers did not get ready in 30 s"
            time.sleep(0.02)
        start_at = time.time() + 0.2
        for _, proc, _ in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{start_at!r}\n".encode())
            proc.stdin.close()
        for _, proc, _ in procs:
            proc.wait(timeout=60)
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    acks: defaultdict[str, list[tuple[int, str, int, str]]] = defaultdict(list)
    fires: defaultdict[str, list[tuple[str, int, Any, int]]] = defaultdict(list)
    total = 0.0
    for name, proc, out in procs:
        err = (tmp_path / f"{name}.err").read_text()
        assert proc.returncode == 0, f"{name} exited with {proc.returncode}: {err[-2000:]}"
        events = [json.loads(line) for line in out.read_text().splitlines()]
        assert events, f"{name} wrote nothing: {err[-2000:]}"
        assert events[-1][0] == "exit", f"{name} did not finish: {err[-2000:]}"
        for event in events:
            if event[0] == "ack":
                _, run, count, seq, payload, stored = event
                assert stored, f"a ping absorbed without a write: {event}"
                acks[run].append((count, name, seq, payload))
            elif event[0] == "fire":
                _, run, count, payload, attempt = event
                fires[run].append((name, count, payload, attempt))
            elif event[0] == "rate":
                total += event[1]
            elif event[0] == "error":
                pytest.fail(f"{name}: a ping raised: {event}")
            elif event[0] == "exit":
                assert event[1] == 0, f"{name} failed open {event[1]} times: {err[-2000:]}"
    logger.info("%s: %.0f acknowledged pings/s across %d processes", delivery, total, PROCESSES)
    assert len(acks) >= 2, "the pings should span several windows (max_delay 0.5 s)"
    assert set(fires) == set(acks), "every window some ping was stored in fires, no other"
    for run, stored in acks.items():
        [(_, count, payload, attempt)] = fires[run]  # exactly once
        assert attempt == 1
        last = max(c for c, *_ in stored)
        # the last stored write: one process's batch; its last ping's payload is stored
        writers = {name for c, name, _, _ in stored if c == last}
        assert len(writers) == 1, f"run {run}: two writes with count {last}"
        expected = max((seq, p) for c, _, seq, p in stored if c == last)[1]
        assert (count, payload) == (last, expected), f"run {run}"
