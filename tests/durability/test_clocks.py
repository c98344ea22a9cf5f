"""The writer's wall clock stepped forward a day and back a day while it serves (libfaketime,
Debian's `faketime`; the monotonic clock left alone, as an NTP step leaves it): no lease
ends early, no msg_id is forgotten inside its window, and none is kept past it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cmdbus_trio.client.blocking import ClaimClient, IngestClient

from ..helpers import serving

pytestmark = pytest.mark.slow
LIBFAKETIME = next(
    iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))),
    Path("/usr/lib/faketime/libfaketimeMT.so.1"),
)  # Debian's faketime, on any architecture
FAKETIME_CACHE_S = 1
"""How long libfaketime keeps what it read from the offset file."""
WINDOW_S = 4.0
RECORD = {"execution_id": 1, "payload": "{}"}


@pytest.fixture
def stepped_clock(tmp_path: Path) -> dict[str, str]:
    """The environment of a writer whose wall clock follows ``tmp_path/offset``."""
    if not LIBFAKETIME.exists():
        if os.environ.get("CI"):
            pytest.fail("libfaketime is missing: .ci/run installs faketime")
        pytest.skip("libfaketime is not installed (apt-get install faketime)")
    (tmp_path / "offset").write_text("+0\n")
    return offset_env(tmp_path / "offset")


def offset_env(offset: Path) -> dict[str, str]:
    """libfaketime following ``offset``, read again after :data:`FAKETIME_CACHE_S`. Not
    on every call (FAKETIME_NO_CACHE): it reads the file inside each timed wait of a
    thread, and the interpreter's GIL hand-over is one, under the GIL's own mutex, so
    every hand-over waited for a file read: a pair of writers answered 14 publishes a
    second, not 150, and their control faces took seconds to answer."""
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(offset),
        "FAKETIME_CACHE_DURATION": str(FAKETIME_CACHE_S),
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


def step(tmp_path: Path, offset: str) -> None:
    """Steps the writer's wall clock, and waits until libfaketime read the step."""
    (tmp_path / "offset").write_text(f"{offset}\n")
    time.sleep(FAKETIME_CACHE_S + 0.2)


def test_a_stepped_wall_clock_ends_no_lease_and_keeps_msg_ids_for_their_window(
    tmp_path: Path, stepped_clock: dict[str, str]
) -> None:
    settings = {
        **stepped_clock,
        "CMDBUS_ACK_WAIT_MS": "3000",
        "CMDBUS_DEDUP_WINDOW_MS": str(int(WINDOW_S * 1000)),
    }
    with (
        serving(tmp_path, **settings) as (_, ports),
        IngestClient(ports["cmd_ingest"]) as ingest,
        ClaimClient(ports["cmd_claim"]) as claim,
    ):
        first = ingest.publish(RECORD, msg_id="before-the-step")
        held = claim.next("commands.>", wait=5)
        assert held is not None
        step(tmp_path, "+1d")  # forward: would age every lease and id by a day
        assert ingest.publish(RECORD, msg_id="before-the-step").sort_key == first.sort_key
        assert claim.ack(held.sort_key)  # its lease is 3 s of the monotonic clock
        step(tmp_path, "-1d")  # back: would keep an id stamped now for a day
        later = ingest.publish(RECORD, msg_id="after-the-step")
        time.sleep(WINDOW_S + 0.5)
        again = ingest.publish(RECORD, msg_id="after-the-step")
        assert not again.duplicate and again.sort_key > later.sort_key
