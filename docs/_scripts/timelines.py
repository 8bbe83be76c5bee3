"""Draw the timeline pictures of docs/semantics.rst from the real coordinator.

Run from the project root with the bench extra installed (it has matplotlib):
``python docs/_scripts/timelines.py``. The SVGs are committed, so building the docs
does not need matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import trio
import trio.testing

import trio_debounce

OUT = Path(__file__).resolve().parent.parent / "_static"
PINGS = [0.0, 1.0, 2.0, 3.0, 7.0, 7.5]
SCENARIOS = [
    ("trailing", "trailing", 2.0, None),
    ("trailing-max-delay", "trailing", 2.0, 2.5),
    ("leading", "leading", 2.0, None),
    ("both", "both", 2.0, None),
]


def simulate(mode: str, delay: float, max_delay: float | None):  # type: ignore[no-untyped-def]
    results = []
    fires: list[trio_debounce.Fire] = []

    async def record(fire: trio_debounce.Fire) -> None:
        fires.append(fire)

    async def main() -> None:
        async with trio_debounce.open_coordinator(handlers={"wf": record}) as c:
            for i, t in enumerate(PINGS):
                await trio.sleep_until(t)
                r = c.debounce_nowait(
                    "wf", "k", f"p{i}", delay=delay, max_delay=max_delay, mode=mode
                )
                results.append((t, r))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return results, fires


def draw(name: str, mode: str, delay: float, max_delay: float | None) -> None:
    results, fires = simulate(mode, delay, max_delay)
    fig, ax = plt.subplots(figsize=(8, 2.2))
    # each window spans from its first ping to its final deadline
    closes: list[tuple[float, float]] = []
    starts: list[float] = []
    for t, r in results:
        if r.outcome.value != "coalesce":
            starts.append(t)
            closes.append((t, t))
        t0 = closes[-1][0]
        cap = t0 + max_delay if max_delay is not None else float("inf")
        closes[-1] = (t0, min(t + delay, cap))
    for t0, t1 in closes:
        ax.axvspan(t0, t1, ymin=0.15, ymax=0.85, color="tab:blue", alpha=0.12)
    for t, r in results:
        y = 0.62 - 0.07 * (r.ping_count - 1)  # stagger each window's deadline arrows
        ax.plot([t, t], [0.3, 0.7], color="black", lw=1.5)
        label = {"schedule-trailing": "S", "fire-immediate": "F", "coalesce": "c"}[r.outcome.value]
        ax.text(t, 0.75, label, ha="center", va="bottom", fontsize=8)
        end = t + delay
        if max_delay is not None:
            end = min(end, max(o for o in starts if o <= t) + max_delay)
        ax.annotate(
            "",
            xy=(end, y),
            xytext=(t, y),
            arrowprops={"arrowstyle": "->", "color": "tab:gray", "lw": 0.8, "linestyle": "dashed"},
        )
    for f in fires:
        color = "tab:red" if f.edge.value == "trailing" else "tab:green"
        ax.plot(f.fired_at, 0.5, marker="*", markersize=14, color=color)
        ax.text(
            f.fired_at,
            0.12,
            f"{f.edge.value}\n{f.payload}, {f.ping_count} pings",
            ha="center",
            va="top",
            fontsize=7,
            color=color,
        )
    ax.set_ylim(-0.3, 1.0)
    ax.set_xlim(-0.5, 10.5)
    ax.set_yticks([])
    ax.set_xlabel("time (s)")
    cap = "" if max_delay is None else f", max_delay={max_delay:g}"
    ax.set_title(
        f"mode={mode}, delay={delay:g}{cap}: pings (|), deadline after each "
        "ping (dashed), fires (*)",
        fontsize=9,
    )
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(OUT / f"timeline-{name}.svg")
    plt.close(fig)


# ------------------------------------------------------------------ window options

#: (name, title, pings as (time, payload, order key or None), debounce kwargs, run time)
Ping = tuple[float, str, "int | None"]
OPTION_SCENARIOS: list[tuple[str, str, list[Ping], dict[str, Any], float]] = [
    (
        "max-count",
        "max_count=3, delay=2: the third ping makes the window due at once",
        [(0.0, "p0", None), (0.5, "p1", None), (1.0, "p2", None), (1.5, "p3", None),
         (2.0, "p4", None), (5.0, "p5", None)],
        {"delay": 2.0, "max_count": 3},
        0.0,
    ),
    (
        "collect",
        "payload_policy='collect', max_items=3, delay=2: the 4th ping overflows (fire-early)",
        [(0.0, "a", None), (0.5, "b", None), (1.0, "c", None), (1.5, "d", None),
         (2.0, "e", None), (6.0, "f", None)],
        {"delay": 2.0, "payload_policy": "collect", "max_items": 3},
        0.0,
    ),
    (
        "queue-latest",
        "overlap='queue-latest', delay=1, runs of 4 s (bars): a due window waits for the run",
        [(0.0, "p0", None), (2.0, "p1", None), (3.0, "p2", None), (3.5, "p3", None),
         (7.5, "p4", None)],
        {"delay": 1.0, "overlap": "queue-latest"},
        4.0,
    ),
    (
        "order-key",
        "order_key in brackets, delay=2: the highest key wins; drop_stale drops [8] (9 fired)",
        [(0.0, "p0", 5), (1.0, "p1", 9), (2.0, "p2", 7), (3.0, "p3", 3), (7.0, "p4", 8),
         (8.0, "p5", 12)],
        {"delay": 2.0, "drop_stale": True},
        0.0,
    ),
]  # fmt: skip


def simulate_options(
    pings: list[tuple[float, str, int | None]], kwargs: dict[str, Any], run_time: float
) -> tuple[list[tuple[float, str, int | None, trio_debounce.DebounceResult]], list[Any]]:
    results = []
    fires: list[trio_debounce.Fire] = []

    async def record(fire: trio_debounce.Fire) -> None:
        fires.append(fire)
        await trio.sleep(run_time)

    async def main() -> None:
        async with trio_debounce.open_coordinator(handlers={"wf": record}) as c:
            for t, payload, order in pings:
                await trio.sleep_until(t)
                extra = dict(kwargs)
                if order is not None:
                    extra["order_key"] = order
                else:
                    extra.pop("drop_stale", None)
                results.append((t, payload, order, c.debounce_nowait("wf", "k", payload, **extra)))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return results, fires


def draw_options(
    name: str,
    title: str,
    pings: list[tuple[float, str, int | None]],
    kwargs: dict[str, Any],
    run_time: float,
) -> None:
    results, fires = simulate_options(pings, kwargs, run_time)
    fig, ax = plt.subplots(figsize=(8, 2.4))
    for i, f in enumerate(fires):  # each window spans from its first ping to its fire
        ax.axvspan(f.first_ping_at, f.fired_at, ymin=0.25, ymax=0.85, color="tab:blue", alpha=0.12)
        if run_time:  # the run (the handler) of each fire, staggered
            y = -0.12 - 0.12 * (i % 2)
            ax.plot([f.fired_at, f.fired_at + run_time], [y, y], color="tab:orange", lw=3)
            ax.text(f.fired_at + run_time / 2, y - 0.03, f"run of {f.payload}", fontsize=6,
                    ha="center", va="top")  # fmt: skip
    letters = {"schedule-trailing": "S", "fire-immediate": "F", "coalesce": "c", "stale": "x"}
    for t, payload, order, r in results:
        ax.plot([t, t], [0.35, 0.75], color="black", lw=1.5)
        label = payload if order is None else f"{payload}[{order}]"
        ax.text(t, 0.8, f"{letters[r.outcome.value]} {label}", ha="center", va="bottom", fontsize=7)
    for f in fires:
        ax.plot(f.fired_at, 0.55, marker="*", markersize=14, color="tab:red")
        payload = "[" + ", ".join(f.payload) + "]" if isinstance(f.payload, list) else f.payload
        ax.text(
            f.fired_at,
            0.22,
            f"{payload}\n{f.ping_count} pings",
            ha="center",
            va="top",
            fontsize=7,
            color="tab:red",
        )
    ax.set_ylim(-0.45, 1.05)
    ax.set_xlim(-0.5, 13.5)
    ax.set_yticks([])
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=8.5)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(OUT / f"timeline-{name}.svg", metadata={"Date": None})
    plt.close(fig)


# ------------------------------------------------------------------ flow control

#: (name, title, ping times, the coordinator method, its keyword arguments)
FLOW_PINGS = [0.0, 0.5, 1.5, 2.5, 3.0, 4.5, 8.0, 8.5]
FLOW_SCENARIOS: list[tuple[str, str, str, dict[str, Any]]] = [
    (
        "throttle",
        "throttle(interval=2): a leading fire, then trailing fires 2 s apart (cool-downs)",
        "throttle",
        {"interval": 2.0},
    ),
    (
        "throttle-leading",
        "throttle(interval=2, trailing=False): the pings inside a window are dropped (x)",
        "throttle",
        {"interval": 2.0, "trailing": False},
    ),
    (
        "audit",
        "throttle(interval=2, leading=False) (audit): the latest ping, 2 s after the first",
        "throttle",
        {"interval": 2.0, "leading": False},
    ),
    (
        "batch",
        "batch(max_items=3, max_wait=2): at the 3rd item, or 2 s after the first",
        "batch",
        {"max_items": 3, "max_wait": 2.0},
    ),
    (
        "rate-limit",
        "rate_limit(limit=2, period=2): the first 2 pings of each window fire, the rest drop",
        "rate_limit",
        {"limit": 2, "period": 2.0},
    ),
]


def simulate_flow(
    method: str, kwargs: dict[str, Any]
) -> tuple[list[tuple[float, str, trio_debounce.DebounceResult]], list[Any]]:
    results = []
    fires: list[trio_debounce.Fire] = []

    async def record(fire: trio_debounce.Fire) -> None:
        fires.append(fire)

    async def main() -> None:
        async with trio_debounce.open_coordinator(handlers={"wf": record}) as c:
            for i, t in enumerate(FLOW_PINGS):
                await trio.sleep_until(t)
                payload = f"p{i}"
                results.append((t, payload, await getattr(c, method)("wf", "k", payload, **kwargs)))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return results, fires


def draw_flow(name: str, title: str, method: str, kwargs: dict[str, Any]) -> None:
    results, fires = simulate_flow(method, kwargs)
    fig, ax = plt.subplots(figsize=(8, 2.4))
    span = kwargs.get("interval", kwargs.get("max_wait", kwargs.get("period", 0.0)))
    letters = {"schedule-trailing": "S", "fire-immediate": "F", "coalesce": "c", "dropped": "x"}
    opened = [
        t for t, _, r in results if r.outcome.value in ("schedule-trailing", "fire-immediate")
    ]
    for t in opened:  # each window from its opening, span long
        ax.axvspan(t, t + span, ymin=0.25, ymax=0.85, color="tab:blue", alpha=0.10)
    for f in fires:  # a throttle's cool-down after a trailing fire
        if method == "throttle" and f.edge.value == "trailing" and kwargs.get("leading", True):
            ax.axvspan(f.fired_at, f.fired_at + span, ymin=0.25, ymax=0.85, color="tab:gray",
                       alpha=0.10, hatch="//")  # fmt: skip
    for t, payload, r in results:
        ax.plot([t, t], [0.35, 0.75], color="black", lw=1.5)
        ax.text(
            t, 0.8, f"{letters[r.outcome.value]} {payload}", ha="center", va="bottom", fontsize=7
        )
    for f in fires:
        color = "tab:red" if f.edge.value == "trailing" else "tab:green"
        ax.plot(f.fired_at, 0.55, marker="*", markersize=14, color=color)
        payload = "[" + ", ".join(f.payload) + "]" if isinstance(f.payload, list) else f.payload
        ax.text(f.fired_at, 0.22, f"{payload}\n{f.reason.value}", ha="center", va="top",
                fontsize=7, color=color)  # fmt: skip
    ax.set_ylim(-0.3, 1.05)
    ax.set_xlim(-0.5, 11.0)
    ax.set_yticks([])
    ax.set_xlabel("time (s)")
    ax.set_title(title + "; fires (*) with their reason", fontsize=8.5)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(OUT / f"timeline-{name}.svg", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for scenario in SCENARIOS:
        draw(*scenario)
    for option_scenario in OPTION_SCENARIOS:
        draw_options(*option_scenario)
    for flow_scenario in FLOW_SCENARIOS:
        draw_flow(*flow_scenario)
