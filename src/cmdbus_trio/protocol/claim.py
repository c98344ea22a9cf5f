"""The claim faces' requests and replies, both dialects (docs/protocol.md, "Command
claim", "Event claim").

Decoding checks every field but ``group`` and ``from`` and names the bad one; it never
touches a coordinator. ``group`` and ``from`` are handed on as sent: which group they name
(and whether it may be created) is for the bus's consumer groups to resolve
(``bus.groups.ConsumerGroups.resolve``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from ._envelope import encode_ok
from ._fields import I64_MAX, FieldError, UnsupportedOp, is_int, whole_number
from ._json import dumps, dumps_str, loads
from .subjects import parse_filter
from .trace import TraceContext
from .trace import decode as decode_trace

OPS: Final = ("next", "ack", "nack", "extend", "lag", "dead", "requeue", "purge")
"""The command claim face's v2 ops."""
GROUP_OPS: Final = (*OPS, "delete_group")
"""The event claim face's v2 ops (named groups)."""
MAX_DEAD_LIMIT: Final = 1000
DEFAULT_DEAD_LIMIT: Final = 100
MAX_SORT_KEYS: Final = 1000
"""Sort keys one ``requeue`` or ``purge`` may name."""
MAX_CLAIM_BATCH: Final = 1000
"""Records one ``next`` may take (``max``), and sort keys one ``ack``, ``nack`` or
``extend`` may settle (``sort_keys``)."""

LEASE_MAX: Final = (1 << 53) - 1
"""Lease tokens stay within what every JSON reader holds exactly."""
_SETTLING: Final = frozenset({"sort_key", "sort_keys", "lease", "leases", "group"})
_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    "next": frozenset({"filter", "group", "from", "member", "timeout_ms", "max"}),
    # The settling worker's trace context: the writer's ack or nack span is its child.
    # `lease` / `leases`: the token each delivery came with, so that a settle sent late
    # (or again, after a reconnect) cannot settle a later lease of the same record.
    "ack": frozenset({*_SETTLING, "traceparent", "tracestate"}),
    "nack": frozenset({*_SETTLING, "delay_ms", "traceparent", "tracestate"}),
    "extend": _SETTLING,
    "lag": frozenset({"filter", "group"}),
    "dead": frozenset({"filter", "group", "after", "limit"}),
    "requeue": frozenset({"sort_keys", "filter", "group"}),
    "purge": frozenset({"sort_keys", "filter", "group"}),
    "delete_group": frozenset({"group"}),
}


@attrs.frozen
class Delivery:
    """What a ``next`` reply says of the record it hands out, besides the record."""

    sort_key: int
    subject: str
    redelivered: bool
    deliveries: int
    """Times it was handed out, this time included."""
    lease: int | None = attrs.field(default=None, kw_only=True, eq=False)
    """The token of this delivery's lease, unique in the writer's life (and, being
    random, across its restarts): a settle that names it settles this lease only. None
    where none is given (v1, dead letters). Not compared: two deliveries are equal when
    they hand out the same record the same way, whatever their random tokens."""


@attrs.frozen
class Next:
    group: Any
    start: Any
    """The request's ``from``: where a group it creates starts."""
    filter: tuple[str, ...]
    timeout_ms: int | None
    max: int | None = None
    """Take up to this many records (the reply's ``deliveries``); None: one
    (``delivery``)."""
    op = "next"


LeaseTokens = tuple[int | None, ...] | None
"""The lease token a settle names for each of its sort keys (None: any lease this
connection holds), or None when it names none."""


@attrs.frozen
class Ack:
    group: Any
    sort_keys: tuple[int, ...]
    many: bool = False
    """Named by ``sort_keys`` (the reply is a list, in their order), not ``sort_key``."""
    trace: TraceContext | None = None
    """The acking worker's context (its span is the parent of the writer's)."""
    leases: LeaseTokens = None
    op = "ack"


@attrs.frozen
class Nack:
    group: Any
    sort_keys: tuple[int, ...]
    delay_ms: int
    many: bool = False
    trace: TraceContext | None = None
    leases: LeaseTokens = None
    op = "nack"


@attrs.frozen
class Extend:
    group: Any
    sort_keys: tuple[int, ...]
    many: bool = False
    leases: LeaseTokens = None
    op = "extend"


@attrs.frozen
class Lag:
    group: Any
    filter: tuple[str, ...] | None
    op = "lag"


@attrs.frozen
class Dead:
    group: Any
    filter: str | None
    """As the store's queries take it (the tokens joined by dots)."""
    after: int
    limit: int
    op = "dead"


@attrs.frozen
class MoveDead:
    """``requeue`` or ``purge``: the dead letters named by ``sort_keys``, else those
    matching ``filter``."""

    op: str
    group: Any
    sort_keys: tuple[int, ...] | None
    filter: str | None

    @property
    def requeue(self) -> bool:
        return self.op == "requeue"


@attrs.frozen
class DeleteGroup:
    group: str
    op = "delete_group"


ClaimRequest = Next | Ack | Nack | Extend | Lag | Dead | MoveDead | DeleteGroup


def decode_op(op: str, fields: Mapping[str, Any], *, named_groups: bool) -> ClaimRequest:
    """The v2 request for ``op`` from its fields. ``named_groups``: the event claim face,
    which also knows ``delete_group``.

    Error handling: :class:`UnsupportedOp` for an op the face does not know,
    :class:`FieldError` naming the first bad field.
    """
    known = _FIELDS.get(op)
    if known is None or (op == "delete_group" and not named_groups):
        raise UnsupportedOp(op, GROUP_OPS if named_groups else OPS)
    if unknown := sorted(set(fields) - known):
        raise FieldError(unknown[0], "unknown field")
    group = fields.get("group")
    if op == "next":
        tokens = parse_filter(fields.get("filter"))
        return Next(group, fields.get("from"), tokens, _timeout(fields), _max(fields))
    if op == "ack":
        keys, many, leases = _settling(fields)
        return Ack(group, keys, many, decode_trace(fields), leases)
    if op == "extend":
        keys, many, leases = _settling(fields)
        return Extend(group, keys, many, leases)
    if op == "nack":
        keys, many, leases = _settling(fields)
        delay_ms = whole_number(fields.get("delay_ms", 0), "delay_ms")
        return Nack(group, keys, delay_ms, many, decode_trace(fields), leases)
    if op == "lag":
        return Lag(group, None if fields.get("filter") is None else parse_filter(fields["filter"]))
    if op == "dead":
        after = whole_number(fields.get("after", 0), "after")
        limit = fields.get("limit", DEFAULT_DEAD_LIMIT)
        if not is_int(limit):
            raise FieldError("limit", "expected an integer")
        return Dead(group, _filter_text(fields), after, max(1, min(MAX_DEAD_LIMIT, limit)))
    if op in ("requeue", "purge"):
        return MoveDead(op, group, _sort_keys(fields), _filter_text(fields))
    if not isinstance(group, str):
        raise FieldError("group", "expected the name of a consumer group")
    return DeleteGroup(group)


@attrs.frozen
class V1Next:
    group: Any
    filter: tuple[str, ...]


@attrs.frozen
class V1Ack:
    group: Any
    sort_key: int


@attrs.frozen
class V1Nack:
    group: Any
    sort_key: int


def decode_v1(frame: bytes) -> V1Next | V1Ack | V1Nack:
    """A v1 request: ``{"Next": {filter, member}}``, ``{"Ack": {sort_key}}`` or
    ``{"Nack": {sort_key}}``, each with an optional ``group``.

    Error handling: :class:`FieldError`, or the JSON decoder's error for a frame that is
    not JSON; v1 answers either by closing the connection.
    """
    value = loads(frame)
    if not (isinstance(value, dict) and len(value) == 1):
        raise FieldError("request", 'expected {"Next"|"Ack"|"Nack": {...}}')
    ((tag, body),) = value.items()
    if not isinstance(body, dict):
        raise FieldError(tag, "expected an object")
    group = body.get("group")
    if tag == "Next":
        tokens = parse_filter(body.get("filter"))
        member = body.get("member")
        if not (is_int(member) and 0 <= member < 1 << 32):
            raise FieldError("member", "expected an unsigned 32-bit integer")
        return V1Next(group, tokens)
    if tag == "Ack":
        return V1Ack(group, sort_key(body))
    if tag == "Nack":
        return V1Nack(group, sort_key(body))
    raise FieldError("request", f"unknown request {tag!r}")


def sort_key(fields: Mapping[str, Any]) -> int:
    return whole_number(fields.get("sort_key"), "sort_key", lowest=1)


def _max(fields: Mapping[str, Any]) -> int | None:
    value = fields.get("max")
    if value is None:
        return None
    if not (is_int(value) and 1 <= value <= MAX_CLAIM_BATCH):
        raise FieldError("max", f"expected an integer in 1..{MAX_CLAIM_BATCH}")
    return int(value)


def _settling(fields: Mapping[str, Any]) -> tuple[tuple[int, ...], bool, LeaseTokens]:
    """The records an ``ack``, ``nack`` or ``extend`` names: ``sort_key`` (with its
    ``lease``), or a list in ``sort_keys`` (then True: the reply is a list; with
    ``leases``, a token or null for each, in order)."""
    keys = fields.get("sort_keys")
    if keys is None:
        if "leases" in fields:
            raise FieldError("leases", "goes with sort_keys; with sort_key, name its lease")
        lease = fields.get("lease")
        return (sort_key(fields),), False, None if lease is None else (_lease(lease, "lease"),)
    if "sort_key" in fields:
        raise FieldError("sort_keys", "name either sort_key or sort_keys, not both")
    if "lease" in fields:
        raise FieldError("lease", "goes with sort_key; with sort_keys, name leases")
    sort_keys = _key_list(keys, 1, MAX_CLAIM_BATCH)
    leases = fields.get("leases")
    if leases is None:
        return sort_keys, True, None
    if not (isinstance(leases, list) and len(leases) == len(sort_keys)):
        raise FieldError("leases", "expected a list as long as sort_keys")
    return sort_keys, True, tuple(None if one is None else _lease(one, "leases") for one in leases)


def _lease(value: Any, field: str) -> int:
    if not (is_int(value) and 0 <= value <= LEASE_MAX):
        raise FieldError(field, f"expected a lease token, an integer in 0..{LEASE_MAX}")
    return int(value)


def _timeout(fields: Mapping[str, Any]) -> int | None:
    timeout_ms = fields.get("timeout_ms")
    return None if timeout_ms is None else whole_number(timeout_ms, "timeout_ms")


def _filter_text(fields: Mapping[str, Any]) -> str | None:
    """The optional ``filter``, checked, as the store's queries take it."""
    value = fields.get("filter")
    return None if value is None else ".".join(parse_filter(value))


def _sort_keys(fields: Mapping[str, Any]) -> tuple[int, ...] | None:
    keys = fields.get("sort_keys")
    if (keys is None) == (fields.get("filter") is None):
        raise FieldError("sort_keys", "name either sort_keys (a list) or filter")
    if keys is None:
        return None
    return _key_list(keys, 0, MAX_SORT_KEYS)


def _key_list(keys: Any, least: int, most: int) -> tuple[int, ...]:
    """``sort_keys``: a list of ``least`` to ``most`` sort keys."""
    if not (
        isinstance(keys, list)
        and least <= len(keys) <= most
        and all(is_int(key) and 1 <= key <= I64_MAX for key in keys)
    ):
        count = f"{least} to {most}" if least else f"at most {most}"
        raise FieldError("sort_keys", f"expected a list of {count} integers in 1..{I64_MAX}")
    return tuple(keys)


# --- replies -------------------------------------------------------------------------------


def with_record(head: dict[str, Any], record: str, trace: TraceContext | None = None) -> bytes:
    """``head`` as a JSON object with ``"record"`` last, the record's trace context (if
    any) before it: the stored JSON text spliced in, never decoded and encoded again
    (that took ~6 ms of the loop for a 0.9 MiB record)."""
    members = b"" if trace is None else trace.json_members()
    return b"".join((dumps(head)[:-1], members, b',"record":', record.encode(), b"}"))


def delivery(handed: Delivery, record: str, trace: TraceContext | None = None) -> bytes:
    """A delivery as v2 ``next`` replies carry it, ``record`` the stored JSON text and
    ``trace`` the context it was published with (no members when None).

    Built from string pieces rather than by encoding a dict: this runs once per record a
    ``next`` hands out, on the loop (in a batch of 64 the dict's encoding was a tenth of
    the loop's time). The bytes are those of :func:`with_record` of that dict (a
    property test checks it)."""
    redelivered = "true" if handed.redelivered else "false"
    head = (
        f'{{"sort_key":{int(handed.sort_key)},"subject":{dumps_str(handed.subject)},'
        f'"redelivered":{redelivered},"deliveries":{int(handed.deliveries)}'
    )
    if handed.lease is not None:
        head += f',"lease":{int(handed.lease)}'
    members = b"" if trace is None else trace.json_members()
    return b"".join(
        (head.encode("utf-8", "backslashreplace"), members, b',"record":', record.encode(), b"}")
    )


def dead_letter(
    sort_key: int, subject: str, deliveries: int, record: str, trace: TraceContext | None = None
) -> bytes:
    """A dead letter as ``dead`` pages list it, ``record`` the stored JSON text."""
    return with_record(
        {
            "sort_key": sort_key,
            "subject": subject,
            "redelivered": deliveries > 1,
            "deliveries": deliveries,
        },
        record,
        trace,
    )


SETTLED_FIELD = {"ack": "acked", "nack": "nacked", "extend": "extended"}
"""The reply field of each settle op."""


def settled_reply(
    request_id: int,
    name: str,
    outcomes: Sequence[bool],
    many: bool,
    why: Sequence[str | None] | None = None,
    **extra: Any,
) -> bytes:
    """The reply to an ``ack`` (``name`` ``acked``), ``nack`` or ``extend``: the outcome
    of each sort key in order when the request named ``sort_keys`` (``many``), else of
    its one ``sort_key``; ``why`` each one was refused (null for one settled), where one
    was; ``extra`` fields after it."""
    body: dict[str, Any] = {name: list(outcomes) if many else outcomes[0]}
    if why is not None:
        body["why"] = list(why) if many else why[0]
    return encode_ok(request_id, body | extra)


def deliveries_reply(request_id: int, body: dict[str, Any], handed: Sequence[bytes]) -> bytes:
    """A v2 ``next`` reply with ``max``: ``body``'s fields and the deliveries
    (:func:`delivery`), in the order they were leased."""
    head = encode_ok(request_id, body)[:-1]
    return b"".join((head, b',"deliveries":[', b",".join(handed), b"]}"))


def next_reply(request_id: int, body: dict[str, Any], handed: bytes | None) -> bytes:
    """A v2 ``next`` reply: ``body``'s fields and the delivery (:func:`delivery`, or None
    for null)."""
    if handed is None:
        return encode_ok(request_id, {**body, "delivery": None})
    return b"".join((encode_ok(request_id, body)[:-1], b',"delivery":', handed, b"}"))
