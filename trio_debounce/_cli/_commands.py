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
from ._parser import DEBOUNCE_MODES, FLOW_MODES
from ._replay import FlowOptions, read_events, replay

if TYPE_CHECKING:
    from ..nats import NatsConfig

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: URL schemes ``run --backend`` accepts: NATS over TCP, and over TLS.
_BACKEND_SCHEMES = ("nats://", "tls://")


#: The options of the debounce modes, by ``dest`` (``replay`` has them all, ``run``
#: the first two), and of the flow-control modes, each with the modes it goes with.
_DEBOUNCE_OPTIONS = (
    "delay",
    "max_delay",
    "max_count",
    "payload",
    "overlap",
    "run_time",
    "order_field",
)
_FLOW_OPTIONS: dict[str, tuple[str, ...]] = {
    "interval": ("throttle", "audit"),
    "no_leading": ("throttle",),
    "no_trailing": ("throttle",),
    "max_wait": ("batch",),
    "max_items": ("batch",),
    "max_bytes": ("batch",),
    "limit": ("rate-limit",),
    "period": ("rate-limit",),
}
#: The options each flow-control mode needs.
_FLOW_REQUIRED: dict[str, tuple[str, ...]] = {
    "throttle": ("interval",),
    "audit": ("interval",),
    "batch": ("max_wait",),
    "rate-limit": ("limit", "period"),
}
#: The option that gives a flow-control window its length.
_FLOW_SPAN = {
    "throttle": "interval",
    "audit": "interval",
    "batch": "max_wait",
    "rate-limit": "period",
}


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(args: argparse.Namespace, dest: str) -> bool:
    """Was the option given? (Every mode option defaults to None, or False for a flag;
    compared by identity, as ``--delay 0`` is given.)"""
    value = getattr(args, dest, None)
    return value is not None and value is not False


def mode_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> FlowOptions | None:
    """Check that the options given go with ``--mode``; return the flow options of a
    flow-control mode, or None for a debounce mode (whose values
    :func:`check_durations` and the command check).

    Raises:
      SystemExit: status 2 with ``parser``'s usage line, naming the option: an option
        of another mode, a missing one (``--delay`` for a debounce mode, ``--interval``
        for a throttle...), or a bad value of a flow-control option.
    """
    mode = args.mode
    if mode in DEBOUNCE_MODES:
        for dest, modes in _FLOW_OPTIONS.items():
            if _given(args, dest):
                parser.error(
                    f"{_option(dest)} is an option of --mode {' and '.join(modes)}, not "
                    f"of --mode {mode}"
                )
        if args.delay is None:
            parser.error(f"--mode {mode} needs --delay")
        return None
    assert mode in FLOW_MODES
    for dest in _DEBOUNCE_OPTIONS:
        if _given(args, dest):
            parser.error(
                f"{_option(dest)} is an option of the debounce modes "
                f"({', '.join(DEBOUNCE_MODES)}), not of --mode {mode}"
            )
    for dest, modes in _FLOW_OPTIONS.items():
        if _given(args, dest) and mode not in modes:
            also = " (--mode audit is throttle --no-leading)" if mode == "audit" else ""
            parser.error(
                f"{_option(dest)} is an option of --mode {' and '.join(modes)}, not of "
                f"--mode {mode}{also}"
            )
    for dest in _FLOW_REQUIRED[mode]:
        if getattr(args, dest) is None:
            parser.error(f"--mode {mode} needs {_option(dest)}")
    try:
        span_dest = _FLOW_SPAN[mode]
        span = _validate.positive_duration(_option(span_dest), getattr(args, span_dest))
        for dest in ("max_items", "max_bytes", "limit"):
            value = getattr(args, dest)
            if value is not None and value < 1:
                raise ValueError(f"{_option(dest)} must be >= 1, got {value}")
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if args.no_leading and args.no_trailing:
        parser.error("--no-leading and --no-trailing together leave a throttle no edge to fire")
    return FlowOptions(
        mode="audit" if args.no_leading else mode,
        span=span,
        trailing=not args.no_trailing,
        max_items=args.max_items,
        max_bytes=args.max_bytes,
        limit=1 if args.limit is None else args.limit,
    )


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
    flow = mode_options(parser, args)
    for option in ("key_field", "time_field", "order_field"):
        if getattr(args, option) == "":
            parser.error(f"--{option.replace('_', '-')} must not be empty")
    delay: float | None = None
    max_delay: float | None = None
    run_time = 0.0
    if flow is None:
        delay, max_delay = check_durations(parser, args)
        try:
            run_time = _validate.duration("--run-time", args.run_time or 0.0)
            if args.max_count is not None and args.max_count < 1:
                raise ValueError(f"--max-count must be >= 1, got {args.max_count}")
            window_options(
                Mode(args.mode),
                args.max_count,
                args.payload or "last",
                None,
                None,
                args.overlap or "allow",
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
        if flow is not None:
            result = replay(events, flow=flow)
        else:
            result = replay(
                events,
                delay=delay,
                max_delay=max_delay,
                mode=args.mode,
                max_count=args.max_count,
                payload_policy=args.payload or "last",
                overlap=args.overlap or "allow",
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
    flow = mode_options(parser, args)
    delay, max_delay = (0.0, None) if flow is not None else check_durations(parser, args)
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
        mode=Mode.TRAILING if flow is not None else Mode(args.mode),
        key_field=args.key_field,
        jobs=args.jobs,
        command=tuple(args.cmd),
        open_backend=open_backend,
        stop_grace=stop_grace,
        flow=flow,
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
