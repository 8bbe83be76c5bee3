"""The ``trio-debounce`` commands: each turns its parsed options into a run of its job
(:mod:`._replay`, :mod:`._live`, :mod:`._git_events`) and returns the exit status."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import trio

from .. import _validate
from .._backend import DebounceBackend
from .._codec import hide_userinfo
from .._options import window_options
from .._types import Mode
from ._events import EventError, decode_line
from ._git_events import GitEventsError, git_events
from ._live import LiveOptions, run_live
from ._replay import read_events, replay

if TYPE_CHECKING:
    from ..nats import NatsConfig

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: URL schemes ``run --backend`` accepts: NATS over TCP, and over TLS.
_BACKEND_SCHEMES = ("nats://", "tls://")


def check_durations(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[float, float | None]:
    """Return ``(delay, max_delay)`` (floats in seconds, or the input's time unit;
    ``max_delay`` None when not given), checked.

    Raises:
      SystemExit: status 2 with ``parser``'s usage line: a negative, NaN or infinite
        value, or ``--max-delay`` below ``--delay``.
    """
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


def cmd_replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce replay``; return the exit status: 0, or 2 for unreadable or
    bad input (one line on stderr, nothing on stdout).

    Raises:
      SystemExit: status 2 with the usage line, for a bad option.
      OSError: writing stdout failed.
    """
    delay, max_delay = check_durations(parser, args)
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
                error("stdin is closed")
                return EXIT_USAGE
            raw = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as stream:
                raw = stream.read()
    except OSError as exc:
        error(f"cannot read {args.file!r}: {exc.strerror or exc}")
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
        error(f"{_display_name(args.file)}: {exc}")
        return EXIT_USAGE
    out = sys.stdout
    if args.format == "summary":
        out.write(json.dumps(result.summary()) + "\n")
    else:
        for fire in result.fires:
            out.write(json.dumps(fire.to_json()) + "\n")
    out.flush()
    return 0


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce run``; return the exit status of :func:`run_live`, or 2 if
    the run cannot start (stdin closed, a bad ``TRIO_DEBOUNCE_*`` setting, no nats
    extra).

    Raises:
      SystemExit: status 2 with the usage line, for a bad option.
      OutputError, InputError, BackendStartError: from :func:`run_live`.
    """
    delay, max_delay = check_durations(parser, args)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.key_field is not None and not args.key_field:
        parser.error("--key-field must not be empty")
    try:
        stop_grace = _validate.duration("--stop-grace", args.stop_grace)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
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
        error("stdin is closed")
        return EXIT_USAGE
    options = LiveOptions(
        delay=delay,
        max_delay=max_delay,
        mode=Mode(args.mode),
        key_field=args.key_field,
        jobs=args.jobs,
        command=tuple(args.cmd),
        open_backend=open_backend,
        stop_grace=stop_grace,
    )
    return trio.run(run_live, options, sys.stdin.fileno(), sys.stdout, sys.stderr)


def _nats_backend(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, create_bucket: bool = True
) -> Callable[[], AbstractAsyncContextManager[DebounceBackend]] | None:
    """The opener of a command's NATS backend, on :func:`nats_config`'s config
    (``create_bucket`` False for the commands that only read). Bad options exit through
    ``parser.error``; None (after an error line) when the environment is bad or the
    extra is missing."""
    config = nats_config(parser, args, create_bucket=create_bucket)
    if config is None:
        return None
    from ..nats import open_nats_backend  # the extra is importable: nats_config checked

    process_id = getattr(args, "process_id", None)
    return functools.partial(open_nats_backend, config, process_id=process_id)


def nats_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, create_bucket: bool = True
) -> NatsConfig | None:
    """A command's NATS settings: ``NatsConfig.from_env()`` overridden by ``--backend``
    and ``--bucket`` (and ``create_bucket``, False for the commands that never create
    the bucket). Bad options exit through ``parser.error``; None (after an error line)
    when the environment is bad or the nats extra is missing."""
    servers = tuple(url.strip() for url in args.backend.split(",") if url.strip())
    if not servers:
        parser.error("--backend must name at least one server URL")
    for url in servers:
        if not url.startswith(_BACKEND_SCHEMES):
            parser.error(
                f"--backend URLs must start with nats:// or tls://, got {hide_userinfo(url)!r}"
            )
    if args.bucket is not None and not args.bucket:
        parser.error("--bucket must not be empty")
    process_id = getattr(args, "process_id", None)
    if process_id is not None and not process_id:
        parser.error("--process-id must not be empty")
    try:
        # Imported here: the nats extra is optional, and in-memory runs never need it.
        from ..nats import NatsConfig
    except ImportError as exc:
        error(
            f"--backend needs the nats extra (from a clone: pip install '.[nats]'): "
            f"cannot import {exc.name or 'it'}"
        )
        return None
    try:
        config = NatsConfig.from_env()
    except (TypeError, ValueError) as exc:
        error(f"bad NATS settings in the environment: {exc}")
        return None
    overrides: dict[str, object] = {"servers": servers}
    if not create_bucket:
        overrides["create_bucket"] = False
    if args.bucket is not None:
        overrides["bucket"] = args.bucket
    try:
        return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        parser.error(hide_userinfo(str(exc)))


def cmd_events_git(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``trio-debounce events git``; return the exit status: 0, or 2 if the path
    has no usable history (one line on stderr).

    Raises:
      OSError: writing stdout failed.
    """
    try:
        events = git_events(args.path)
    except GitEventsError as exc:
        error(str(exc))
        return EXIT_USAGE
    out = sys.stdout
    for event in events:
        out.write(json.dumps(event.to_json()) + "\n")
    out.flush()
    return 0


def _display_name(path: str) -> str:
    return "<stdin>" if path == "-" else path


def error(message: str) -> None:
    """Write ``trio-debounce: error: <message>`` on stderr."""
    sys.stderr.write(f"trio-debounce: error: {message}\n")
    sys.stderr.flush()
