"""What the two claim faces share (docs/protocol.md, "Command claim", "Event claim"):
competing consumers with leases, in both dialects.

Each connection has its own handler: the leases it holds are released the moment it
closes. ``next`` waits in memory (no thread, no polling) for a matching record, leases it,
and, under a Gate slot, has its body read from the store with the other bodies asked for
meanwhile (:mod:`cmdbus_trio.bus.bodies`). ``ack`` is durable before it is answered: it
goes through the group committer like a publish. The bus's consumer groups resolve a
request's ``group`` (and ``from``) to the coordinator to use: the command bus's one fixed
group, or an event group by name.

On a group the connection already uses, an ``ack``, and a ``next`` that finds a record
and a Gate slot at once, are answered by a callback (a :class:`Deferred`) instead of a
task: the same steps, without waiting.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import GateClosed, Shed
from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.claims import Claims, Delivery
from cmdbus_trio.bus.committer import Ticket
from cmdbus_trio.logs import event
from cmdbus_trio.protocol import (
    FieldError,
    Request,
    dumps,
    encode_frame,
    encode_ok,
)
from cmdbus_trio.protocol import claim as codec
from cmdbus_trio.protocol import tier as tier_codec
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage.buslog import DeadRecord, StoredRecord

from . import FaceContext
from ._handler import CloseConnection, Deferred, V1Reply, checked_pages
from ._listen import serve as serve_connections

log = logging.getLogger(__name__)


class ClaimHandler:
    gated_ops = frozenset({"dead", "requeue", "purge", "lag"})
    """``next`` is not among them: it takes its Gate slot only once a record is there,
    so a consumer parked in ``next`` holds no intake place (see :meth:`_next`)."""
    large_reply_ops = frozenset({"dead"})

    def __init__(self, ctx: FaceContext, bus: Bus) -> None:
        self.face = ctx.name
        self.gate = ctx.gate
        self.max_reply = ctx.config.max_reply_bytes
        self.bus = bus
        self.groups = bus.groups
        self._used: dict[str, Claims] = {}  # the groups this connection claimed from
        self._resolved: dict[str | None, Claims] = {}  # group field -> its coordinator

    async def _claims(self, group: Any, start: Any = None) -> Claims:
        claims = await self.groups.resolve(group, start)
        self._used[claims.group] = claims
        if start is None and (group is None or isinstance(group, str)):
            self._resolved[group] = claims  # until it is deleted
        return claims

    def holding(self) -> bool:
        return any(claims.holds(self) for claims in self._used.values())

    def closed(self, outcome: str) -> None:
        # This connection's leases redeliver at once. Said in the log and a metric: the
        # worker, if it did not close the connection itself, finds its ack refused.
        released = sum(claims.release(self) for claims in self._used.values())
        if released:
            metrics.LEASES_RELEASED.labels(face=self.face, outcome=outcome).inc(released)
            event(
                log,
                logging.INFO,
                "leases_released",
                face=self.face,
                outcome=outcome,
                leases=released,
            )

    # --- v1 --------------------------------------------------------------------------------

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        try:
            request = codec.decode_v1(frame)
            if not isinstance(request, codec.V1Nack) or request.group is not None:
                claims = await self._claims(request.group)
        except FieldError:
            raise CloseConnection("protocol_error") from None
        except Exception as exc:  # not JSON
            raise CloseConnection("protocol_error") from exc
        if isinstance(request, codec.V1Next):
            try:
                delivery, stored = await self._next(claims, request.filter, None, patient=True)
            except GateClosed:
                raise CloseConnection("closed") from None  # draining: v1 can only close
            except StoreUnavailable:
                raise CloseConnection("unavailable") from None  # v1 has no error frame
            reply = {"sort_key": delivery.sort_key, "redelivered": delivery.redelivered}
            return V1Reply("next", encode_frame(_with_record(reply, stored.record)))
        if isinstance(request, codec.V1Ack):
            try:
                await self._ack(claims, request.sort_key)
            except StoreUnavailable:
                raise CloseConnection("unavailable") from None  # not durable: redelivered
            return V1Reply("ack", encode_frame(b"1"))
        # v1 Nack: the record redelivers after ack_wait, in whichever group this
        # connection holds it when the request names none.
        for group in [claims] if request.group is not None else self._used.values():
            group.nack(request.sort_key, self, delay=group.ack_wait)
        return V1Reply("nack", encode_frame(b"1"))

    # --- v2 --------------------------------------------------------------------------------

    def v2(self, request: Request, arrival: float) -> Awaitable[bytes] | Deferred:
        op = codec.decode_op(request.op, request.fields, named_groups=self.groups.named)
        # A group this connection has used already, and nothing to wait for: answered by
        # a callback, without a task (a task per request was much of the loop's time).
        group = op.group
        claims = self._resolved.get(group) if group is None or isinstance(group, str) else None
        if claims is not None and claims.deleted:
            del self._resolved[group]
            claims = None
        if claims is not None and isinstance(op, codec.Ack):
            return self._ack_deferred(request.id, claims, op.sort_key)
        if claims is not None and isinstance(op, codec.Next) and op.start is None:
            ready = self._next_now(request.id, claims, op.filter, request.budget)
            if ready is not None:
                return ready
        return self._v2(op, request.id, request.budget, arrival)

    async def _v2(
        self, op: codec.ClaimRequest, request_id: int, budget: float | None, arrival: float
    ) -> bytes:
        if isinstance(op, codec.DeleteGroup):
            # (the codec refuses it where groups are not named)
            return encode_ok(request_id, {"deleted": await self.groups.delete(op.group)})
        claims = await self._claims(op.group, op.start if isinstance(op, codec.Next) else None)
        if isinstance(op, codec.Next):
            result: bytes | None = None
            timeout = float("inf") if op.timeout_ms is None else op.timeout_ms / 1000
            with trio.move_on_after(timeout):
                delivery, stored = await self._next(claims, op.filter, budget)
                result = _delivery(delivery, stored)
            body: dict[str, Any] = {}
            if op.start == "beginning" and (deleted := self.bus.log.deleted_through):
                body["deleted_through"] = deleted  # the group starts at the oldest kept
            return _next_reply(request_id, body, result)
        if isinstance(op, codec.Lag):
            # An event group's lag walks its backlog: work, so it waits for a slot (the
            # command bus's is a copy of counts kept as they change, but goes the same way).
            with await self.gate.acquire("lag", budget=budget, arrival=arrival):
                subjects = await claims.backlog(op.filter)
            return encode_ok(request_id, {"subjects": subjects, "total": sum(subjects.values())})
        if isinstance(op, codec.Dead):
            return await self._dead(request_id, claims, op, budget, arrival)
        if isinstance(op, codec.MoveDead):
            moved = await self._move_dead(claims, op, budget, arrival)
            return encode_ok(request_id, {f"{op.op}d": moved})
        if isinstance(op, codec.Ack):
            return encode_ok(request_id, {"acked": await self._ack(claims, op.sort_key)})
        if isinstance(op, codec.Nack):
            nacked = claims.nack(op.sort_key, self, op.delay_ms / 1000)
            return encode_ok(request_id, {"nacked": nacked})
        extended = claims.extend(op.sort_key, self)
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
        delivered (its delivery count restored, not ``redelivered``), offered to the parked
        consumers once the Gate frees a slot (see :meth:`Claims.give_back`).

        Error handling: :class:`Shed` when admission refuses, unless ``patient`` (v1,
        which has no way to say ``busy``): then it waits ``retry_after`` and tries again.
        """
        while True:
            delivery = await claims.next(filter_tokens, self)
            try:
                slot = await self.gate.acquire("next", budget=budget)
            except Shed as shed:
                claims.give_back(delivery.sort_key, self, offer=False)
                self.gate.when_free(claims.offer_held)
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
                reply.settle(_next_reply(request_id, {}, _delivery(delivery, outcome)))

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
        op: codec.Dead,
        budget: float | None,
        arrival: float,
    ) -> bytes:
        """A page of dead letters, filtered in the query and encoded in the thread (the
        stored records spliced in, never decoded), bounded by ``limit`` and the reply cap
        like ``read_execution``."""
        head = {"id": request_id, "ok": True}
        with await self.gate.acquire("dead", budget=budget, arrival=arrival) as slot:
            return await slot.run_cancellable(
                self._dead_page, claims.group, op.filter, op.after, op.limit, head
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
        op: codec.MoveDead,
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
        requeue = op.requeue
        moved = 0
        after = 0
        with await self.gate.acquire(op.op, budget=budget, arrival=arrival) as slot:
            while chosen := await slot.run_cancellable(
                partial(
                    self.bus.log.dead_subjects,
                    claims.group,
                    after=after,
                    filter=op.filter,
                    sort_keys=op.sort_keys,
                )
            ):
                ticket = Ticket(dead_moves=[(claims.group, key, requeue) for key, _ in chosen])
                self.bus.committer.enqueue(ticket)
                with trio.CancelScope(shield=True):
                    await ticket.wait()
                    done = set(ticket.moved)
                    if requeue:
                        evicted = claims.requeue(
                            (key, subject) for key, subject in chosen if (claims.group, key) in done
                        )
                        self.groups.count_evicted(claims.group, evicted)
                moved += len(done)
                if op.sort_keys is not None:
                    break  # all of them were in the one query
                after = chosen[-1][0]
        return moved


def _with_record(head: dict[str, Any], record: str) -> bytes:
    """``head`` as a JSON object with ``"record"`` last: the stored JSON text spliced in,
    never decoded and encoded again (that took ~6 ms of the loop for a 0.9 MiB record)."""
    return b"".join((dumps(head)[:-1], b',"record":', record.encode(), b"}"))


def _dead_fragment(dead: DeadRecord) -> bytes:
    return _with_record(
        {
            "sort_key": dead.sort_key,
            "subject": dead.subject,
            "redelivered": dead.deliveries > 1,
            "deliveries": dead.deliveries,
        },
        dead.record,
    )


def _delivery(delivery: Delivery, stored: StoredRecord) -> bytes:
    return _with_record(
        {
            "sort_key": delivery.sort_key,
            "subject": delivery.subject,
            "redelivered": delivery.redelivered,
            "deliveries": delivery.deliveries,
        },
        stored.record,
    )


def _next_reply(request_id: int, body: dict[str, Any], delivery: bytes | None) -> bytes:
    """A ``next`` reply: ``body``'s fields and the delivery (JSON, or None for null)."""
    if delivery is None:
        return encode_ok(request_id, {**body, "delivery": None})
    return b"".join((encode_ok(request_id, body)[:-1], b',"delivery":', delivery, b"}"))


async def serve(
    ctx: FaceContext, store: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the claim face of the bus ``store``: each connection has its own handler."""
    bus = ctx.store(store, Bus)
    await serve_connections(ctx, lambda _send: ClaimHandler(ctx, bus), task_status=task_status)
