"""The ``trio-debounce`` command line: ``replay``, ``run``, ``events git``, the
operator's commands on a shared bucket (``windows``, ``processes``, ``cancel``,
``flush``), and ``runs`` (with its actions ``runs cancel`` and ``runs retry``) on a run
store.

Exit statuses: 0 success; 2 bad options, or bad input (``replay`` and ``events git``
print the reason on stderr and nothing on stdout; ``run`` skips bad lines and exits 2
at the end), or a failure to start (``run --backend``: the backend is unreachable,
refuses the credentials or has an unusable bucket; the operator's commands and
``runs``: the bucket or file cannot be read (or written) or does not exist; one line
on stderr); 1 when the output cannot be written (stdout closed early by ``| head``, a
full disk), for ``run``, when a COMMAND failed or could not start, for ``cancel`` and
``flush``, when there is nothing to do, and for ``runs cancel|retry``, when the run
does not exist or its state refuses the action; 130 interrupted (Ctrl-C); 143 ``run``
or ``windows --follow`` stopped by SIGTERM or SIGHUP. See docs/cli.rst.

The modules, by job: :mod:`._parser` (the options), :mod:`._commands` (options to a
run and an exit status), :mod:`._replay` (an event log on a virtual clock),
:mod:`._live` (a live stream, and its stop on SIGTERM or SIGHUP), :mod:`._events`
(JSON-lines input), :mod:`._git_events` (events from a git history),
:mod:`._inspect` (``windows`` and ``processes``, and the output of every inspection),
:mod:`._follow` (``windows --follow``), :mod:`._steer` (``cancel`` and ``flush``),
:mod:`._runs` (``runs`` and its actions). The library never imports this package.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from ._commands import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    cmd_events_git,
    cmd_replay,
    cmd_run,
    error,
)
from ._follow import follow_windows
from ._inspect import cmd_processes, cmd_windows
from ._live import BackendStartError, InputError, OutputError
from ._parser import parse_args
from ._runs import cmd_runs, cmd_runs_cancel, cmd_runs_retry
from ._steer import cmd_cancel, cmd_flush

__all__ = ["main"]


def _cmd_windows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``windows``, or ``windows --follow``."""
    return follow_windows(args, parser) if args.follow else cmd_windows(args, parser)


#: The command of each parsed ``job`` (see :func:`._parser.build_parser`).
_JOBS: dict[str, Callable[[argparse.Namespace, argparse.ArgumentParser], int]] = {
    "replay": cmd_replay,
    "run": cmd_run,
    "events git": cmd_events_git,
    "windows": _cmd_windows,
    "processes": cmd_processes,
    "cancel": cmd_cancel,
    "flush": cmd_flush,
    "runs": cmd_runs,
    "runs cancel": cmd_runs_cancel,
    "runs retry": cmd_runs_retry,
}


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
    args = parse_args(argv)
    if sys.stdout is None and not (args.job == "run" and args.cmd):
        error("stdout is closed")
        sys.exit(EXIT_USAGE)
    try:
        # each command reports option errors with its own usage line
        status = _JOBS[args.job](args, args.parser)
    except (InputError, BackendStartError) as exc:
        error(str(exc))
        status = EXIT_USAGE
    except OutputError as exc:  # run's: the status says whether lines were rejected
        _output_failed(exc.error)
        status = exc.status
    except BaseException as exc:
        if _is_interrupt(exc):
            sys.stderr.write("trio-debounce: interrupted\n")
            status = EXIT_INTERRUPTED
        elif isinstance(exc, OSError) and exc.filename is None:
            # Writing the output failed; input errors are handled by the commands
            # with exit status 2.
            _output_failed(exc)
            status = 1
        else:
            raise
    sys.exit(status)


def _output_failed(exc: OSError) -> None:
    """Report that stdout could not be written: quietly when its reader closed it.

    Either way stdout is pointed at the null device, so that the interpreter's own
    flush of what is still buffered at exit cannot fail again: Python 3.14 turns such
    a failure into exit status 120 (earlier versions ignored it or printed it)."""
    if not isinstance(exc, BrokenPipeError):
        # Downstream closed the pipe (e.g. `| head`): exit quietly, as Python's docs
        # recommend. Any other failure (a full disk) is reported.
        error(f"cannot write output: {exc.strerror or exc}")
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout already closed or gone
        pass
