"""Single-server scenarios: soak, process death, blocked loops, clocks, resource faults.

Every scenario runs driver processes (:mod:`tests.chaos.driver`, or
``tests/runs/runs_driver.py`` for deferred runs) on a real ``nats-server``, checks their logs
(:mod:`tests.chaos.checker`) and returns table rows. Leases are short (2 s) and the
operation deadline (5 s) is longer than a JetStream leader election (docs/reliability.rst);
the ping rate is limited so that two cores carry the clients and the server.
"""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tests.chaos.checker import Report, check
from tests.chaos.fleet import Event, Fleet, monitored_server, stream_messages
from tests.chaos.registry import Context, Row, load, register
from tests.harness.nats_server import NatsServer

LEASE = 2.0
SKEW = 0.5
OP_TIMEOUT = 5.0
#: A ping may take twice its operation deadline (the second to re-read a write whose
#: answer was lost: docs/protocol.rst, "Group commit") plus this much (scheduling on two
#: busy cores).
PING_MARGIN = 2.0
#: The largest delay the driver draws (--max-delay); a cap is up to 4 delays.
MAX_DELAY = 1.5


def settle_time(max_delay: float = MAX_DELAY) -> float:
    """Seconds to wait after the load (and the last kill) before closing the drivers:
    a takeover (lease + skew + a heartbeat) and the longest window, with a margin."""
    return LEASE + SKEW + LEASE / 3 + 4 * max_delay + 4.0


@dataclass
class FleetRun:
    """The outcome of :func:`run_fleet`: the events, the report and the samples."""

    fleet: Fleet
    events: list[Event]
    report: Report
    killed: set[str]
    hung_at_exit: list[str]
    bucket_samples: list[tuple[float, int]] = field(default_factory=list)
    load_seconds: float = 0.0


def common_args(
    *, delivery: str, rate: float, keys: int, seconds: float, handler_time: float = 0.05
) -> list[str]:
    return [
        "--delivery",
        delivery,
        "--lease",
        str(LEASE),
        "--skew",
        str(SKEW),
        "--op-timeout",
        str(OP_TIMEOUT),
        "--rate",
        str(rate),
        "--keys",
        str(keys),
        "--seconds",
        str(seconds),
        "--handler-time",
        str(handler_time),
        "--sample-every",
        "5",
    ]


def run_fleet(
    ctx: Context,
    label: str,
    *,
    delivery: str,
    processes: int,
    keys: int,
    rate: float,
    seconds: float,
    kill_gap: tuple[float, float] | None = None,
    extra: Callable[[int], Sequence[str]] = lambda n: (),
    server: NatsServer | None = None,
    monitor_port: int | None = None,
    handler_time: float = 0.05,
    common: Sequence[str] = (),
    after_load: Callable[[], None] | None = None,
    max_delay: float = MAX_DELAY,
) -> FleetRun:
    """Drivers on one bucket for ``seconds`` of load, with kills every ``kill_gap``
    seconds (a random live, ready driver; never the last one; replaced at once by a
    new process id), then a settle time, then a clean close of every survivor."""
    tmp = ctx.tmp / label
    tmp.mkdir(parents=True)
    own_server = server is None
    if server is None:
        server, monitor_port = monitored_server(tmp / "js")
        server.start()
    fleet = Fleet(
        server.url,
        tmp,
        [
            *common_args(
                delivery=delivery, rate=rate, keys=keys, seconds=seconds, handler_time=handler_time
            ),
            *("--max-delay", str(max_delay), "--min-delay", str(min(0.2, max_delay))),
            *common,
        ],
    )
    samples: list[tuple[float, int]] = []
    began = time.time()
    next_id = processes
    try:
        first = [fleet.spawn(f"p{n}", *extra(n)) for n in range(processes)]
        fleet.wait_ready(first)
        ctx.note(f"{label}: {processes} drivers ready in {time.time() - began:.1f} s")
        began = time.time()
        end = began + seconds
        next_kill = began + (ctx.rng.uniform(*kill_gap) if kill_gap else float("inf"))
        next_sample = began
        kills = 0
        while time.time() < end:
            now = time.time()
            if monitor_port is not None and now >= next_sample:
                count = stream_messages(monitor_port, fleet.bucket)
                if count is not None:
                    samples.append((now - began, count))
                next_sample = now + 5.0
            if kill_gap is not None and now >= next_kill:
                ready = [inc for inc in fleet.incarnations if inc.live and inc.ready()]
                if len(ready) >= 2:
                    fleet.kill(ctx.rng.choice(ready))
                    kills += 1
                    left = end - time.time()
                    if left > 2.0:
                        fleet.spawn(f"p{next_id}", "--seconds", f"{left:.1f}", *extra(next_id))
                        next_id += 1
                next_kill = time.time() + ctx.rng.uniform(*kill_gap)
            time.sleep(0.1)
        load_seconds = time.time() - began
        if after_load is not None:
            after_load()
        # The drivers stop pinging on their own; give the last windows and takeovers
        # time, then close (on_exit="wait" fires what is still pending).
        time.sleep(settle_time(max_delay))
        if monitor_port is not None:
            count = stream_messages(monitor_port, fleet.bucket)
            if count is not None:
                samples.append((time.time() - began, count))
        hung = fleet.shutdown(timeout=OP_TIMEOUT * 3 + 4 * max_delay)
        ctx.note(f"{label}: load {load_seconds:.1f} s, {kills} kills, closed")
    except BaseException:
        fleet.kill_all()
        raise
    finally:
        if own_server:
            server.stop()
    killed = {inc.name for inc in fleet.incarnations if inc.killed_at is not None}
    events = fleet.events()
    report = check(
        events, delivery=delivery, ping_bound=2 * OP_TIMEOUT + PING_MARGIN, killed=killed
    )
    ctx.note(f"{label}: {report.summary()}")
    return FleetRun(
        fleet, events, report, killed, [inc.name for inc in hung], samples, load_seconds
    )


def row(label: str, run: FleetRun, zero: tuple[str, ...], *, exit_bound: bool = True) -> Row:
    """The table row of a fleet run; notes name what is outside the guarantees.

    ``exit_bound``: a driver whose exit took longer than its bound counts as a hung
    call (False where a bounded exit is not promised: its pending fires wait for the
    store)."""
    report = run.report
    crashed = {inc.name for inc in run.fleet.crashed()} | set(report.crashed)
    out = Row(
        scenario=label,
        runs=len(run.fleet.incarnations),
        pings=report.pings,
        windows=report.windows,
        lost=len(report.lost),
        fired_twice=len(set(report.fired_twice)),
        interrupted=len(set(report.interrupted)),
        hung_calls=len(report.hung) + (len(run.hung_at_exit) if exit_bound else 0),
        crashes=len(crashed),
        zero=zero,
    )
    out.notes.append(report.summary())
    problems, notes = report.broken_promises()
    out.problems += problems
    out.notes += notes
    if report.lost:
        out.notes.append(f"lost: {report.lost[:5]}")
    if report.fired_twice:
        out.notes.append(f"fired twice: {sorted(set(report.fired_twice))[:5]}")
    if crashed:
        out.notes.append(f"crashed: {sorted(crashed)}\n{run.fleet.tails()}")
    if run.hung_at_exit:
        out.notes.append(f"hung at exit: {run.hung_at_exit}")
    return out


def exit_stats(events: list[Event]) -> dict[str, int]:
    """The drivers' final statistics, summed (``takeovers``, ``fail_open_windows``...)."""
    total: defaultdict[str, int] = defaultdict(int)
    for ev in events:
        if ev["ev"] == "exit":
            for name, value in ev["stats"].items():
                if isinstance(value, int):
                    total[name] += value
    return dict(total)


# ------------------------------------------------------------------------ soak


def trend(values: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean of the second quarter and of the last quarter of the samples (the first
    quarter is warm-up: imports, connection pools, the key space filling)."""
    n = len(values)
    if n < 4:
        return (values[0][1], values[-1][1]) if values else (0.0, 0.0)
    early = [v for _, v in values[n // 4 : n // 2]]
    late = [v for _, v in values[3 * n // 4 :]]
    return statistics.fmean(early), statistics.fmean(late)


def soak_rows(ctx: Context, run: FleetRun, label: str, keys: int) -> Row:
    out = row(label, run, zero=("lost", "hung_calls", "crashes"))
    per_proc: defaultdict[str, list[Event]] = defaultdict(list)
    for ev in run.events:
        if ev["ev"] == "sample":
            per_proc[ev["proc"]].append(ev)
    growth_rss = []
    growth_fds = []
    for proc, samples in sorted(per_proc.items()):
        began = samples[0]["t"]
        rss = trend([(s["t"] - began, s["rss_kb"]) for s in samples])
        fds = trend([(s["t"] - began, s["fds"]) for s in samples])
        growth_rss.append(rss[1] / rss[0] - 1 if rss[0] else 0.0)
        growth_fds.append(fds[1] - fds[0])
        out.notes.append(
            f"{proc}: rss {rss[0]:.0f} -> {rss[1]:.0f} kB, fds {fds[0]:.1f} -> {fds[1]:.1f} "
            f"({len(samples)} samples)"
        )
    keys_trend = trend([(t, float(n)) for t, n in run.bucket_samples])
    out.notes.append(
        f"bucket messages (keys + markers): {[n for _, n in run.bucket_samples]}; "
        f"second quarter {keys_trend[0]:.0f}, last quarter {keys_trend[1]:.0f}"
    )
    out.notes.append(
        f"pings/s {run.report.pings / max(run.load_seconds, 1e-9):.1f} over "
        f"{run.load_seconds:.0f} s"
    )
    # Flat: bounded by the key space (leases, windows, fire records and markers of at
    # most every key), and no steady growth of memory or descriptors. The bounds are
    # loose on purpose: a leak over minutes is far steeper.
    if run.bucket_samples and max(n for _, n in run.bucket_samples) > 3 * keys + 50:
        out.problems.append(f"bucket grew past 3 x {keys} keys")
    if not ctx.short and run.load_seconds > 120:
        if growth_rss and max(growth_rss) > 0.25:
            out.problems.append(f"RSS grew {max(growth_rss):.0%} over the soak")
        if growth_fds and max(growth_fds) > 8:
            out.problems.append(f"open descriptors grew by {max(growth_fds):.0f}")
    return out


@register("soak", short_seconds=25, full_seconds=80)
def soak(ctx: Context) -> list[Row]:
    """4 processes x 1,000 keys (one key space shared by all four), all modes, random
    delays and caps, about 10 pings a second each, against one bucket."""
    keys = 1000
    run = run_fleet(
        ctx,
        "soak",
        delivery="at-least-once",
        processes=4,
        keys=keys,
        rate=8.0 if ctx.short else 10.0,
        seconds=ctx.seconds,
        # CHAOS_TRACE_MEMORY=1: each driver prints where its memory grew (stderr).
        common=("--trace-memory",) if os.environ.get("CHAOS_TRACE_MEMORY") else (),
    )
    return [soak_rows(ctx, run, "soak", keys)]


# ------------------------------------------------------------------ process death


@register("death", short_seconds=20, full_seconds=25)
def death(ctx: Context) -> list[Row]:
    """kill -9 of owners and claim holders at random points: debounce windows (3
    processes on 60 keys, a kill every 1.5-4 s, handlers of 0.05-0.3 s so that kills
    land inside them) and deferred runs (tests/runs/runs_driver.py, the SIGKILL scenario of
    tests/runs/test_runs_processes.py), under both delivery modes."""
    rows = []
    for delivery in ("at-least-once", "at-most-once"):
        label = f"death/windows/{delivery}"
        run = run_fleet(
            ctx,
            label.replace("/", "-"),
            delivery=delivery,
            processes=3,
            keys=60,
            rate=10.0,
            seconds=ctx.seconds,
            kill_gap=(1.5, 4.0),
            handler_time=0.0,
            extra=lambda n: ("--handler-time", f"{random.Random(n).uniform(0.05, 0.3):.3f}"),
        )
        zero = (
            ("lost", "hung_calls", "crashes")
            if delivery == "at-least-once"
            else ("fired_twice", "hung_calls", "crashes")
        )
        rows.append(row(label, run, zero))
    rows += deferred_runs(ctx)
    return rows


def deferred_runs(
    ctx: Context, prefix: str = "death/runs", options: dict[str, float] | None = None
) -> list[Row]:
    """The deferred-run SIGKILL scenario of tests/runs/test_runs_processes.py on NATS
    (``options``: more runs_driver options, for every process)."""
    import tests.runs.test_runs_processes as runs_test

    rows = []
    seconds = min(ctx.seconds, 30.0)
    for delivery in ("at-least-once", "at-most-once"):
        label = f"{prefix}/{delivery}"
        tmp = ctx.tmp / label.replace("/", "-")
        tmp.mkdir(parents=True)
        server = NatsServer(tmp / "js")
        server.start()
        cluster = runs_test.Cluster(
            tmp, runs_test.nats_args(server), delivery=delivery, rng=ctx.rng
        )
        cluster.options.update(options or {})
        failed = ""
        try:
            try:
                passed = runs_test.fault_scenario(
                    cluster,
                    runs=int(20 * seconds),
                    feed_seconds=seconds,
                    due_window=(0.5, 4.0),
                )
            except AssertionError as exc:
                failed = str(exc).splitlines()[0][:200]
                passed = None
            tally, listed = runs_test.tally(cluster)
            if passed is not None:
                tally = passed  # it also counts re-sent schedules and same-id restarts
        finally:
            cluster.kill_all()
            server.stop()
        # The start-latency bound of tests/runs/test_runs_processes.py is a timing check:
        # reported with the load, not a promise of this table.
        late = [p for p in listed if "after max(due, orphaned)" in p]
        other = [p for p in listed if p not in late]
        allowed = tally.interrupted + tally.killed_after_tombstone
        out = Row(
            scenario=label,
            runs=len(cluster.incarnations),
            pings=tally.sent,
            windows=tally.acked,
            lost=tally.lost if delivery == "at-least-once" else max(0, tally.lost - allowed),
            fired_twice=tally.ran_twice,
            interrupted=tally.interrupted,
            hung_calls=0,
            crashes=len(cluster.crashed),
            zero=(
                ("lost", "crashes")
                if delivery == "at-least-once"
                else ("lost", "fired_twice", "crashes")
            ),
        )
        out.notes.append(tally.line())
        out.notes.append(f"{len(late)} starts later than the latency bound ({load()})")
        if delivery == "at-most-once" and tally.lost:
            out.notes.append(
                f"{tally.lost} lost, {allowed} of them killed inside the handler or after "
                "the tombstone write (allowed under at-most-once)"
            )
        out.problems += other[:5]
        if failed and not listed:
            out.problems.append(failed)
        ctx.note(f"{label}: {tally.line()}")
        rows.append(out)
    return rows


@register("slow-lease-watch", short_seconds=12, full_seconds=20)
def slow_lease_watch(ctx: Context) -> list[Row]:
    """Deferred runs on NATS whose lease index is fed by a slow consumer: every
    process's watch of the lease keys takes each batch 1 s late (its lease is 1 s), so
    its index shows peers' leases expired while they renew them; with the SIGKILLs of
    ``death``. A claim from a stale index must lose its compare-and-swap or take a run
    its owner will not start: nothing lost, nothing run twice under at-most-once."""
    return deferred_runs(ctx, "slow-lease-watch", {"--watch-lag": 1.0})


@register("blocked-loop", short_seconds=15, full_seconds=20)
def blocked_loop(ctx: Context) -> list[Row]:
    """One of three coordinators blocks its event loop (``time.sleep`` in a task) for
    2.5 leases mid-load; its peers take its windows over meanwhile."""
    rows = []
    for delivery in ("at-least-once", "at-most-once"):
        label = f"blocked-loop/{delivery}"
        run = run_fleet(
            ctx,
            label.replace("/", "-"),
            delivery=delivery,
            processes=3,
            keys=60,
            rate=10.0,
            seconds=ctx.seconds,
            extra=lambda n: (
                ("--block-at", str(ctx.seconds / 3), "--block-for", str(2.5 * LEASE))
                if n == 0
                else ()
            ),
        )
        zero = (
            ("lost", "hung_calls", "crashes")
            if delivery == "at-least-once"
            else ("fired_twice", "hung_calls", "crashes")
        )
        out = row(label, run, zero)
        out.notes.append(f"takeovers {exit_stats(run.events).get('takeovers', 0)}")
        rows.append(out)
    return rows


# ------------------------------------------------------------------------ clocks


@register("clocks", short_seconds=20, full_seconds=25)
def clocks(ctx: Context) -> list[Row]:
    """Three coordinators whose wall clocks (the backend's ``wall_time`` seam) differ
    by up to the documented maximum skew (offsets -skew/2, 0, +skew/2), and one whose
    clock steps forwards and backwards by up to the skew mid-run. All live: no window
    is fired by two owners (two confirmed first attempts), in either mode; takeovers
    (which need an owner's lease to lapse: only a starved process's) are counted."""
    rows = []
    half = SKEW / 2
    s = ctx.seconds
    steps = f"{s * 0.2:.1f}:{half},{s * 0.4:.1f}:{-2 * half},{s * 0.6:.1f}:{2 * half}"
    steps += f",{s * 0.8:.1f}:{-half}"
    offsets = {0: ("--clock-offset", str(-half)), 1: (), 2: ("--clock-offset", str(half))}
    for delivery in ("at-least-once", "at-most-once"):
        label = f"clocks/{delivery}"
        run = run_fleet(
            ctx,
            label.replace("/", "-"),
            delivery=delivery,
            processes=4,
            keys=80,
            rate=8.0,
            seconds=s,
            extra=lambda n: offsets.get(n, ("--clock-steps", steps)),
        )
        zero = (
            ("lost", "hung_calls", "crashes")
            if delivery == "at-least-once"
            else ("fired_twice", "hung_calls", "crashes")
        )
        out = row(label, run, zero)
        stats = exit_stats(run.events)
        out.notes.append(
            f"takeovers {stats.get('takeovers', 0)} (a live owner starved past its lease on "
            f"a loaded host; each must still fire once: see 'two owners'), unconfirmed "
            f"fires {stats.get('unconfirmed_fires', 0)}; steps of p3: {steps}"
        )
        rows.append(out)
    return rows


# --------------------------------------------------------------- resource faults


def fill_store(url: str, *, values: int, size: int) -> int:
    """Put ``values`` values of ``size`` bytes in a bucket ``filler`` (nats-py, in a
    throw-away asyncio loop); returns the bytes written before the store refused."""
    import asyncio

    import nats

    async def fill() -> int:
        client = await nats.connect(url)
        try:
            kv = await client.jetstream().create_key_value(bucket="filler", history=1)
            written = 0
            for n in range(values):
                try:
                    await kv.put(f"v{n}", b"x" * size)
                except Exception:
                    break
                written += size
            return written
        finally:
            await client.close()

    return asyncio.run(fill())


def free_store(url: str, monitor_port: int) -> str:
    """Delete the bucket ``filler``: the store has room again. Returns the server's
    store use afterwards."""
    import asyncio

    import nats

    async def free() -> None:
        client = await nats.connect(url)
        try:
            await client.jetstream().delete_key_value("filler")
        finally:
            await client.close()

    asyncio.run(free())
    time.sleep(1.0)
    return f"bucket messages {stream_messages(monitor_port, 'filler')} in the filler"


@register("store-full", short_seconds=15, full_seconds=20)
def store_full(ctx: Context) -> list[Row]:
    """A server whose JetStream store holds 256 KiB (``max_file_store``), most of it
    taken by another bucket, and pings with 500-byte payloads: writes fail while the store
    is full (the server answers "insufficient resources" or not at all). Calls stay
    within their bound, nothing crashes; pings fail open (the default) and are listed
    as fail-open windows. After the load the filler bucket is deleted. Promised: no
    ping outlives its bound, no process crashes. Observed and reported, not promised:
    windows whose finalize could not write (the owner must renew its lapsed lease
    first) wait for the store, so an exit with ``on_exit="wait"`` waits too."""
    tmp = ctx.tmp / "store-full"
    tmp.mkdir(parents=True)
    conf = tmp / "limits.conf"
    conf.write_text("jetstream {\n  max_file_store: 262144\n}\n")
    server, port = monitored_server(tmp / "js", "-c", str(conf))
    server.start()
    try:
        filled = fill_store(server.url, values=110, size=2000)
        ctx.note(f"store-full: {filled} bytes of 262144 taken by a filler bucket")
        run = run_fleet(
            ctx,
            "store-full-fleet",
            delivery="at-least-once",
            processes=2,
            keys=3000,
            rate=20.0,
            seconds=ctx.seconds,
            server=server,
            monitor_port=port,
            common=("--payload-bytes", "500"),
            max_delay=0.5 if ctx.short else MAX_DELAY,
            after_load=lambda: ctx.note(f"store-full: freed: {free_store(server.url, port)}"),
        )
    finally:
        server.stop()
    out = row("store-full", run, ("hung_calls", "crashes"), exit_bound=False)
    stats = exit_stats(run.events)
    errors = [ev["error"] for ev in run.events if ev["ev"] == "err"]
    out.notes.append(
        f"exit statistics (drivers that exited): fail-open windows "
        f"{stats.get('fail_open_windows', 0)}, backend errors "
        f"{stats.get('backend_errors', 0)}, unconfirmed fires "
        f"{stats.get('unconfirmed_fires', 0)}; ping errors {len(errors)} "
        f"{sorted(set(e[:80] for e in errors))[:3]}; bucket samples {run.bucket_samples}"
    )
    if not run.report.fail_open and not errors:
        out.notes.append("the store never filled: no fail-open window, no ping error")
    return [out]


@register("twin-process-id", short_seconds=12, full_seconds=15)
def twin_process_id(ctx: Context) -> list[Row]:
    """A second process started with the process id of a live one: only one may run.
    The later start must be refused with ``ProcessIdTakenError`` within the holder's
    heartbeat interval plus the skew (it watches the live lease for a renewal), before
    it stores anything; the earlier keeps pinging, and its pings are stored and fire.
    Then the earlier is killed (``SIGKILL``) and restarted under the same id: a restart
    after a crash is not refused (it waits that long, then takes the id over). None is
    lost, and no window fires twice but for the re-run that at-least-once promises of
    a fire the SIGKILL cut short (the restart runs it again, attempt 2): a window fired
    twice without such a cut, or by two owners, breaks the promise."""
    tmp = ctx.tmp / "twin"
    tmp.mkdir(parents=True)
    server = NatsServer(tmp / "js")
    server.start()
    max_delay = 0.5 if ctx.short else MAX_DELAY
    watch = LEASE / 3 + SKEW  # the holder's heartbeat interval plus the skew
    fleet = Fleet(
        server.url,
        tmp,
        [
            *common_args(delivery="at-least-once", rate=8.0, keys=40, seconds=3600.0),
            *("--max-delay", str(max_delay)),
        ],
    )
    killed: list[str] = []
    refused_in: float | None = None
    try:
        # Both ping until their standard input is closed.
        first = fleet.spawn("p0")
        fleet.wait_ready([first])
        time.sleep(1.0)
        spawned = time.time()
        twin = fleet.spawn("p0")
        # The twin must give up on its own (its start is refused); generous margin for
        # the interpreter's start-up and the connection on a loaded machine.
        try:
            twin.proc.wait(timeout=watch + 30.0)
            refused_in = time.time() - spawned
        except subprocess.TimeoutExpired:
            pass
        time.sleep(ctx.seconds / 2)
        fleet.kill(first)
        killed.append(first.name)
        restarted = fleet.spawn("p0")
        fleet.wait_ready([restarted])
        # Long enough for the restart to adopt what the killed one left (its lease
        # lapses, then the skew, then a heartbeat), with a second of margin.
        time.sleep(max(ctx.seconds / 2, LEASE + SKEW + 2 * LEASE / 3 + 1.0))
        fleet.close(restarted)
        hung = fleet.shutdown(timeout=settle_time(max_delay) + OP_TIMEOUT * 3)
    finally:
        fleet.kill_all()
        server.stop()
    events = fleet.events()
    report = check(
        events, delivery="at-least-once", ping_bound=2 * OP_TIMEOUT + PING_MARGIN, killed=killed
    )
    twin_events = [ev for ev in events if ev["proc"] == twin.name]
    refusals = [
        ev for ev in twin_events if ev["ev"] == "crash" and "ProcessIdTakenError" in ev["error"]
    ]
    twin_ran = [ev for ev in twin_events if ev["ev"] in ("ready", "ping", "err", "start")]
    first_refused = [
        ev
        for ev in events
        if ev["proc"] == first.name and ev["ev"] == "err" and "ProcessIdTaken" in ev["error"]
    ]
    refused_at = min((ev["t"] for ev in refusals), default=None)
    stored_after = sum(
        1
        for ev in events
        if ev["proc"] == first.name
        and ev["ev"] == "ping"
        and ev["stored"]
        and refused_at is not None
        and ev["t0"] > refused_at
    )
    restarted_ready = any(ev["ev"] == "ready" for ev in events if ev["proc"] == restarted.name)
    # The twin's refusal is its expected end, not a crash.
    crashed = ({inc.name for inc in fleet.crashed()} | set(report.crashed)) - {twin.name}
    out = Row(
        scenario="twin-process-id",
        runs=3,
        pings=report.pings,
        windows=report.windows,
        lost=len(report.lost),
        fired_twice=len(set(report.fired_twice)),
        interrupted=len(set(report.interrupted)),
        hung_calls=len(report.hung) + len(hung),
        crashes=len(crashed),
        # Not fired_twice: the kill may land inside a handler, which the restart then
        # runs again (at-least-once); such re-runs are checked below instead.
        zero=("lost", "hung_calls", "crashes"),
    )
    problems, notes = report.broken_promises()
    out.problems += problems
    out.notes += notes
    uncut = sorted(set(report.fired_twice) - set(report.interrupted))
    if uncut:
        out.problems.append(f"{len(uncut)} windows fired twice with no kill cutting a fire short")
        out.notes.append(f"fired twice, not cut: {uncut[:5]}")
    detected = "never" if refused_in is None else f"{refused_in:.2f} s"
    out.notes.append(
        f"the later start was refused {detected} after it was spawned (interpreter start "
        f"included; watch {watch:.2f} s); the earlier stored {stored_after} pings after "
        f"that; the restart after its SIGKILL was "
        f"{'ready' if restarted_ready else 'NOT ready'}; {report.errors} ping errors"
    )
    out.notes.append(report.summary())
    if not refusals:
        out.problems.append("the later of two processes with one id was not refused")
    if twin_ran:
        out.problems.append(f"the refused process ran: {len(twin_ran)} events")
    if first_refused:
        out.problems.append(f"the earlier process was fenced ({len(first_refused)} refusals)")
    if not stored_after:
        out.problems.append("the earlier process stored no ping after the refusal")
    if not restarted_ready:
        out.problems.append("the restart after a crash did not start")
    if report.errors:
        out.problems.append(f"{report.errors} ping errors")
    return [out]
