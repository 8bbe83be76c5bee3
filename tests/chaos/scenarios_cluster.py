"""Chaos scenarios on a three-node JetStream cluster, and stalls through a TCP proxy.

Each scenario starts its own cluster (:mod:`tests.harness.nats_cluster`) or server and runs
three coordinators in this process, each through its own connection and trio-asyncio
loop (:class:`tests.harness.cluster_load.Load`: the chaos driver's event format, judged by
:func:`tests.chaos.checker.check`), at a limited rate, while faults are injected:

``cluster-one-node``
  rounds of: kill the stream leader (restart it after the election), ``SIGSTOP`` the
  node a client is connected to (past stale-connection detection, then ``SIGCONT``),
  kill a random node; buckets with three replicas.
``cluster-no-quorum``
  two nodes down at once (the stream leader stays, so writes reach a leader that
  cannot commit them), then quorum back: calls fail within their bound (fail open,
  or raise under ``on_backend_error="raise"``) and everything resumes.
``cluster-runs``
  persisted deferred runs (``open_nats_run_store``) on the same kind of cluster, the
  stream leader killed while they are pending: every scheduled run runs once.
``stalls``
  one server, one coordinator behind the proxy (:mod:`tests.harness.tcp_proxy`): replies
  slower than ``op_timeout``, stalls, connections cut mid-write, and ``SIGSTOP`` /
  ``SIGCONT`` cycles of the server.

Leases are 2 s; ``op_timeout`` is 5 s on the cluster (longer than a leader election,
about 4.5 s here) and 1 s behind the proxy. Every store call is timed: one longer
than its bound counts as a hung call, as does a ping longer than its bound.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

import trio

from tests.chaos.checker import Report
from tests.chaos.registry import Context, Row, register
from tests.harness.cluster_load import RUN_WORKFLOW, Load
from tests.harness.nats_cluster import NatsCluster, running_cluster
from tests.harness.nats_server import NatsServer
from tests.harness.tcp_proxy import open_tcp_proxy
from trio_debounce import BackendUnavailableError, RunOptions, open_coordinator
from trio_debounce.nats import NatsConfig, open_nats_run_store

LEASE = 2.0
SKEW = 0.5
CLUSTER_OP_TIMEOUT = 5.0
PROXY_OP_TIMEOUT = 1.0
#: Seconds a call may take beyond op_timeout (a ping: beyond twice op_timeout, the
#: second to re-read a write whose answer was lost): the bridge may spend a second
#: cancelling a nats-py call, and the machine is shared.
MARGIN = 1.0 + 1.5
RATE = 6.0  # pings a second, all coordinators together


def cluster_config(cluster: NatsCluster) -> NatsConfig:
    return NatsConfig(
        servers=cluster.urls,
        bucket="c" + uuid.uuid4().hex[:12],
        replicas=3,
        process_lease=LEASE,
        max_clock_skew=SKEW,
        op_timeout=CLUSTER_OP_TIMEOUT,
        connect_timeout=5.0,
        ping_interval=1.0,
    )


def row(
    ctx: Context, name: str, load: Load, report: Report, op_timeout: float, crashes: int
) -> Row:
    """The table's row for a debounce scenario; notes list what is outside the promises.
    The merged events are written to ``<name>.events.jsonl`` in the scenario's
    directory (kept with ``--keep``), for the checker's findings to be traced."""
    with open(ctx.tmp / f"{name}.events.jsonl", "w", encoding="utf-8") as out_file:
        for event in load.events:
            out_file.write(json.dumps(event, default=str) + "\n")
    bound = op_timeout + MARGIN
    slow = [secs for _, secs in load.store_calls if secs > bound]
    out = Row(
        scenario=name,
        runs=len(load.coordinators),
        pings=report.pings,
        windows=report.windows,
        lost=len(report.lost),
        fired_twice=len(report.fired_twice),
        interrupted=len(report.interrupted),
        hung_calls=len(report.hung) + len(slow),
        crashes=crashes + len(report.crashed),
        zero=("lost", "hung_calls", "crashes"),
    )
    problems, notes = report.broken_promises()
    out.problems += problems
    out.notes += notes
    longest = max((secs for _, secs in load.store_calls), default=0.0)
    out.notes.append(
        f"{report.summary()}; late commits {len(load.late_commits)}; wrong payloads "
        f"{len(report.wrong_payload)}; store calls {len(load.store_calls)}, longest "
        f"{longest:.2f} s (bound {bound:.1f} s)"
    )
    return out


def run_trio(ctx: Context, name: str, main: Callable[[], Awaitable[None]]) -> int:
    """Run ``main`` in its own ``trio.run``; a crash (anything escaping it) is noted
    and counted, never raised."""
    try:
        trio.run(main)
    except BaseException as exc:  # the table reports it
        ctx.note(f"{name}: crashed: {exc!r}")
        return 1
    return 0


async def fault(cluster: NatsCluster, name: str, action: str, ctx: Context) -> None:
    ctx.note(f"node {name}: {action}")
    await trio.to_thread.run_sync(getattr(cluster.node(name), action))


def connected_node(load: Load, cluster: NatsCluster, proc: str) -> str:
    url = load.backends[proc]._view.store._store._nc.connected_url  # type: ignore[attr-defined]
    return next(n.name for n in cluster.nodes if n.port == url.port)


@register("cluster-one-node", short_seconds=25, full_seconds=120)
def cluster_one_node(ctx: Context) -> list[Row]:
    with running_cluster(ctx.tmp / "cluster") as cluster:
        cfg = cluster_config(cluster)
        load = Load(cfg, ctx.rng)
        reports: list[Report] = []

        async def main() -> None:
            async with load.open("AB"), load.open("C", on_backend_error="raise"):
                leader = await trio.to_thread.run_sync(cluster.wait_stream_current, cfg.bucket)
                end = trio.current_time() + ctx.seconds
                done = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(load.run, RATE, until=done))
                    while trio.current_time() < end:
                        began = time.monotonic()
                        await trio.sleep(1.5)
                        await fault(cluster, leader.name, "kill", ctx)
                        await trio.to_thread.run_sync(cluster.wait_stream_leader, cfg.bucket)
                        ctx.note(f"new stream leader after {time.monotonic() - began - 1.5:.1f} s")
                        await fault(cluster, leader.name, "start", ctx)
                        await trio.to_thread.run_sync(cluster.wait_stream_current, cfg.bucket)
                        frozen = connected_node(load, cluster, ctx.rng.choice("AB"))
                        await fault(cluster, frozen, "pause", ctx)
                        await trio.sleep(4.0)
                        await fault(cluster, frozen, "resume", ctx)
                        await trio.to_thread.run_sync(cluster.wait_stream_current, cfg.bucket)
                        victim = ctx.rng.choice(cluster.nodes).name
                        await fault(cluster, victim, "kill", ctx)
                        await trio.sleep(3.0)
                        await fault(cluster, victim, "start", ctx)
                        leader = await trio.to_thread.run_sync(
                            cluster.wait_stream_current, cfg.bucket
                        )
                    done.set()
                reports.append(
                    await load.wait_settled(30.0, ping_bound=2 * CLUSTER_OP_TIMEOUT + MARGIN)
                )

        crashes = run_trio(ctx, "cluster-one-node", main)
    report = reports[0] if reports else load.check(ping_bound=2 * CLUSTER_OP_TIMEOUT + MARGIN)
    return [row(ctx, "cluster-one-node", load, report, CLUSTER_OP_TIMEOUT, crashes)]


@register("cluster-no-quorum", short_seconds=10, full_seconds=40)
def cluster_no_quorum(ctx: Context) -> list[Row]:
    with running_cluster(ctx.tmp / "cluster") as cluster:
        cfg = cluster_config(cluster)
        load = Load(cfg, ctx.rng)
        reports: list[Report] = []
        raised: list[str] = []

        async def main() -> None:
            async with load.open("AB"), load.open("C", on_backend_error="raise"):
                leader = await trio.to_thread.run_sync(cluster.wait_stream_current, cfg.bucket)
                end = trio.current_time() + ctx.seconds
                while True:
                    await load.run(RATE, 2.0)
                    followers = [n for n in cluster.nodes if n is not leader]
                    for node in followers:
                        await fault(cluster, node.name, "kill", ctx)
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(partial(load.run, RATE / 2, 3.0))
                        began = trio.current_time()
                        try:
                            await load.coordinators["C"].debounce("wf", "q", "c", delay=0.5)
                            raised.append("did not raise")
                        except BackendUnavailableError:
                            raised.append(f"{trio.current_time() - began:.2f} s")
                    for node in followers:
                        await fault(cluster, node.name, "start", ctx)
                    leader = await trio.to_thread.run_sync(cluster.wait_stream_current, cfg.bucket)
                    if trio.current_time() > end:
                        break
                await load.run(RATE, 3.0)
                reports.append(
                    await load.wait_settled(40.0, ping_bound=2 * CLUSTER_OP_TIMEOUT + MARGIN)
                )

        crashes = run_trio(ctx, "cluster-no-quorum", main)
    report = reports[0] if reports else load.check(ping_bound=2 * CLUSTER_OP_TIMEOUT + MARGIN)
    out = row(ctx, "cluster-no-quorum", load, report, CLUSTER_OP_TIMEOUT, crashes)
    out.notes.append(f"raise-mode pings during the outage raised after: {', '.join(raised)}")
    out.hung_calls += sum(1 for r in raised if r == "did not raise")
    return [out]


@register("cluster-runs", short_seconds=5, full_seconds=40)
def cluster_runs(ctx: Context) -> list[Row]:
    with running_cluster(ctx.tmp / "cluster") as cluster:
        cfg = cluster_config(cluster)
        load = Load(cfg, ctx.rng)
        scheduled: list[str] = []
        errored: list[str] = []
        count = max(20, int(ctx.seconds * 4))

        async def main() -> None:
            options = partial(RunOptions, lease=LEASE, max_clock_skew=SKEW)
            async with (
                open_nats_run_store(cfg) as store_a,
                open_nats_run_store(cfg) as store_b,
                open_coordinator(
                    run_store=store_a,
                    run_handlers={RUN_WORKFLOW: load.run_handler("A")},
                    run_options=options(process_id="A"),
                ) as a,
                open_coordinator(
                    run_store=store_b,
                    run_handlers={RUN_WORKFLOW: load.run_handler("B")},
                    run_options=options(process_id="B"),
                ),
            ):
                leader = await trio.to_thread.run_sync(cluster.wait_stream_current, cfg.bucket)
                # The last run is due 1 + count / 4 s after the loop starts: wait for
                # it (and a failover's worth more), not a fixed 40 s (the full budget
                # schedules runs due a minute ahead; those were counted lost).
                last_due = trio.current_time() + 1.0 + 0.25 * count
                for i in range(count):
                    run_id = f"r{i}"
                    for _ in range(8):
                        try:
                            await a.schedule(
                                RUN_WORKFLOW, run_id, i, after=1.0 + 0.25 * i, persist=True
                            )
                        except BackendUnavailableError:
                            errored.append(run_id)
                            await trio.sleep(1.0)
                        else:
                            scheduled.append(run_id)
                            break
                    if i == count // 4:
                        await fault(cluster, leader.name, "kill", ctx)
                await trio.to_thread.run_sync(cluster.wait_stream_leader, cfg.bucket)
                await fault(cluster, leader.name, "start", ctx)
                give_up = max(last_due, trio.current_time()) + 40.0
                while trio.current_time() < give_up:
                    if {r.run_id for _, r in load.run_fires} >= set(scheduled):
                        break
                    await trio.sleep(0.25)
                await trio.sleep(LEASE)

        crashes = run_trio(ctx, "cluster-runs", main)
    ran = [r.run_id for _, r in load.run_fires]
    out = Row(
        scenario="cluster-runs",
        runs=2,
        pings=len(scheduled) + len(errored),
        windows=len(set(scheduled) | set(ran)),
        lost=len(set(scheduled) - set(ran)),
        fired_twice=len(ran) - len(set(ran)),
        crashes=crashes,
        hung_calls=len(set(ran) - set(scheduled) - set(errored)),
        zero=("lost", "fired_twice", "hung_calls", "crashes"),
    )
    out.notes.append(
        f"scheduled {len(scheduled)}, schedule calls that raised (retried) {len(errored)}"
    )
    return [out]


@register("stalls", short_seconds=10, full_seconds=90)
def stalls(ctx: Context) -> list[Row]:
    server = NatsServer(ctx.tmp / "js")
    server.start()
    try:
        base = NatsConfig(
            servers=(server.url,),
            bucket="s" + uuid.uuid4().hex[:12],
            process_lease=LEASE,
            max_clock_skew=SKEW,
            op_timeout=PROXY_OP_TIMEOUT,
            connect_timeout=3.0,
            ping_interval=1.0,
        )
        load = Load(base, ctx.rng)
        reports: list[Report] = []

        async def main() -> None:
            async with open_tcp_proxy(server.port) as proxy:
                load.config = replace(base, servers=(f"nats://127.0.0.1:{proxy.port}",))
                async with load.open("A"):
                    load.config = base
                    async with load.open("B"), load.open("C", on_backend_error="raise"):
                        end = trio.current_time() + ctx.seconds
                        while True:
                            ctx.note("proxy: replies slower than op_timeout")
                            proxy.reply_delay = 1.5 * PROXY_OP_TIMEOUT
                            await load.run(RATE, 2.0)
                            proxy.reply_delay = 0.0
                            ctx.note("proxy: stall")
                            proxy.stall()
                            await load.run(RATE, 2.0)
                            proxy.resume()
                            ctx.note("proxy: cuts mid-write")
                            for _ in range(3):
                                proxy.cut_mid_write()
                                await load.run(RATE, 1.0)
                            for pause in (0.5, 1.5, 3.5):
                                await fault_server(server, ctx, pause)
                                await load.run(RATE, 1.0)
                            if trio.current_time() > end:
                                break
                        await load.run(RATE, 2.0)
                        reports.append(
                            await load.wait_settled(20.0, ping_bound=2 * PROXY_OP_TIMEOUT + MARGIN)
                        )
                ctx.note(
                    f"proxy: {proxy.accepted} connections, {proxy.cuts_mid_write} cut mid-write"
                )

        crashes = run_trio(ctx, "stalls", main)
    finally:
        with contextlib.suppress(Exception):
            server.stop(timeout=5.0)
    report = reports[0] if reports else load.check(ping_bound=2 * PROXY_OP_TIMEOUT + MARGIN)
    return [row(ctx, "stalls", load, report, PROXY_OP_TIMEOUT, crashes)]


async def fault_server(server: NatsServer, ctx: Context, seconds: float) -> None:
    """``SIGSTOP`` the server for ``seconds``, then ``SIGCONT``."""
    ctx.note(f"server: SIGSTOP for {seconds} s")
    await trio.to_thread.run_sync(server.pause)
    try:
        await trio.sleep(seconds)
    finally:
        await trio.to_thread.run_sync(server.resume)
