"""Failover across real OS processes sharing a real ``nats-server`` bucket.

Each process is ``tests/nats/failover_driver.py`` (one coordinator, workflow ``"wf"``),
driven over stdin and reporting JSON lines on stdout. The tests ping windows through
random live processes (a round's keys are trailing, leading and both-edges windows in
turn: ``failover_driver.key_mode``), ``SIGKILL`` the process that owns the most open
windows (before their fire, or while its handler runs), start a replacement under a
new process id, and then check, from the reports alone, per window (run id) and edge
(the leading edge of a window opened by a ``fire-immediate`` ping; the trailing edge
of a trailing window, and of a both-edges window with two pings or more):

* lost: an edge the window needs never started (under at-least-once, also one whose
  every start was interrupted and that never completed; a leading edge is excused
  once a later fire of its key started, since its re-run is then skipped by design);
* ran twice: more than one ``start`` of one edge of the run, across processes;
* interrupted: a ``start`` without its ``done`` in a killed process;
* every trailing fire carries the payload (and count) of the window's latest stored
  ping, every leading fire its opening ping's (count 1);
* every fire starts within lease + skew + heartbeat + delay + 1.5 s of the kill or of
  the window's last ping, whichever is later.

At-least-once must lose nothing; at-most-once must run nothing twice. The hand-off
tests close a process's stdin with ``--on-exit handoff``: a live peer fires each open
window once and on time, and with no peer alive, a process started later fires them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harness.env import LONG, ROOT, deliveries
from tests.harness.nats_server import NatsServer
from tests.nats.failover_driver import key_mode

pytestmark = [pytest.mark.slow, pytest.mark.realtime]

#: The driver, run as a module so that it imports the tests package first (which
#: applies ``TRIO_DEBOUNCE_TEST_AUTO_HOST``: tests/__init__.py).
DRIVER = ("-m", "tests.nats.failover_driver")

LEASE = 1.0
SKEW = 0.2
DELAY = 0.6
HEARTBEAT = LEASE / 3
#: A fire after a kill starts within this of the kill or of its window's last ping.
LATENCY_BOUND = LEASE + SKEW + HEARTBEAT + DELAY + 1.5
#: Processes alive at once in the failover test.
PROCESSES = 3
#: Keys pinged per round (one kill per round).
KEYS_PER_ROUND = 24
#: Owner-kill events each mode must reach.
MIN_OWNER_KILLS = 50
if LONG:
    # The long variant (nox -s chaos): twice the owner-kill events.
    #: Rounds each mode runs at least.
    MIN_ROUNDS = 4
    #: Owner-kill events (open windows whose owner was killed) each mode aims for.
    TARGET_OWNER_KILLS = 100
    #: Seconds of rounds each mode may spend (then it stops, whatever the count).
    ROUNDS_BUDGET = 40.0
else:
    # The suite's variant: rounds until the owner-kill events it asserts (4 or 5).
    MIN_ROUNDS = 2
    TARGET_OWNER_KILLS = MIN_OWNER_KILLS
    ROUNDS_BUDGET = 30.0

Event = dict[str, Any]


@dataclass
class Driver:
    """One driver process, as the test sees it."""

    name: str
    proc: subprocess.Popen[bytes]
    handler_time: float
    log: Path
    reader: threading.Thread | None = None
    ready_at: float | None = None
    exited_at: float | None = None
    killed_at: float | None = None
    closed: bool = False
    eof: bool = False

    @property
    def live(self) -> bool:
        return self.killed_at is None and self.exited_at is None and not self.eof

    @property
    def usable(self) -> bool:
        """Live and ready to take pings."""
        return self.live and self.ready_at is not None


@dataclass
class Kill:
    """One SIGKILL: when, whom, and the windows it left open (owner-kill events)."""

    at: float
    name: str
    keys: set[str]
    affected: set[str] = field(default_factory=set)
    interrupted: set[str] = field(default_factory=set)


class Cluster:
    """Driver processes sharing one bucket; their reports, indexed by run id."""

    def __init__(
        self,
        server: NatsServer,
        tmp_path: Path,
        *,
        delivery: str,
        delay: float = DELAY,
        rng: random.Random,
    ) -> None:
        self.url = server.url
        self.bucket = "f" + uuid.uuid4().hex[:12]
        self.delivery = delivery
        self.delay = delay
        self.tmp_path = tmp_path
        self.rng = rng
        self.drivers: dict[str, Driver] = {}
        self.events: list[Event] = []
        self._queue: queue.Queue[tuple[str, Event | None]] = queue.Queue()
        self._next = 0
        self.acks: defaultdict[str, list[Event]] = defaultdict(list)
        self.starts: defaultdict[str, list[Event]] = defaultdict(list)
        self.dones: defaultdict[str, list[Event]] = defaultdict(list)
        self.errors: list[Event] = []
        self.outstanding: set[str] = set()  # payloads sent whose ack has not come
        self.sent_to: dict[str, str] = {}  # payload -> the process it was sent to
        self.crashed: list[str] = []  # drivers that ended without a kill or a close
        self.first_kill_in_handler = rng.randrange(2)  # 0: round 0 kills in a handler

    # ------------------------------------------------------------ processes

    def spawn(self, *, on_exit: str = "wait", handler_time: float | None = None) -> Driver:
        name = f"p{self._next}"
        self._next += 1
        if handler_time is None:
            handler_time = self.rng.uniform(0.05, 0.2)
        log = self.tmp_path / f"{name}.log"
        args = [
            sys.executable,
            *DRIVER,
            "--url",
            self.url,
            "--bucket",
            self.bucket,
            "--process-id",
            name,
            "--delivery",
            self.delivery,
            "--lease",
            str(LEASE),
            "--skew",
            str(SKEW),
            "--delay",
            str(self.delay),
            "--handler-time",
            str(handler_time),
            "--on-exit",
            on_exit,
            "--log-level",
            "INFO",
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=ROOT,
                env=env,
            )
        driver = Driver(name, proc, handler_time, log)
        driver.reader = threading.Thread(target=self._read, args=(driver,), daemon=True)
        driver.reader.start()
        self.drivers[name] = driver
        return driver

    def _read(self, driver: Driver) -> None:
        assert driver.proc.stdout is not None
        for raw in driver.proc.stdout:
            try:
                event: Event = json.loads(raw)
            except ValueError:
                event = {"ev": "garbage", "line": raw.decode(errors="replace")}
            event["proc"] = driver.name
            self._queue.put((driver.name, event))
        self._queue.put((driver.name, None))

    def pump(self, timeout: float = 0.0) -> None:
        """Take in every report that has arrived, waiting up to ``timeout`` for one."""
        block = timeout > 0
        while True:
            try:
                name, event = self._queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            driver = self.drivers[name]
            if event is None:
                driver.eof = True
                if driver.killed_at is None and not driver.closed:
                    self.crashed.append(driver.name)
                continue
            self.events.append(event)
            kind = event["ev"]
            if kind == "ready":
                driver.ready_at = event["t"]
            elif kind == "exit":
                driver.exited_at = event["t"]
            elif kind == "ack":
                self.acks[event["run"]].append(event)
                self.outstanding.discard(event["payload"])
            elif kind == "error":
                self.errors.append(event)
                self.outstanding.discard(event["payload"])
            elif kind == "start":
                self.starts[event["run"]].append(event)
            elif kind == "done":
                self.dones[event["run"]].append(event)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            self.check_crashes()
            if predicate():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.pump(min(left, 0.02))

    def check_crashes(self) -> None:
        """Fail at once if a driver ended on its own (neither killed nor closed)."""
        if self.crashed:
            for name in self.crashed:
                self.drivers[name].proc.wait(5)
            raise AssertionError(
                "driver processes died on their own: "
                + ", ".join(f"{n} (rc {self.drivers[n].proc.returncode})" for n in self.crashed)
            )

    def sleep(self, seconds: float) -> None:
        """Sleep while taking in reports."""
        self.wait_for(lambda: False, seconds)

    def wait_ready(self, timeout: float = 15.0) -> None:
        starting = [d for d in self.drivers.values() if d.live and d.ready_at is None]
        ok = self.wait_for(lambda: all(d.ready_at is not None for d in starting), timeout)
        assert ok, f"drivers not ready within {timeout} s: {[d.name for d in starting]}"

    def usable(self) -> list[Driver]:
        return [d for d in self.drivers.values() if d.usable]

    def ping(self, driver: Driver, key: str, payload: str | None = None) -> str:
        if payload is None:
            payload = f"{key}/{self.rng.getrandbits(48):012x}"
        assert driver.proc.stdin is not None
        self.outstanding.add(payload)
        self.sent_to[payload] = driver.name
        try:
            driver.proc.stdin.write(f"ping {key} {payload}\n".encode())
            driver.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.outstanding.discard(payload)
        return payload

    def wait_acks(self, timeout: float = 5.0) -> None:
        ok = self.wait_for(lambda: not self.outstanding, timeout)
        assert ok, f"{len(self.outstanding)} pings unanswered after {timeout} s"

    def kill(self, driver: Driver) -> float:
        """SIGKILL the driver, reap it, and take in all it wrote before dying."""
        at = time.time()
        os.kill(driver.proc.pid, signal.SIGKILL)
        driver.killed_at = at
        driver.proc.wait(5)
        assert driver.reader is not None
        driver.reader.join(5)
        self.pump()
        # Pings sent to it that it never answered are not waited for.
        self.outstanding -= {p for p in self.outstanding if self.sent_to[p] == driver.name}
        return at

    def close(self, driver: Driver) -> None:
        """Close the driver's stdin: its coordinator's block exits normally."""
        assert driver.proc.stdin is not None
        driver.closed = True
        with contextlib.suppress(BrokenPipeError, OSError):
            driver.proc.stdin.close()

    def shutdown(self, timeout: float = 15.0) -> None:
        """Close every live driver's stdin and wait for them to exit."""
        for driver in self.drivers.values():
            if driver.live:
                self.close(driver)
        deadline = time.monotonic() + timeout
        for driver in self.drivers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                driver.proc.wait(max(0.1, deadline - time.monotonic()))
        self.wait_for(lambda: all(d.eof for d in self.drivers.values()), 2.0)

    def kill_all(self) -> None:
        """Kill (by pid) every driver still running; never raises."""
        for driver in self.drivers.values():
            if driver.proc.poll() is None:
                try:
                    os.kill(driver.proc.pid, signal.SIGKILL)
                    driver.proc.wait(5)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            for stream in (driver.proc.stdin, driver.proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for driver in self.drivers.values():
            try:
                text = driver.log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                text = ["(no log)"]
            out.append(f"--- {driver.name} (rc {driver.proc.poll()}) ---\n" + "\n".join(text))
        return "\n".join(out)

    # -------------------------------------------------------------- windows

    def stored_runs(self, keys: set[str] | None = None) -> set[str]:
        return {
            run
            for run, acks in self.acks.items()
            if any(a["stored"] for a in acks) and (keys is None or acks[0]["key"] in keys)
        }

    def owner(self, run: str) -> str | None:
        """The process that last said (in an ack) that it owns the run."""
        owned = [a for a in self.acks[run] if a["owner"]]
        return max(owned, key=lambda a: a["count"])["proc"] if owned else None

    def needs(self, run: str) -> set[str]:
        """The edges window ``run`` must fire: leading if a ping opened it with a
        leading fire; trailing for a trailing window, and for a both-edges window that
        holds two pings or more."""
        stored = [a for a in self.acks[run] if a["stored"]]
        if not stored:
            return set()
        mode = key_mode(stored[0]["key"])
        edges = set()
        if any(a["outcome"] == "fire-immediate" for a in stored):
            edges.add("leading")
        if mode == "trailing" or (mode == "both" and max(a["count"] for a in stored) >= 2):
            edges.add("trailing")
        return edges

    def starts_of(self, run: str, edge: str) -> list[Event]:
        return [s for s in self.starts.get(run, []) if s["edge"] == edge]

    def dones_of(self, run: str, edge: str) -> list[Event]:
        return [d for d in self.dones.get(run, []) if d["edge"] == edge]

    def later_fire_started(self, run: str, key: str, token: int) -> bool:
        """Did a fire of ``key`` with a fencing token above ``token`` start (so that a
        leading fire's re-run is skipped by design)?"""
        return any(
            s["token"] > token for runs in self.starts.values() for s in runs if s["key"] == key
        )

    def edge_settled(self, run: str, edge: str) -> bool:
        """Has the edge been run to its end (at-least-once), or started and ended or
        died with its process (at-most-once)?"""
        starts = self.starts_of(run, edge)
        done_in = {(d["proc"], d["attempt"]) for d in self.dones_of(run, edge)}
        if self.delivery == "at-least-once":
            if done_in:
                return True
            top = max((s["token"] for s in starts), default=None)
            return (
                edge == "leading"
                and top is not None
                and self.later_fire_started(run, starts[0]["key"], top)
            )
        return bool(starts) and not any(
            (s["proc"], s["attempt"]) not in done_in and self.drivers[s["proc"]].live
            for s in starts
        )

    def open_windows(self, driver: Driver, keys: set[str]) -> set[str]:
        """Runs of ``keys`` whose fire ``driver`` still has to run or finish: owned
        with an edge not started anywhere, or with a start in it not done there."""
        runs = set()
        for run in self.stored_runs(keys):
            for edge in self.needs(run):
                starts = self.starts_of(run, edge)
                done_here = {
                    d["attempt"] for d in self.dones_of(run, edge) if d["proc"] == driver.name
                }
                if (not starts and self.owner(run) == driver.name) or any(
                    s["proc"] == driver.name and s["attempt"] not in done_here for s in starts
                ):
                    runs.add(run)
        return runs

    def settled(self, runs: set[str]) -> bool:
        """Has every edge of every run been run to its end (or, under at-most-once,
        died with its process)?"""
        return all(self.edge_settled(run, edge) for run in runs for edge in self.needs(run))


@dataclass
class Tally:
    runs: int = 0
    fires: int = 0
    lost: int = 0
    lost_at_fire: int = 0
    ran_twice: int = 0
    interrupted: int = 0
    rerun: int = 0
    #: Re-runs (attempt > 1) of a fire no killed process had started: the owner died
    #: after writing its fire record and before committing the fire (deleting the
    #: window), and a survivor ran both the record and the window.
    uncommitted_reruns: int = 0
    stale_payloads: int = 0
    kills: int = 0
    owner_kill_events: int = 0
    max_failover_latency: float = 0.0
    max_late: float = 0.0


def tally(cluster: Cluster, kills: list[Kill]) -> tuple[Tally, list[str]]:
    """Count lost, ran twice and interrupted windows (per edge); list every violated
    promise."""
    t = Tally(kills=len(kills), owner_kill_events=sum(len(k.affected) for k in kills))
    problems: list[str] = []
    killed = {d.name for d in cluster.drivers.values() if d.killed_at is not None}
    kill_of_key = {key: k for k in kills for key in k.keys}
    for run in sorted(cluster.stored_runs()):
        acks = cluster.acks[run]
        stored = [a for a in acks if a["stored"]]
        # Pings merged into one write (group commit) report its count; the write's
        # stored payload is its last ping's, the last to enter debounce in that process.
        latest = max(stored, key=lambda a: (a["count"], a["seq"]))
        # A leading fire carries its opening ping's payload (written alone).
        opener = next((a for a in stored if a["outcome"] == "fire-immediate"), None)
        last_ack = max(a["t"] for a in acks)
        t.runs += 1
        for edge in sorted(cluster.needs(run)):
            _tally_edge(cluster, t, problems, run, edge, latest, opener, last_ack, killed)
        for start in cluster.starts.get(run, []):
            kill = kill_of_key.get(start["key"])
            if kill is None or start["t"] < kill.at:
                continue
            since = max(kill.at, last_ack)
            latency = start["t"] - since
            if latency > LATENCY_BOUND:
                problems.append(
                    f"run {run} started {latency:.3f} s after max(kill, last ack) "
                    f"(bound {LATENCY_BOUND:.3f} s): {start}"
                )
            if run in kill.affected:
                t.max_failover_latency = max(t.max_failover_latency, latency)
                due = latest["at"] if start["edge"] == "trailing" else None
                t.max_late = max(t.max_late, start["t"] - max(kill.at, due or kill.at))
    for error in cluster.errors:
        problems.append(f"a ping raised: {error}")
    return t, problems


def _tally_edge(
    cluster: Cluster,
    t: Tally,
    problems: list[str],
    run: str,
    edge: str,
    latest: Event,
    opener: Event | None,
    last_ack: float,
    killed: set[str],
) -> None:
    """Count one edge of window ``run``: lost, ran twice, interrupted, its payloads."""
    starts = sorted(cluster.starts_of(run, edge), key=lambda s: s["t"])
    dones = cluster.dones_of(run, edge)
    done_in = {(d["proc"], d["attempt"]) for d in dones}
    t.fires += len(starts)
    interrupted = [
        s for s in starts if s["proc"] in killed and (s["proc"], s["attempt"]) not in done_in
    ]
    t.interrupted += len(interrupted)
    if not cluster.edge_settled(run, edge) or not starts:
        t.lost += 1
        # Under at-most-once a fire is lost when its process dies between the commit of
        # the fire and the handler's end: allowed (an interrupted start). A window whose
        # owner died before it was due must be adopted and fired.
        allowed = cluster.delivery == "at-most-once" and bool(interrupted)
        if allowed:
            t.lost_at_fire += 1
        else:
            problems.append(
                f"lost: {edge} edge of run {run} key {latest['key']} (acks "
                f"{len(cluster.acks[run])}, starts {len(starts)}, owner {cluster.owner(run)})"
            )
    if len(starts) > 1:
        t.ran_twice += 1
        t.rerun += len(starts) - 1
        # A re-run needs an earlier attempt whose process was killed after it started:
        # inside the handler, or after it returned but before its record was purged.
        cut = [s for s in starts if s["proc"] in killed]
        if cluster.delivery == "at-most-once":
            problems.append(f"ran twice under at-most-once: {edge} edge of run {run}: {starts}")
        elif len(starts) - 1 > len(cut):
            t.uncommitted_reruns += len(starts) - 1 - len(cut)
            problems.append(f"re-run without a killed attempt: run {run}: {starts}")
    want = latest if edge == "trailing" else opener
    for start in starts:
        count = latest["count"] if edge == "trailing" else 1
        if want is None or start["payload"] != want["payload"] or start["count"] != count:
            t.stale_payloads += 1
            problems.append(
                f"{edge} fire of run {run} with payload {start['payload']!r} (count "
                f"{start['count']}); want {None if want is None else want['payload']!r} "
                f"(count {count})"
            )
        if start["attempt"] > 1 and cluster.delivery == "at-most-once":
            problems.append(f"attempt {start['attempt']} under at-most-once: {start}")


def run_round(cluster: Cluster, round_no: int, kills: list[Kill]) -> None:
    rng = cluster.rng
    keys = {f"r{round_no}k{i}" for i in range(KEYS_PER_ROUND)}
    ordered = sorted(keys)
    # Pings in waves through random live processes: the first one opens each window.
    for wave in range(3):
        for key in ordered:
            if wave == 0 or rng.random() < 0.6:
                cluster.ping(rng.choice(cluster.usable()), key)
        cluster.sleep(0.03)
    cluster.wait_acks()
    # Kill the process with the most open windows: before their fire, or in a handler,
    # by turns (from a random first), so that even a short run has both kinds.
    in_handler = (round_no + cluster.first_kill_in_handler) % 2 == 0
    if in_handler:
        target = max(cluster.usable(), key=lambda d: len(cluster.open_windows(d, keys)))
        cluster.wait_for(
            lambda: any(
                s["proc"] == target.name and s["key"] in keys
                for runs in cluster.starts.values()
                for s in runs
            ),
            DELAY + 1.0,
        )
        cluster.sleep(rng.uniform(0.0, 0.9 * target.handler_time))
    else:
        cluster.sleep(rng.uniform(0.0, 0.8 * DELAY))
        target = max(cluster.usable(), key=lambda d: len(cluster.open_windows(d, keys)))
    at = cluster.kill(target)
    # All it wrote is in: what it left open is exact.
    affected = cluster.open_windows(target, keys)
    kill = Kill(at, target.name, keys, affected)
    kill.interrupted = {
        run
        for run in affected
        if any(s["proc"] == target.name for s in cluster.starts.get(run, []))
    }
    kills.append(kill)
    cluster.spawn()
    # Keep pinging a bit, through the survivors (and the newcomer once it is ready).
    for _ in range(4):
        for key in rng.sample(ordered, 3):
            cluster.ping(rng.choice(cluster.usable()), key)
        cluster.sleep(0.1)
    cluster.wait_acks()
    runs = cluster.stored_runs(keys)
    earliest_quiet = at + LEASE + SKEW + 2 * HEARTBEAT + 0.3
    cluster.wait_for(
        lambda: time.time() >= earliest_quiet and cluster.settled(runs),
        max(0.0, at + LATENCY_BOUND + 3.0 - time.time()),
    )
    cluster.wait_ready()


@pytest.mark.solo  # nothing beside it: its kills, leases and latencies are timed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("delivery", deliveries("at-least-once"))
def test_sigkill_failover(nats_server: NatsServer, tmp_path: Path, delivery: str) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    cluster = Cluster(nats_server, tmp_path, delivery=delivery, rng=rng)
    kills: list[Kill] = []
    started = time.monotonic()
    try:
        for _ in range(PROCESSES):
            cluster.spawn()
        cluster.wait_ready()
        round_no = 0
        while round_no < MIN_ROUNDS or (
            sum(len(k.affected) for k in kills) < TARGET_OWNER_KILLS
            and time.monotonic() - started < ROUNDS_BUDGET
        ):
            run_round(cluster, round_no, kills)
            round_no += 1
        cluster.shutdown()
        cluster.check_crashes()
        result, problems = tally(cluster, kills)
        for driver in cluster.drivers.values():
            if driver.killed_at is None and driver.proc.returncode != 0:
                problems.append(f"{driver.name} exited with {driver.proc.returncode}")
        elapsed = time.monotonic() - started
        print(  # noqa: T201
            f"\n[{delivery}] seed {seed}: {round_no} rounds in {elapsed:.1f} s; "
            f"windows {result.runs}, fires {result.fires}, lost {result.lost} "
            f"({result.lost_at_fire} killed in their fire), "
            f"ran twice {result.ran_twice} (re-runs {result.rerun}, of uncommitted fires "
            f"{result.uncommitted_reruns}), stale payloads {result.stale_payloads}, "
            f"interrupted {result.interrupted}, kills {result.kills}, "
            f"owner-kill events {result.owner_kill_events} "
            f"({sum(len(k.interrupted) for k in kills)} in a handler), "
            f"max failover latency {result.max_failover_latency:.3f} s "
            f"(bound {LATENCY_BOUND:.2f} s; max lateness past schedule or kill "
            f"{result.max_late:.3f} s)"
        )
        assert result.owner_kill_events >= MIN_OWNER_KILLS
        if delivery == "at-least-once":
            assert result.lost == 0, problems
        else:
            assert result.ran_twice == 0, problems
        assert problems == [], f"seed {seed}:\n" + "\n".join(problems[:20])
    except BaseException:
        print(cluster.log_tails())  # noqa: T201
        raise
    finally:
        cluster.kill_all()


HANDOFF_DELAY = 1.5
HANDOFF_KEYS = 8


def _ping_handoff_windows(cluster: Cluster, leaver: Driver, peer: Driver | None) -> set[str]:
    keys = {f"h{i}" for i in range(HANDOFF_KEYS)}
    for key in sorted(keys):
        cluster.ping(leaver, key)  # the leaver opens and owns every window
    cluster.wait_acks()
    for key in sorted(keys):
        if cluster.rng.random() < 0.5:
            cluster.ping(peer or leaver, key)
    cluster.wait_acks()
    runs = cluster.stored_runs(keys)
    assert len(runs) == HANDOFF_KEYS
    assert all(cluster.owner(run) == leaver.name for run in runs)
    return runs


def _check_fired_once(cluster: Cluster, runs: set[str], by: Driver) -> list[tuple[Event, Event]]:
    fired = []
    for run in runs:
        starts = cluster.starts.get(run, [])
        stored = [a for a in cluster.acks[run] if a["stored"]]
        latest = max(stored, key=lambda a: (a["count"], a["seq"]))
        assert len(starts) == 1, (run, starts)
        [start] = starts
        assert start["proc"] == by.name
        assert start["attempt"] == 1
        assert (start["payload"], start["count"]) == (latest["payload"], latest["count"])
        assert [d["proc"] for d in cluster.dones.get(run, [])] == [by.name]
        fired.append((start, latest))
    return fired


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
def test_handoff_to_a_live_peer(nats_server: NatsServer, tmp_path: Path, delivery: str) -> None:
    cluster = Cluster(
        nats_server, tmp_path, delivery=delivery, delay=HANDOFF_DELAY, rng=random.Random()
    )
    try:
        leaver = cluster.spawn(on_exit="handoff")
        peer = cluster.spawn()
        cluster.wait_ready()
        runs = _ping_handoff_windows(cluster, leaver, peer)
        cluster.close(leaver)
        assert cluster.wait_for(lambda: leaver.exited_at is not None, 5.0), "no exit"
        assert leaver.proc.wait(5) == 0
        assert leaver.exited_at is not None
        # The leaver did not wait for its windows: it left them to the peer.
        first_due = min(max(a["at"] for a in cluster.acks[run]) for run in runs)
        assert leaver.exited_at < first_due - 0.3
        assert cluster.wait_for(lambda: cluster.settled(runs), HANDOFF_DELAY + LEASE + 3.0)
        for start, latest in _check_fired_once(cluster, runs, peer):
            # On time: at the window's deadline, not a lease later.
            assert latest["at"] - 0.05 <= start["t"] <= latest["at"] + 0.3, (start, latest)
        cluster.shutdown()
        assert all(d.proc.returncode == 0 for d in cluster.drivers.values())
        assert sum(len(cluster.starts.get(run, [])) for run in runs) == HANDOFF_KEYS
    except BaseException:
        print(cluster.log_tails())  # noqa: T201
        raise
    finally:
        cluster.kill_all()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delivery", ["at-least-once", "at-most-once"])
def test_handoff_with_no_peer_then_a_newcomer(
    nats_server: NatsServer, tmp_path: Path, delivery: str
) -> None:
    cluster = Cluster(
        nats_server, tmp_path, delivery=delivery, delay=HANDOFF_DELAY, rng=random.Random()
    )
    try:
        leaver = cluster.spawn(on_exit="handoff")
        cluster.wait_ready()
        runs = _ping_handoff_windows(cluster, leaver, None)
        cluster.close(leaver)
        assert cluster.wait_for(lambda: leaver.exited_at is not None, 5.0), "no exit"
        assert leaver.proc.wait(5) == 0
        last_due = max(max(a["at"] for a in cluster.acks[run]) for run in runs)
        # Nobody is alive when the windows fall due; nothing fires.
        cluster.sleep(max(0.0, last_due + 0.5 - time.time()))
        assert not any(cluster.starts.get(run) for run in runs)
        newcomer = cluster.spawn()
        cluster.wait_ready()
        assert newcomer.ready_at is not None
        assert cluster.wait_for(lambda: cluster.settled(runs), 5.0)
        for start, _ in _check_fired_once(cluster, runs, newcomer):
            # Overdue: fired at once by the newcomer's start-up reconcile.
            assert start["t"] - newcomer.ready_at < 1.0, start
        cluster.shutdown()
        assert all(d.proc.returncode == 0 for d in cluster.drivers.values())
    except BaseException:
        print(cluster.log_tails())  # noqa: T201
        raise
    finally:
        cluster.kill_all()
