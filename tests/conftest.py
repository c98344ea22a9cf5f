from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from cmdbus_trio import metrics
from cmdbus_trio.config import DATA_FACE_NAMES, Config, load

from .helpers import serving

# Hypothesis's default deadline (200 ms an example) is a wall-clock assertion: on a loaded
# CI machine a decoder test failed it once. Tests assert behaviour, never speed.
settings.register_profile("cmdbus", deadline=None)
settings.load_profile("cmdbus")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cycles", type=int, default=3, help="crash-test cycles (tests/durability); nox -s crash"
    )
    parser.addoption(
        "--cuts", type=int, default=3, help="power cuts a mode (tests/powercut); nox -s powercut"
    )
    parser.addoption(
        "--scale-records",
        type=int,
        default=6000,
        help="records published through three writers (tests/client/test_scale_out.py)",
    )


@pytest.fixture
def scale_records(request: pytest.FixtureRequest) -> int:
    records: int = request.config.getoption("--scale-records")
    return records


@pytest.fixture
def power_cuts_wanted(request: pytest.FixtureRequest) -> int:
    cuts: int = request.config.getoption("--cuts")
    return cuts


@pytest.fixture
def crash_cycles(request: pytest.FixtureRequest) -> int:
    cycles: int = request.config.getoption("--cycles")
    return cycles


@pytest.fixture(autouse=True, scope="session")
def nothing_blocked_the_loop() -> Iterator[None]:
    """Nothing blocks the loop (docs/architecture.md, "Decisions"): the loop-blocking
    counter must stay 0 across the whole suite (in each process of a parallel run: an
    error at the end, which fails the run, as a hook's exit status in a worker did not)."""
    yield
    blocked = sum(
        sample.value
        for metric in metrics.LOOP_BLOCKING_CALLS.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )
    assert not blocked, f"cmdbus_loop_blocking_calls_total is {blocked}, expected 0"


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., Config]:
    """A Config on loopback port 0 in a temp data dir; data faces off unless asked for."""

    def make(**flags: Any) -> Config:
        base: dict[str, str | None] = {
            "data_dir": str(tmp_path / "data"),
            "control_bind": "127.0.0.1:0",
            **{f"{face}_bind": "" for face in DATA_FACE_NAMES},
        }
        base.update({name: str(value) for name, value in flags.items()})
        return load(base, environ={})

    return make


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """A writer (``cmdbus-trio serve``, every face on port 0) shared by the tests of a
    module, with that module's ``WRITER_SETTINGS`` (``CMDBUS_*`` variables); its ports."""
    settings: dict[str, str] = getattr(request.module, "WRITER_SETTINGS", {})
    name = request.module.__name__.rpartition(".")[2]
    with serving(tmp_path_factory.mktemp(name), **settings) as (_, ports):
        yield ports
