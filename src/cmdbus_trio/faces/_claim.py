"""What the two claim faces share (PROTOCOL.md, "Claim faces"): competing consumers
with leases, in both dialects.

Each connection has its own handler: the leases it holds are released the moment it
closes. ``next`` waits in memory (no thread, no polling) for a matching record, leases it,
and, under a Gate slot, has its body read from the store with the other bodies asked for
meanwhile (:mod:`cmdbus_trio.bus.bodies`). ``ack`` is durable before it is answered: it
goes through the group committer like a publish. A face gives the handler a *resolver*
from the request's ``group`` (and ``from``) to the coordinator to use.

On a group the connection already uses, an ``ack``, and a ``next`` that finds a record
and a Gate slot at once, are answered by a callback (a :class:`Deferred`) instead of a
task: the same steps, without waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from cmdbus_trio.admission import GateClosed, Shed
from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.claims import Claims, Delivery
from cmdbus_trio.bus.committer import Ticket
from cmdbus_trio.protocol import (
    FieldError,
    Request,
    UnsupportedOp,
    dumps,
    encode_frame,
    encode_ok,
    is_int,
    loads,
)
from cmdbus_trio.protocol import tier as tier_codec
from cmdbus_trio.protocol.subjects import parse_filter
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage.buslog import DEAD_KEYS_PAGE, DeadRecord, StoredRecord

from . import FaceContext
from ._connection import CloseConnection, Deferred, V1Reply, checked_pages

Resolve = Callable[[Any, Any], Awaitable[Claims]]
"""(group field, from field) -> the group's coordinator; raises FieldError."""
Delete = Callable[[str], Awaitable[bool]]
"""group name -> deleted (False: no such group)."""

OPS = ("next", "ack", "nack", "extend", "lag", "dead", "requeue", "purge")
GROUP_OPS = (*OPS, "delete_group")
_FIELDS: dict[str, frozenset[str]] = {
    "next": frozenset({"filter", "group", "from", "member", "timeout_ms"}),
    "ack": frozenset({"sort_key", "group"}),
    "nack": frozenset({"sort_key", "group", "delay_ms"}),
    "extend": frozenset({"sort_key", "group"}),
    "lag": frozenset({"filter", "group"}),
    "dead": frozenset({"filter", "group", "after", "limit"}),
    "requeue": frozenset({"sort_keys", "filter", "group"}),
    "purge": frozenset({"sort_keys", "filter", "group"}),
    "delete_group": frozenset({"group"}),
}
MAX_DEAD_LIMIT = 1000


class ClaimHandler:
    gated_ops = frozenset({"dead", "requeue", "purge"})
    """``next`` is not among them: it takes its Gate slot only once a record is there,
    so a consumer parked in ``next`` holds no intake place (see :meth:`_next`)."""
    large_reply_ops = frozenset({"dead"})

    def __init__(
        self, ctx: FaceContext, bus: Bus, resolve: Resolve, delete: Delete | None = None
    ) -> None:
        self.gate = ctx.gate
        self.max_reply = ctx.config.max_reply_bytes
        self.bus = bus
        self.resolve = resolve
        self.delete = delete  # named groups only (the event claim face)
        self._used: dict[str, Claims] = {}  # the groups this connection claimed from
        self._resolved: dict[str | None, Claims] = {}  # group field -> its coordinator

    async def _claims(self, group: Any, start: Any = None) -> Claims:
        claims = await self.resolve(group, start)
        self._used[claims.group] = claims
        if start is None and (group is None or isinstance(group, str)):
            self._resolved[group] = claims  # until it is deleted
        return claims

    def holding(self) -> bool:
        return any(claims.holds(self) for claims in self._used.values())

    def closed(self) -> None:
        for claims in self._used.values():
            claims.release(self)  # this connection's leases redeliver at once

    # --- v1 --------------------------------------------------------------------------------

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        try:
            value = loads(frame)
            if not (isinstance(value, dict) and len(value) == 1):
                raise FieldError("request", 'expected {"Next"|"Ack"|"Nack": {...}}')
            ((tag, body),) = value.items()
            if not isinstance(body, dict):
                raise FieldError(tag, "expected an object")
            if tag == "Next":
                filter_tokens = parse_filter(body.get("filter"))
                member = body.get("member")
                if not (is_int(member) and 0 <= member < 1 << 32):
                    raise FieldError("member", "expected an unsigned 32-bit integer")
            elif tag in ("Ack", "Nack"):
                sort_key = _sort_key(body)
            else:
                raise FieldError("request", f"unknown request {tag!r}")
            if tag != "Nack" or body.get("group") is not None:
                claims = await self._claims(body.get("group"))
        except FieldError:
            raise CloseConnection("protocol_error") from None
        except Exception as exc:  # not JSON
            raise CloseConnection("protocol_error") from exc
        if tag == "Next":
            try:
                delivery, stored = await self._next(claims, filter_tokens, None, patient=True)
            except GateClosed:
                raise CloseConnection("closed") from None  # draining: v1 can only close
            except StoreUnavailable:
                raise CloseConnection("unavailable") from None  # v1 has no error frame
            reply = {
                "sort_key": delivery.sort_key,
                "redelivered": delivery.redelivered,
                "record": _record(stored),
            }
            return V1Reply("next", encode_frame(dumps(reply)))
        if tag == "Ack":
            try:
                await self._ack(claims, sort_key)
            except StoreUnavailable:
                raise CloseConnection("unavailable") from None  # not durable: redelivered
            return V1Reply("ack", encode_frame(b"1"))
        # v1 Nack: the record redelivers after ack_wait, in whichever group this
        # connection holds it when the request names none.
        for group in [claims] if body.get("group") is not None else self._used.values():
            group.nack(sort_key, self, delay=group.ack_wait)
        return V1Reply("nack", encode_frame(b"1"))

    # --- v2 --------------------------------------------------------------------------------

    def v2(self, request: Request, arrival: float) -> Awaitable[bytes] | Deferred:
        known = _FIELDS.get(request.op)
        if known is None or (request.op == "delete_group" and self.delete is None):
            raise UnsupportedOp(request.op, OPS if self.delete is None else GROUP_OPS)
        if unknown := sorted(set(request.fields) - known):
            raise FieldError(unknown[0], "unknown field")
        # A group this connection has used already, and nothing to wait for: answered by
        # a callback, without a task (a task per request was much of the loop's time).
        fields = request.fields
        group = fields.get("group")
        claims = self._resolved.get(group) if group is None or isinstance(group, str) else None
        if claims is not None and claims.deleted:
            del self._resolved[group]
            claims = None
        if claims is not None and request.op == "ack":
            return self._ack_deferred(request.id, claims, _sort_key(fields))
        budget = None if request.deadline_ms is None else request.deadline_ms / 1000
        if claims is not None and request.op == "next" and fields.get("from") is None:
            filter_tokens = parse_filter(fields.get("filter"))
            _timeout_ms(fields)
            ready = self._next_now(request.id, claims, filter_tokens, budget)
            if ready is not None:
                return ready
        return self._v2(request.op, request.id, fields, budget, arrival)

    async def _v2(
        self,
        op: str,
        request_id: int,
        fields: dict[str, Any],
        budget: float | None,
        arrival: float,
    ) -> bytes:
        if op == "delete_group":
            group = fields.get("group")
            if not isinstance(group, str) or self.delete is None:
                raise FieldError("group", "expected the name of a consumer group")
            return encode_ok(request_id, {"deleted": await self.delete(group)})
        claims = await self._claims(fields.get("group"), fields.get("from"))
        if op == "next":
            filter_tokens = parse_filter(fields.get("filter"))
            timeout_ms = _timeout_ms(fields)
            result: Any = None
            with trio.move_on_after(float("inf") if timeout_ms is None else timeout_ms / 1000):
                delivery, stored = await self._next(claims, filter_tokens, budget)
                result = _delivery(delivery, stored)
            body: dict[str, Any] = {"delivery": result}
            if fields.get("from") == "beginning" and (deleted := self.bus.log.deleted_through):
                body["deleted_through"] = deleted  # the group starts at the oldest kept
            return encode_ok(request_id, body)
        if op == "lag":
            tokens = None if fields.get("filter") is None else parse_filter(fields["filter"])
            subjects = await claims.backlog(tokens)
            return encode_ok(request_id, {"subjects": subjects, "total": sum(subjects.values())})
        if op == "dead":
            return await self._dead(request_id, claims, fields, budget, arrival)
        if op in ("requeue", "purge"):
            moved = await self._move_dead(claims, op, fields, budget, arrival)
            return encode_ok(request_id, {f"{op}d": moved})
        sort_key = _sort_key(fields)
        if op == "ack":
            return encode_ok(request_id, {"acked": await self._ack(claims, sort_key)})
        if op == "nack":
            delay_ms = fields.get("delay_ms", 0)
            if not (is_int(delay_ms) and delay_ms >= 0):
                raise FieldError("delay_ms", "expected a non-negative integer")
            return encode_ok(request_id, {"nacked": claims.nack(sort_key, self, delay_ms / 1000)})
        extended = claims.extend(sort_key, self)
        return encode_ok(
            request_id, {"extended": extended, "lease_ms": round(claims.ack_wait * 1000)}
        )

    # --- shared ----------------------------------------------------------------------------

    async def _next(
        self,
        claims: Claims,
        filter_tokens: tuple[str, ...],
        budget: float | None,
        *,
        patient: bool = False,
    ) -> tuple[Delivery, StoredRecord]:
        """Wait for a matching record, then read its body under a Gate slot.

        The wait for a record is the client's (``timeout_ms``, or unbounded): the Gate
        and the request's budget see the request only once a record is handed to it, so
        a parked consumer holds no slot, and its budget is not spent by waiting. A
        ``next`` that is then shed gives its record back as if it had never been
        delivered (its delivery count restored, not ``redelivered``).

        Error handling: :class:`Shed` when admission refuses, unless ``patient`` (v1,
        which has no way to say ``busy``): then it waits ``retry_after`` and tries again.
        """
        while True:
            delivery = await claims.next(filter_tokens, self)
            try:
                slot = await self.gate.acquire("next", budget=budget)
            except Shed as shed:
                claims.give_back(delivery.sort_key, self)
                if not patient:
                    raise
                await trio.sleep((shed.retry_after_ms or 1000 * self.gate.shed_after) / 1000)
                continue
            except BaseException:
                claims.give_back(delivery.sort_key, self)
                raise
            with slot:
                try:
                    # A record leased is read whatever else is cancelled (a batch takes a
                    # hop, not a client's patience).
                    with trio.CancelScope(shield=True):
                        stored = await self.bus.bodies.read(delivery.sort_key)
                except LookupError:
                    if delivery.sort_key > claims.evicted_through:  # a bug: internal
                        claims.give_back(delivery.sort_key, self)
                        raise
                    # Evicted (CMDBUS_EVT_MAX_BYTES) while this waited for its Gate slot:
                    # the group forgot and counted it; take the next one.
                    continue
                except BaseException:
                    claims.give_back(delivery.sort_key, self)  # never delivered
                    raise
            return delivery, stored

    def _next_now(
        self,
        request_id: int,
        claims: Claims,
        filter_tokens: tuple[str, ...],
        budget: float | None,
    ) -> Deferred | None:
        """``next`` when a matching record and a Gate slot are there now: leased, its body
        read with the others asked for meanwhile, answered by the reader's callback.
        None when it would have to wait (for a record or a slot): a task does that."""
        if claims.closed or not self.gate.can_admit_now or not claims.has(filter_tokens):
            return None
        slot = self.gate.acquire_nowait("next", budget=budget)  # a slot is free
        delivery = claims.next_nowait(filter_tokens, self)
        assert delivery is not None  # has() said so, and nothing ran in between
        reply = Deferred()

        def read(outcome: StoredRecord | Exception) -> None:
            slot.release()
            if isinstance(outcome, Exception):
                claims.give_back(delivery.sort_key, self)
                reply.settle(outcome)
            else:
                reply.settle(encode_ok(request_id, {"delivery": _delivery(delivery, outcome)}))

        self.bus.bodies.read_then(delivery.sort_key, read)
        return reply

    def _start_ack(
        self, claims: Claims, sort_key: int, then: Callable[[Ticket], None] | None = None
    ) -> Ticket | None:
        """Make the ack of a record this connection holds durable (None: it holds no
        record by that key): group-committed like a publish. Once the commit settles,
        the claim index forgets the record, or redelivers it if the commit failed; then
        ``then`` is called with the ticket."""
        if not claims.begin_ack(sort_key, self):
            return None

        def settled(ticket: Ticket) -> None:
            if ticket.error is None:
                claims.finish_ack(sort_key)
            else:
                claims.abort_ack(sort_key)
            if then is not None:
                then(ticket)

        ticket = Ticket(acks=[(claims.group, sort_key)], on_settled=settled)
        self.bus.committer.enqueue(ticket)
        return ticket

    async def _ack(self, claims: Claims, sort_key: int) -> bool:
        ticket = self._start_ack(claims, sort_key)
        if ticket is None:
            return False
        with trio.CancelScope(shield=True):  # an ack that started finishes
            await ticket.wait()
        return True

    def _ack_deferred(self, request_id: int, claims: Claims, sort_key: int) -> Deferred:
        """``_ack`` answered by the committer's callback instead of a task."""
        reply = Deferred()

        def answer(ticket: Ticket) -> None:
            acked = encode_ok(request_id, {"acked": True})
            reply.settle(acked if ticket.error is None else ticket.error)

        if self._start_ack(claims, sort_key, answer) is None:
            reply.settle(encode_ok(request_id, {"acked": False}))
        return reply

    # --- dead letters ------------------------------------------------------------------------

    async def _dead(
        self,
        request_id: int,
        claims: Claims,
        fields: dict[str, Any],
        budget: float | None,
        arrival: float,
    ) -> bytes:
        """A page of dead letters, filtered in the query and encoded in the thread (the
        stored records spliced in, never decoded), bounded by ``limit`` and the reply cap
        like ``read_execution``."""
        filter_text = _filter_text(fields)
        after = fields.get("after", 0)
        if not (is_int(after) and after >= 0):
            raise FieldError("after", "expected a non-negative integer")
        limit = fields.get("limit", 100)
        if not is_int(limit):
            raise FieldError("limit", "expected an integer")
        limit = max(1, min(MAX_DEAD_LIMIT, limit))
        head = {"id": request_id, "ok": True}
        with await self.gate.acquire("dead", budget=budget, arrival=arrival) as slot:
            return await slot.run_cancellable(
                self._dead_page, claims.group, filter_text, after, limit, head
            )

    def _dead_page(
        self, group: str, filter_text: str | None, after: int, limit: int, head: dict[str, Any]
    ) -> bytes:
        with contextlib.closing(
            self.bus.log.iter_dead(group, after=after, filter=filter_text)
        ) as pages:
            fragments = (
                tier_codec.Fragments.of((dead.sort_key, _dead_fragment(dead)) for dead in page)
                for page in checked_pages(pages)
            )
            return tier_codec.page(
                head, fragments, limit=limit, max_reply=self.max_reply, name="dead letter"
            )

    async def _move_dead(
        self,
        claims: Claims,
        op: str,
        fields: dict[str, Any],
        budget: float | None,
        arrival: float,
    ) -> int:
        """Requeue or purge the dead letters named by ``sort_keys`` or matched by
        ``filter``, durably, in transactions of up to 1,000; returns how many were still
        dead (and so moved).

        Cancellation: a transaction that started is committed and its records requeued in
        memory (shielded): the store and the coordinator never disagree. One cut short by
        its budget keeps what it did; the reply is then ``deadline``.
        """
        sort_keys = fields.get("sort_keys")
        if (sort_keys is None) == (fields.get("filter") is None):
            raise FieldError("sort_keys", "name either sort_keys (a list) or filter")
        if sort_keys is not None and not (
            isinstance(sort_keys, list)
            and len(sort_keys) <= DEAD_KEYS_PAGE
            and all(is_int(key) and key >= 1 for key in sort_keys)
        ):
            raise FieldError(
                "sort_keys", f"expected a list of at most {DEAD_KEYS_PAGE} positive integers"
            )
        filter_text = _filter_text(fields)
        requeue = op == "requeue"
        moved = 0
        after = 0
        with await self.gate.acquire(op, budget=budget, arrival=arrival) as slot:
            while chosen := await slot.run_cancellable(
                partial(
                    self.bus.log.dead_subjects,
                    claims.group,
                    after=after,
                    filter=filter_text,
                    sort_keys=sort_keys,
                )
            ):
                ticket = Ticket(dead_moves=[(claims.group, key, requeue) for key, _ in chosen])
                self.bus.committer.enqueue(ticket)
                with trio.CancelScope(shield=True):
                    await ticket.wait()
                    done = set(ticket.moved)
                    if requeue:
                        claims.requeue(
                            (key, subject) for key, subject in chosen if (claims.group, key) in done
                        )
                moved += len(done)
                if sort_keys is not None:
                    break  # all of them were in the one query
                after = chosen[-1][0]
        return moved


def _filter_text(fields: dict[str, Any]) -> str | None:
    """The request's optional ``filter``, checked, as the store's queries take it."""
    filter = fields.get("filter")
    return None if filter is None else ".".join(parse_filter(filter))


def _dead_fragment(dead: DeadRecord) -> bytes:
    head = dumps(
        {
            "sort_key": dead.sort_key,
            "subject": dead.subject,
            "redelivered": dead.deliveries > 1,
            "deliveries": dead.deliveries,
        }
    )
    return b"".join((head[:-1], b',"record":', dead.record.encode(), b"}"))


def _timeout_ms(fields: dict[str, Any]) -> int | None:
    timeout_ms = fields.get("timeout_ms")
    if timeout_ms is not None and not (is_int(timeout_ms) and timeout_ms >= 0):
        raise FieldError("timeout_ms", "expected a non-negative integer")
    return timeout_ms


def _sort_key(fields: dict[str, Any]) -> int:
    sort_key = fields.get("sort_key")
    if not (is_int(sort_key) and sort_key >= 1):
        raise FieldError("sort_key", "expected a positive integer")
    return sort_key


def _record(stored: StoredRecord) -> Any:
    return loads(stored.record.encode())


def _delivery(delivery: Delivery, stored: StoredRecord) -> dict[str, Any]:
    return {
        "sort_key": delivery.sort_key,
        "subject": delivery.subject,
        "redelivered": delivery.redelivered,
        "deliveries": delivery.deliveries,
        "record": _record(stored),
    }
