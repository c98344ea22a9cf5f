"""Trace context on the wire (docs/protocol.md, "Trace context"): what a publish may carry,
what is refused (naming the field), and how a delivery carries it back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cmdbus_trio.protocol import FieldError, bus, claim, trace
from cmdbus_trio.protocol.trace import TraceContext

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
RECORD = {"execution_id": 7, "payload": "{}"}


def test_a_well_formed_context_is_kept_as_given() -> None:
    assert trace.decode({"traceparent": PARENT}) == TraceContext(PARENT)
    assert trace.decode({"traceparent": PARENT, "tracestate": "a=1,b=2"}) == TraceContext(
        PARENT, "a=1,b=2"
    )
    assert trace.decode({}) is None
    assert trace.decode({"traceparent": PARENT, "tracestate": ""}) == TraceContext(PARENT)
    assert trace.decode({"tracestate": ""}) is None  # empty: none, with or without a parent
    flags_upper = PARENT[:-2] + "FF"  # PROTOCOL: "<2 hex>" for the flags
    assert trace.decode({"traceparent": flags_upper}) == TraceContext(flags_upper)
    at_cap = "k=" + "v" * (trace.MAX_TRACESTATE_BYTES - 2)
    assert trace.decode({"traceparent": PARENT, "tracestate": at_cap}) == TraceContext(
        PARENT, at_cap
    )


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ({"traceparent": 1}, "traceparent", "expected a W3C traceparent string"),
        ({"traceparent": PARENT + "-00"}, "traceparent", "over 55 characters"),
        ({"traceparent": "01" + PARENT[2:]}, "traceparent", "version 00"),
        ({"traceparent": PARENT.upper()}, "traceparent", "lowercase"),
        ({"traceparent": PARENT[:-1]}, "traceparent", "expected 00-"),
        ({"traceparent": PARENT.replace("-", "_")}, "traceparent", "expected 00-"),
        ({"traceparent": f"00-{'0' * 32}-00f067aa0ba902b7-01"}, "traceparent", "trace id"),
        ({"traceparent": f"00-{'a' * 32}-{'0' * 16}-01"}, "traceparent", "span id"),
        ({"tracestate": "a=1"}, "tracestate", "without a traceparent"),
        ({"traceparent": PARENT, "tracestate": 5}, "tracestate", "string"),
        (
            {"traceparent": PARENT, "tracestate": "k=" + "v" * trace.MAX_TRACESTATE_BYTES},
            "tracestate",
            "over 512 bytes",
        ),
        ({"traceparent": PARENT, "tracestate": "k=é"}, "tracestate", "printable ASCII"),
        ({"traceparent": PARENT, "tracestate": "k=\n"}, "tracestate", "printable ASCII"),
    ],
)
def test_a_malformed_context_names_its_field(fields: dict[str, Any], field: str, why: str) -> None:
    with pytest.raises(FieldError) as caught:
        trace.decode(fields)
    assert str(caught.value).startswith(f"{field}: ")
    assert why in str(caught.value)


def test_publish_takes_the_context_beside_its_record() -> None:
    op = bus.decode_op("publish", {"record": RECORD, "traceparent": PARENT, "tracestate": "a=1"})
    assert isinstance(op, bus.Publish)
    assert op.record.trace == TraceContext(PARENT, "a=1")
    assert "traceparent" not in op.record.stored()  # beside the record's text, not in it
    plain = bus.decode_op("publish", {"record": RECORD})
    assert isinstance(plain, bus.Publish) and plain.record.trace is None


def test_publish_batch_takes_a_context_per_record() -> None:
    op = bus.decode_op(
        "publish_batch",
        {"records": [RECORD, {"record": RECORD, "traceparent": PARENT}, {"record": RECORD}]},
    )
    assert isinstance(op, bus.PublishBatch)
    assert [r.trace for r in op.records] == [None, TraceContext(PARENT), None]
    assert len({r.stored() for r in op.records}) == 1  # the same record, however carried


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"records": [RECORD, {"record": RECORD, "traceparent": "x"}]}, "records[1].traceparent"),
        ({"records": [{"record": RECORD, "tracestate": "a=1"}]}, "records[0].tracestate"),
        ({"records": [{"record": {"payload": "{}"}}]}, "records[0].record.execution_id"),
        ({"records": [RECORD], "traceparent": PARENT}, "traceparent"),
        ({"records": [{"record": RECORD, "colour": 1}]}, "records[0].colour"),
        ({"records": [{"record": RECORD, "msg_id": 7}]}, "records[0].msg_id"),
    ],
)
def test_a_batch_names_the_record_whose_context_is_bad(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as caught:
        bus.decode_op("publish_batch", fields)
    assert str(caught.value).startswith(f"{field}: ")


def test_v1_records_carry_no_context() -> None:
    with pytest.raises(FieldError, match=r"^record\.traceparent: unknown field"):
        bus.decode_v1_record(json.dumps({**RECORD, "traceparent": PARENT}).encode())


tracestates = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)


@given(state=st.none() | tracestates)
def test_a_delivery_carries_the_context_before_its_record(state: str | None) -> None:
    """Any printable tracestate (quotes and backslashes too) makes valid JSON, and the
    hand-built delivery is the bytes its dict would encode to."""
    context = TraceContext(PARENT, state or None)
    handed = claim.Delivery(3, "commands.shared.shard.0", False, 1)
    encoded = claim.delivery(handed, '{"n":1}', context)
    head = {"sort_key": 3, "subject": "commands.shared.shard.0", "redelivered": False}
    head["deliveries"] = 1
    assert encoded == claim.with_record(head, '{"n":1}', context)
    expected = {**head, **context.as_fields(), "record": {"n": 1}}
    assert json.loads(encoded) == expected
    assert list(json.loads(encoded))[-1] == "record"


def test_a_record_without_context_is_delivered_without_its_keys() -> None:
    handed = claim.Delivery(3, "s", True, 2)
    assert not {"traceparent", "tracestate"} & set(json.loads(claim.delivery(handed, "{}")))
    assert claim.delivery(handed, "{}", None) == claim.delivery(handed, "{}")
    letter = json.loads(claim.dead_letter(3, "s", 2, "{}", TraceContext(PARENT)))
    assert letter["traceparent"] == PARENT and "tracestate" not in letter


def test_ack_and_nack_take_the_workers_context_and_extend_does_not() -> None:
    fields = {"sort_keys": [1, 2], "traceparent": PARENT}
    ack = claim.decode_op("ack", fields, named_groups=False)
    nack = claim.decode_op("nack", {**fields, "tracestate": "a=1"}, named_groups=False)
    assert isinstance(ack, claim.Ack) and ack.trace == TraceContext(PARENT)
    assert isinstance(nack, claim.Nack) and nack.trace == TraceContext(PARENT, "a=1")
    plain = claim.decode_op("ack", {"sort_key": 1}, named_groups=False)
    assert isinstance(plain, claim.Ack) and plain.trace is None
    with pytest.raises(FieldError, match=r"^traceparent: unknown field"):
        claim.decode_op("extend", fields, named_groups=False)
    with pytest.raises(FieldError, match=r"^traceparent: the trace id is all zeros"):
        claim.decode_op(
            "ack",
            {"sort_key": 1, "traceparent": f"00-{'0' * 32}-{'1' * 16}-01"},
            named_groups=False,
        )


@given(
    parent=st.from_regex(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-fA-F]{2}", fullmatch=True),
    state=st.none() | st.text(max_size=600),
)
def test_whatever_is_accepted_is_storable_and_comes_back_as_json(
    parent: str, state: str | None
) -> None:
    """Any traceparent and tracestate: refused naming the field, or accepted as text that
    encodes (SQLite stores it) and makes valid JSON members."""
    try:
        context = trace.decode({"traceparent": parent, "tracestate": state})
    except FieldError as exc:
        assert str(exc).split(":")[0] in ("traceparent", "tracestate")
        return
    assert context is not None
    context.traceparent.encode()
    assert json.loads(b"{" + context.json_members()[1:] + b"}") == context.as_fields()
