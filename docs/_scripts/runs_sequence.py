"""Draw the sequence picture of docs/runs.rst: a deferred run's claim, heartbeat and
takeover, as the scheduler (``trio_debounce/_runs/``) writes them.

Run from the project root: ``python docs/_scripts/runs_sequence.py``. It needs only
the standard library and writes ``docs/_static/runs-takeover.svg``, which is
committed, so building the docs runs nothing.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "_static" / "runs-takeover.svg"

WIDTH = 980
LANES = {"A": 250, "store": 560, "B": 870}
TOP = 70
STEP = 46
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
INK = "#1f2933"
MUTED = "#52606d"
A_COLOUR = "#1c64b5"
B_COLOUR = "#b5541c"
STORE_COLOUR = "#3e4c59"

# (from, to, label, detail, colour); "note" rows span lanes; "gap" rows leave room.
ROWS: list[tuple[str, ...]] = [
    ("A", "store", "create_run (schedule, persist=True)", "pending · owner=A · epoch 1 · token 1"),
    ("A", "store", "put_lease (heartbeat)", "rl.A: expires_at = now + lease"),
    ("B", "store", "put_lease (heartbeat)", "rl.B: expires_at = now + lease"),
    ("A", "store", "put_lease (heartbeat)", "one write per interval, whatever the runs"),
    ("dies", "A", "A dies (SIGKILL, power cut)", ""),
    ("gap", "", "", ""),
    (
        "B",
        "store",
        "B's claim sweep: list_leases, list_runs",
        "wakes as A's expires_at + max_clock_skew passes",
    ),
    (
        "B",
        "store",
        "claim: update_run, CAS on the listed revision",
        "owner=B · B's epoch · token 2",
    ),
    ("self", "B", "timer on Trio's clock", "until scheduled_at, wall clock re-checked"),
    ("B", "store", "start: update_run, CAS", "pending → started · attempt 1 · token 3"),
    ("handler", "B", "run handler(RunFire)", "attempt=1 · fencing_token=3"),
    ("B", "store", "finish: update_run, CAS", 'started → done · outcome="ran" (tombstone)'),
]


def text(x: float, y: float, s: str, *, size: int = 13, colour: str = INK, anchor: str = "middle",
         weight: str = "normal", italic: bool = False) -> str:  # fmt: skip
    style = " font-style='italic'" if italic else ""
    return (
        f"<text x='{x:.0f}' y='{y:.0f}' {FONT} font-size='{size}' fill='{colour}' "
        f"text-anchor='{anchor}' font-weight='{weight}'{style}>{escape(s)}</text>"
    )


def arrow(x1: float, x2: float, y: float, colour: str) -> str:
    head = -9 if x2 > x1 else 9
    return (
        f"<line x1='{x1}' y1='{y}' x2='{x2 + head * 0.2}' y2='{y}' stroke='{colour}' "
        f"stroke-width='1.6'/>"
        f"<polygon points='{x2},{y} {x2 + head},{y - 5} {x2 + head},{y + 5}' fill='{colour}'/>"
    )


def colour_of(lane: str) -> str:
    return A_COLOUR if lane == "A" else B_COLOUR


def draw() -> str:
    height = TOP + STEP * (len(ROWS) + 1) + 70
    out: list[str] = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}'>",
        f"<rect width='{WIDTH}' height='{height}' fill='white'/>",
    ]
    heads = {"A": ("process A", A_COLOUR), "store": ("run store", STORE_COLOUR),
             "B": ("process B", B_COLOUR)}  # fmt: skip
    death_y = TOP + STEP * 5
    bottom = TOP + STEP * (len(ROWS) + 0.6)
    for lane, x in LANES.items():
        label, colour = heads[lane]
        out.append(
            f"<rect x='{x - 70}' y='{TOP - 48}' width='140' height='30' rx='4' "
            f"fill='white' stroke='{colour}' stroke-width='1.6'/>"
        )
        out.append(text(x, TOP - 28, label, colour=colour, weight="bold"))
        end = death_y if lane == "A" else bottom
        out.append(
            f"<line x1='{x}' y1='{TOP - 18}' x2='{x}' y2='{end}' stroke='{colour}' "
            f"stroke-width='1.2' stroke-dasharray='5,4'/>"
        )
    # A's lease: from its last renewal to expiry + skew (the takeover point).
    beat_y = TOP + STEP * 4
    sweep_y = TOP + STEP * 7
    lx = LANES["A"] - 95
    out.append(
        f"<path d='M{lx + 8},{beat_y} L{lx},{beat_y} L{lx},{sweep_y} L{lx + 8},{sweep_y}' "
        f"fill='none' stroke='{MUTED}' stroke-width='1.2'/>"
    )
    mid = (beat_y + sweep_y) / 2
    out.append(text(lx - 6, mid - 8, "A's lease", size=12, colour=MUTED, anchor="end"))
    out.append(text(lx - 6, mid + 8, "+ max_clock_skew", size=12, colour=MUTED, anchor="end"))
    # B's handler runs between its start and its tombstone.
    start_y = TOP + STEP * 10
    done_y = TOP + STEP * 12
    out.append(
        f"<rect x='{LANES['B'] - 6}' y='{start_y}' width='12' height='{done_y - start_y}' "
        f"fill='#f7e3d7' stroke='{B_COLOUR}' stroke-width='1.2'/>"
    )
    for i, (kind, lane, label, detail) in enumerate(ROWS, start=1):
        y = TOP + STEP * i
        if kind == "gap":
            continue
        if kind == "dies":
            x = LANES["A"]
            out.append(
                f"<path d='M{x - 9},{y - 9} L{x + 9},{y + 9} M{x - 9},{y + 9} L{x + 9},{y - 9}' "
                f"stroke='#c81e1e' stroke-width='3'/>"
            )
            out.append(text(x + 16, y + 5, label, colour="#c81e1e", anchor="start", weight="bold"))
            continue
        if kind in ("self", "handler"):
            x = LANES[lane]
            out.append(text(x - 16, y - 3, label, anchor="end", colour=colour_of(lane)))
            out.append(text(x - 16, y + 13, detail, size=11, anchor="end", colour=MUTED))
            continue
        x1, x2 = LANES[kind], LANES[lane]
        colour = colour_of(kind)
        out.append(arrow(x1, x2, y, colour))
        cx = (x1 + x2) / 2
        out.append(text(cx, y - 7, label, colour=colour))
        out.append(text(cx, y + 16, detail, size=11, colour=MUTED))
    foot = bottom + 30
    out.append(
        text(
            WIDTH / 2,
            foot,
            "Every update_run names the revision it read: a run changed meanwhile "
            "(re-scheduled, cancelled, claimed) is re-read, never run stale.",
            size=11,
            colour=MUTED,
            italic=True,
        )
    )
    out.append(
        text(
            WIDTH / 2,
            foot + 17,
            "At-most-once delivery writes pending → done (the tombstone) instead of "
            "pending → started, then runs the handler, and writes nothing after it.",
            size=11,
            colour=MUTED,
            italic=True,
        )
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    OUT.write_text(draw(), encoding="utf-8")
    print(f"wrote {OUT}")
