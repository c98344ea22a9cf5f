"""The live fan-out of the event bus: a record reaches the subscribers whose filter matches
it, and costs nothing per subscriber that does not want it."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import trio

from cmdbus_trio.bus import subscriptions
from cmdbus_trio.bus.committer import Committed
from cmdbus_trio.bus.subscriptions import Hub
from cmdbus_trio.protocol.subjects import parse_filter


def test_a_record_is_compared_with_filters_and_encoded_only_when_wanted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = {"matches": 0, "fragment": 0}
    real_matches, real_fragment = subscriptions.matches, subscriptions.fragment

    def counting_matches(*args: object) -> bool:
        calls["matches"] += 1
        return real_matches(*args)  # type: ignore[arg-type]

    def counting_fragment(*args: object) -> bytes:
        calls["fragment"] += 1
        return real_fragment(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(subscriptions, "matches", counting_matches)
    monkeypatch.setattr(subscriptions, "fragment", counting_fragment)
    hub = Hub(capacity=1000)
    with ExitStack() as stack:
        crowd = [
            stack.enter_context(hub.subscribe(parse_filter(f"events.other_{n % 10}")))
            for n in range(1000)
        ]
        mine = stack.enter_context(hub.subscribe(parse_filter("events.step_done")))
        everything = stack.enter_context(hub.subscribe(None))
        hub.feed([Committed(n, "events.step_done", "{}") for n in range(1, 101)])
        hub.feed([Committed(101, "events.nobody", "{}")])
        assert calls["matches"] <= 2 * 11  # the 11 filters, once for each of two subjects
        assert calls["fragment"] == 101  # once a record, shared by its subscribers
        assert all(not s.overflowed for s in crowd)
        assert [p.sort_key for p in _buffered(mine)] == list(range(1, 101))
        assert [p.sort_key for p in _buffered(everything)] == list(range(1, 102))
        assert all(_buffered(s) == [] for s in crowd[:10])


def _buffered(subscription: subscriptions.Subscription) -> list[subscriptions.Pushed]:
    out = []
    while True:
        try:
            out.append(subscription._receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


def test_a_subscriber_that_falls_behind_is_cut_off_alone() -> None:
    hub = Hub(capacity=3)
    with hub.subscribe(None) as slow, hub.subscribe(parse_filter("events.a")) as other:
        hub.feed([Committed(n, "events.b", "{}") for n in range(1, 5)])
        assert slow.overflowed and not other.overflowed
