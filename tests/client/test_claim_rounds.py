"""The sans-io policy of a sharded `next` (client/_shards.py), shared by the trio and the
blocking clients: order, what an error means, pauses."""

from __future__ import annotations

import pytest

from cmdbus_trio.client import ShardMap
from cmdbus_trio.client._calls import Delivery
from cmdbus_trio.client._errors import ConnectionLost, DeadlineExceeded, Invalid, Unavailable
from cmdbus_trio.client._shards import (
    ASK_LEAST,
    ASK_MOST,
    MAX_IDLE_PAUSE,
    ClaimRounds,
    Rotation,
)

SHARDS = ShardMap.parse("0@127.0.0.1:1,1@127.0.0.1:2,2@127.0.0.1:3")
DELIVERY = Delivery(7, "commands.shared.shard.1", False, 1, {"execution_id": 1, "payload": "{}"})


def test_a_served_shard_moves_the_next_round_on() -> None:
    rotation = Rotation(3)
    rounds = ClaimRounds(SHARDS, rotation)
    assert rounds.round() == [0, 1, 2]
    assert rounds.answered(0, None) is None
    claimed = rounds.answered(1, DELIVERY)
    assert claimed is not None and (claimed.shard, claimed.delivery) == (1, DELIVERY)
    assert ClaimRounds(SHARDS, rotation).round() == [2, 0, 1]


def test_pauses_double_up_to_the_cap_and_stop_at_the_wait() -> None:
    rounds = ClaimRounds(SHARDS, Rotation(3))
    pauses = [rounds.pause(10.0) for _ in range(7)]
    assert pauses == [0.01, 0.02, 0.04, 0.08, 0.16, MAX_IDLE_PAUSE, MAX_IDLE_PAUSE]
    assert rounds.pause(0.003) == 0.003  # never past the caller's wait
    assert rounds.pause(0.0) is None


def test_a_writer_that_is_down_is_skipped_until_all_are() -> None:
    rounds = ClaimRounds(SHARDS, Rotation(3))
    rounds.round()
    rounds.failed(0, ConnectionLost("gone"))
    rounds.failed(1, Unavailable("draining"))
    assert rounds.pause(1.0) == 0.01  # shard 2 answered: go on
    rounds.round()  # a new round forgets the last one's failures
    for shard in range(3):
        rounds.failed(shard, ConnectionLost(f"gone {shard}"))
    with pytest.raises(ConnectionLost, match="gone 2") as raised:
        rounds.pause(1.0)
    assert raised.value.shard == 2


def test_a_bad_request_is_raised_at_once_with_its_shard() -> None:
    rounds = ClaimRounds(SHARDS, Rotation(3))
    rounds.round()
    with pytest.raises(Invalid) as raised:
        rounds.failed(1, Invalid("filter: bad"))
    assert raised.value.shard == 1


def test_every_writer_away_is_waited_for_within_the_reconnect_window() -> None:
    """Every writer away in a round: within the reconnect window, a reconnect pause,
    whatever is left of the caller's wait (a call to one writer rides through the same
    way); past the window, the last error, with a note."""
    import time

    from cmdbus_trio.client._retry import RECONNECT_MAX_PAUSE, Reconnect

    def all_away(rounds: ClaimRounds) -> None:
        rounds.round()
        for shard in range(3):
            rounds.failed(shard, ConnectionLost(f"gone {shard}"))

    window = Reconnect(0.3)
    rounds = ClaimRounds(SHARDS, Rotation(3), window)
    all_away(rounds)
    pause = rounds.pause(10.0)
    assert pause is not None and 0 < pause <= RECONNECT_MAX_PAUSE
    all_away(rounds)
    pause = rounds.pause(0.0)  # the caller's wait is over: rides through all the same
    assert pause is not None and pause > 0
    time.sleep(0.35)  # past the window
    all_away(rounds)
    with pytest.raises(ConnectionLost, match="gone 2") as raised:
        rounds.pause(10.0)
    assert "every writer was away for the whole 0.3 s window" in raised.value.__notes__
    assert window.statistics().gave_up == 1
    again = ClaimRounds(SHARDS, Rotation(3), window)  # a new call, a new window
    all_away(again)
    assert again.pause(10.0) is not None


def test_a_silent_writer_is_skipped_for_the_call_and_asked_last_until_it_answers() -> None:
    """A writer that did not answer in time is not asked again in this call and comes
    last in later calls' rounds until it answers; the call ends (None) at its wait, or
    when every writer was silent; it never rides through the reconnect window."""
    from cmdbus_trio.client._retry import Reconnect

    rotation = Rotation(3)
    rounds = ClaimRounds(SHARDS, rotation, Reconnect(60))
    assert rounds.round() == [0, 1, 2]
    rounds.failed(0, DeadlineExceeded("no reply in time"))
    rounds.answered(1, None)
    rounds.answered(2, None)
    assert rounds.pause(1.0) == 0.01
    assert rounds.round() == [1, 2]  # shard 0 skipped for the rest of the call
    later = ClaimRounds(SHARDS, rotation)
    assert later.round() == [1, 2, 0]  # asked last by the next call
    later.answered(0, None)
    assert ClaimRounds(SHARDS, rotation).round() == [0, 1, 2]  # it answered: in turn again
    silent = ClaimRounds(SHARDS, Rotation(3), Reconnect(60))
    silent.round()
    for shard in range(3):
        silent.failed(shard, DeadlineExceeded("no reply in time"))
    assert silent.pause(5.0) is None  # none left to ask: the call ends
    assert silent.round() == []
    mixed = ClaimRounds(SHARDS, Rotation(3), Reconnect(60))
    mixed.round()
    mixed.failed(0, DeadlineExceeded("no reply in time"))
    mixed.failed(1, ConnectionLost("gone"))
    mixed.failed(2, ConnectionLost("gone"))
    assert mixed.pause(0.0) is None  # not every writer away: the wait bounds the call


def test_an_ask_is_bounded_by_what_is_left_of_the_wait() -> None:
    rounds = ClaimRounds(SHARDS, Rotation(3))
    assert rounds.ask_timeout(3.0, None) == 3.0
    assert rounds.ask_timeout(0.0, None) == ASK_LEAST  # a spent wait still asks each once
    assert rounds.ask_timeout(-1.0, None) == ASK_LEAST
    assert rounds.ask_timeout(float("inf"), None) == ASK_MOST  # wait=None: never unbounded
    assert rounds.ask_timeout(3.0, 1.0) == 1.0  # the caller's own timeout when shorter
    assert rounds.ask_timeout(3.0, 5.0) == 3.0
