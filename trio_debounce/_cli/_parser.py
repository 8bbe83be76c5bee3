"""The ``trio-debounce`` argument parser: every command and option, and nothing else."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import _validate
from .._types import Mode
from .._version import __version__

#: The debounce modes (the coordinator's :class:`Mode`), then the flow-control modes
#: (``throttle``, ``audit``: a throttle with no leading edge, ``batch``, ``rate-limit``).
DEBOUNCE_MODES = tuple(m.value for m in Mode)
FLOW_MODES = ("throttle", "audit", "batch", "rate-limit")


def _add_mode_options(parser: argparse.ArgumentParser, unit: str) -> None:
    """``--mode`` and the options of each mode: ``--delay`` and ``--max-delay`` for
    the debounce modes, the flow-control options for the others. None is required
    here: which go with which mode is checked by :func:`._commands.mode_options`."""
    parser.add_argument(
        "--mode",
        choices=[*DEBOUNCE_MODES, *FLOW_MODES],
        default="trailing",
        help="debounce (trailing, leading, both: edges that fire) or flow control "
        "(throttle, audit, batch, rate-limit) (default: trailing)",
    )
    debounce = parser.add_argument_group(
        "debounce options (--mode trailing, leading, both)",
        "--delay is required with these modes, and refused with the others.",
    )
    debounce.add_argument(
        "--delay",
        type=float,
        metavar="S",
        help=f"quiet period that ends a window ({unit}; finite, >= 0)",
    )
    debounce.add_argument(
        "--max-delay",
        type=float,
        metavar="S",
        help=f"cap on a window's length from its first ping ({unit}; >= --delay)",
    )
    flow = parser.add_argument_group(
        "flow-control options (--mode throttle, audit, batch, rate-limit)",
        "Each goes with its modes only. --mode throttle and audit need --interval, "
        "batch needs --max-wait, rate-limit needs --limit and --period.",
    )
    flow.add_argument(
        "--interval",
        type=float,
        metavar="S",
        help=f"throttle, audit: a window's length; fires are at least this far apart "
        f"({unit}; finite, > 0)",
    )
    flow.add_argument(
        "--no-leading",
        action="store_true",
        help="throttle: no leading edge (the same as --mode audit)",
    )
    flow.add_argument(
        "--no-trailing",
        action="store_true",
        help="throttle: no trailing edge (the pings after a leading fire are dropped)",
    )
    flow.add_argument(
        "--max-wait",
        type=float,
        metavar="S",
        help=f"batch: a batch fires this long after its first event ({unit}; finite, > 0)",
    )
    flow.add_argument(
        "--max-items",
        type=int,
        metavar="N",
        help="batch: a batch fires at its N-th event (N >= 1; default: 1000)",
    )
    flow.add_argument(
        "--max-bytes",
        type=int,
        metavar="B",
        help="batch: a batch fires before an event that would take it past B bytes, "
        "each event counting its length as compact JSON in UTF-8 (B >= 1; default: no "
        "bound)",
    )
    flow.add_argument(
        "--limit",
        type=int,
        metavar="N",
        help="rate-limit: events that fire per window; the rest are dropped (N >= 1)",
    )
    flow.add_argument(
        "--period",
        type=float,
        metavar="S",
        help=f"rate-limit: a window's length, fixed from its first event ({unit}; finite, > 0)",
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
            "virtual clock (trio.testing.MockClock): debounce it, or with a flow-control "
            "--mode throttle, batch or rate-limit it. Durations are in the input's time "
            "unit."
        ),
    )
    rp.add_argument("file", metavar="FILE", help="JSON-lines input, or - for stdin")
    _add_mode_options(rp, "input time units")
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
    opts = rp.add_argument_group(
        "window options (--mode trailing, leading, both)",
        "The debounce window's options; refused with the flow-control modes. See the "
        "semantics page of the docs.",
    )
    opts.add_argument(
        "--max-count",
        type=int,
        metavar="N",
        help="a window is due at its N-th ping (N >= 1)",
    )
    opts.add_argument(
        "--payload",
        choices=["last", "first", "collect"],
        help="what a trailing fire carries: the latest event, the first, or the list of "
        "all (default: last)",
    )
    opts.add_argument(
        "--overlap",
        choices=["allow", "queue-latest"],
        help="queue-latest: a window due while its key's run executes waits for the run "
        "to end (trailing mode only; default: allow)",
    )
    opts.add_argument(
        "--run-time",
        type=float,
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
            "Debounce lines from stdin on the real clock (or with a flow-control --mode: "
            "throttle, batch or rate-limit them). Each fire "
            "prints a JSON line, or runs COMMAND with the payload on its stdin (a batch: "
            "one line per event) and TRIO_DEBOUNCE_KEY, TRIO_DEBOUNCE_PINGS and "
            "TRIO_DEBOUNCE_REASON in its environment. SIGTERM or SIGHUP stops it: the "
            "pending windows fire at once (with --backend they are handed off to the "
            "peers), running commands get --stop-grace to finish, and the exit status "
            "is 143."
        ),
    )
    _add_mode_options(run, "seconds")
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
            "1 no trailing fire pending, 2 the bucket cannot be reached or written, 124 "
            "not fired within --timeout."
        ),
    )
    _add_window_arguments(flush)
    flush.add_argument("--wait", action="store_true", help="wait until the fire is committed")
    flush.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        metavar="SECONDS",
        help="with --wait: give up after this long, exit status 124 (default: 120, "
        "enough for a dead owner's lease of 60 s to lapse and a survivor to adopt it)",
    )
    flush.set_defaults(job="flush", parser=flush)
    _add_runs(commands)
    return parser


#: The states and outcomes ``runs`` lists by.
_RUN_STATES = ["pending", "started", "done"]
_RUN_OUTCOMES = ["ran", "failed", "expired", "misfired"]


def _add_runs(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``runs`` (list) and its actions ``runs cancel`` and ``runs retry``."""
    runs = commands.add_parser(
        "runs",
        help="list the persisted deferred runs of a run store, or cancel or retry one",
        usage="%(prog)s (--backend URL[,URL...] [--bucket NAME] | --sqlite PATH)\n"
        "                          [--state S] [--outcome O] [--workflow W] "
        "[--format table|jsonl]\n"
        "       %(prog)s {cancel,retry} RUN_ID (--backend URL[,URL...] [--bucket NAME] |\n"
        "                          --sqlite PATH)",
        description=(
            "Without an action: print the persisted runs of a run store (a NATS bucket "
            "or an SQLite file): run id, workflow, state, outcome, due time, expiry, "
            "holder, attempts, fencing token and finish time. Reads only: the store is "
            "not created, and a read-only user (or file) will do. With an action, steer "
            "one run as a coordinator would, by compare-and-swap: 'cancel' deletes a "
            "pending run, 'retry' makes a failed run pending again for a live process "
            "to claim (see 'runs cancel --help' and 'runs retry --help'). Exit status "
            "0; 1 when the run does not exist or its state refuses the action; 2 for "
            "bad options or a store that cannot be read."
        ),
    )
    _add_store_options(runs, suppress=False)
    runs.add_argument(
        "--state", choices=_RUN_STATES, help="only runs in this state (default: every state)"
    )
    runs.add_argument(
        "--outcome",
        choices=_RUN_OUTCOMES,
        help="only finished runs (state done) with this outcome",
    )
    runs.add_argument("--workflow", metavar="W", help="only this workflow's runs")
    _add_format_option(runs, default=None)
    runs.set_defaults(job="runs", parser=runs, action=None)
    actions = runs.add_subparsers(dest="action", metavar="ACTION", required=False, prog=runs.prog)
    for name, help_line, description in (
        (
            "cancel",
            "delete a pending run (exit 1 if it started or finished)",
            "Delete the pending run RUN_ID by compare-and-swap, as "
            "Coordinator.cancel_run does: a live owner that has it armed finds it gone "
            "and never runs it. A run whose handler started, or that finished, is left "
            "as it is (exit 1), as is a run that does not exist. Prints one line saying "
            "what was done.",
        ),
        (
            "retry",
            "make a failed run pending again, for a live process to claim",
            "Write the failed run RUN_ID (a tombstone with outcome 'failed', under "
            "at-least-once delivery) back to pending, due now, with no owner, by "
            "compare-and-swap: a live process with a handler for its workflow claims "
            "it at its next sweep and runs it with its payload, as attempt + 1. Exit 1 "
            "if the run does not exist, is not failed, or its expiry has passed. "
            "Prints one line saying what was done.",
        ),
    ):
        action = actions.add_parser(name, help=help_line, description=description)
        action.add_argument("run_id", metavar="RUN_ID", help="the run's id")
        _add_store_options(action, suppress=True)
        action.set_defaults(job=f"runs {name}", parser=action)


def _add_store_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """``--backend``/``--bucket`` or ``--sqlite``: the run store of ``runs``. Given to
    ``runs`` and to its actions, so they go before the action or after it; an
    action's are ``SUPPRESS``ed when absent, so they never hide the ones before it
    (see :func:`check_run_store_options`)."""
    default = argparse.SUPPRESS if suppress else None
    group = parser.add_argument_group(
        "the run store (exactly one of --backend and --sqlite)",
        "NATS settings other than these (credentials, TLS, timeouts) come from the "
        "TRIO_DEBOUNCE_* environment.",
    )
    store = group.add_mutually_exclusive_group()
    store.add_argument(
        "--backend",
        metavar="URL[,URL...]",
        default=default,
        help="NATS JetStream servers (nats:// or tls:// URLs, comma-separated): the "
        "runs of a bucket",
    )
    store.add_argument(
        "--sqlite", metavar="PATH", default=default, help="the runs of an SQLite run store file"
    )
    group.add_argument(
        "--bucket",
        metavar="NAME",
        default=default,
        help="with --backend: the KV bucket (default: $TRIO_DEBOUNCE_NATS_BUCKET, else "
        "trio_debounce)",
    )


def check_run_store_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the run store options of ``runs`` and its actions, given before the action
    or after it.

    Raises:
      SystemExit: status 2 with ``parser``'s usage line: neither or both of
        ``--backend`` and ``--sqlite``, ``--bucket`` without ``--backend``, or a
        listing option with an action.
    """
    if (args.backend is None) == (args.sqlite is None):
        parser.error("give exactly one of --backend URL and --sqlite PATH")
    if args.bucket is not None and args.backend is None:
        parser.error("--bucket needs --backend")
    if args.sqlite == "":
        parser.error("--sqlite must not be empty")
    if args.action is not None:
        for option in ("state", "outcome", "workflow", "format"):
            if getattr(args, option) is not None:
                parser.error(f"--{option} lists runs: it takes no action ({args.action})")


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


def _seconds(text: str) -> float:
    """An option's seconds: a finite number > 0 (argparse reports the error)."""
    try:
        return _validate.positive_duration("--timeout", float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    _add_format_option(parser)


def _add_format_option(parser: argparse.ArgumentParser, *, default: str | None = "table") -> None:
    """``--format table|jsonl`` (``default`` None: ``runs``, which refuses it with an
    action, and reads None as a table)."""
    parser.add_argument(
        "--format",
        choices=["table", "jsonl"],
        default=default,
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
