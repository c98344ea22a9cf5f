"""Every v2 op as a :class:`Call`: the request fields and how to read the reply into a
typed result. Both transports run these; nothing here does I/O."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import attrs

from cmdbus_trio.protocol import claim
from cmdbus_trio.protocol.bus import Published
from cmdbus_trio.protocol.tier import TierRecord

from .tracing import current_fields

_log = logging.getLogger("cmdbus_trio.client")
T = TypeVar("T")
Record = dict[str, Any]
"""A published record: ``{"execution_id": str | int, "payload": "<JSON text>",
"transaction_id"?: str}``."""


@attrs.frozen
class Call(Generic[T]):
    op: str
    fields: dict[str, Any]
    parse: Callable[[dict[str, Any]], T]
    idempotent: bool
    """Safe to send again when it is unknown whether the first attempt was carried out."""
    wait: float | None = None
    """Seconds the server may legitimately hold the reply (``next``'s ``timeout_ms``)."""
    after_loss: bool = attrs.field(
        default=attrs.Factory(lambda call: call.idempotent, takes_self=True)
    )
    """Safe to send again on a new connection once the writer was lost or said it is
    unavailable: what an idempotent call is, and a ``next`` (a lost connection gives its
    leases back, so asking again loses nothing)."""


# --- results ------------------------------------------------------------------------------


@attrs.frozen
class Delivery(claim.Delivery):
    """A record handed out by ``next``, and what the reply says of it: with the trace
    context it was published with, if any (:func:`cmdbus_trio.client.tracing.context_of`
    continues that trace)."""

    record: Record
    traceparent: str | None = None
    tracestate: str | None = None


@attrs.frozen
class DeadPage:
    """One page of dead letters; ask again with ``after=next_after`` until it is
    ``None``."""

    records: tuple[Delivery, ...]
    next_after: int | None


@attrs.frozen
class Lag:
    subjects: dict[str, int]
    total: int


@attrs.frozen
class Appended:
    global_sequence: int
    log_record_count: int
    deduplicated: bool


@attrs.frozen
class BatchAppended:
    appended: int
    """Records actually stored (deduplicated ones are not)."""
    requested: int
    results: tuple[Appended, ...]


@attrs.frozen
class Page:
    """One page of ``read_execution`` or ``scan``; ask again with ``after=next_after``
    until it is ``None``."""

    records: tuple[TierRecord, ...]
    next_after: int | None
    exists: bool | None = None
    """``read_execution`` only."""
    record_count: int | None = None
    """``read_execution`` only: the execution's records in the tier."""


@attrs.frozen
class Subscribed:
    sort_key: int
    subject: str
    record: Record
    traceparent: str | None = None
    tracestate: str | None = None


# --- readers --------------------------------------------------------------------------------


def _published(reply: dict[str, Any]) -> Published:
    return Published(
        reply["sort_key"], reply["subject"], reply["duplicate"], reply.get("evicted", False)
    )


def delivery(value: dict[str, Any]) -> Delivery:
    return Delivery(
        value["sort_key"],
        value["subject"],
        value["redelivered"],
        value["deliveries"],
        value["record"],
        value.get("traceparent"),
        value.get("tracestate"),
        lease=value.get("lease"),
    )


def _appended(reply: dict[str, Any]) -> Appended:
    return Appended(reply["global_sequence"], reply["log_record_count"], reply["deduplicated"])


def _page(reply: dict[str, Any]) -> Page:
    return Page(
        tuple(TierRecord(**record) for record in reply["records"]),
        reply["next_after"],
        reply.get("exists"),
        reply.get("record_count"),
    )


class Batch(list[Subscribed]):
    """One frame of a subscription: its records, and ``deleted_through`` when the writer's
    retention had deleted records after the cursor (the stream starts at the oldest kept;
    the first frame says so, with no records)."""

    deleted_through: int | None = None


def subscribed(reply: dict[str, Any]) -> Batch:
    batch = Batch(
        Subscribed(
            r["sort_key"], r["subject"], r["record"], r.get("traceparent"), r.get("tracestate")
        )
        for r in reply["records"]
    )
    batch.deleted_through = reply.get("deleted_through")
    return batch


def _options(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


# --- ingest faces ---------------------------------------------------------------------------


def new_msg_id() -> str:
    """A random ``msg_id`` (128 bits): what a publish that names none is sent with, so
    that sending it again after a lost connection never stores it twice."""
    return secrets.token_hex(16)


def publish(record: Record, msg_id: str | None = None) -> Call[Published]:
    """A publish, with the current span's trace context when there is one; a ``msg_id``
    of the client's own when the caller gives none (the caller's wins)."""
    fields = {"record": record, "msg_id": msg_id or new_msg_id()} | current_fields()
    return Call("publish", fields, _published, idempotent=True)


def publish_batch(records: Iterable[Record]) -> Call[list[int]]:
    """A batch, each record with a ``msg_id`` of the client's own (see :func:`publish`)
    and, with the current span's trace context, that context."""
    trace = current_fields()
    items = [{"record": r, "msg_id": new_msg_id(), **trace} for r in records]
    return Call(
        "publish_batch",
        {"records": items},
        lambda reply: list(reply["sort_keys"]),
        idempotent=True,
    )


# --- claim faces ------------------------------------------------------------------------


def next_delivery(
    filter: str,
    *,
    wait: float | None = None,
    group: str | None = None,
    start: str | None = None,
) -> Call[Delivery | None]:
    """``wait``: seconds to wait for a record (``None``: until one comes)."""
    return _next(
        _next_fields(filter, wait, group, start),
        lambda reply: None if reply["delivery"] is None else delivery(reply["delivery"]),
        wait,
    )


def next_batch(
    filter: str,
    most: int,
    *,
    wait: float | None = None,
    group: str | None = None,
    start: str | None = None,
) -> Call[list[Delivery]]:
    """Up to ``most`` (1..1,000) records as soon as one is there; ``wait`` as for
    :func:`next_delivery` (an empty list once it passes)."""
    return _next(
        {**_next_fields(filter, wait, group, start), "max": most},
        lambda reply: [delivery(value) for value in reply["deliveries"]],
        wait,
    )


def _next_fields(
    filter: str, wait: float | None, group: str | None, start: str | None
) -> dict[str, Any]:
    timeout_ms = None if wait is None else max(0, round(wait * 1000))
    return _options(filter=filter, group=group, timeout_ms=timeout_ms, **{"from": start})


def _next(
    fields: dict[str, Any], parse: Callable[[dict[str, Any]], T], wait: float | None
) -> Call[T]:
    wait = float("inf") if wait is None else wait
    return Call("next", fields, parse, idempotent=False, wait=wait, after_loss=True)


Settled = int | claim.Delivery
"""What a settle names: a :class:`Delivery` (its lease: a settle sent late, or again
after a reconnect, cannot settle a later lease of the record, another task's say), or
a sort key (whatever lease of it this connection holds)."""


def _lease(one: Settled) -> tuple[int, int | None]:
    """The sort key and lease token (None: any) that ``one`` names."""
    if isinstance(one, claim.Delivery):
        return one.sort_key, one.lease
    return one, None


def _settling(
    op: str, settled: Sequence[Settled], group: str | None, **fields: Any
) -> Call[list[bool]]:
    name = claim.SETTLED_FIELD[op]
    named = [_lease(one) for one in settled]
    leases = [lease for _, lease in named]
    return Call(
        op,
        _options(
            sort_keys=[key for key, _ in named],
            leases=leases if any(lease is not None for lease in leases) else None,
            group=group,
            **fields,
        )
        | _worker_trace(op),
        lambda reply: [bool(outcome) for outcome in _told_why(op, named, reply)[name]],
        idempotent=True,
    )


def _settle_one(op: str, one: Settled, group: str | None, **fields: Any) -> Call[bool]:
    name = claim.SETTLED_FIELD[op]
    sort_key, lease = _lease(one)
    return Call(
        op,
        _options(sort_key=sort_key, lease=lease, group=group, **fields) | _worker_trace(op),
        lambda reply: bool(_told_why(op, [(sort_key, lease)], reply)[name]),
        idempotent=True,
    )


def _told_why(op: str, named: Sequence[tuple[int, int | None]], reply: Any) -> Any:
    """Log (debug) why the writer refused a settle of the records, where it says."""
    why = reply.get("why")
    for (sort_key, _), reason in zip(named, why if isinstance(why, list) else [why]):  # noqa: B905
        if reason is not None:  # (a log only: a list too short is no error)
            _log.debug("%s of sort_key %s refused: %s", op, sort_key, reason)
    return reply


def _worker_trace(op: str) -> dict[str, str]:
    """An ack's or nack's trace context: the worker's current span (an extend has none)."""
    return {} if op == "extend" else current_fields()


def ack_many(settled: Sequence[Settled], group: str | None = None) -> Call[list[bool]]:
    """Ack up to 1,000 records in one request (one group commit): for each, in order,
    whether this connection held it (by that lease, for a :class:`Delivery`)."""
    return _settling("ack", settled, group)


def nack_many(
    settled: Sequence[Settled], group: str | None = None, delay: float | None = None
) -> Call[list[bool]]:
    return _settling("nack", settled, group, delay_ms=_delay_ms(delay))


def extend_many(settled: Sequence[Settled], group: str | None = None) -> Call[list[bool]]:
    return _settling("extend", settled, group)


def ack(settled: Settled, group: str | None = None) -> Call[bool]:
    return _settle_one("ack", settled, group)


def nack(settled: Settled, group: str | None = None, delay: float | None = None) -> Call[bool]:
    return _settle_one("nack", settled, group, delay_ms=_delay_ms(delay))


def extend(settled: Settled, group: str | None = None) -> Call[bool]:
    return _settle_one("extend", settled, group)


def _delay_ms(delay: float | None) -> int | None:
    return None if delay is None else max(0, round(delay * 1000))


def lag(filter: str | None = None, group: str | None = None) -> Call[Lag]:
    return Call(
        "lag",
        _options(filter=filter, group=group),
        lambda r: Lag(dict(r["subjects"]), r["total"]),
        idempotent=True,
    )


def dead(
    filter: str | None = None,
    group: str | None = None,
    limit: int | None = None,
    after: int | None = None,
) -> Call[DeadPage]:
    return Call(
        "dead",
        _options(filter=filter, group=group, limit=limit, after=after),
        lambda r: DeadPage(tuple(delivery(d) for d in r["records"]), r["next_after"]),
        idempotent=True,
    )


def move_dead(
    op: str, sort_keys: Sequence[int] | None, filter: str | None, group: str | None
) -> Call[int]:
    """``requeue`` or ``purge``: safe to repeat (a dead letter moves once)."""
    keys = None if sort_keys is None else list(sort_keys)
    return Call(
        op,
        _options(sort_keys=keys, filter=filter, group=group),
        lambda r: int(r[f"{op}d"]),
        idempotent=True,
    )


def delete_group(group: str) -> Call[bool]:
    return Call("delete_group", {"group": group}, lambda r: bool(r["deleted"]), idempotent=True)


# --- tier face ----------------------------------------------------------------------------


def append(
    execution_id: str | int,
    payload: str,
    *,
    tier: str | None = None,
    transaction_id: str | None = None,
    expected_version: int | None = None,
) -> Call[Appended]:
    fields = _options(
        execution_id=execution_id,
        payload=payload,
        tier=tier,
        transaction_id=transaction_id,
        expected_version=expected_version,
    )
    # With expected_version a second attempt of a stored append gets `conflict`, not a
    # duplicate: safe to retry.
    return Call("append", fields, _appended, idempotent=expected_version is not None)


def append_batch(
    execution_id: str | int,
    payloads: Iterable[str],
    *,
    tier: str | None = None,
    transaction_id: str | None = None,
) -> Call[BatchAppended]:
    def parse(reply: dict[str, Any]) -> BatchAppended:
        results = tuple(_appended(item["body"]) for item in reply["results"])
        return BatchAppended(reply["appended"], reply["requested"], results)

    fields = _options(
        execution_id=execution_id, payloads=list(payloads), tier=tier, transaction_id=transaction_id
    )
    return Call("append_batch", fields, parse, idempotent=False)


def delete_execution(execution_id: str | int, *, tier: str | None = None) -> Call[int]:
    fields = _options(execution_id=execution_id, tier=tier)
    return Call("delete_execution", fields, lambda r: int(r["deleted"]), idempotent=True)


def read_execution(
    execution_id: str | int,
    *,
    tier: str | None = None,
    after: int | None = None,
    limit: int | None = None,
) -> Call[Page]:
    fields = _options(execution_id=execution_id, tier=tier, after=after, limit=limit)
    return Call("read_execution", fields, _page, idempotent=True)


def scan(
    *, tier: str | None = None, after: int | None = None, limit: int | None = None
) -> Call[Page]:
    return Call("scan", _options(tier=tier, after=after, limit=limit), _page, idempotent=True)


def tier_health() -> Call[dict[str, Any]]:
    return Call("health", {}, dict, idempotent=True)


def subscribe(start: int = 0, filter: str | None = None) -> Call[Batch]:
    """Each frame of the stream reads into a :class:`Batch` of records."""
    return Call(
        "subscribe",
        _options(filter=filter, **{"from": start}),
        subscribed,
        idempotent=False,
        after_loss=True,  # again after the last record received (the client's)
        wait=float("inf"),
    )
