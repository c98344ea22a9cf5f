"""The live fan-out of the event bus: a record reaches the subscribers whose filter matches
it, and costs nothing per subscriber that does not want it."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

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
    hub = Hub(capacity=1000, max_bytes=1 << 20)
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
    return list(subscription._buffer)


def test_a_subscriber_that_falls_behind_is_cut_off_alone() -> None:
    hub = Hub(capacity=3, max_bytes=1 << 20)
    with hub.subscribe(None) as slow, hub.subscribe(parse_filter("events.a")) as other:
        hub.feed([Committed(n, "events.b", "{}") for n in range(1, 5)])
        assert slow.overflowed and not other.overflowed


def _record(sort_key: int, pad: int) -> Committed:
    return Committed(sort_key, "events.b", '"' + "x" * pad + '"')


def test_a_subscriber_is_cut_off_by_bytes_as_well_as_records() -> None:
    """Issue 38: 10,000 records of 150 KiB would have been 1.5 GB buffered for one
    subscriber. The byte cap cuts it off first; a record larger than the cap is buffered
    when it is alone."""
    size = len(subscriptions.fragment(1, "events.b", '"' + "x" * 1000 + '"'))
    hub = Hub(capacity=1000, max_bytes=3 * size)
    with hub.subscribe(None) as slow, hub.subscribe(None) as reader:
        hub.feed([_record(n, 1000) for n in range(1, 4)])
        assert not slow.overflowed and slow.buffered_bytes == 3 * size
        reader._buffer.clear()  # it read them
        reader._bytes = 0
        hub.feed([_record(4, 1000)])
        assert slow.overflowed and not reader.overflowed
    hub = Hub(capacity=1000, max_bytes=100)
    with hub.subscribe(None) as alone:
        hub.feed([_record(1, 5000)])
        assert not alone.overflowed and len(_buffered(alone)) == 1
        hub.feed([_record(2, 10)])
        assert alone.overflowed


async def test_frames_fit_their_byte_room_and_a_large_record_goes_alone() -> None:
    """The live records, taken a batch at a time, go out in frames that fit the reply
    cap's room, as the catch-up pages do (one packing for both)."""
    from cmdbus_trio.faces.evt_subscribe import _runs

    hub = Hub(capacity=1000, max_bytes=1 << 30)
    sizes = [100, 100, 100, 5000, 100, 100]
    with hub.subscribe(None) as live:
        hub.feed([_record(n, pad) for n, pad in enumerate(sizes, 1)])
        live.end()
        room = 2 * len(subscriptions.fragment(1, "events.b", '"' + "x" * 100 + '"')) + 1
        batches = [batch async for batch in live.batches(4)]
        assert [len(batch) for batch in batches] == [4, 2]
        assert live.buffered_bytes == 0
        assert [len(b) async for b in live.batches(4)] == []  # ended, drained
    keys = {p.fragment: p.sort_key for batch in batches for p in batch}
    frames = [
        [keys[piece] for piece in run]
        for batch in batches
        for run in _runs([p.fragment for p in batch], room)
    ]
    assert frames == [[1, 2], [3], [4], [5, 6]]
