"""Merge the drivers' logs and check the guarantees per window (active run id).

Across processes on real clocks a window's boundaries depend on timing, so runs are not
compared with the single-process model; each window (run id) is checked on its own,
from the ``ping``, ``start`` and ``end`` events of :mod:`tests.chaos.driver`:

* a window *needs* a trailing fire when it holds a stored ping and its mode is
  ``trailing``, or its mode is ``both`` and a stored ping saw a count of 2 or more;
* **lost**: a window that needs a trailing fire and has none that ran to its end
  (under at-least-once), or none that started (under at-most-once); also a window
  whose latest stored ping began after the start of its last trailing fire (a
  stored ping left without a fire at or after its arrival); and, under at-least-once,
  a window whose leading fire started in no attempt that ran to its end, unless a
  later fire of its key (a higher fencing token) had started: a survivor runs an
  interrupted leading fire again, except once a later one committed;
* **fired twice**: a window with more than one start of the same edge; among them,
  **two owners**: two first attempts of the same edge that both carry a fencing
  token (confirmed fires: never allowed, in either mode; a re-run after a kill has a
  later attempt, an unconfirmed fire token 0);
* **interrupted**: a start without its end, in a killed process;
* **payload**: a confirmed trailing fire (token > 0) whose payload is not a ping of
  its window (one reported as not stored may have landed late), or is superseded by
  a stored ping that surely came later (its call began after the fired ping's call
  returned, and it returned before the fire);
* **hung calls**: a ping that took longer than its bound (not counting one that
  overlapped a blocked event loop in its process).

Pings reported as not stored and windows opened by fail-open are listed separately:
they are outside the guarantees (see docs/protocol.rst).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]

#: Seconds of slack when comparing times of two processes on one host.
SLACK = 0.05


@dataclass
class Report:
    """What the checker found; the lists hold run ids (or payloads), for the log."""

    pings: int = 0
    errors: int = 0
    windows: int = 0
    lost: list[str] = field(default_factory=list)
    fired_twice: list[str] = field(default_factory=list)
    two_owners: list[str] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    wrong_payload: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    not_stored: list[str] = field(default_factory=list)
    fail_open: list[str] = field(default_factory=list)
    unconfirmed: int = 0
    crashed: list[str] = field(default_factory=list)

    def broken_promises(self) -> tuple[list[str], list[str]]:
        """The promises outside the table's columns that this report breaks (windows
        fired by two owners, wrong payloads), and notes naming the first few runs."""
        problems: list[str] = []
        notes: list[str] = []
        if self.two_owners:
            problems.append(f"{len(self.two_owners)} windows fired by two owners")
            notes.append(f"two owners: {self.two_owners[:5]}")
        if self.wrong_payload:
            problems.append(f"wrong payload in {len(self.wrong_payload)} fires")
            notes.append(f"wrong payload: {self.wrong_payload[:5]}")
        return problems, notes

    def summary(self) -> str:
        return (
            f"pings {self.pings} (errors {self.errors}), windows {self.windows}, "
            f"lost {len(self.lost)}, fired twice {len(self.fired_twice)} (two owners "
            f"{len(self.two_owners)}), interrupted "
            f"{len(self.interrupted)}, wrong payload {len(self.wrong_payload)}, hung "
            f"{len(self.hung)}, not stored {len(self.not_stored)}, fail-open windows "
            f"{len(self.fail_open)}, unconfirmed fires {self.unconfirmed}"
        )


def check(
    events: Iterable[Event],
    *,
    delivery: str,
    ping_bound: float,
    killed: Iterable[str] = (),
) -> Report:
    """Check merged driver events (any order).

    Args:
      events: the ``tests.chaos.driver`` events of every incarnation.
      delivery (str): ``"at-least-once"`` or ``"at-most-once"``.
      ping_bound (float): seconds a ping may take (the op_timeout plus a margin).
      killed: names of the incarnations that were killed (their open handlers count
        as interrupted; a crash is an incarnation that logged ``crash``).
    """
    killed = set(killed)
    report = Report()
    pings: defaultdict[str, list[Event]] = defaultdict(list)
    #: Key -> the pings of it that failed open (their writes may land later).
    failed_open: defaultdict[str, list[Event]] = defaultdict(list)
    starts: defaultdict[str, list[Event]] = defaultdict(list)
    ends: set[tuple[str, str, int, str]] = set()
    fail_open: set[str] = set()
    blocks: defaultdict[str, list[tuple[float, float]]] = defaultdict(list)
    block_began: dict[str, float] = {}
    all_events = sorted(events, key=lambda e: float(e.get("t", 0.0)))
    for ev in all_events:
        kind = ev["ev"]
        if kind == "block":
            block_began[ev["proc"]] = ev["t"]
        elif kind == "unblock":
            blocks[ev["proc"]].append((block_began.pop(ev["proc"], ev["t"]), ev["t"]))
        elif kind == "crash":
            report.crashed.append(ev["proc"])
    for proc, began in block_began.items():  # blocked when killed
        blocks[proc].append((began, float("inf")))

    for ev in all_events:
        kind = ev["ev"]
        if kind in ("ping", "err"):
            report.pings += 1
            overlaps_block = any(
                a - SLACK <= ev["t"] and ev["t0"] <= b + SLACK for a, b in blocks[ev["proc"]]
            )
            if ev["t"] - ev["t0"] > ping_bound and not overlaps_block:
                report.hung.append(f"{ev['proc']}:{ev['payload']}")
        if kind == "err":
            report.errors += 1
        elif kind == "ping":
            if ev["fail_open"]:
                fail_open.add(ev["run"])
                failed_open[ev["key"]].append(ev)
            if not ev["stored"]:
                report.not_stored.append(ev["payload"])
            if ev["outcome"] != "stale":
                pings[ev["run"]].append(ev)
        elif kind == "start":
            starts[ev["run"]].append(ev)
            if ev["token"] == 0:
                report.unconfirmed += 1
        elif kind == "end":
            ends.add((ev["proc"], ev["run"], ev["attempt"], ev["edge"]))
    report.fail_open = sorted(fail_open)
    runs = (set(pings) | set(starts)) - fail_open
    report.windows = len(runs)

    for run in sorted(runs):
        stored = [p for p in pings[run] if p["stored"]]
        fires = starts[run]
        for fire in fires:
            cut = (fire["proc"], run, fire["attempt"], fire["edge"]) not in ends
            if cut and fire["proc"] in killed:
                report.interrupted.append(run)
        for edge in ("leading", "trailing"):
            if sum(1 for fire in fires if fire["edge"] == edge) > 1:
                report.fired_twice.append(run)
                confirmed = [
                    fire
                    for fire in fires
                    if fire["edge"] == edge and fire["token"] > 0 and fire["attempt"] == 1
                ]
                if len(confirmed) > 1:
                    report.two_owners.append(run)
                break
        if not stored:
            continue
        mode = stored[0]["mode"]
        needs = mode == "trailing" or (mode == "both" and max(p["count"] for p in stored) >= 2)
        if not needs:
            continue
        trailing = [fire for fire in fires if fire["edge"] == "trailing"]
        if delivery == "at-least-once":
            done = [
                fire
                for fire in trailing
                if (fire["proc"], run, fire["attempt"], "trailing") in ends
            ]
        else:
            done = trailing
        if not done:
            report.lost.append(run)
            continue
        last_ping = max(p["t0"] for p in stored)
        if last_ping > max(fire["t"] for fire in trailing) + SLACK:
            report.lost.append(run)
            continue
        # A ping reported as not stored may have landed after all (its write timed out
        # and committed later): the fire may carry it. So may a ping of the key that
        # failed open (logged with its local window's run id) whose write landed late
        # in this shared window, as documented for a register that timed out.
        by_payload = {p["payload"]: p for p in pings[run]}
        for p in failed_open.get(stored[0]["key"], ()):
            by_payload.setdefault(p["payload"], p)
        for fire in trailing:
            if fire["token"] == 0:
                continue  # unconfirmed: this process's own latest payload
            fired = by_payload.get(fire["payload"])
            later = fired is not None and any(
                p["t0"] > fired["t"] + SLACK and p["t"] < fire["t"] - SLACK for p in stored
            )
            if fired is None and fire["payload"].split(":")[0] in killed:
                continue  # pinged by a process killed before it logged the ping
            if fired is None or later:
                report.wrong_payload.append(run)
                break
    if delivery == "at-least-once":
        _check_leading(runs, starts, ends, report)
    return report


def _check_leading(
    runs: set[str],
    starts: dict[str, list[dict[str, Any]]],
    ends: set[tuple[str, str, int, str]],
    report: Report,
) -> None:
    """At-least-once: every confirmed leading fire ran to its end in some attempt,
    unless a later fire of its key started (its re-run is then skipped by design)."""
    tokens: dict[str, list[int]] = defaultdict(list)
    for run in runs:
        for fire in starts[run]:
            tokens[fire["key"]].append(fire["token"])
    for run in sorted(runs):
        leading = [fire for fire in starts[run] if fire["edge"] == "leading"]
        if not leading or any(
            (fire["proc"], run, fire["attempt"], "leading") in ends for fire in leading
        ):
            continue
        top = max(fire["token"] for fire in leading)
        later = any(token > top for token in tokens[leading[0]["key"]])
        if top > 0 and not later and run not in report.lost:
            report.lost.append(run)
