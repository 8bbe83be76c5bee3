"""The ``trio-debounce`` argument parser: every command and option, and nothing else."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._types import Mode
from .._version import __version__

_MODES = [m.value for m in Mode]


def _add_debounce_options(parser: argparse.ArgumentParser, unit: str) -> None:
    parser.add_argument(
        "--delay",
        required=True,
        type=float,
        metavar="S",
        help=f"quiet period that ends a window ({unit}; finite, >= 0)",
    )
    parser.add_argument(
        "--max-delay",
        type=float,
        metavar="S",
        help=f"cap on a window's length from its first ping ({unit}; >= --delay)",
    )
    parser.add_argument(
        "--mode", choices=_MODES, default="trailing", help="edges that fire (default: trailing)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command.

    Each command's namespace carries ``job`` (``"replay"``, ``"run"`` or
    ``"events git"``) and ``parser`` (its own subparser, whose ``error()`` prints that
    command's usage line).
    """
    parser = argparse.ArgumentParser(
        prog="trio-debounce",
        description="Debounce event streams with trio_debounce's coordinator.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command_name", required=True, metavar="COMMAND")

    rp = commands.add_parser(
        "replay",
        help="replay a JSON-lines event log on a virtual clock",
        description=(
            "Drive every event of a JSON-lines log through the real coordinator on a "
            "virtual clock (trio.testing.MockClock). Durations are in the input's time "
            "unit."
        ),
    )
    rp.add_argument("file", metavar="FILE", help="JSON-lines input, or - for stdin")
    _add_debounce_options(rp, "input time units")
    rp.add_argument("--key-field", default="key", metavar="F", help="default: key")
    rp.add_argument("--time-field", default="ts", metavar="F", help="default: ts")
    rp.add_argument(
        "--format",
        choices=["jsonl", "summary"],
        default="jsonl",
        help="one JSON line per fire, or one summary object (default: jsonl)",
    )
    rp.add_argument(
        "--sort", action="store_true", help="sort events by time (stable) instead of failing"
    )
    opts = rp.add_argument_group("window options", "See the semantics page of the docs.")
    opts.add_argument(
        "--max-count",
        type=int,
        metavar="N",
        help="a window is due at its N-th ping (N >= 1)",
    )
    opts.add_argument(
        "--payload",
        choices=["last", "first", "collect"],
        default="last",
        help="what a trailing fire carries: the latest event, the first, or the list of "
        "all (default: last)",
    )
    opts.add_argument(
        "--overlap",
        choices=["allow", "queue-latest"],
        default="allow",
        help="queue-latest: a window due while its key's run executes waits for the run "
        "to end (trailing mode only; default: allow)",
    )
    opts.add_argument(
        "--run-time",
        type=float,
        default=0.0,
        metavar="S",
        help="how long each fire's run takes (input time units; default: 0)",
    )
    opts.add_argument(
        "--order-field",
        metavar="F",
        help="order events by this numeric field: the latest is the highest, not the last "
        "to arrive",
    )
    rp.set_defaults(job="replay", parser=rp)

    run = commands.add_parser(
        "run",
        help="debounce a live stream of lines from stdin",
        description=(
            "Debounce lines from stdin on the real clock. Each fire prints a JSON line, "
            "or runs COMMAND with the payload on its stdin and TRIO_DEBOUNCE_KEY and "
            "TRIO_DEBOUNCE_PINGS in its environment. SIGTERM or SIGHUP stops it: the "
            "pending windows fire at once (with --backend they are handed off to the "
            "peers), running commands get --stop-grace to finish, and the exit status "
            "is 143."
        ),
    )
    _add_debounce_options(run, "seconds")
    run.add_argument(
        "--key-field",
        metavar="F",
        help="lines are JSON objects keyed by this field (default: the line is the key)",
    )
    run.add_argument(
        "--jobs", type=int, default=1, metavar="N", help="commands run at once (default: 1)"
    )
    run.add_argument(
        "--stop-grace",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM or SIGHUP, seconds that running commands get to finish; then "
        "they get SIGTERM, and SIGKILL half a second later (finite, >= 0; default: 10)",
    )
    shared = run.add_argument_group(
        "shared windows",
        "Share the windows with every process run with the same servers and bucket: "
        "each burst fires once, in the process that owns its window. Everything else "
        "(credentials, TLS, timeouts) comes from the TRIO_DEBOUNCE_* environment "
        "variables.",
    )
    _add_backend_options(
        shared,
        required=False,
        servers="NATS JetStream servers (nats:// or tls:// URLs, comma-separated); "
        "without it the windows are in memory",
        bucket="the KV bucket to share",
    )
    shared.add_argument(
        "--process-id",
        metavar="ID",
        help="this process's id in the bucket, unique among live processes (default: a random one)",
    )
    # Only what comes after "--" is the COMMAND (see parse_args); a positional argument
    # before it lands here and is refused.
    run.add_argument("cmd", nargs="*", metavar="-- COMMAND", help="command to run per fire")
    run.set_defaults(job="run", parser=run)

    events = commands.add_parser("events", help="make event logs from other sources")
    sources = events.add_subparsers(dest="source", required=True, metavar="SOURCE")
    git = sources.add_parser(
        "git",
        help="one event per commit and top-level path, from a git repository's history",
        description=(
            "Print one JSON line per commit reachable from HEAD and top-level path it "
            'touched: {"ts": committer time, "key": top-level path, "id": sha[:12]}, '
            "sorted by (ts, key, id). Merge commits contribute no paths."
        ),
    )
    git.add_argument("path", nargs="?", default=".", metavar="PATH", help="repository (default: .)")
    git.set_defaults(job="events git", parser=git)

    windows = commands.add_parser(
        "windows",
        help="list the windows of a shared bucket",
        description=(
            "Print every window of the bucket: workflow, key, mode, state (open, due, "
            "waiting for a queue-latest run, or firing), owner and its lease's time "
            "left, first and last ping, ping count, due time, cap, payload size and "
            "fencing token; with --follow, then every change as it happens. Reads "
            "only: the bucket is not created, and a read-only user will do. Exit status "
            "0, or 2 if the bucket cannot be read; with --follow, 130 after Ctrl-C and "
            "143 after SIGTERM or SIGHUP."
        ),
    )
    _add_bucket_options(windows)
    windows.add_argument("--workflow", metavar="W", help="only this workflow's windows")
    windows.add_argument(
        "--key",
        metavar="PATTERN",
        help="only keys matching this glob (*, ?, [...]), applied after listing the "
        "workflow's keys",
    )
    windows.add_argument(
        "--follow",
        action="store_true",
        help="after the windows there now (change listed), print one line per change "
        "(opened, updated, fired, closed) as it happens, until Ctrl-C (exit status "
        "130) or SIGTERM or SIGHUP (143)",
    )
    windows.set_defaults(job="windows", parser=windows)

    processes = commands.add_parser(
        "processes",
        help="list the processes of a shared bucket",
        description=(
            "Print every process lease of the bucket: process id, epoch, live or not, "
            "lease time left, heartbeat interval, age of the last beat, draining or "
            "released, and the windows and fire records it holds. Reads only. Exit "
            "status 0, or 2 if the bucket cannot be read."
        ),
    )
    _add_bucket_options(processes)
    processes.set_defaults(job="processes", parser=processes)

    cancel = commands.add_parser(
        "cancel",
        help="close a window of a shared bucket without firing it",
        description=(
            "Close the open window (WORKFLOW, KEY) without firing it, whoever owns it: "
            "a revision-checked close, as Coordinator.cancel does; its owner counts a "
            "cancel. Exit status 0 cancelled, 1 no open window, 2 the bucket cannot be "
            "reached or written."
        ),
    )
    _add_window_arguments(cancel)
    cancel.set_defaults(job="cancel", parser=cancel)

    flush = commands.add_parser(
        "flush",
        help="fire a window of a shared bucket now",
        description=(
            "Make the open window (WORKFLOW, KEY) due now and ask its owner to fire it: "
            "a live owner fires it within one heartbeat interval, a dead owner's "
            "survivor when it adopts it. Exit status 0 requested (with --wait: fired), "
            "1 no trailing fire pending, 2 the bucket cannot be reached or written."
        ),
    )
    _add_window_arguments(flush)
    flush.add_argument("--wait", action="store_true", help="wait until the fire is committed")
    flush.set_defaults(job="flush", parser=flush)
    return parser


def _add_backend_options(
    group: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    required: bool,
    servers: str,
    bucket: str,
) -> None:
    """``--backend`` and ``--bucket``, with these helps."""
    group.add_argument("--backend", required=required, metavar="URL[,URL...]", help=servers)
    group.add_argument(
        "--bucket",
        metavar="NAME",
        help=f"{bucket} (default: $TRIO_DEBOUNCE_NATS_BUCKET, else trio_debounce)",
    )


#: The help of ``--backend`` in the commands that read or steer a shared bucket.
_SERVERS_HELP = (
    "NATS JetStream servers (nats:// or tls:// URLs, comma-separated); credentials, TLS "
    "and timeouts come from the TRIO_DEBOUNCE_* environment"
)


def _add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """WORKFLOW, KEY and the bucket's options, of the commands that steer a window."""
    parser.add_argument("workflow", metavar="WORKFLOW", help="the window's workflow")
    parser.add_argument("key", metavar="KEY", help="the window's debounce key")
    _add_backend_options(
        parser,
        required=True,
        servers=_SERVERS_HELP,
        bucket="the KV bucket",
    )


def _add_bucket_options(parser: argparse.ArgumentParser) -> None:
    """The options of the commands that read a shared bucket."""
    _add_backend_options(
        parser,
        required=True,
        servers=_SERVERS_HELP,
        bucket="the KV bucket",
    )
    parser.add_argument(
        "--format",
        choices=["table", "jsonl"],
        default="table",
        help="an aligned table for people (colour on a terminal, never with NO_COLOR "
        "set), or one JSON object per line with times as epoch seconds (default: table)",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line (``sys.argv[1:]`` when ``argv`` is None).

    ``run``'s COMMAND is everything after the first ``--``, split off before argparse
    sees it, so that the COMMAND's own options are never taken for ``run``'s. An
    argument before the ``--`` that is no option (``run events.jsonl --delay 1``) is a
    usage error naming it.

    Returns:
      argparse.Namespace: the options, with ``job``, ``parser`` (see
      :func:`build_parser`) and, for ``run``, ``cmd`` (list[str], empty without
      COMMAND).

    Raises:
      SystemExit: with status 2 and a usage message for bad options; with status 0
        after ``--help`` or ``--version``.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in words:
        dashes = words.index("--")
        # The command's name is the first word that is not an option (the top-level
        # options, --help and --version, take no value).
        name = next((i for i, word in enumerate(words[:dashes]) if not word.startswith("-")), None)
        if name is not None and words[name] == "run":
            words, command = words[:dashes], words[dashes + 1 :]
    args = build_parser().parse_args(words)
    if args.job == "run":
        if args.cmd:
            args.parser.error(
                f"unexpected argument {args.cmd[0]!r}: run reads its events from stdin "
                "(trio-debounce run ... < FILE); to run a COMMAND per fire, put it after "
                "-- (trio-debounce run ... -- COMMAND ...)"
            )
        args.cmd = command
    return args
