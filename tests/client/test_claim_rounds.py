"""The sans-io policy of a sharded `next` (client/_shards.py), shared by the trio and the
blocking clients: order, what an error means, pauses."""

from __future__ import annotations

import pytest

from cmdbus_trio.client import ShardMap
from cmdbus_trio.client._calls import Delivery
from cmdbus_trio.client._errors import ConnectionLost, Invalid, Unavailable
from cmdbus_trio.client._shards import MAX_IDLE_PAUSE, ClaimRounds, Rotation

SHARDS = ShardMap.parse("0@127.0.0.1:1,1@127.0.0.1:2,2@127.0.0.1:3")
DELIVERY = Delivery(7, "commands.shared.shard.1", False, 1, {"execution_id": 1, "payload": "{}"})


def test_a_served_shard_moves_the_next_round_on() -> None:
    rotation = Rotation(3)
    rounds = ClaimRounds(SHARDS, rotation)
    assert rounds.round() == [0, 1, 2]
    claimed = rounds.served(1, DELIVERY)
    assert (claimed.shard, claimed.delivery) == (1, DELIVERY)
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
    """Every writer away in a round: within the reconnect window, a reconnect pause (or
    None once the caller's wait is spent); a writer back resets it; past the window, the
    last error, with a note."""
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
    assert rounds.pause(0.0) is None  # the caller's wait is over first: no record
    time.sleep(0.35)  # past the window
    all_away(rounds)
    with pytest.raises(ConnectionLost, match="gone 2") as raised:
        rounds.pause(10.0)
    assert "every writer was away for the whole 0.3 s window" in raised.value.__notes__
    assert window.statistics().gave_up == 1
    again = ClaimRounds(SHARDS, Rotation(3), window)  # a new call, a new window
    all_away(again)
    assert again.pause(10.0) is not None
