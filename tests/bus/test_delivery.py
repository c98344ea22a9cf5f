"""Delivery to one connection (bus/delivery.py) through its claim handler: each op's one
way to complete (`ack` by the committer's callback, `nack` and `extend` at once, `next`
in a task), and what a `next` that is shed, refused or fails leaves behind. The claim
handler is run in-process over a real bus log; each test checks what it leaves in the
claim index."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from cmdbus_trio.admission import Gate, GateClosed, Shed, ShedReason, Slot
from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.bodies import BodyReader
from cmdbus_trio.bus.claims import Claims
from cmdbus_trio.bus.committer import GroupCommitter
from cmdbus_trio.bus.groups import ConsumerGroups
from cmdbus_trio.config import Bind, load
from cmdbus_trio.faces import FaceContext
from cmdbus_trio.faces._claim import ClaimHandler
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.metrics import REGISTRY
from cmdbus_trio.protocol import FieldError, Request
from cmdbus_trio.protocol import claim as codec
from cmdbus_trio.protocol.bus import BusKind, SubjectRule
from cmdbus_trio.protocol.subjects import parse_filter
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage.buslog import BusEntry, BusLog

from ..helpers import publish_through

SUBJECT = "commands.shared.shard.0"


@attrs.frozen
class Setup:
    handler: ClaimHandler
    claims: Claims
    gate: Gate
    log: BusLog
    ctx: FaceContext


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    log = await trio.to_thread.run_sync(BusLog.open, tmp_path / "commands.sqlite3")
    await trio.to_thread.run_sync(
        log.publish, [BusEntry(SUBJECT, json.dumps({"n": n})) for n in (1, 2)]
    )
    committer = GroupCommitter(log, SubjectRule(BusKind.COMMANDS))
    groups = ConsumerGroups(
        log, committer, ack_wait=30.0, max_deliver=0, limiter=trio.CapacityLimiter(1),
        fixed="commands",
    )  # fmt: skip
    await groups.open()  # records 1 and 2, from the store
    claims = await groups.resolve(None, None)
    bus = Bus(log, committer, BodyReader(log), groups)
    gate = Gate("cmd_claim", max_inflight=1, max_waiters=8, shed_after=1.0, default_budget=10)
    ctx = FaceContext("cmd_claim", Bind("127.0.0.1", 0), load({}, environ={}), gate, trio.Event())

    async with trio.open_nursery() as nursery:
        await nursery.start(committer.run)
        await nursery.start(bus.bodies.run)
        yield Setup(ClaimHandler(ctx, bus), claims, gate, log, ctx)
        nursery.cancel_scope.cancel()
    await trio.to_thread.run_sync(log.close)


def request(op: str, **fields: Any) -> Request:
    return Request(1, op, None, fields)


async def answer(pending: Any) -> Any:
    with trio.fail_after(10):
        if not isinstance(pending, Deferred):
            return json.loads(await pending)
        settled: list[bytes | Exception] = []
        done = trio.Event()
        pending.when_settled(lambda outcome: (settled.append(outcome), done.set()))
        await done.wait()
        if isinstance(settled[0], Exception):
            raise settled[0]
        return json.loads(settled[0])


async def use_the_group(setup: Setup) -> None:
    """The connection's first request resolves the group (a task)."""
    assert (await answer(setup.handler.v2(request("lag"), trio.current_time())))["total"] == 2


async def test_an_ack_completes_by_the_committers_callback_a_next_in_a_task(
    setup: Setup,
) -> None:
    pending = setup.handler.v2(request("next", filter="commands.>"), trio.current_time())
    assert not isinstance(pending, Deferred)  # it may wait: a task, always
    delivery = (await answer(pending))["delivery"]
    assert (delivery["sort_key"], delivery["record"]) == (1, {"n": 1})
    assert setup.gate.statistics().inflight == 0  # the slot ended with the read
    pending = setup.handler.v2(request("ack", sort_key=1), trio.current_time())
    assert isinstance(pending, Deferred)
    assert (await answer(pending))["acked"] is True
    assert setup.claims.lag() == {SUBJECT: 1}


async def test_an_ack_of_nothing_held_is_answered_at_once(setup: Setup) -> None:
    """No group used yet, no lease: false, by the same path, without a commit."""
    pending = setup.handler.v2(request("ack", sort_key=2), trio.current_time())
    assert isinstance(pending, Deferred)
    assert (await answer(pending))["acked"] is False
    assert setup.claims.lag() == {SUBJECT: 2}


async def test_nack_and_extend_complete_at_once(setup: Setup) -> None:
    await answer(setup.handler.v2(request("next", filter="commands.>"), 0.0))
    extended = setup.handler.v2(request("extend", sort_key=1), 0.0)
    assert isinstance(extended, Deferred)
    assert await answer(extended) == {"id": 1, "ok": True, "extended": True, "lease_ms": 30000}
    nacked = setup.handler.v2(request("nack", sort_key=1), 0.0)
    assert isinstance(nacked, Deferred)
    assert (await answer(nacked))["nacked"] is True
    assert setup.claims.leased == 0
    for op in ("nack", "extend"):  # held no more
        assert (await answer(setup.handler.v2(request(op, sort_key=1), 0.0)))[f"{op}ed"] is False


@pytest.mark.parametrize("op", ["ack", "nack", "extend"])
async def test_a_settling_op_naming_a_group_on_the_command_bus_is_invalid(
    setup: Setup, op: str
) -> None:
    with pytest.raises(FieldError, match="no consumer groups"):
        setup.handler.v2(request(op, sort_key=1, group="g"), 0.0)


async def test_a_v1_ack_completes_by_the_same_callback(setup: Setup) -> None:
    frame = json.dumps({"Next": {"member": 1, "filter": "commands.>"}}).encode()
    with trio.fail_after(10):
        await setup.handler.v1(frame, 0.0)
        assert setup.claims.leased == 1
        reply = await setup.handler.v1(json.dumps({"Ack": {"sort_key": 1}}).encode(), 0.0)
    assert (reply.op, reply.data[4:]) == ("ack", b"1")
    assert setup.claims.leased == 0 and setup.claims.lag() == {SUBJECT: 1}


async def test_a_failed_body_read_is_answered_and_the_record_redelivered(
    setup: Setup,
) -> None:
    await use_the_group(setup)
    await trio.to_thread.run_sync(setup.log.close)
    pending = setup.handler.v2(request("next", filter="commands.>"), trio.current_time())
    with pytest.raises(StoreUnavailable):
        await answer(pending)
    assert setup.claims.leased == 0 and setup.claims.lag() == {SUBJECT: 2}
    assert setup.gate.statistics().inflight == 0


async def test_a_next_refused_at_the_gate_leases_nothing(setup: Setup) -> None:
    await use_the_group(setup)
    setup.gate.close()
    refused = setup.handler.v2(request("next", filter="commands.>"), trio.current_time())
    with pytest.raises(GateClosed):
        await answer(refused)
    assert setup.claims.leased == 0 and setup.claims.lag() == {SUBJECT: 2}


def saturated_gate(setup: Setup) -> Slot:
    """A Gate with one slot, taken, and no queue: every `next` is shed at once."""
    gate = Gate("cmd_claim", max_inflight=1, max_waiters=0, shed_after=0.2, default_budget=10)
    setup.handler.gate = setup.handler.consumer.gate = gate
    return gate.acquire_nowait("next")


async def test_a_shed_v2_next_is_busy_and_costs_the_record_nothing(setup: Setup) -> None:
    await use_the_group(setup)
    held = saturated_gate(setup)
    refused = setup.handler.v2(request("next", filter="commands.>"), trio.current_time())
    with pytest.raises(Shed) as shed:
        await answer(refused)
    assert shed.value.reason is ShedReason.WAITERS_FULL
    assert setup.claims.leased == 0
    held.release()
    delivery = (await answer(setup.handler.v2(request("next", filter="commands.>"), 0.0)))[
        "delivery"
    ]
    assert (delivery["sort_key"], delivery["deliveries"], delivery["redelivered"]) == (1, 1, False)


async def test_a_v1_next_waits_for_room_instead_of_being_closed(setup: Setup) -> None:
    """v1 cannot say `busy`: a shed `Next` waits (retry_after at a time) until admitted."""
    held = saturated_gate(setup)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            replies: list[Any] = []

            async def worker() -> None:
                frame = json.dumps({"Next": {"member": 1, "filter": "commands.>"}}).encode()
                replies.append(await setup.handler.v1(frame, trio.current_time()))

            nursery.start_soon(worker)
            await trio.sleep(1.0)  # five shed waits: still waiting, nothing leased
            assert not replies and setup.claims.leased == 0
            held.release()
    (reply,) = replies
    body = json.loads(reply.data[4:])
    assert (body["sort_key"], body["redelivered"]) == (1, False)
    assert setup.handler.gate.statistics().shed_total["waiters_full"] >= 3


async def test_a_failed_body_read_does_not_count_as_a_delivery(setup: Setup) -> None:
    await use_the_group(setup)
    await trio.to_thread.run_sync(setup.log.close)
    with pytest.raises(StoreUnavailable):
        await answer(setup.handler.v2(request("next", filter="commands.>"), 0.0))
    again = setup.claims.next_nowait(("commands", ">"), object())
    assert again is not None and (again.deliveries, again.redelivered) == (1, False)


async def next_after_eviction(setup: Setup, *, forget: bool) -> Any:
    """A `next` leases record 1, then waits for the Gate's only slot; meanwhile record 1
    is evicted from the store (after the group forgot it, unless not ``forget``)."""
    await use_the_group(setup)
    held = setup.gate.acquire_nowait("next")
    replies: list[Any] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def consumer() -> None:
                pending = setup.handler.v2(request("next", filter="commands.>"), 0.0)
                try:
                    replies.append(await answer(pending))
                except LookupError as exc:
                    replies.append(exc)

            nursery.start_soon(consumer)
            await trio.sleep(0.1)
            assert setup.claims.leased == 1  # record 1, leased before its slot
            if forget:
                assert setup.claims.evict_through(1) == 1
            await trio.to_thread.run_sync(setup.log.evict, 1)
            held.release()
    return replies[0]


async def test_a_next_whose_record_was_evicted_while_it_waited_takes_the_next_one(
    setup: Setup,
) -> None:
    reply = await next_after_eviction(setup, forget=True)
    assert reply["delivery"]["sort_key"] == 2


async def test_a_record_missing_without_an_eviction_is_still_an_error(setup: Setup) -> None:
    assert isinstance(await next_after_eviction(setup, forget=False), LookupError)
    assert setup.claims.leased == 0  # given back, as any failed read


@pytest.mark.parametrize(
    "stored", ['{"n":1}', '{"s":"é \\u2028 \\"q\\" \\ud800","deep":[[[{}]]]}', "[]", '"text"']
)
@pytest.mark.parametrize("body", [{}, {"deleted_through": 5}])
def test_a_delivery_splices_the_stored_record_into_valid_json(
    stored: str, body: dict[str, Any]
) -> None:
    """The stored text goes into the reply as it is: the reply parses to what encoding
    the decoded record would have given."""
    delivery = codec.Delivery(3, "commands.p.shard.0", redelivered=True, deliveries=2)
    reply = codec.next_reply(7, body, codec.delivery(delivery, stored))
    assert json.loads(reply) == {
        "id": 7,
        "ok": True,
        **body,
        "delivery": {
            "sort_key": 3,
            "subject": "commands.p.shard.0",
            "redelivered": True,
            "deliveries": 2,
            "record": json.loads(stored),
        },
    }
    assert json.loads(codec.next_reply(7, body, None)) == {
        "id": 7,
        "ok": True,
        **body,
        "delivery": None,
    }


async def test_a_record_given_back_by_a_shed_next_wakes_one_parked_consumer(
    setup: Setup,
) -> None:
    """Issue 38: with the Gate full, a record handed to a parked ``next`` that is then
    shed went straight to the next parked one, which was shed too: one record answered
    every parked consumer ``busy``. It now waits for a free slot, then goes to one."""
    await use_the_group(setup)
    owner = object()
    for _ in range(2):  # both records out, so that every consumer below parks
        assert setup.claims.next_nowait(parse_filter(">"), owner) is not None
    held = saturated_gate(setup)
    outcomes: list[str] = []
    two = trio.Event()

    async def consumer() -> None:
        try:
            await answer(setup.handler.v2(request("next", filter="commands.>"), 0.0))
            outcomes.append("delivered")
        except Shed:
            outcomes.append("busy")
        if len(outcomes) == 2:
            two.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(consumer)
            await trio.testing.wait_all_tasks_blocked()
            assert setup.claims.give_back(1, owner)  # one record back, the Gate still full
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == ["busy"]  # it used to be five
            assert setup.claims.has(parse_filter(">"))  # queued for a new `next` to take
            held.release()  # a free slot: the record goes to the next parked consumer
            await two.wait()
            assert outcomes == ["busy", "delivered"]
            nursery.cancel_scope.cancel()


# --- batches (issue 41): `next` with `max`, `ack`/`nack`/`extend` with `sort_keys` ------


async def publish_more(setup: Setup, count: int, size: int = 10) -> None:
    """Records 3 onwards, committed through the bus so that the group learns of them."""
    payloads = [json.dumps({"pad": "x" * size, "execution_pool": "shared"})] * count
    await publish_through(setup.handler.bus.committer, payloads)


async def test_a_batch_leases_each_record_on_its_own_and_acks_in_one_commit(
    setup: Setup,
) -> None:
    await publish_more(setup, 3)  # 1..5 in all
    reply = await answer(setup.handler.v2(request("next", filter="commands.>", max=4), 0.0))
    handed = [delivery["sort_key"] for delivery in reply["deliveries"]]
    assert handed == [1, 2, 3, 4] and "delivery" not in reply
    assert setup.claims.leased == 4  # four leases, not one
    acking = setup.handler.v2(request("ack", sort_keys=[4, 99, 2, 2]), 0.0)
    assert isinstance(acking, Deferred)
    assert (await answer(acking))["acked"] == [True, False, True, False]
    assert setup.claims.leased == 2 and setup.claims.lag() == {SUBJECT: 3}
    nacked = await answer(setup.handler.v2(request("nack", sort_keys=[3]), 0.0))
    assert nacked["nacked"] == [True]
    extended = await answer(setup.handler.v2(request("extend", sort_keys=[1, 3]), 0.0))
    assert extended == {
        "id": 1, "ok": True, "extended": [True, False], "why": [None, "not_leased"],
        "lease_ms": 30000,
    }  # fmt: skip
    again = await answer(setup.handler.v2(request("next", filter="commands.>", max=10), 0.0))
    # Record 3 alone is redelivered (nacked); 1 is still leased; 5 was never handed out.
    assert [(d["sort_key"], d["redelivered"]) for d in again["deliveries"]] == [
        (3, True),
        (5, False),
    ]


def refused(face: str, op: str, why: str) -> float:
    value = REGISTRY.get_sample_value(
        "cmdbus_settles_refused_total", {"face": face, "op": op, "why": why}
    )
    return value or 0.0


async def test_a_refused_settle_says_why_and_is_counted(setup: Setup) -> None:
    """Each reason: nobody holds it, another connection does, this one does by a newer
    lease; a reply with nothing refused has no `why`."""
    before = {why: refused("cmd_claim", "ack", why) for why in REASONS}
    mine = await answer(setup.handler.v2(request("next", filter="commands.>"), 0.0))
    first = mine["delivery"]
    assert first["sort_key"] == 1
    nacked = await answer(setup.handler.v2(request("nack", sort_key=1), 0.0))
    assert nacked == {"id": 1, "ok": True, "nacked": True}
    again = await answer(setup.handler.v2(request("next", filter="commands.>"), 0.0))
    assert (again["delivery"]["sort_key"], again["delivery"]["deliveries"]) == (1, 2)
    other = ClaimHandler(setup.ctx, setup.handler.bus)
    theirs = await answer(other.v2(request("next", filter="commands.>"), 0.0))
    assert theirs["delivery"]["sort_key"] == 2

    one = await answer(setup.handler.v2(request("ack", sort_key=1, lease=first["lease"]), 0.0))
    assert (one["acked"], one["why"]) == (False, "lease_replaced")
    many = await answer(setup.handler.v2(request("ack", sort_keys=[2, 99, 1]), 0.0))
    assert many["acked"] == [False, False, True]
    assert many["why"] == ["leased_elsewhere", "not_leased", None]
    after = {why: refused("cmd_claim", "ack", why) for why in REASONS}
    assert {why: after[why] - before[why] for why in REASONS} == dict.fromkeys(REASONS, 1.0)
    extended = await answer(other.v2(request("extend", sort_key=2), 0.0))
    assert "why" not in extended and extended["extended"] is True


REASONS = ("not_leased", "leased_elsewhere", "lease_replaced")


async def test_a_batch_takes_what_is_there_and_an_empty_one_times_out(setup: Setup) -> None:
    reply = await answer(setup.handler.v2(request("next", filter="commands.>", max=1000), 0.0))
    assert [d["sort_key"] for d in reply["deliveries"]] == [1, 2]  # what was there
    with trio.fail_after(10):
        empty = setup.handler.v2(request("next", filter="commands.>", max=5, timeout_ms=50), 0.0)
        assert (await answer(empty))["deliveries"] == []


async def test_a_batch_stays_within_the_reply_cap_and_gives_the_rest_back(
    setup: Setup,
) -> None:
    await publish_more(setup, 6, size=3000)  # 3..8, about 3 kB each
    setup.handler.max_reply = 10_000
    reply = await answer(setup.handler.v2(request("next", filter="commands.>", max=8), 0.0))
    handed = [d["sort_key"] for d in reply["deliveries"]]
    assert handed == [1, 2, 3, 4, 5]  # two small, then what fits of the 3 kB ones
    assert len(json.dumps(reply, separators=(",", ":"))) <= 10_000
    assert setup.claims.leased == 5
    rest = await answer(setup.handler.v2(request("next", filter="commands.>", max=8), 0.0))
    assert [(d["sort_key"], d["deliveries"]) for d in rest["deliveries"]] == [
        (6, 1),
        (7, 1),
        (8, 1),
    ]


async def test_a_batch_record_whose_lease_lapses_redelivers_alone(setup: Setup) -> None:
    """The timer (ack_wait, set to 0.2 s) is shorter than the wait (0.6 s)."""
    setup.claims.ack_wait = 0.2
    async with trio.open_nursery() as nursery:
        await nursery.start(setup.claims.run_timers)
        reply = await answer(setup.handler.v2(request("next", filter="commands.>", max=2), 0.0))
        assert [d["sort_key"] for d in reply["deliveries"]] == [1, 2]
        assert (await answer(setup.handler.v2(request("ack", sort_keys=[2]), 0.0)))["acked"] == [
            True
        ]
        await trio.sleep(0.6)
        again = await answer(setup.handler.v2(request("next", filter="commands.>", max=2), 0.0))
        assert [(d["sort_key"], d["deliveries"]) for d in again["deliveries"]] == [(1, 2)]
        nursery.cancel_scope.cancel()


async def test_a_disconnect_releases_the_whole_batch(setup: Setup) -> None:
    await answer(setup.handler.v2(request("next", filter="commands.>", max=2), 0.0))
    assert setup.claims.leased == 2
    setup.handler.closed("closed")
    assert setup.claims.leased == 0 and setup.claims.lag() == {SUBJECT: 2}
    other = ClaimHandler(setup.ctx, setup.handler.bus)
    again = await answer(other.v2(request("next", filter="commands.>", max=2), 0.0))
    assert [d["redelivered"] for d in again["deliveries"]] == [True, True]


async def test_a_shed_batch_gives_every_record_back_uncounted(setup: Setup) -> None:
    held = saturated_gate(setup)
    with pytest.raises(Shed):
        await answer(setup.handler.v2(request("next", filter="commands.>", max=2), 0.0))
    assert setup.claims.leased == 0
    held.release()
    reply = await answer(setup.handler.v2(request("next", filter="commands.>", max=2), 0.0))
    assert [(d["deliveries"], d["redelivered"]) for d in reply["deliveries"]] == [
        (1, False),
        (1, False),
    ]


@pytest.mark.parametrize(
    ("op", "fields", "field"),
    [
        ("next", {"filter": ">", "max": 0}, "max"),
        ("next", {"filter": ">", "max": 1001}, "max"),
        ("next", {"filter": ">", "max": 2.0}, "max"),
        ("next", {"filter": ">", "max": True}, "max"),
        ("ack", {"sort_keys": []}, "sort_keys"),
        ("ack", {"sort_keys": list(range(1, 1002))}, "sort_keys"),
        ("ack", {"sort_keys": [1, 0]}, "sort_keys"),
        ("nack", {"sort_keys": 5}, "sort_keys"),
        ("extend", {"sort_keys": [1], "sort_key": 1}, "sort_keys"),
        ("ack", {}, "sort_key"),
    ],
)
def test_batch_fields_out_of_bounds_are_invalid_naming_the_field(
    op: str, fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(FieldError, match=f"^{field}:"):
        codec.decode_op(op, fields, named_groups=False)


@pytest.mark.parametrize("op", ["ack", "nack", "extend"])
def test_batch_fields_at_their_bounds_are_taken(op: str) -> None:
    keys = list(range(1, 1001))
    decoded = codec.decode_op(op, {"sort_keys": keys}, named_groups=False)
    assert decoded.sort_keys == tuple(keys) and decoded.many  # type: ignore[union-attr]
    one = codec.decode_op(op, {"sort_key": 7}, named_groups=False)
    assert one.sort_keys == (7,) and not one.many  # type: ignore[union-attr]
    for most in (1, 1000):
        taken = codec.decode_op("next", {"filter": ">", "max": most}, named_groups=False)
        assert isinstance(taken, codec.Next) and taken.max == most
