"""What the two claim faces share (docs/protocol.md, "Command claim", "Event claim"):
competing consumers with leases, in both dialects.

Each connection has its own handler and its own :class:`~cmdbus_trio.bus.delivery.Consumer`,
which owns what the connection holds (leases, their slots and bodies, acks) and lets go
of it the moment the connection closes. The handler decodes a request, calls the
consumer (or the bus's consumer groups, for dead letters and lag), and encodes the
result. ``ack`` completes by the committer's callback, with no task; ``next`` and the
paged ops wait, each in a task of its own; ``nack`` and ``extend`` complete at once.
"""

from __future__ import annotations

from collections.abc import Awaitable
from functools import partial
from typing import Any

import trio

from cmdbus_trio.admission import GateClosed
from cmdbus_trio.bus import Bus, dead_letters
from cmdbus_trio.bus.claims import Claims, Delivery
from cmdbus_trio.bus.delivery import Consumer
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.protocol import FieldError, Request, encode_frame, encode_ok
from cmdbus_trio.protocol import claim as codec
from cmdbus_trio.storage import StoreUnavailable

from . import FaceContext
from ._handler import CloseConnection, V1Reply
from ._listen import serve as serve_connections

_Waiting = codec.Next | codec.Lag | codec.Dead | codec.MoveDead | codec.DeleteGroup
"""The ops that wait (for a record, a slot, a thread or a commit): each in a task."""
_Settle = codec.Ack | codec.Nack | codec.Extend


class ClaimHandler:
    gated_ops = frozenset({"dead", "requeue", "purge", "lag"})
    """``next`` is not among them: it takes its Gate slot only once a record is there,
    so a consumer parked in ``next`` holds no intake place (see :meth:`Consumer.next`)."""
    large_reply_ops = frozenset({"dead"})

    def __init__(self, ctx: FaceContext, bus: Bus) -> None:
        self.gate = ctx.gate
        self.max_reply = ctx.config.max_reply_bytes
        self.bus = bus
        self.groups = bus.groups
        self.consumer = Consumer(bus, ctx.gate, ctx.name)

    def holding(self) -> bool:
        return self.consumer.holding()

    def closed(self, outcome: str) -> None:
        self.consumer.release(outcome)

    # --- v1 --------------------------------------------------------------------------------

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        acking: Deferred[list[bool]] | None = None
        try:
            request = codec.decode_v1(frame)
            if isinstance(request, codec.V1Next):
                claims = await self.consumer.group(request.group)
            elif isinstance(request, codec.V1Ack):
                acking = self.consumer.ack(request.group, [request.sort_key])
            elif request.group is None:  # in whichever group this connection holds it
                self.consumer.nack_held(request.sort_key)
            else:  # the record redelivers after ack_wait
                self.consumer.nack(request.group, [request.sort_key])
        except FieldError:
            raise CloseConnection("protocol_error") from None
        except Exception as exc:  # not JSON
            raise CloseConnection("protocol_error") from exc
        if isinstance(request, codec.V1Next):
            return await self._v1_next(claims, request.filter)
        if acking is not None:
            return await self._v1_ack(acking)
        return V1Reply("nack", encode_frame(b"1"))

    async def _v1_next(self, claims: Claims, filter_tokens: tuple[str, ...]) -> V1Reply:
        try:
            (handed,) = await self.consumer.next(
                claims, filter_tokens, None, encode=_v1_delivery, patient=True
            )
        except GateClosed:
            raise CloseConnection("closed") from None  # draining: v1 can only close
        except StoreUnavailable:
            raise CloseConnection("unavailable") from None  # v1 has no error frame
        return V1Reply("next", encode_frame(handed))

    async def _v1_ack(self, acking: Deferred[list[bool]]) -> V1Reply:
        try:
            with trio.CancelScope(shield=True):  # an ack that started finishes
                await acking.outcome()
        except StoreUnavailable:
            raise CloseConnection("unavailable") from None  # not durable: redelivered
        return V1Reply("ack", encode_frame(b"1"))

    # --- v2 --------------------------------------------------------------------------------

    def v2(self, request: Request, arrival: float) -> Awaitable[bytes] | Deferred[bytes]:
        op = codec.decode_op(request.op, request.fields, named_groups=self.groups.named)
        if isinstance(op, codec.Ack):
            acking = self.consumer.ack(op.group, op.sort_keys, op.trace, op.leases)
            return acking.map(partial(self._settled, request.id, op))
        if isinstance(op, codec.Nack):
            delay = op.delay_ms / 1000
            nacked = self.consumer.nack(op.group, op.sort_keys, delay, op.trace, op.leases)
            return Deferred.of(self._settled(request.id, op, nacked))
        if isinstance(op, codec.Extend):
            extended = self.consumer.extend(op.group, op.sort_keys, op.leases)
            lease_ms = round(self.consumer.lease_seconds * 1000)
            return Deferred.of(self._settled(request.id, op, extended, lease_ms=lease_ms))
        return self._v2(op, request.id, request.budget, arrival)

    def _settled(self, request_id: int, op: _Settle, outcomes: list[bool], **extra: Any) -> bytes:
        """A settle's reply, with why each key refused was refused (as it stands when
        the reply is made: for an ack, once its commit settled)."""
        why = self.consumer.refusals(op.op, op.group, op.sort_keys, outcomes, op.leases)
        name = codec.SETTLED_FIELD[op.op]
        return codec.settled_reply(request_id, name, outcomes, op.many, why, **extra)

    async def _v2(
        self, op: _Waiting, request_id: int, budget: float | None, arrival: float
    ) -> bytes:
        if isinstance(op, codec.Next):
            return await self._next(op, request_id, budget)
        if isinstance(op, codec.DeleteGroup):
            # (the codec refuses it where groups are not named)
            return encode_ok(request_id, {"deleted": await self.groups.delete(op.group)})
        claims = await self.consumer.group(op.group)
        # The rest is work, so it waits for a slot. (An event group's lag walks its
        # backlog; the command bus's is a copy of counts kept as they change, but goes the
        # same way.)
        with await self.gate.acquire(op.op, budget=budget, arrival=arrival) as slot:
            if isinstance(op, codec.Lag):
                subjects = await claims.backlog(op.filter)
                total = sum(subjects.values())
                return encode_ok(request_id, {"subjects": subjects, "total": total})
            if isinstance(op, codec.Dead):
                head = {"id": request_id, "ok": True}
                return await dead_letters.page(
                    self.bus, claims, slot, head,
                    filter=op.filter, after=op.after, limit=op.limit, max_reply=self.max_reply,
                )  # fmt: skip
            moved = await dead_letters.move_dead(
                self.bus, claims, slot, requeue=op.requeue, filter=op.filter, sort_keys=op.sort_keys
            )
        return encode_ok(request_id, {f"{op.op}d": moved})

    async def _next(self, op: codec.Next, request_id: int, budget: float | None) -> bytes:
        """Up to ``max`` deliveries (one without it) as soon as one is there, within the
        reply cap; none after ``timeout_ms``. The group it names is created with
        ``from``."""
        claims = await self.consumer.group(op.group, op.start)
        room: int | None = None
        if op.max is not None:  # what the deliveries may take of the reply cap
            worst = {"deleted_through": 1 << 63} if op.start == "beginning" else {}
            room = self.max_reply - len(codec.deliveries_reply(request_id, worst, []))
        handed: list[bytes] = []
        timeout = float("inf") if op.timeout_ms is None else op.timeout_ms / 1000
        with trio.move_on_after(timeout):
            handed = await self.consumer.next(
                claims, op.filter, budget, encode=codec.delivery, most=op.max or 1, room=room
            )
        body: dict[str, Any] = {}
        if op.start == "beginning" and (deleted := self.bus.log.deleted_through):
            body["deleted_through"] = deleted  # the group starts at the oldest kept
        if op.max is not None:
            return codec.deliveries_reply(request_id, body, handed)
        return codec.next_reply(request_id, body, handed[0] if handed else None)


def _v1_delivery(delivery: Delivery, record: str, trace: object) -> bytes:
    """v1's delivery frame, as NoETL's clients read it: no trace context."""
    head = {"sort_key": delivery.sort_key, "redelivered": delivery.redelivered}
    return codec.with_record(head, record)


async def serve(
    ctx: FaceContext, store: str, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the claim face of the bus ``store``: each connection has its own handler."""
    bus = ctx.store(store, Bus)
    await serve_connections(ctx, lambda _send: ClaimHandler(ctx, bus), task_status=task_status)
