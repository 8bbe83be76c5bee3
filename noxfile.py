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
    session.install("-e", ".[docs,nats,otel]")  # autodoc imports the extras' modules
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
    # tests/harness/nats_server.py, which starts it (it imports pytest).
    session.install("-e", ".[bench,test]")
    session.run("python", "bench/suite.py", *session.posargs)


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos scenarios of docs/reliability.rst on real nats-server and driver
    processes, with the cluster tests and the long variants of the suite's SIGKILL
    tests: 19 min 55 s on two cores in all (2026-12-06; budget 20 minutes); prints the
    table and fails if a promised zero is not.
    ``nox -s chaos -- --short`` runs the short budgets, ``--only NAME`` one scenario,
    ``--scale 2`` longer load phases, ``--keep DIR`` the logs."""
    session.install("-e", ".[test]")
    # The fuzz targets of the document decoders and the key codec, for a bounded time.
    session.run("python", "-m", "tests.protocol.fuzz", "--seconds", "30")
    # The cluster tests under load, kept out of the default run (tests/nats/test_nats_cluster.py).
    # One process (-n 0): nothing else shares the cores with them.
    session.run(
        "pytest",
        "-n",
        "0",
        "tests/nats/test_nats_cluster.py",
        env={"TRIO_DEBOUNCE_CLUSTER_TESTS": "1"},
    )
    # The long variants of the suite's SIGKILL scenarios (more rounds, runs and kills;
    # the suite runs short ones that make the same assertions), also in one process.
    session.run(
        "pytest",
        "-n",
        "0",
        "tests/nats/test_nats_failover.py",
        "tests/runs/test_runs_processes.py",
        env={"TRIO_DEBOUNCE_LONG_TESTS": "1"},
    )
    session.run("python", "-m", "tests.chaos", *session.posargs)


# ------------------------------------------------------------------ versions and floors
#
# .ci/run runs these after the whole suite on the machine's Python (README: "Python
# versions and CI").
# Python 3.11 is the machine's Python; 3.12 and 3.13 come from pyenv here; 3.14 from
# Debian's sid suite, in a chroot (.ci/sid-python). Every venv is made by uv, from the
# interpreter's real path (pyenv's shims pick a version by configuration, not by name).

#: The NATS tests: each with the trio-asyncio host as well as the default one. Every
#: file of tests/nats/, and the two of other layers that also run on a real server.
NATS_TESTS = (
    "tests/nats",
    "tests/cli/test_cli_run_nats.py",
    "tests/runs/test_runs_processes.py",
)

#: The conformance, NATS-backend and semantics tests: the suite's part that runs on
#: the other versions and at the dependency floors.
CORE_TESTS = (
    # conformance: the backend and run-store suites (trio_debounce.testing)
    "tests/shared/test_shared_memory.py",
    "tests/runs/test_run_store_memory.py",
    "tests/runs/test_run_store_sqlite.py",
    "tests/nats/test_run_store_nats.py",
    "tests/nats/test_nats_hosts.py",
    # the NATS backend
    "tests/nats/test_nats_backend.py",
    "tests/nats/test_nats_store.py",
    # semantics
    "tests/local/test_semantics.py",
    "tests/engine/test_engine.py",
    "tests/local/test_properties.py",
    "tests/local/test_options.py",
)


def _interpreter(version: str) -> str:
    """The real path of a Python ``version`` ("3.12"): on PATH outside pyenv's shims,
    or under ``$(pyenv root)/versions``."""
    import glob
    import os
    import shutil

    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if "shims" in directory:
            continue
        found = shutil.which(f"python{version}", path=directory)
        if found:
            return found
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"))
    if not candidates:
        raise RuntimeError(f"no Python {version}: not on PATH, not under {pyenv_root}/versions")
    return candidates[-1]


def _uv_venv(session: nox.Session, python: str) -> str:
    """A fresh venv of the session's own, made by uv from ``python``; its python."""
    venv = f".nox/{session.name}-venv"
    session.run("uv", "venv", "--quiet", "--clear", "-p", python, venv, external=True)
    return f"{venv}/bin/python"


def _uv_install(session: nox.Session, python: str, *args: str) -> None:
    session.run("uv", "pip", "install", "--quiet", "-p", python, *args, external=True)


@nox.session(python=False, name="tests-3.11-trio-asyncio")
def tests_trio_asyncio(session: nox.Session) -> None:
    """The NATS tests on the machine's Python with ``asyncio_host="auto"`` meaning the
    trio-asyncio host (tests/__init__.py); the suite itself runs them on the default
    (thread) host."""
    python = _uv_venv(session, _interpreter("3.11"))
    _uv_install(session, python, "-e", ".[test]")
    # Not the SQLite variants of the run-store process tests: no NATS in them.
    args = session.posargs or (*NATS_TESTS, "-k", "not sqlite")
    session.run(python, "-m", "pytest", *args, env={"TRIO_DEBOUNCE_TEST_AUTO_HOST": "trio-asyncio"})


def _core_tests(session: nox.Session, version: str) -> None:
    python = _uv_venv(session, _interpreter(version))
    _uv_install(session, python, "-e", ".[test]")
    session.run(python, "-W", "error", "-c", "import trio_debounce.nats")
    session.run(python, "-m", "pytest", *(session.posargs or CORE_TESTS))


@nox.session(python=False, name="tests-3.12")
def tests_312(session: nox.Session) -> None:
    """The conformance, NATS-backend and semantics tests on Python 3.12 (pyenv)."""
    _core_tests(session, "3.12")


@nox.session(python=False, name="tests-3.13")
def tests_313(session: nox.Session) -> None:
    """The conformance, NATS-backend and semantics tests on Python 3.13 (pyenv)."""
    _core_tests(session, "3.13")


@nox.session(python=False, name="tests-3.14")
def tests_314(session: nox.Session) -> None:
    """The whole suite on Python 3.14 from Debian sid, in a chroot (.ci/sid-python;
    needs root). Arguments after ``--`` go to pytest instead."""
    # The suite's test_nats_hosts imports trio_debounce.nats under -W error there too.
    # With the operator commands' longer tests (tests/harness/env.py, OPERATOR_ENV).
    session.run(
        "bash",
        ".ci/sid-python",
        "3.14",
        *session.posargs,
        external=True,
        env={"TRIO_DEBOUNCE_OPERATOR_TESTS": "1"},
    )


@nox.session(python=False)
def lowest(session: nox.Session) -> None:
    """The tests of the other versions at the lowest versions ``pyproject.toml``
    allows for every direct runtime dependency (trio, nats-py, trio-asyncio), on the
    machine's Python: the floors are the tested ones. The test tools install at their
    newest versions around them (they satisfy nothing the runtime pins), and the
    static checks are not run here."""
    python = _uv_venv(session, _interpreter("3.11"))
    _uv_install(session, python, "--resolution", "lowest-direct", "-e", ".[nats]")
    # Adds the test tools; nats-py and trio-asyncio, already at their floors, satisfy
    # the test extra's ranges and stay (uv pip install upgrades nothing unasked).
    _uv_install(session, python, "-e", ".[test]")
    session.run(
        python,
        "-c",
        "import importlib.metadata as m; "
        "print(*(f'{d} {m.version(d)}' for d in ('trio', 'nats-py', 'trio-asyncio')), sep='; ')",
    )
    session.run(python, "-W", "error", "-c", "import trio_debounce.nats")
    session.run(python, "-m", "pytest", *(session.posargs or CORE_TESTS))


@nox.session(python=False)
def package(session: nox.Session) -> None:
    """Build the sdist and the wheel (uv build, hatchling) and check them as a release
    would: ``twine check`` (metadata and README rendering), check-wheel-contents, and
    the licence texts of ``MIT OR Apache-2.0`` in both (PEP 639 ``license-files``)."""
    import pathlib
    import tarfile
    import tempfile
    import zipfile

    python = _uv_venv(session, _interpreter("3.11"))
    _uv_install(session, python, "twine==7.0.0", "check-wheel-contents==0.6.3")
    bin_dir = pathlib.Path(python).parent
    out = pathlib.Path(tempfile.mkdtemp(prefix="trio-debounce-dist-"))
    session.run("uv", "build", "--quiet", "--out-dir", str(out), external=True)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    session.run(str(bin_dir / "twine"), "check", "--strict", str(sdist), str(wheel))
    session.run(str(bin_dir / "check-wheel-contents"), str(wheel))
    licences = {"LICENSE", "LICENSE.MIT", "LICENSE.APACHE2"}
    in_wheel = {
        pathlib.PurePosixPath(name).name
        for name in zipfile.ZipFile(wheel).namelist()
        if ".dist-info/licenses/" in name
    }
    with tarfile.open(sdist) as archive:
        in_sdist = {pathlib.PurePosixPath(name).name for name in archive.getnames()}
    for where, names in (("wheel", in_wheel), ("sdist", in_sdist)):
        if not licences <= names:
            session.error(f"the {where} lacks {sorted(licences - names)}")
    session.log(f"{sdist.name}, {wheel.name}: checked, with {sorted(licences)}")
