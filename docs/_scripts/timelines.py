"""Draw the timeline pictures of docs/semantics.rst from the real coordinator.

Run from the project root with the bench extra installed (it has matplotlib):
``python docs/_scripts/timelines.py``. The SVGs are committed, so building the docs
does not need matplotlib.
"""

from __future__ import annotations

from pathlib import Path

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


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for scenario in SCENARIOS:
        draw(*scenario)
