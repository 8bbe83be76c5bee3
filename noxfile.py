"""Developer sessions: ``nox -s tests``, ``lint``, ``typing``, ``docs``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typing", "docs"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite, as .ci/run runs it."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules (with the ASYNC set) and formatting."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typing(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and this file."""
    session.install("-e", ".[test]", "nox")
    session.run("mypy", "--strict")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx docs with warnings as errors."""
    session.install("-e", ".[docs]")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against same-run baselines (pyperf); never part of the test suite."""
    session.install("-e", ".[bench]")
    for name in ("core", "shared"):
        out = f"{session.create_tmp()}/bench-{name}.json"
        session.run("python", f"bench/bench_{name}.py", "--quiet", "-o", out, *session.posargs)
        session.run("python", "bench/report.py", out)
    # Deferred-run stores: one process (a store of 100,000 runs is built once), its own
    # JSON and table; about 5 minutes.
    out = f"{session.create_tmp()}/bench-runs.json"
    session.run("python", "bench/bench_runs.py", "-o", out)


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos scenarios of docs/reliability.rst on real nats-server and driver
    processes (about 20 minutes on two cores); prints the table and fails if a
    promised zero is not. ``nox -s chaos -- --short`` runs the short budgets, ``--only
    NAME`` one scenario, ``--scale 2`` longer load phases, ``--keep DIR`` the logs."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "tests.chaos", *session.posargs)
