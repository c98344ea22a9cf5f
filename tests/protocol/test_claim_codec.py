"""The claim and subscribe faces' request codecs: every field checked, the bad one named."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdbus_trio.protocol import (
    ErrorCode,
    FieldError,
    RemoteProtocolError,
    UnsupportedOp,
    claim,
    subscribe,
)


def test_each_op_decodes_to_its_request() -> None:
    decode = claim.decode_op
    assert decode("next", {"filter": "commands.a.>", "timeout_ms": 5}, named_groups=False) == (
        claim.Next(None, None, ("commands", "a", ">"), 5)
    )
    assert decode(
        "next", {"group": "g", "from": "tail", "filter": ">"}, named_groups=True
    ) == claim.Next("g", "tail", (">",), None)
    assert decode("next", {"filter": ">", "max": 9}, named_groups=False) == claim.Next(
        None, None, (">",), None, 9
    )
    assert decode("ack", {"sort_key": 3}, named_groups=False) == claim.Ack(None, (3,))
    assert decode("ack", {"sort_keys": [3, 1]}, named_groups=False) == claim.Ack(
        None, (3, 1), many=True
    )
    assert decode("extend", {"sort_key": 3, "group": "g"}, named_groups=True) == claim.Extend(
        "g", (3,)
    )
    assert decode("nack", {"sort_key": 3}, named_groups=False) == claim.Nack(None, (3,), 0)
    assert decode("nack", {"sort_key": 3, "delay_ms": 9}, named_groups=False).delay_ms == 9
    assert decode("lag", {}, named_groups=False) == claim.Lag(None, None)
    assert decode("lag", {"filter": "a.*"}, named_groups=False) == claim.Lag(None, ("a", "*"))
    assert decode("dead", {}, named_groups=False) == claim.Dead(None, None, 0, 100)
    assert decode("dead", {"filter": "a.>", "after": 7, "limit": 5000}, named_groups=False) == (
        claim.Dead(None, "a.>", 7, claim.MAX_DEAD_LIMIT)
    )
    assert decode("dead", {"limit": -3}, named_groups=False).limit == 1
    requeue = decode("requeue", {"sort_keys": [1, 2]}, named_groups=False)
    assert requeue == claim.MoveDead("requeue", None, (1, 2), None) and requeue.requeue
    purge = decode("purge", {"filter": "a.b"}, named_groups=True)
    assert purge == claim.MoveDead("purge", None, None, "a.b") and not purge.requeue
    assert decode("delete_group", {"group": "g"}, named_groups=True) == claim.DeleteGroup("g")


@pytest.mark.parametrize(
    ("op", "fields", "field"),
    [
        ("next", {"filter": ">", "timeout_ms": -1}, "timeout_ms"),
        ("next", {"filter": ">", "timeout_ms": True}, "timeout_ms"),
        ("next", {"filter": 3}, "filter"),
        ("next", {}, "filter"),
        ("next", {"other": 1}, "other"),
        ("ack", {}, "sort_key"),
        ("ack", {"sort_key": 0}, "sort_key"),
        ("extend", {"sort_key": "1"}, "sort_key"),
        ("nack", {"sort_key": 1, "delay_ms": -1}, "delay_ms"),
        ("nack", {"sort_key": 1, "delay_ms": 1.5}, "delay_ms"),
        ("ack", {"sort_key": 1, "lease": -1}, "lease"),
        ("ack", {"sort_key": 1, "lease": claim.LEASE_MAX + 1}, "lease"),
        ("nack", {"sort_key": 1, "lease": "7"}, "lease"),
        ("extend", {"sort_key": 1, "lease": True}, "lease"),
        ("ack", {"sort_key": 1, "leases": [1]}, "leases"),
        ("ack", {"sort_keys": [1], "lease": 1}, "lease"),
        ("ack", {"sort_keys": [1, 2], "leases": [1]}, "leases"),
        ("nack", {"sort_keys": [1], "leases": 1}, "leases"),
        ("extend", {"sort_keys": [1], "leases": [1.5]}, "leases"),
        ("lag", {"filter": ""}, "filter"),
        ("dead", {"after": -1}, "after"),
        ("dead", {"limit": "10"}, "limit"),
        ("dead", {"filter": "a..b"}, "filter"),
        ("requeue", {}, "sort_keys"),
        ("requeue", {"sort_keys": [1], "filter": "a"}, "sort_keys"),
        ("purge", {"sort_keys": [0]}, "sort_keys"),
        ("purge", {"sort_keys": "1"}, "sort_keys"),
        ("purge", {"sort_keys": list(range(1, claim.MAX_SORT_KEYS + 2))}, "sort_keys"),
        ("delete_group", {}, "group"),
        ("delete_group", {"group": 7}, "group"),
    ],
)
def test_a_bad_field_is_named(op: str, fields: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        claim.decode_op(op, fields, named_groups=True)
    assert str(caught.value).startswith(field)
    assert caught.value.code is ErrorCode.INVALID


def test_lease_tokens_are_decoded_beside_their_sort_keys() -> None:
    """The twins of the lease errors: a token at each end of its range, a list with a
    null (any lease of that key), and none at all."""
    op = claim.decode_op("ack", {"sort_key": 3, "lease": claim.LEASE_MAX}, named_groups=False)
    assert isinstance(op, claim.Ack) and (op.sort_keys, op.leases) == ((3,), (claim.LEASE_MAX,))
    fields = {"sort_keys": [3, 4], "leases": [0, None], "delay_ms": 5}
    op = claim.decode_op("nack", fields, named_groups=False)
    assert isinstance(op, claim.Nack) and op.leases == (0, None) and op.many
    op = claim.decode_op("extend", {"sort_keys": [3]}, named_groups=False)
    assert isinstance(op, claim.Extend) and op.leases is None


def test_sort_keys_at_the_cap_are_accepted() -> None:
    keys = list(range(1, claim.MAX_SORT_KEYS + 1))
    assert claim.decode_op("purge", {"sort_keys": keys}, named_groups=False).sort_keys == tuple(
        keys
    )


def test_delete_group_is_unsupported_on_the_command_face() -> None:
    with pytest.raises(UnsupportedOp) as caught:
        claim.decode_op("delete_group", {"group": "g"}, named_groups=False)
    assert caught.value.code is ErrorCode.UNSUPPORTED
    assert str(caught.value).endswith("ops: " + ", ".join(claim.OPS))
    with pytest.raises(UnsupportedOp, match="delete_group"):
        claim.decode_op("publish", {}, named_groups=True)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        ({"Next": {"filter": "commands.>", "member": 0}}, claim.V1Next(None, ("commands", ">"))),
        (
            {"Next": {"filter": ">", "member": (1 << 32) - 1, "group": "g"}},
            claim.V1Next("g", (">",)),
        ),
        ({"Ack": {"sort_key": 4}}, claim.V1Ack(None, 4)),
        ({"Nack": {"sort_key": 4, "group": "g"}}, claim.V1Nack("g", 4)),
    ],
)
def test_v1_requests(frame: dict[str, Any], expected: object) -> None:
    assert claim.decode_v1(json.dumps(frame).encode()) == expected


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        ([], "request"),
        ({"Next": {}, "Ack": {}}, "request"),
        ({"Next": 3}, "Next"),
        ({"Next": {"filter": ">", "member": -1}}, "member"),
        ({"Next": {"filter": ">", "member": 1 << 32}}, "member"),
        ({"Next": {"member": 1, "filter": ""}}, "filter"),
        ({"Ack": {"sort_key": 0}}, "sort_key"),
        ({"Nack": {}}, "sort_key"),
        ({"Publish": {}}, "request"),
    ],
)
def test_v1_bad_requests_name_the_field(frame: object, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        claim.decode_v1(json.dumps(frame).encode())
    assert str(caught.value).startswith(field)


def test_a_v1_frame_that_is_not_json_is_a_protocol_error() -> None:
    for decode_v1 in (claim.decode_v1, subscribe.decode_v1):
        with pytest.raises(RemoteProtocolError):
            decode_v1(b"{not json")


def test_subscribe_requests() -> None:
    assert subscribe.decode_op("subscribe", {}) == subscribe.Subscribe(0, None)
    assert subscribe.decode_op("subscribe", {"from": 9, "filter": "events.>"}) == (
        subscribe.Subscribe(9, ("events", ">"))
    )
    assert subscribe.decode_v1(b'{"shard": 2, "cursor": 0}') == subscribe.V1Subscribe(2, 0)
    with pytest.raises(UnsupportedOp):
        subscribe.decode_op("next", {})


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"from": -1}, "from"), ({"from": "0"}, "from"), ({"filter": 1}, "filter"), ({"x": 1}, "x")],
)
def test_subscribe_names_the_bad_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        subscribe.decode_op("subscribe", fields)
    assert str(caught.value).startswith(field)


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (b"[]", "request"),
        (b'{"cursor": 0}', "shard"),
        (b'{"shard": 0, "cursor": -1}', "cursor"),
        (b'{"shard": 0, "cursor": true}', "cursor"),
    ],
)
def test_v1_subscribe_names_the_bad_field(frame: bytes, field: str) -> None:
    with pytest.raises(FieldError) as caught:
        subscribe.decode_v1(frame)
    assert str(caught.value).startswith(field)


@given(
    sort_key=st.integers(1, (1 << 63) - 1),
    subject=st.text(max_size=40),
    redelivered=st.booleans(),
    deliveries=st.integers(1, 1 << 31),
    lease=st.none() | st.integers(0, claim.LEASE_MAX),
    record=st.sampled_from(['{"n":1}', '{"s":"é \\u2028 \\"q\\""}', "[]", '"text"', "{}"]),
)
def test_a_delivery_is_the_bytes_its_dict_would_encode_to(
    sort_key: int,
    subject: str,
    redelivered: bool,
    deliveries: int,
    lease: int | None,
    record: str,
) -> None:
    """``delivery`` builds its head by hand (it runs once per record handed out): the
    bytes are those of encoding the dict, lone surrogates in the subject included."""
    handed = claim.Delivery(sort_key, subject, redelivered, deliveries, lease=lease)
    head: dict[str, Any] = {
        "sort_key": sort_key,
        "subject": subject,
        "redelivered": redelivered,
        "deliveries": deliveries,
    }
    if lease is not None:
        head["lease"] = lease
    assert claim.delivery(handed, record) == claim.with_record(head, record)
