"""Deferred runs across real OS processes, killed with ``SIGKILL`` at random points.

Each process is ``tests/runs/runs_driver.py`` (one coordinator with a run handler for
workflow ``"job"`` on a shared run store: one SQLite file, or a bucket of a real
``nats-server``). The test feeds it ``schedule(persist=True)`` commands over stdin; the
driver appends one JSON line per event to its own log file (``O_APPEND``, one
``write(2)`` a line, so a line survives a ``SIGKILL`` whole or not at all): ``ack``
(schedule returned), ``start``/``end`` around the handler's few milliseconds of work,
``claim`` (a take-over), and ``w0``/``w1`` around each write that makes a run a
tombstone.

The fault scenario keeps three drivers alive, kills a random one every 0.5 to 1.5 s and
starts a replacement at once, under a new process id or under the killed one's
(a stable id: the new incarnation bumps the epoch and takes its runs back). At the end
every process is stopped cleanly and the merged logs are counted, per run:

* lost: acked and never started (under at-least-once: never ended);
* ran twice: two ``end``s under at-least-once, two ``start``s under at-most-once;
* interrupted: a ``start`` without its ``end`` in a killed process (the kill landed
  inside the handler).

At-least-once must lose nothing, and each re-run must follow an attempt whose process
was killed before its finish was recorded (a ``start`` without ``end``, or an ``end``
whose tombstone write never returned), with a higher attempt and fencing token.
At-most-once must run nothing twice, and a lost run must have died with a killed
process after its tombstone write was sent (inside the handler, or between that write
and the handler's start). Every start comes at most ``LATENCY_BOUND`` after the later
of its due time and the event that orphaned it (the death of the process it was taken
from), and never before its due time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness.env import LONG, ROOT, deliveries
from tests.harness.nats_server import NatsServer

pytestmark = [pytest.mark.slow, pytest.mark.realtime]

#: The driver, run as a module so that it imports the tests package first (which
#: applies ``TRIO_DEBOUNCE_TEST_AUTO_HOST``: tests/__init__.py).
DRIVER = ("-m", "tests.runs.runs_driver")

LEASE = 1.0
HEARTBEAT = 0.25
SKEW = 0.1
HORIZON = 2.0
OP_TIMEOUT = 2.0
HANDLER_TIME = 0.004
#: The issue's bound (lease + heartbeat + 1 s) plus a margin for two loaded cores.
LATENCY_MARGIN = 2.0
LATENCY_BOUND = LEASE + HEARTBEAT + 1.0 + LATENCY_MARGIN
#: Driver processes alive at once.
PROCESSES = 3
#: Warm standby processes kept started (a restart takes one: no interpreter start-up).
SPARES = 3
#: A start may precede its due time by this much (float rounding of the wall clock).
EARLY_TOLERANCE = 0.002

Event = dict[str, Any]


@dataclass
class Incarnation:
    """One driver process, as the test sees it."""

    name: str
    process_id: str
    proc: subprocess.Popen[bytes]
    log: Path
    stderr: Path
    spawned_at: float
    reader: threading.Thread | None = None
    warm_at: float | None = None  # a standby's store is open
    ready_at: float | None = None
    exited_at: float | None = None
    killed_at: float | None = None
    closed: bool = False
    eof: bool = False

    @property
    def live(self) -> bool:
        return self.killed_at is None and not self.closed and not self.eof

    @property
    def usable(self) -> bool:
        return self.live and self.ready_at is not None

    @property
    def died_at(self) -> float | None:
        """When it stopped holding claims: killed, or exited cleanly (released)."""
        return self.killed_at if self.killed_at is not None else self.exited_at


@dataclass
class RunLog:
    """Everything the logs say about one run."""

    acks: list[Event] = field(default_factory=list)
    errors: list[Event] = field(default_factory=list)
    starts: list[Event] = field(default_factory=list)
    ends: list[Event] = field(default_factory=list)
    claims: list[Event] = field(default_factory=list)
    w0: list[Event] = field(default_factory=list)
    w1: list[Event] = field(default_factory=list)


class Cluster:
    """Driver processes sharing one run store."""

    def __init__(
        self,
        tmp_path: Path,
        store_args: list[str],
        *,
        delivery: str,
        rng: random.Random,
        lease: float = LEASE,
        heartbeat: float = HEARTBEAT,
        skew: float = SKEW,
        horizon: float = HORIZON,
        spares: int = SPARES,
    ) -> None:
        self.tmp_path = tmp_path
        self.spare_count = spares
        self.store_args = store_args
        self.delivery = delivery
        self.rng = rng
        self.options = {
            "--lease": lease,
            "--heartbeat": heartbeat,
            "--skew": skew,
            "--horizon": horizon,
            "--op-timeout": OP_TIMEOUT,
            "--handler-time": HANDLER_TIME,
        }
        self.incarnations: dict[str, Incarnation] = {}
        self._next_name = 0
        self._next_id = 0
        self.sent: dict[str, tuple[str, float]] = {}  # run id -> (incarnation, due)
        self.crashed: list[str] = []
        self._offsets: dict[str, int] = {}
        self.spares: list[Incarnation] = []
        self._runs: defaultdict[str, RunLog] = defaultdict(RunLog)
        self._answered: defaultdict[str, set[str]] = defaultdict(set)

    # ------------------------------------------------------------ processes

    def new_process_id(self) -> str:
        process_id = f"p{self._next_id}"
        self._next_id += 1
        return process_id

    def _start_spare(self) -> Incarnation:
        """Start a ``--standby`` driver: it imports everything, then waits for ``go``."""
        name = f"i{self._next_name}"
        self._next_name += 1
        log = self.tmp_path / f"{name}.events"
        stderr_path = self.tmp_path / f"{name}.stderr"
        args = [
            sys.executable,
            *DRIVER,
            *self.store_args,
            "--standby",
            "--name",
            name,
            "--log",
            str(log),
            "--delivery",
            self.delivery,
            "--log-level",
            "WARNING",
        ]
        for option, value in self.options.items():
            args += [option, str(value)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with stderr_path.open("wb") as stderr:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=ROOT,
                env=env,
            )
        inc = Incarnation(name, "", proc, log, stderr_path, time.time())
        inc.reader = threading.Thread(target=self._read, args=(inc,), daemon=True)
        inc.reader.start()
        return inc

    def spawn(self, process_id: str | None = None) -> Incarnation:
        """Start a driver under ``process_id`` (a new one when None): a warm spare (a
        new OS process, its interpreter already started) takes it at once."""
        if process_id is None:
            process_id = self.new_process_id()
        # A warm spare (its store open) if there is one, else the oldest.
        warm = [spare for spare in self.spares if spare.warm_at is not None]
        if warm or self.spares:
            inc = (warm or self.spares)[0]
            self.spares.remove(inc)
        else:
            inc = self._start_spare()
        while len(self.spares) < self.spare_count:
            self.spares.append(self._start_spare())
        inc.process_id = process_id
        inc.spawned_at = time.time()
        self.incarnations[inc.name] = inc
        assert inc.proc.stdin is not None
        inc.proc.stdin.write(f"go {process_id}\n".encode())
        inc.proc.stdin.flush()
        return inc

    def _read(self, inc: Incarnation) -> None:
        assert inc.proc.stdout is not None
        for raw in inc.proc.stdout:
            try:
                event: Event = json.loads(raw)
            except ValueError:
                continue
            if event.get("ev") == "standby":
                inc.warm_at = event["t"]
            elif event.get("ev") == "ready":
                inc.ready_at = event["t"]
            elif event.get("ev") == "exit":
                inc.exited_at = event["t"]
        inc.eof = True
        if inc.killed_at is None and not inc.closed:
            self.crashed.append(inc.name)

    def check_crashes(self) -> None:
        if self.crashed:
            raise AssertionError(
                "driver processes died on their own: "
                + ", ".join(self.crashed)
                + "\n"
                + self.tails()
            )

    def live(self) -> list[Incarnation]:
        return [inc for inc in self.incarnations.values() if inc.live]

    def usable(self) -> list[Incarnation]:
        return [inc for inc in self.incarnations.values() if inc.usable]

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while any(inc.ready_at is None for inc in self.live()):
            self.check_crashes()
            assert time.monotonic() < deadline, "drivers not ready in time:\n" + self.tails()
            time.sleep(0.02)

    def send(self, inc: Incarnation, runs: list[tuple[str, float]]) -> None:
        """Ask ``inc`` to schedule each ``(run_id, due)``."""
        assert inc.proc.stdin is not None
        for run_id, due in runs:
            self.sent[run_id] = (inc.name, due)
        text = "".join(f"s {run_id} {due!r}\n" for run_id, due in runs)
        with contextlib.suppress(BrokenPipeError, OSError):
            inc.proc.stdin.write(text.encode())
            inc.proc.stdin.flush()

    def unanswered(self, inc: Incarnation) -> list[tuple[str, float]]:
        """The ``(run_id, due)`` sent to the dead ``inc`` that it neither acked nor
        started (its log is final)."""
        self.runs()
        seen = self._answered[inc.name]
        return [
            (run, due)
            for run, (name, due) in self.sent.items()
            if name == inc.name and run not in seen
        ]

    def kill(self, inc: Incarnation) -> float:
        """SIGKILL by pid and reap."""
        at = time.time()
        inc.killed_at = at
        os.kill(inc.proc.pid, signal.SIGKILL)
        inc.proc.wait(5)
        return at

    def close(self, inc: Incarnation) -> None:
        """Close its stdin: the coordinator's block exits normally."""
        assert inc.proc.stdin is not None
        inc.closed = True
        with contextlib.suppress(BrokenPipeError, OSError):
            inc.proc.stdin.close()

    def wait_exit(self, inc: Incarnation, timeout: float = 15.0) -> None:
        inc.proc.wait(timeout)
        assert inc.reader is not None
        inc.reader.join(5)

    def shutdown(self, timeout: float = 20.0) -> None:
        for inc in self.live() + self.spares:
            self.close(inc)
        deadline = time.monotonic() + timeout
        for inc in [*self.incarnations.values(), *self.spares]:
            if inc.killed_at is None:
                self.wait_exit(inc, max(0.1, deadline - time.monotonic()))

    def kill_all(self) -> None:
        """Kill (by pid) every driver still running; never raises."""
        for inc in [*self.incarnations.values(), *self.spares]:
            if inc.proc.poll() is None:
                try:
                    os.kill(inc.proc.pid, signal.SIGKILL)
                    inc.proc.wait(5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            for stream in (inc.proc.stdin, inc.proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def dump(self) -> None:
        """Write the incarnations' life times to ``cluster.json`` (for a post-mortem)."""
        lives = [
            {
                "name": inc.name,
                "id": inc.process_id,
                "pid": inc.proc.pid,
                "spawned": inc.spawned_at,
                "ready": inc.ready_at,
                "killed": inc.killed_at,
                "exited": inc.exited_at,
            }
            for inc in self.incarnations.values()
        ]
        (self.tmp_path / "cluster.json").write_text(json.dumps(lives, indent=1))

    def tails(self, lines: int = 12) -> str:
        out = []
        for inc in self.incarnations.values():
            try:
                text = inc.stderr.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                text = ["(no stderr)"]
            out.append(f"--- {inc.name} {inc.process_id} (rc {inc.proc.poll()}) ---")
            out.extend(text)
        return "\n".join(out)

    # ------------------------------------------------------------ logs

    def runs(self) -> dict[str, RunLog]:
        """Every incarnation's log, merged by run id (read on from where the last call
        stopped: only whole lines)."""
        kinds = {"ack": "acks", "err": "errors", "start": "starts", "end": "ends"}
        kinds.update(claim="claims", w0="w0", w1="w1")
        for inc in self.incarnations.values():
            offset = self._offsets.get(inc.name, 0)
            try:
                with inc.log.open("rb") as file:
                    file.seek(offset)
                    data = file.read()
            except FileNotFoundError:
                continue
            whole = data.rfind(b"\n") + 1
            self._offsets[inc.name] = offset + whole
            for line in data[:whole].splitlines():
                event = json.loads(line)
                attr = kinds.get(event["ev"])
                if attr is not None:
                    getattr(self._runs[event["run"]], attr).append(event)
                    if event["ev"] in ("ack", "err", "start"):
                        self._answered[inc.name].add(event["run"])
        return dict(self._runs)


# ---------------------------------------------------------------- the tally


@dataclass
class Tally:
    sent: int = 0
    acked: int = 0
    uncertain: int = 0  # sent to a process killed before it acked, never re-sent
    resent: int = 0  # schedules re-sent after their process was killed unanswered
    schedule_errors: int = 0
    started: int = 0
    kills: int = 0
    same_id_restarts: int = 0
    lost: int = 0
    ran_twice: int = 0
    interrupted: int = 0  # runs with a start without end in a killed process
    killed_before_finish: int = 0  # runs whose attempt ended, then its process died
    killed_after_tombstone: int = 0  # at-most-once: killed between w0 and the start
    reruns: int = 0
    claims: int = 0
    claims_from_live: int = 0
    max_latency: float = 0.0
    max_latency_taken_over: float = 0.0
    latency_run: str = ""
    latencies: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    def line(self) -> str:
        return (
            f"runs {self.acked} acked of {self.sent} sent ({self.resent} re-sent after a "
            f"kill, {self.uncertain} uncertain, {self.schedule_errors} schedule errors), "
            f"started {self.started}, "
            f"kills {self.kills} ({self.same_id_restarts} restarted under the same id), "
            f"lost {self.lost}, ran twice {self.ran_twice} (re-runs {self.reruns}), "
            f"interrupted {self.interrupted}, killed after the handler and before the "
            f"finish {self.killed_before_finish}, killed between the tombstone write and "
            f"the start {self.killed_after_tombstone}, claims {self.claims} "
            f"(from a live owner {self.claims_from_live}), max start latency after due "
            f"or orphaning {self.max_latency:.3f} s (p50 {self.quantile(0.5):.3f} s, "
            f"p99 {self.quantile(0.99):.3f} s; taken over "
            f"{self.max_latency_taken_over:.3f} s; bound {LATENCY_BOUND:.2f} s)"
        )


def stored_records(db: Path) -> dict[str, tuple[str, str | None, int, int]]:
    """``run_id -> (state, outcome, attempt, token)`` as the SQLite file holds them at
    the end (read directly: the test checks what the store says, not what a process
    believed)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT run_id, state, outcome, attempt, token FROM runs")
        return {row[0]: (row[1], row[2], row[3], row[4]) for row in rows}


def check_records(
    cluster: Cluster, records: dict[str, tuple[str, str | None, int, int]]
) -> list[str]:
    """Every acked run ended as a tombstone: ``ran`` by the last attempt logged (under
    at-most-once, a lost run's tombstone is the killed attempt's own write)."""
    problems = []
    for run_id, log in cluster.runs().items():
        if not log.acks:
            continue
        record = records.get(run_id)
        if record is None:
            problems.append(f"run {run_id}: acked, and gone from the store")
            continue
        state, outcome, attempt, token = record
        tried = log.starts + log.w0
        last = max(tried, key=lambda e: e["token"]) if tried else None
        if (state, outcome) != ("done", "ran") or last is None or last["token"] != token:
            problems.append(f"run {run_id}: stored {record}, last attempt logged {last}")
        elif not log.starts and last["attempt"] != attempt:
            problems.append(f"run {run_id}: stored {record}, its lost attempt {last}")
    return problems


def tally(cluster: Cluster) -> tuple[Tally, list[str]]:
    incs = cluster.incarnations
    runs = cluster.runs()
    t = Tally(sent=len(cluster.sent))
    problems: list[str] = []
    deaths: defaultdict[str, list[float]] = defaultdict(list)  # process id -> deaths
    for inc in incs.values():
        if inc.died_at is not None:
            deaths[inc.process_id].append(inc.died_at)
    t.kills = sum(1 for inc in incs.values() if inc.killed_at is not None)
    killed = {name for name, inc in incs.items() if inc.killed_at is not None}
    alo = cluster.delivery == "at-least-once"

    def killed_after(proc: str, at: float) -> bool:
        inc = incs[proc]
        return inc.killed_at is not None and inc.killed_at >= at

    for run_id in sorted(set(cluster.sent) | set(runs)):
        log = runs.get(run_id, RunLog())
        if log.acks:
            t.acked += 1
        elif log.errors:
            t.schedule_errors += 1
        else:
            t.uncertain += 1
            sender = cluster.sent.get(run_id, ("?", 0.0))[0]
            if sender not in killed:
                problems.append(f"run {run_id}: sent to {sender}, never acked, not killed")
        t.claims += len(log.claims)
        starts = sorted(log.starts, key=lambda e: e["t"])
        ends = {(e["proc"], e["attempt"]) for e in log.ends}
        finished = {(e["proc"], e["attempt"]) for e in log.w1 if e["ok"]}
        if starts:
            t.started += 1
        # Interrupted: a start without its end, which only a kill may leave.
        cut = [s for s in starts if (s["proc"], s["attempt"]) not in ends]
        for s in cut:
            if s["proc"] not in killed:
                problems.append(f"run {run_id}: started without end in a live process: {s}")
        if any(s["proc"] in killed for s in cut):
            t.interrupted += 1
        # Lost.
        done = bool(log.ends) if alo else bool(starts)
        if log.acks and not done:
            t.lost += 1
            if alo:
                problems.append(f"lost under at-least-once: run {run_id}: {starts}")
            else:
                # Allowed only when it died with a killed process after the tombstone
                # write was sent: inside the handler, or before the handler's start.
                dead = [
                    w for w in log.w0 if w["proc"] in killed and killed_after(w["proc"], w["t"])
                ]
                if not dead:
                    problems.append(
                        f"lost under at-most-once without a kill after its tombstone write: "
                        f"run {run_id} (acks {log.acks}, claims {log.claims}, w0 {log.w0})"
                    )
                elif not starts:
                    t.killed_after_tombstone += 1
        # Ran twice.
        if alo:
            if len(log.ends) > 1:
                t.ran_twice += 1
            if len(starts) > 1:
                t.reruns += len(starts) - 1
            killed_before_finish = False
            for before, after in itertools.pairwise(starts):
                key = (before["proc"], before["attempt"])
                if not (before["proc"] in killed and killed_after(before["proc"], before["t"])):
                    problems.append(
                        f"re-run of run {run_id} whose previous attempt's process was not "
                        f"killed: {before} then {after}"
                    )
                elif key in finished:
                    problems.append(
                        f"re-run of run {run_id} after its finish was recorded: {before} "
                        f"then {after}"
                    )
                elif key in ends:
                    killed_before_finish = True
                if not (after["attempt"] > before["attempt"] and after["token"] > before["token"]):
                    problems.append(
                        f"re-run of run {run_id} without a higher attempt and fencing token: "
                        f"{before} then {after}"
                    )
            t.killed_before_finish += killed_before_finish
        else:
            if len(starts) > 1:
                t.ran_twice += 1
                t.reruns += len(starts) - 1
                problems.append(f"ran twice under at-most-once: run {run_id}: {starts}")
            for s in starts:
                if s["attempt"] != 1:
                    problems.append(f"attempt {s['attempt']} under at-most-once: {s}")
        # Latency: each start against max(due, the death of the owner it was taken from).
        for s in starts:
            due = s["scheduled"]
            if s["t"] < due - EARLY_TOLERANCE:
                problems.append(f"run {run_id} started {due - s['t']:.3f} s early: {s}")
            claims = [c for c in log.claims if c["proc"] == s["proc"] and c["t"] <= s["t"]]
            acks = [a for a in log.acks if a["proc"] == s["proc"]]
            if claims:
                claim = max(claims, key=lambda c: c["t"])
                earlier = [d for d in deaths.get(claim["from"], []) if d <= claim["t"]]
                if earlier:
                    orphaned = max(earlier)
                else:
                    orphaned = claim["t"]
                    t.claims_from_live += 1
                taken_over = True
            elif acks:
                orphaned = min(a["t"] for a in acks)
                taken_over = False
            else:
                problems.append(f"run {run_id} started by {s['proc']}, which never held it")
                continue
            latency = s["t"] - max(due, orphaned)
            t.latencies.append(latency)
            if latency > t.max_latency:
                t.max_latency = latency
                t.latency_run = f"{run_id}: {s}"
            if taken_over:
                t.max_latency_taken_over = max(t.max_latency_taken_over, latency)
            if latency > LATENCY_BOUND:
                problems.append(
                    f"run {run_id} started {latency:.3f} s after max(due, orphaned) "
                    f"(bound {LATENCY_BOUND:.2f} s): {s}"
                )
    return t, problems


# ---------------------------------------------------------------- the scenario


def settled(cluster: Cluster) -> bool:
    """Has every acked run started (at-most-once) or ended (at-least-once), or died
    with a killed process after its tombstone write?"""
    killed = {n for n, inc in cluster.incarnations.items() if inc.killed_at is not None}
    for log in cluster.runs().values():
        if not log.acks:
            continue
        if cluster.delivery == "at-least-once":
            if not log.ends:
                return False
        elif not log.starts and not any(w["proc"] in killed for w in log.w0):
            return False
    return True


def fault_scenario(
    cluster: Cluster,
    *,
    runs: int,
    feed_seconds: float,
    due_window: tuple[float, float],
    kill_gap: tuple[float, float] = (0.5, 1.5),
    db: Path | None = None,
) -> Tally:
    """Feed ``runs`` runs over ``feed_seconds`` while killing and restarting drivers;
    wait until they settle; stop every driver cleanly; count."""
    rng = cluster.rng
    started = time.monotonic()
    for _ in range(PROCESSES):
        cluster.spawn()
    cluster.wait_ready()
    tick = 0.1
    ticks = int(feed_seconds / tick)
    ids = [f"r{n:05d}" for n in range(runs)]
    batches = [ids[i * runs // ticks : (i + 1) * runs // ticks] for i in range(ticks)]
    same_id = 0
    resent = 0
    next_kill = time.time() + rng.uniform(*kill_gap)
    last_kill = 0.0
    backlog: list[tuple[str, float]] = []
    for batch in batches:
        tick_end = time.monotonic() + tick
        now = time.time()
        backlog.extend((run, now + rng.uniform(*due_window)) for run in batch)
        targets = cluster.usable()
        if targets and backlog:
            rng.shuffle(backlog)
            for i, target in enumerate(targets):
                cluster.send(target, backlog[i :: len(targets)])
            backlog = []
        ready = cluster.usable()
        if time.time() >= next_kill and len(ready) >= 2:
            # A random ready driver (one still starting up has no runs yet), and never
            # the last one: a ready peer is always there to take the victim's runs.
            victim = rng.choice(ready)
            last_kill = cluster.kill(victim)
            # A client retries the schedules the victim never answered (idempotent),
            # unless the victim already started the run (its fate is then known).
            unanswered = cluster.unanswered(victim)
            resent += len(unanswered)
            backlog.extend(unanswered)
            if rng.random() < 0.5:
                same_id += 1
                cluster.spawn(victim.process_id)
            else:
                cluster.spawn()
            next_kill = time.time() + rng.uniform(*kill_gap)
        cluster.check_crashes()
        time.sleep(max(0.0, tick_end - time.monotonic()))
    if backlog:
        cluster.wait_ready()
        cluster.send(rng.choice(cluster.usable()), backlog)
    # No more kills: wait for every run to settle, and for re-runs of the last kill.
    last_due = max(due for _, due in cluster.sent.values())
    quiet = max(last_due, last_kill + LEASE + SKEW + 2 * HEARTBEAT) + 0.3
    deadline = max(quiet, last_kill + LATENCY_BOUND) + 5.0
    while time.time() < deadline and not (time.time() >= quiet and settled(cluster)):
        cluster.check_crashes()
        time.sleep(0.25)
    cluster.wait_ready()
    cluster.shutdown()
    cluster.check_crashes()
    cluster.dump()
    result, problems = tally(cluster)
    if db is not None:
        problems += check_records(cluster, stored_records(db))
    result.same_id_restarts = same_id
    result.resent = resent
    for inc in cluster.incarnations.values():
        if inc.killed_at is None and inc.proc.returncode != 0:
            problems.append(f"{inc.name} exited with {inc.proc.returncode}")
    elapsed = time.monotonic() - started
    summary = f"[{cluster.delivery}] {elapsed:.1f} s: {result.line()}"
    print(f"\n{summary}\n  slowest start: {result.latency_run}")  # noqa: T201
    if cluster.delivery == "at-least-once":
        assert result.lost == 0, summary + "\n" + "\n".join(problems[:20])
    else:
        assert result.ran_twice == 0, summary + "\n" + "\n".join(problems[:20])
        assert result.lost <= result.interrupted + result.killed_after_tombstone, summary
    assert problems == [], summary + "\n" + "\n".join(problems[:20])
    assert result.kills >= 5, summary
    return result


@pytest.fixture
def db_dir(tmp_path: Path) -> Iterator[Path]:
    """Where the SQLite file goes: a tmpfs (``/dev/shm``) when there is one.

    The store syncs the WAL at each run write (``synchronous=FULL``), which on a busy
    shared disk costs milliseconds a write: thousands of runs a few seconds apart then
    measure the disk, not the scheduler. A ``SIGKILL`` loses nothing the kernel has
    (the page cache outlives the process), so a tmpfs changes no outcome here.
    """
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="trio-debounce-runs-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sqlite_args(db_dir: Path) -> list[str]:
    return ["--store", "sqlite", "--path", str(db_dir / "runs.db")]


def nats_args(server: NatsServer) -> list[str]:
    return ["--store", "nats", "--url", server.url, "--bucket", "r" + uuid.uuid4().hex[:12]]


#: The fault scenarios' length: ``(runs, feed seconds)`` on SQLite and on NATS, and the
#: seconds between kills. The suite feeds 6 s at the long variant's rate of schedules,
#: with a kill every 0.3 to 0.9 s (at least the 5 kills the scenario asserts, about 8);
#: ``nox -s chaos`` runs the long variant (20 s and 12 s, a kill every 0.5 to 1.5 s).
SQLITE_FEED = (2000, 20.0) if LONG else (600, 6.0)
NATS_FEED = (300, 12.0) if LONG else (150, 6.0)
KILL_GAP = (0.5, 1.5) if LONG else (0.3, 0.9)
#: Seconds from a schedule to the run's due time: past the horizon (2 s) for a part of
#: the runs either way (the long variant's last runs fall due a second later).
DUE_WINDOW = (0.5, 4.0) if LONG else (0.5, 3.0)


@pytest.mark.solo  # nothing beside it: its kills, leases and latencies are timed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("delivery", deliveries("at-least-once"))
def test_sqlite_sigkill(tmp_path: Path, db_dir: Path, delivery: str) -> None:
    seed = random.randrange(2**32)
    print(f"\nseed {seed}")  # noqa: T201
    cluster = Cluster(tmp_path, sqlite_args(db_dir), delivery=delivery, rng=random.Random(seed))
    try:
        fault_scenario(
            cluster,
            runs=SQLITE_FEED[0],
            feed_seconds=SQLITE_FEED[1],
            due_window=DUE_WINDOW,
            kill_gap=KILL_GAP,
            db=db_dir / "runs.db",
        )
    except BaseException:
        print(cluster.tails())  # noqa: T201
        raise
    finally:
        cluster.kill_all()


@pytest.mark.solo  # nothing beside it: its kills, leases and latencies are timed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("delivery", deliveries("at-most-once"))
def test_nats_sigkill(nats_server: NatsServer, tmp_path: Path, delivery: str) -> None:
    seed = random.randrange(2**32)
    print(f"\nseed {seed}")  # noqa: T201
    cluster = Cluster(tmp_path, nats_args(nats_server), delivery=delivery, rng=random.Random(seed))
    try:
        fault_scenario(
            cluster,
            runs=NATS_FEED[0],
            feed_seconds=NATS_FEED[1],
            due_window=DUE_WINDOW,
            kill_gap=KILL_GAP,
        )
    except BaseException:
        print(cluster.tails())  # noqa: T201
        raise
    finally:
        cluster.kill_all()


# ---------------------------------------------------------------- restart and exit

#: A lease long enough that a run taken over only after it lapses is obvious.
LONG_LEASE = 20.0
#: Runs of the restart and exit tests.
FEW_RUNS = 20
#: Seconds from their schedule to the first of those runs' due times: time to have them
#: acked and the process killed or exited before any is due (its asserts check that).
FEW_RUNS_DUE_IN = 2.0


def store_args(request: pytest.FixtureRequest, store: str, db_dir: Path) -> list[str]:
    if store == "sqlite":
        return sqlite_args(db_dir)
    return nats_args(request.getfixturevalue("nats_server"))


def long_lease_cluster(tmp_path: Path, args: list[str], delivery: str) -> Cluster:
    return Cluster(
        tmp_path,
        args,
        delivery=delivery,
        rng=random.Random(),
        lease=LONG_LEASE,
        heartbeat=0.5,
        skew=0.5,
        horizon=2.0,
        spares=1,
    )


def wait_until(cluster: Cluster, predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        cluster.check_crashes()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def schedule_and_wait(
    cluster: Cluster, inc: Incarnation, runs: list[tuple[str, float]]
) -> dict[str, RunLog]:
    cluster.send(inc, runs)
    ids = [run for run, _ in runs]
    assert wait_until(
        cluster, lambda: all(cluster.runs().get(run, RunLog()).acks for run in ids), 5.0
    ), "schedules not acked in time:\n" + cluster.tails()
    logs = cluster.runs()
    for run in ids:
        [ack] = logs[run].acks
        assert (ack["owner"], ack["outcome"]) == (inc.process_id, "scheduled"), ack
    return logs


def ended(cluster: Cluster, ids: list[str]) -> bool:
    logs = cluster.runs()
    return all(logs.get(run, RunLog()).ends for run in ids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
@pytest.mark.parametrize("store", ["sqlite", "nats"])
def test_restart_with_a_stable_process_id_runs_its_late_runs_at_once(
    request: pytest.FixtureRequest, tmp_path: Path, db_dir: Path, store: str, delivery: str
) -> None:
    """A driver with process id "svc" schedules runs and is killed before they are due;
    once they are overdue, a new process with the same id starts: having watched the
    dead lease for one heartbeat interval plus the skew without a renewal (so it is no
    twin), it takes them back at once (its epoch fences the dead one's claims) and runs
    each once, attempt 1, long before the dead incarnation's lease would have let a
    peer take them."""
    cluster = long_lease_cluster(tmp_path, store_args(request, store, db_dir), delivery)
    try:
        first = cluster.spawn("svc")
        cluster.wait_ready()
        now = time.time()
        runs = [(f"svc-{i}", now + FEW_RUNS_DUE_IN + 0.02 * i) for i in range(FEW_RUNS)]
        ids = [run for run, _ in runs]
        schedule_and_wait(cluster, first, runs)
        killed_at = cluster.kill(first)
        first_due = min(due for _, due in runs)
        last_due = max(due for _, due in runs)
        assert killed_at < first_due - 0.2, "killed too late: the runs were due"
        # Nobody is alive when they fall due: nothing runs.
        time.sleep(max(0.0, last_due + 0.5 - time.time()))
        assert not any(log.starts for log in cluster.runs().values())
        second = cluster.spawn("svc")
        assert wait_until(cluster, lambda: ended(cluster, ids), 10.0), cluster.tails()
        logs = cluster.runs()
        latest = 0.0
        for run in ids:
            [start] = logs[run].starts
            assert start["proc"] == second.name, start
            assert start["attempt"] == 1, start
            latest = max(latest, start["t"])
        assert second.ready_at is not None
        print(  # noqa: T201
            f"\n[{store} {delivery}] {FEW_RUNS} runs {last_due - killed_at:.2f} s overdue "
            f"at the restart, all started within {latest - second.spawned_at:.3f} s of it "
            f"({latest - second.ready_at:.3f} s of its coordinator's start; the dead "
            f"lease lapses {LONG_LEASE:g} s after the kill)"
        )
        # At once: by the first claim sweep, not after the old lease lapsed (+ skew), as
        # a peer would have had to wait.
        assert latest - second.ready_at < 1.5, latest - second.ready_at
        assert latest < killed_at + LONG_LEASE / 2
        cluster.shutdown()
        assert all(
            inc.proc.returncode == 0
            for inc in cluster.incarnations.values()
            if inc.killed_at is None
        )
    except BaseException:
        print(cluster.tails())  # noqa: T201
        raise
    finally:
        cluster.kill_all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
@pytest.mark.parametrize("store", ["sqlite", "nats"])
def test_clean_exit_releases_claims_to_a_peer(
    request: pytest.FixtureRequest, tmp_path: Path, db_dir: Path, store: str, delivery: str
) -> None:
    """A driver that exits normally (on_exit default) leaves its persisted runs in the
    store and releases its lease: a live peer runs each once, on time, not a lease
    later."""
    cluster = long_lease_cluster(tmp_path, store_args(request, store, db_dir), delivery)
    try:
        leaver = cluster.spawn("leaver")
        peer = cluster.spawn("peer")
        cluster.wait_ready()
        now = time.time()
        runs = [(f"left-{i}", now + FEW_RUNS_DUE_IN + 0.02 * i) for i in range(FEW_RUNS)]
        ids = [run for run, _ in runs]
        schedule_and_wait(cluster, leaver, runs)
        cluster.close(leaver)
        cluster.wait_exit(leaver)
        assert leaver.proc.returncode == 0
        assert leaver.exited_at is not None
        # It did not wait for its runs (they may be days away): it left them.
        first_due = min(due for _, due in runs)
        assert leaver.exited_at < first_due - 0.3, "the leaver exited after its runs were due"
        last_due = max(due for _, due in runs)
        assert wait_until(cluster, lambda: ended(cluster, ids), last_due - time.time() + 5.0)
        logs = cluster.runs()
        late = 0.0
        for run, due in runs:
            [start] = logs[run].starts
            assert start["proc"] == peer.name, start
            assert start["attempt"] == 1, start
            assert start["t"] >= due - EARLY_TOLERANCE, start
            late = max(late, start["t"] - due)
        print(  # noqa: T201
            f"\n[{store} {delivery}] {FEW_RUNS} runs left by a clean exit, run by the peer "
            f"at most {late:.3f} s after due (the leaver's lease would lapse "
            f"{LONG_LEASE:g} s after its last heartbeat)"
        )
        # On time: at their due time, not after the leaver's lease.
        assert late < 1.0, late
        cluster.shutdown()
        assert all(inc.proc.returncode == 0 for inc in cluster.incarnations.values())
    except BaseException:
        print(cluster.tails())  # noqa: T201
        raise
    finally:
        cluster.kill_all()
