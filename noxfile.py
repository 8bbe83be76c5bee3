"""Developer sessions: ``nox -s tests``, ``lint``, ``typing``, ``docs``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typing", "docs"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite, as .ci/run runs it."""
    session.install("-e", ".[test,lint]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (pinned by the lint extra): lint rules (with the ASYNC set) and formatting."""
    session.install(".[lint]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typing(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and this file; pyright's check that
    every public symbol's type is known (100 % type completeness)."""
    session.install("-e", ".[test,lint]", "nox")
    session.run("mypy", "--strict")
    session.run("pyright", "--verifytypes", "trio_debounce", "--ignoreexternal")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx docs with warnings as errors."""
    session.install("-e", ".[docs]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark suite against same-run baselines; never part of the test suite.

    Runs every item of bench/suite.py (every figure the median of 15 paired rounds;
    the scale item up to 100,000 windows) and writes docs/benchmarks/ (results.json,
    index.rst, figures): about 10 minutes on an idle 2-core machine. ``nox -s bench --
    --huge`` adds the 1,000,000-window point (minutes more, several GB), ``-- --only
    ping-local,replay`` runs some items only, ``-- --tiny -o DIR/results.json`` a
    quick smoke run elsewhere, ``-- --compare REV`` the before/after figures against
    git revision REV. bench/README.md lists the items.
    """
    # bench: the harness and the baselines; test: the nats-server binary and
    # tests/nats_server.py, which starts it (it imports pytest).
    session.install("-e", ".[bench,test]")
    session.run("python", "bench/suite.py", *session.posargs)


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos scenarios of docs/reliability.rst on real nats-server and driver
    processes (about 20 minutes on two cores, and 4 more for the long variants of the
    suite's SIGKILL tests); prints the table and fails if a promised zero is not.
    ``nox -s chaos -- --short`` runs the short budgets, ``--only NAME`` one scenario,
    ``--scale 2`` longer load phases, ``--keep DIR`` the logs."""
    session.install("-e", ".[test]")
    # The fuzz targets of the document decoders and the key codec, for a bounded time.
    session.run("python", "-m", "tests.fuzz", "--seconds", "30")
    # The cluster tests under load, kept out of the default run (tests/test_nats_cluster.py).
    # One process (-n 0): nothing else shares the cores with them.
    session.run(
        "pytest", "-n", "0", "tests/test_nats_cluster.py", env={"TRIO_DEBOUNCE_CLUSTER_TESTS": "1"}
    )
    # The long variants of the suite's SIGKILL scenarios (more rounds, runs and kills;
    # the suite runs short ones that make the same assertions), also in one process.
    session.run(
        "pytest",
        "-n",
        "0",
        "tests/test_nats_failover.py",
        "tests/test_runs_processes.py",
        env={"TRIO_DEBOUNCE_LONG_TESTS": "1"},
    )
    session.run("python", "-m", "tests.chaos", *session.posargs)
