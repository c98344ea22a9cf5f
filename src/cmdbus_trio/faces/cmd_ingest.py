"""The ingest faces: command ingest (:9100) and, with another subject rule, event ingest.

v1: a frame is one record; the reply is 8 raw bytes, the big-endian sort key, with no
length prefix, sent once the record is durable; a bad record closes the connection. v2:
``publish`` and ``publish_batch``. Either way a publish is admitted by the face's Gate,
queued for the group committer in the order its connection sent it, and answered after
the commit.
"""

from __future__ import annotations

import trio

from cmdbus_trio.admission import GateClosed, Shed, Slot
from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.committer import Ticket
from cmdbus_trio.protocol import RemoteProtocolError, Request, encode_ok
from cmdbus_trio.protocol import bus as codec
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.storage.buslog import Published

from . import FaceContext
from ._handler import CloseConnection, Deferred, V1Reply
from ._listen import serve as serve_connections


class IngestHandler:
    gated_ops = frozenset({"publish", "publish_batch"})
    large_reply_ops: frozenset[str] = frozenset()

    def __init__(self, ctx: FaceContext, bus: Bus) -> None:
        self.gate = ctx.gate
        self.committer = bus.committer

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        try:
            record = codec.decode_v1_record(frame)
        except RemoteProtocolError:
            raise CloseConnection("protocol_error") from None
        slot = await self._admit_v1(arrival)
        try:
            published = await self._settle(Ticket([(record, None, "record")]), slot)
        except RemoteProtocolError:  # a bad payload, or the wrong shard
            raise CloseConnection("protocol_error") from None
        except StoreUnavailable:
            raise CloseConnection("unavailable") from None
        return V1Reply("publish", published[0].sort_key.to_bytes(8, "big"))

    def holding(self) -> bool:
        return False

    def closed(self, outcome: str) -> None:
        pass  # stateless: one handler serves every connection

    async def _admit_v1(self, arrival: float) -> Slot:
        # v1 has no way to say busy: a shed v1 publish is counted, then waits and retries,
        # so a v1 client sees slower acks instead of errors.
        while True:
            try:
                return await self.gate.acquire("publish", arrival=arrival)
            except Shed as shed:
                await trio.sleep(max(shed.retry_after_ms, 10) / 1000)
            except GateClosed:
                raise CloseConnection("closed") from None  # draining: v1 can only close

    def v2(self, request: Request, arrival: float) -> Deferred:
        op = codec.decode_op(request.op, request.fields)
        slot = self.gate.acquire_nowait(op.op, budget=request.budget, arrival=arrival)
        if isinstance(op, codec.Publish):
            ticket = Ticket([(op.record, op.msg_id, "record")])
        else:
            ticket = Ticket([(r, None, f"records[{i}]") for i, r in enumerate(op.records)])
        reply = Deferred()

        def settled(ticket: Ticket) -> None:
            # The slot is held until the commit, as in _settle: a drain flushes it.
            slot.release()
            if ticket.error is not None:
                reply.settle(ticket.error)
            else:
                assert ticket.published is not None
                reply.settle(_reply_body(request.id, op, ticket.published))

        # Queued now, in arrival order; settled without a task (a callback from the
        # committer): under pipelined load a task per publish was most of the loop's time.
        ticket.on_settled = settled
        self.committer.enqueue(ticket)
        return reply

    async def _settle(self, ticket: Ticket, slot: Slot) -> list[Published]:
        """Queue the ticket now (in arrival order) and wait for its commit, holding the
        slot until then: a drain waits for it, so nothing accepted is dropped."""
        self.committer.enqueue(ticket)
        with slot, trio.CancelScope(shield=True):
            published = await ticket.wait()
        return published


def _reply_body(
    request_id: int, op: codec.Publish | codec.PublishBatch, published: list[Published]
) -> bytes:
    if isinstance(op, codec.Publish):
        first = published[0]
        body = {"sort_key": first.sort_key, "subject": first.subject, "duplicate": first.duplicate}
        if first.evicted:  # only then: the common reply stays as it was
            body["evicted"] = True
        return encode_ok(request_id, body)
    return encode_ok(request_id, {"sort_keys": [p.sort_key for p in published]})


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    handler = IngestHandler(ctx, ctx.store("commands", Bus))
    await serve_connections(ctx, lambda _send: handler, task_status=task_status)
