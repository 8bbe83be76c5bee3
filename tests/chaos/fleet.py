"""Driver processes of a scenario: start, kill (``SIGKILL`` by pid), close, reap.

Every incarnation writes its own JSON-lines log (see :mod:`tests.chaos.driver`);
:meth:`Fleet.events` reads them all back, merged in time order.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.env import ROOT
from tests.harness.nats_server import NatsServer, free_port

Event = dict[str, Any]


@dataclass
class Incarnation:
    """One driver process."""

    name: str
    process_id: str
    proc: subprocess.Popen[bytes]
    log: Path
    stderr: Path
    killed_at: float | None = None
    closed_at: float | None = None

    @property
    def live(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        try:
            with self.log.open() as lines:
                return any('"ev": "ready"' in line for line in lines)
        except OSError:
            return False


@dataclass
class Fleet:
    """Drivers sharing one bucket on one server.

    Args:
      url (str): the server.
      tmp (Path): where the logs go.
      common (list[str]): arguments every driver gets (delivery, lease, rate...).
    """

    url: str
    tmp: Path
    common: list[str]
    bucket: str = field(default_factory=lambda: "c" + uuid.uuid4().hex[:12])
    incarnations: list[Incarnation] = field(default_factory=list)

    def spawn(self, process_id: str, *extra: str) -> Incarnation:
        """Start a driver as ``process_id`` (the incarnation is named ``<id>.<n>``)."""
        n = sum(1 for inc in self.incarnations if inc.process_id == process_id)
        name = f"{process_id}.{n}"
        log = self.tmp / f"{name}.jsonl"
        stderr = self.tmp / f"{name}.err"
        args = [
            sys.executable,
            "-m",
            "tests.chaos.driver",
            "--url",
            self.url,
            "--bucket",
            self.bucket,
            "--process-id",
            process_id,
            "--name",
            name,
            "--log",
            str(log),
            "--seed",
            str(abs(hash((self.bucket, name))) % 2**31),
            *self.common,
            *extra,
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with stderr.open("wb") as err:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=ROOT,
                env=env,
            )
        inc = Incarnation(name, process_id, proc, log, stderr)
        self.incarnations.append(inc)
        return inc

    def wait_ready(self, incs: list[Incarnation], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(inc.ready() or not inc.live for inc in incs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"drivers not ready in {timeout} s:\n{self.tails()}")
            time.sleep(0.1)

    def kill(self, inc: Incarnation) -> float:
        """``SIGKILL`` by pid; returns when (``time.time()``)."""
        at = time.time()
        if inc.live:
            os.kill(inc.proc.pid, signal.SIGKILL)
            inc.proc.wait()
            inc.killed_at = at
        self._close_pipe(inc)
        return at

    @staticmethod
    def _close_pipe(inc: Incarnation) -> None:
        if inc.proc.stdin is not None and not inc.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                inc.proc.stdin.close()

    def close(self, inc: Incarnation) -> None:
        """Close its standard input: it leaves its block (``on_exit="wait"``)."""
        if inc.closed_at is None:
            inc.closed_at = time.time()
            self._close_pipe(inc)

    def shutdown(self, timeout: float = 60.0) -> list[Incarnation]:
        """Close every live driver and wait; kill those still running after
        ``timeout`` s. Returns the ones that had to be killed (hung at exit)."""
        for inc in self.incarnations:
            if inc.live:
                self.close(inc)
        deadline = time.monotonic() + timeout
        hung = []
        for inc in self.incarnations:
            try:
                inc.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(inc)
                # Its stacks first (the driver writes them to its .err log: SIGUSR2 the
                # threads' from C, SIGUSR1 the Trio task tree), then the kill.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(inc.proc.pid, signal.SIGUSR2)
                    time.sleep(0.5)
                    os.kill(inc.proc.pid, signal.SIGUSR1)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inc.proc.wait(2.0)
                self.kill(inc)
        return hung

    def kill_all(self) -> None:
        for inc in self.incarnations:
            if inc.live:
                os.kill(inc.proc.pid, signal.SIGKILL)
                inc.proc.wait()
            self._close_pipe(inc)

    def crashed(self) -> list[Incarnation]:
        """Incarnations that ended without a kill, with a non-zero status."""
        return [
            inc
            for inc in self.incarnations
            if inc.killed_at is None and inc.proc.poll() not in (None, 0)
        ]

    def events(self) -> list[Event]:
        """Every incarnation's events, merged in time order."""
        out: list[Event] = []
        for inc in self.incarnations:
            try:
                text = inc.log.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    out.append({"ev": "garbage", "proc": inc.name, "t": 0.0, "line": line})
        out.sort(key=lambda e: float(e.get("t", 0.0)))
        return out

    def tails(self, lines: int = 8) -> str:
        parts = []
        for inc in self.incarnations:
            try:
                tail = inc.stderr.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                tail = []
            parts.append(f"--- {inc.name} (rc {inc.proc.poll()}):\n" + "\n".join(tail))
        return "\n".join(parts)


def monitored_server(store_dir: Path, *extra: str) -> tuple[NatsServer, int]:
    """A server with its HTTP monitoring port (for :func:`stream_messages`)."""
    port = free_port()
    server = NatsServer(store_dir, extra_args=("-m", str(port), *extra))
    return server, port


def stream_messages(monitor_port: int, bucket: str) -> int | None:
    """Messages in the bucket's stream (one per live key, history 1), from ``/jsz``."""
    url = f"http://127.0.0.1:{monitor_port}/jsz?streams=true"
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            info = json.load(reply)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the reply's body (a ResourceWarning on 3.14)
        return None
    except (OSError, ValueError):
        return None
    for account in info.get("account_details", []):
        for stream in account.get("stream_detail", []):
            if stream.get("name") == f"KV_{bucket}":
                return int(stream["state"]["messages"])
    return None
