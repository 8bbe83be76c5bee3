"""The ``trio-debounce`` command line: ``replay``, ``run`` and ``events git``.

Exit statuses: 0 success; 2 bad options, or bad input (``replay`` and ``events git``
print the reason on stderr and nothing on stdout; ``run`` skips bad lines and exits 2
at the end), or a failure to start (``run --backend``: the backend is unreachable,
refuses the credentials or has an unusable bucket; one line on stderr); 130
interrupted (Ctrl-C); 1 when stdout is closed early (``| head``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import NoReturn

import trio

from .. import _validate
from .._backend import DebounceBackend
from .._options import window_options
from .._types import Mode
from .._version import __version__
from ._events import EventError, decode_line
from ._git_events import GitEventsError, git_events
from ._live import BackendStartError, InputError, LiveOptions, run_live
from ._replay import read_events, replay

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_MODES = [m.value for m in Mode]

#: URL schemes ``run --backend`` accepts: NATS over TCP, and over TLS.
_BACKEND_SCHEMES = ("nats://", "tls://")


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
    rp.set_defaults(func=_cmd_replay, parser=rp)

    run = commands.add_parser(
        "run",
        help="debounce a live stream of lines from stdin",
        description=(
            "Debounce lines from stdin on the real clock. Each fire prints a JSON line, "
            "or runs COMMAND with the payload on its stdin and TRIO_DEBOUNCE_KEY and "
            "TRIO_DEBOUNCE_PINGS in its environment."
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
    shared = run.add_argument_group(
        "shared windows",
        "Share the windows with every process run with the same servers and bucket: "
        "each burst fires once, in the process that owns its window. Everything else "
        "(credentials, TLS, timeouts) comes from the TRIO_DEBOUNCE_* environment "
        "variables.",
    )
    shared.add_argument(
        "--backend",
        metavar="URL[,URL...]",
        help="NATS JetStream servers (nats:// or tls:// URLs, comma-separated); "
        "without it the windows are in memory",
    )
    shared.add_argument(
        "--bucket",
        metavar="NAME",
        help="the KV bucket to share (default: $TRIO_DEBOUNCE_NATS_BUCKET, else trio_debounce)",
    )
    shared.add_argument(
        "--process-id",
        metavar="ID",
        help="this process's id in the bucket, unique among live processes (default: a random one)",
    )
    run.add_argument("cmd", nargs="*", metavar="-- COMMAND", help="command to run per fire")
    run.set_defaults(func=_cmd_run, parser=run)

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
    git.set_defaults(func=_cmd_events_git, parser=git)
    return parser


def _check_durations(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[float, float | None]:
    try:
        delay = _validate.duration("--delay", args.delay)
        max_delay = (
            None if args.max_delay is None else _validate.duration("--max-delay", args.max_delay)
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if max_delay is not None and max_delay < delay:
        parser.error(f"--max-delay must be >= --delay, got {max_delay!r} < {delay!r}")
    return delay, max_delay


def _input_lines(lines: Iterable[bytes]) -> Iterator[str]:
    for number, raw in enumerate(lines, start=1):
        yield decode_line(raw, number)


def _cmd_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    delay, max_delay = _check_durations(parser, args)
    for option in ("key_field", "time_field", "order_field"):
        if getattr(args, option) == "":
            parser.error(f"--{option.replace('_', '-')} must not be empty")
    try:
        run_time = _validate.duration("--run-time", args.run_time)
        if args.max_count is not None and args.max_count < 1:
            raise ValueError(f"--max-count must be >= 1, got {args.max_count}")
        window_options(
            Mode(args.mode),
            args.max_count,
            args.payload,
            None,
            None,
            args.overlap,
            None,
            args.order_field is not None,
            {},
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc).replace("overlap=", "--overlap ").replace("mode=", "--mode "))
    # The whole input is read before the virtual-clock run starts: plain blocking I/O,
    # outside Trio. (A read that blocks on a pipe inside the run is where Ctrl-C would
    # land; read here, it is an ordinary KeyboardInterrupt.) Lines are parsed lazily.
    try:
        if args.file == "-":
            if sys.stdin is None:
                _error("stdin is closed")
                return EXIT_USAGE
            raw = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as stream:
                raw = stream.read()
    except OSError as exc:
        _error(f"cannot read {args.file!r}: {exc.strerror or exc}")
        return EXIT_USAGE
    lines = raw.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final newline ends the last line; it does not start one
    del raw
    try:
        events = read_events(
            _input_lines(lines),
            key_field=args.key_field,
            time_field=args.time_field,
            sort=args.sort,
        )
        result = replay(
            events,
            delay=delay,
            max_delay=max_delay,
            mode=args.mode,
            max_count=args.max_count,
            payload_policy=args.payload,
            overlap=args.overlap,
            run_time=run_time,
            order_field=args.order_field,
        )
    except EventError as exc:
        _error(f"{_display_name(args.file)}: {exc}")
        return EXIT_USAGE
    out = sys.stdout
    if args.format == "summary":
        out.write(json.dumps(result.summary()) + "\n")
    else:
        for fire in result.fires:
            out.write(json.dumps(fire.to_json()) + "\n")
    out.flush()
    return 0


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    delay, max_delay = _check_durations(parser, args)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.key_field is not None and not args.key_field:
        parser.error("--key-field must not be empty")
    if args.backend is None:
        for option in ("bucket", "process_id"):
            if getattr(args, option) is not None:
                parser.error(f"--{option.replace('_', '-')} needs --backend")
        open_backend = None
    else:
        open_backend = _nats_backend(parser, args)
        if open_backend is None:
            return EXIT_USAGE
    if sys.stdin is None:
        _error("stdin is closed")
        return EXIT_USAGE
    options = LiveOptions(
        delay=delay,
        max_delay=max_delay,
        mode=Mode(args.mode),
        key_field=args.key_field,
        jobs=args.jobs,
        command=tuple(args.cmd),
        open_backend=open_backend,
    )
    return trio.run(run_live, options, sys.stdin.fileno(), sys.stdout, sys.stderr)


def _nats_backend(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> Callable[[], AbstractAsyncContextManager[DebounceBackend]] | None:
    """The opener of ``run``'s NATS backend: ``NatsConfig.from_env()`` overridden by
    ``--backend`` and ``--bucket``. Bad options exit through ``parser.error``; None
    (after an error line) when the environment is bad or the extra is missing."""
    servers = tuple(url.strip() for url in args.backend.split(",") if url.strip())
    if not servers:
        parser.error("--backend must name at least one server URL")
    for url in servers:
        if not url.startswith(_BACKEND_SCHEMES):
            parser.error(
                f"--backend URLs must start with nats:// or tls://, got {_redact_url(url)!r}"
            )
    if args.bucket is not None and not args.bucket:
        parser.error("--bucket must not be empty")
    if args.process_id is not None and not args.process_id:
        parser.error("--process-id must not be empty")
    try:
        # Imported here: the nats extra is optional, and in-memory runs never need it.
        from ..nats import NatsConfig, open_nats_backend
    except ImportError as exc:
        _error(
            f"--backend needs the nats extra (from a clone: pip install '.[nats]'): "
            f"cannot import {exc.name or 'it'}"
        )
        return None
    try:
        config = NatsConfig.from_env()
    except (TypeError, ValueError) as exc:
        _error(f"bad NATS settings in the environment: {exc}")
        return None
    overrides: dict[str, object] = {"servers": servers}
    if args.bucket is not None:
        overrides["bucket"] = args.bucket
    try:
        config = dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        parser.error(_redact_url(str(exc)))
    return functools.partial(open_nats_backend, config, process_id=args.process_id)


def _redact_url(text: str) -> str:
    """``text`` with the userinfo of any URL in it (``nats://user:pass@``) hidden."""
    return re.sub(r"(?<=://)[^/@\s]*@", "<hidden>@", text)


def _cmd_events_git(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        events = git_events(args.path)
    except GitEventsError as exc:
        _error(str(exc))
        return EXIT_USAGE
    out = sys.stdout
    for event in events:
        out.write(json.dumps(event.to_json()) + "\n")
    out.flush()
    return 0


def _display_name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def _error(message: str) -> None:
    sys.stderr.write(f"trio-debounce: error: {message}\n")
    sys.stderr.flush()


def _is_interrupt(exc: BaseException) -> bool:
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        matched, _ = exc.split(KeyboardInterrupt)
        return matched is not None
    return False


def _drop_tls_close_noise(record: logging.LogRecord) -> bool:
    """False for the warning asyncio logs whenever a TLS peer closes a stream
    connection (nats-py's included): it is no news, and only this process's stderr
    would show it."""
    return "eof_received() has no effect when using ssl" not in record.getMessage()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Entry point of the ``trio-debounce`` console script; exits with its status."""
    logging.basicConfig(level=logging.WARNING, format="trio-debounce: %(name)s: %(message)s")
    logging.getLogger("asyncio").addFilter(_drop_tls_close_noise)
    parser = build_parser()
    args = parser.parse_args(argv)
    if sys.stdout is None and not (args.func is _cmd_run and args.cmd):
        _error("stdout is closed")
        sys.exit(EXIT_USAGE)
    try:
        # each command reports option errors with its own usage line
        status = args.func(args, args.parser)
    except (InputError, BackendStartError) as exc:
        _error(str(exc))
        status = EXIT_USAGE
    except BaseException as exc:
        if _is_interrupt(exc):
            sys.stderr.write("trio-debounce: interrupted\n")
            status = EXIT_INTERRUPTED
        elif isinstance(exc, BrokenPipeError):
            # Downstream closed the pipe (e.g. `| head`): exit quietly, as Python's docs
            # recommend, without a second error when stdout is flushed at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            status = 1
        elif isinstance(exc, OSError) and exc.filename is None:
            # Writing the output failed (a full disk, say); input errors are handled
            # by the commands with exit status 2.
            _error(f"cannot write output: {exc.strerror or exc}")
            status = 1
        else:
            raise
    sys.exit(status)
