"""Write the benchmark report: ``docs/benchmarks/index.rst`` and its figures
(matplotlib, PNG), from the JSON ``bench/suite.py`` wrote.

``python bench/report.py [docs/benchmarks/results.json]`` regenerates the page alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
#: The items in the report's order (``bench/suite.py``'s ``ITEMS``).
ORDER = (
    "ping-local",
    "ping-keyed",
    "flow",
    "scale",
    "fire-lateness",
    "replay",
    "nats-requests",
    "owner-ping",
    "hot-key",
    "runs",
)


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if value == int(value):
        return f"{value:.0f}"
    return f"{value:.3g}"


def ratio_text(stats: dict[str, float] | None, label: str) -> str:
    if not stats:
        return "-"
    return (
        f"**{fmt(stats['median'])}** ({label}); min-max {fmt(stats['min'])}-{fmt(stats['max'])}, "
        f"IQR {fmt(stats['q1'])}-{fmt(stats['q3'])}"
    )


def verdict(r: dict[str, Any]) -> str:
    if r["met"] is None:
        return "no target" if not r["target"] else "-"
    if r["met"]:
        return "met"
    return f"**missed** ({r['gap']})" if r["gap"] else "**missed**"


def esc(text: str) -> str:
    return text.replace("*", r"\*").replace("|", r"\|")


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 34 12 12 26 6 10 10",
        "",
        "   * - Figure",
        "     - Ours",
        "     - Baseline",
        "     - Ratio: median of paired rounds, spread",
        "     - Rounds",
        "     - Target",
        "     - Verdict",
    ]
    for r in rows:
        base = f"{fmt(r['base'])} {r['unit']} ({esc(r['baseline'])})" if r["baseline"] else "-"
        lines += [
            f"   * - {esc(r['name'])}",
            f"     - {fmt(r['ours'])} {r['unit']}",
            f"     - {base}",
            f"     - {ratio_text(r['ratio'], r['ratio_label'])}",
            f"     - {r['n'] if r['n'] is not None else '-'}",
            f"     - {esc(r['target']) or '-'}",
            f"     - {verdict(r)}",
        ]
    return lines


def _plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: dict[str, str] = {}
    items = results["items"]

    def save(fig: Any, item: str) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{item}.png", dpi=90)
        plt.close(fig)
        made[item] = f"{item}.png"

    if "ping-local" in items:
        samples = items["ping-local"]["samples_us"]
        names = sorted(samples, key=lambda k: sorted(samples[k])[len(samples[k]) // 2])
        fig, ax = plt.subplots(figsize=(7, 3.2))
        meds = [sorted(samples[k])[len(samples[k]) // 2] for k in names]
        lo = [m - min(samples[k]) for m, k in zip(meds, names, strict=True)]
        hi = [max(samples[k]) - m for m, k in zip(meds, names, strict=True)]
        ax.barh(names, meds, xerr=[lo, hi], color="tab:blue")
        ax.set_xscale("log")
        ax.set_xlabel("µs per operation (median, min-max of rounds; log scale)")
        save(fig, "ping-local")
    if "scale" in items:
        ping = items["scale"]["ping_us"]
        sizes = [int(s) for s in ping]
        fig, ax = plt.subplots(figsize=(6, 3))
        for i, s in enumerate(sizes):
            ax.scatter([s] * len(ping[str(s)]), ping[str(s)], s=8, color="tab:blue", alpha=0.5)
            ax.scatter(
                [s],
                [sorted(ping[str(s)])[len(ping[str(s)]) // 2]],
                marker="_",
                s=300,
                color="black",
                label="median" if i == 0 else None,
            )
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("open windows")
        ax.set_ylabel("µs per coalescing ping")
        ax.legend()
        save(fig, "scale")
    if "fire-lateness" in items:
        cases = items["fire-lateness"]["cases"]
        fig, axes = plt.subplots(1, len(cases), figsize=(8, 3))
        for ax, (case, data) in zip(list(axes), cases.items(), strict=True):
            for kind, values in data["samples_ms"].items():
                ordered = sorted(values)
                ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
                ax.plot(ordered, ys, label=kind)
            ax.set_xscale("symlog", linthresh=1)
            ax.set_title(case, fontsize=9)
            ax.set_xlabel("lateness, ms")
            ax.set_ylabel("fraction fired")
            ax.legend(fontsize=8)
        save(fig, "fire-lateness")
    if "hot-key" in items:
        rates = items["hot-key"]["rates"]
        fig, ax = plt.subplots(figsize=(6, 3))
        names = list(rates)
        meds = [sorted(v)[len(v) // 2] for v in rates.values()]
        ax.bar(names, meds, color=["tab:gray" if n == "dbos" else "tab:blue" for n in names])
        ax.axhline(20_000, color="tab:red", linestyle="--", label="target at 100 tasks")
        ax.set_yscale("log")
        ax.set_ylabel("acknowledged pings/s (median)")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        save(fig, "hot-key")
    return made


DESCRIPTIONS = {
    "ping-local": (
        "``debounce_nowait`` into an open trailing window, against (a) a naive Trio "
        "debouncer (cancel a cancel scope and spawn a task per ping, with a checkpoint "
        "per ping), (b) an asyncio ``loop.call_later`` handle cancelled and re-armed per "
        "ping, (c) ``throttlebounce.async_debounce`` (PyPI); ``debounce_nowait`` and "
        "``await debounce()`` against a bare ``await trio.lowlevel.checkpoint()``; "
        "``await debounce()`` into a shared window through ``MemoryBackend`` (the shared "
        "protocol's CPU cost, no network) against the same without a backend; and "
        "``debounce_nowait`` opening a window (until its task sleeps) against "
        "``nursery.start_soon`` of a task sleeping on a deadline. Every variant runs a "
        "fixed number of operations (see the JSON's ``loops``) on a fresh event loop per "
        "sample; the timed functions are ``bench/ping_local.py``'s, and the samples are "
        "also saved as a pyperf suite."
    ),
    "ping-keyed": (
        "Real applications ping many keys. 1,000 open trailing windows (``max_delay`` "
        "set), pinged in turn, each ping a different key than the last, 100,000 pings per "
        "sample: ``debounce_nowait`` against (a) asyncio's ``call_later`` on 1,000 handles "
        "kept in a dict by ``(workflow, key)``, cancelled and re-armed per ping, on a "
        "fresh stdlib loop, and (b) the floor, the least CPython can do for such a ping, "
        "inline in the loop: one dict lookup on the ``(workflow, key)`` tuple, three "
        "attribute writes (deadline, payload, count), a ``min`` against the window's cap "
        "and a result tuple (the clock read once, outside the loop). Both ratios are "
        "taken within each round, in the same rotation."
    ),
    "flow": (
        'The flow-control modes of issue 20 (:doc:`/semantics`, "Throttle, batch and rate '
        'limit") on the keyed workload of ``ping-keyed``: 1,000 open windows pinged in '
        "turn, each ping a different key than the last, 100,000 pings per sample, every "
        "``interval``, ``max_wait`` and ``period`` an hour so that no window ends while "
        "the clock runs. Before the clock starts, each window is opened (the handler "
        "tasks of leading fires run) and pinged once more, so every timed ping is the "
        "mode's absorbing ping: ``throttle_nowait`` (both edges) and "
        "``throttle_nowait(leading=False)`` (an audit) coalesce, ``batch_nowait`` appends "
        "an item (``max_bytes=None``: no JSON sizing; 102 items a batch at the end of a "
        "sample, ``max_items`` far above), ``rate_limit_nowait(limit=1)`` drops. Each is "
        "compared with ``debounce_nowait`` on the same workload (the ``ping-keyed`` "
        "ping, measured again in this item's rounds), and the throttle and the audit with "
        "``throttlebounce.async_throttle(interval, trailing=True)`` (PyPI; unkeyed, on "
        "asyncio): one instance per key in a dict by ``(workflow, key)``, each called "
        "twice before the clock starts, so every timed call replaces its pending call "
        "(throttlebounce has no trailing-only throttle: its absorbed call is the "
        "audit's nearest too). The hot key: ``rate_limit_nowait`` on one key with a limit "
        "above the pings, so that each of the 20,000 pings of a sample fires (a "
        "``Fire`` built, a run id drawn, the handler's task started with "
        "``nursery.start_soon``), against ``nursery.start_soon`` of as many no-op tasks; "
        "timed twice: the calls alone (the tasks run after the clock stops), and until "
        "every task has run and ended (``trio.testing.wait_all_tasks_blocked``). All "
        "variants share one rotation; the timed functions are ``bench/flow.py``'s."
    ),
    "scale": (
        "Memory: in one process, bytes per window with 1,000 windows open against "
        "bytes per bare sleeping Trio task (``nursery.start_soon(trio.sleep, "
        "3600)``) with 1,000 started, as the growth of the Python allocations traced by "
        "``tracemalloc``, each measurement on a fresh loop, in paired rounds after a "
        "warm-up pair. Scale: pairs of fresh processes (3; the JSON's ``processes``); "
        "each windows process opens one coordinator per size (10, 1,000 and 100,000 "
        "windows, each window on a key of its own) and takes the RSS growth per window "
        "from the first 1,010 to all of them, then runs its share of the ping rounds, "
        "reusing the open windows: per round each coordinator, in an order rotated from "
        "round to round, takes a fixed number of coalescing pings on keys drawn at "
        "random among its windows, and the ratio to the 10-window coordinator is taken "
        "within the round; the tasks process takes the RSS growth per bare sleeping "
        "task over the same counts. The collector is off while windows or tasks start "
        "(both sides), and a full collection runs before each reading. The RSS row has "
        "one figure per process. The 1,000,000 point runs only with ``nox -s bench -- "
        "--huge``."
    ),
    "fire-lateness": (
        "10,000 windows with due times spread uniformly over one second (and, without "
        "a target, within 0.1 s), set in random order on the real clock; lateness is "
        "the handler's start (``trio.current_time()``) minus the due time. Baseline: "
        "10,000 tasks in ``trio.sleep_until`` on the same due times. The first due time "
        "is a lead (0.3 s + 0.1 s per 1,000 timers) after the run starts; a round whose "
        "set-up (until every task is blocked) took more than 80% of the lead is run "
        "again with twice the set-up as lead (the JSON's ``leads``), so the lateness "
        "does not measure the set-up. The ratio column is the per-round difference "
        "ours minus baseline, in ms."
    ),
    "replay": (
        "A deterministic log (``bench/replay.py generate``: each key's events in a "
        "burst at exponential intervals of mean 0.25 s, replayed with ``--delay 1 "
        "--max-delay 10``). The 1,000,000-event replay runs once (too long to repeat 15 "
        "times); the paired rounds use a smaller log of the same "
        "shape, each side a process of its own (start-up included on both sides). "
        "Baseline: the naive replay, which jumps a ``MockClock`` (autojump) with one "
        "``trio.sleep_until`` per event. Then the reference log "
        "(``../shared/data/nats-py-commits.jsonl``) through the replay engine, per "
        "event, against parsing its lines, in paired rounds in one process."
    ),
    "nats-requests": (
        "Every message a nats-py client sends goes through ``Client.publish``; the "
        "benchmark counts them (classified by the KV key they touch) while two "
        "processes' coordinators (two connections) ping 10 keys: ``open`` (first ping), "
        "``owner-ping``, ``other-ping`` (a process that does not own the window), and "
        "``finalize`` (from the due time until the fire is done: both processes' "
        "requests). Process-lease renewals (``p`` keys) are excluded. The reference "
        "design spends 2 per ping."
    ),
    "owner-ping": (
        "Latency of an owner ping (``await debounce()``, 200 per round) through the NATS "
        "backend on Trio, against raw nats-py on a plain asyncio loop doing the KV "
        "operations the requests count saw an owner ping do (same sizes, one key), in the "
        "same run. A third variant in the same rotation does these operations through "
        "the backend's store alone (``NatsKvStore``: one crossing into the asyncio host per "
        "operation, no coordinator), which splits the gap into the bridge's share and "
        "the coordinator's."
    ),
    "hot-key": (
        "Tasks of one coordinator pinging one key with ``await debounce()`` (1,000 "
        "pings per round split among the tasks; 2 per task at 1,000 tasks), "
        "``on_backend_error='raise'``: acknowledged (stored) pings per second. Then 4 "
        "processes, 25 tasks each, on one key from a common start. Baseline: DBOS's "
        "``Debouncer`` on SQLite, one caller, sequential coalescing pings into one "
        "key's window, in a process launched once (``bench/baselines/dbos_worker.py``)."
    ),
    "runs": (
        "``bench/runs.py``'s figures: sequential ``schedule(..., after=3600, "
        "persist=True)`` of new ids (and from 10 tasks) on each store, against DBOS "
        "``Queue.enqueue`` of a workflow delayed by an hour on SQLite, and against the two "
        "store calls it makes, in the same rotation; then a coordinator's heartbeat with "
        "100,000 runs pending far in the future, watched through a counting store "
        "(writes per 1 s tick), and a bare lease write and claim-sweep query; then, once, "
        "1,000 persisted runs due at one instant fired with a no-op handler, 100 at once."
    ),
}


def write(results_path: Path, out: Path = OUT) -> Path:
    results = json.loads(results_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(results, out)
    m = results["machine"]
    lines = [
        "Benchmarks",
        "==========",
        "",
        "Each figure against a baseline measured in the same run, written by "
        "``nox -s bench`` (``bench/suite.py``, then ``bench/report.py``; the numbers "
        "below are in ``results.json`` beside this page; ``bench/README.md`` says what "
        "each script measures). The machine is shared and noisy: compare the ratios, "
        "which are taken round by round, rather than the absolute figures.",
        "",
        "Method",
        "------",
        "",
        f"Every ratio is the median of {results['rounds']} paired rounds (the "
        "Rounds column): in each round every variant of a comparison runs once, in an "
        "order rotated from round to round, on a fresh event loop or in a fresh process, "
        "with a fixed number of operations (no loop-count calibration: asyncio's "
        "``call_later`` slows down as cancelled handles pile up), and the ratio is taken "
        "within the round. The spread is the min-max and the interquartile range of "
        "the per-round ratios. Rows measured once (or once per process) say so.",
        "",
        "To measure a change against an older revision, ``python bench/suite.py --compare "
        "REV`` runs the coalescing ping (one window and 1,000 windows in turn), its growth "
        "from 10 to 100,000 windows, the owner ping over NATS and the hot key on the "
        "working tree and on REV in alternating paired rounds, and prints each figure "
        "side by side with a no-regression verdict (``bench/README.md``).",
        "",
        "Machine",
        "-------",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores",
        f"- {m['implementation']} {m['python']}, trio {m['trio']}, pyperf {m['pyperf']}; "
        f"{m['platform']}",
        f"- load average (1, 5, 15 min) at the start {m['loadavg_start']}, at the end "
        f"{m.get('loadavg_end', '(not finished)')}; started {m['started']}; the whole run took "
        f"{results['seconds']:.0f} s",
        *[f"- {note}" for note in results.get("notes", [])],
        "",
    ]

    def rank(key: str) -> int:
        return ORDER.index(key) if key in ORDER else len(ORDER)

    absent = [key for key in ORDER if key not in results["items"]]
    if absent:
        lines += [
            "Not in this run: "
            + ", ".join(f"``{key}``" for key in absent)
            + " (``python bench/suite.py --only NAME`` measures one).",
            "",
        ]
    for key, item in sorted(results["items"].items(), key=lambda kv: rank(kv[0])):
        title = item["title"]
        lines += [title, "-" * len(title), "", DESCRIPTIONS.get(key, ""), ""]
        lines.append(
            f"Took {item['seconds']:.0f} s; load average {item['load'][0]} at its start, "
            f"{item['load'][1]} at its end."
        )
        lines.append("")
        lines += table(item["rows"])
        lines.append("")
        if key in plots:
            lines += [f".. image:: {plots[key]}", f"   :alt: {item['title']}", ""]
    # Written by bench/nats_hosts.py --rst (each host in processes of its own).
    title = "The asyncio hosts of the NATS backend"
    lines += [
        title,
        "-" * len(title),
        "",
        "The two hosts of nats-py's loop (``NatsConfig.asyncio_host``, :doc:`/nats`), "
        "side by side in runs of ``bench/nats_hosts.py`` (not part of ``nox -s "
        "bench``: every sample is a process of its own), on the two machines the "
        "project has measured on; :doc:`/nats` says what they decide.",
        "",
        "On AMD EPYC:",
        "",
        ".. include:: hosts.inc",
        "",
        "On Intel Xeon:",
        "",
        ".. include:: hosts-xeon.inc",
        "",
    ]
    # Written by hand from bench/compare.py's report (the before/after of a refactor).
    title = "Before and after the window engine"
    lines += [title, "-" * len(title), "", ".. include:: engine-before-after.inc", ""]
    missed = [
        (key, r)
        for key, item in results["items"].items()
        for r in item["rows"]
        if r["met"] is False
    ]
    lines += ["Summary", "-------", ""]
    met = sum(1 for item in results["items"].values() for r in item["rows"] if r["met"])
    lines.append(f"{met} targets met, {len(missed)} missed.")
    lines.append("")
    for key, r in missed:
        lines.append(f"- {key}: {esc(r['name'])}: {r['gap']}")
    lines.append("")
    page = out / "index.rst"
    page.write_text("\n".join(lines))
    return page


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT / "results.json"
    print(write(path, path.parent))
