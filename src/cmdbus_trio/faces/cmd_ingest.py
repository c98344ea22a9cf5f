"""The ingest faces: command ingest (:9100) and, with another subject rule, event ingest.

v1: a frame is one record; the reply is 8 raw bytes, the big-endian sort key, with no
length prefix, sent once the record is durable; a bad record closes the connection. v2:
``publish`` and ``publish_batch``. Either way a publish is admitted by the face's Gate,
queued for the group committer in the order its connection sent it, and completes by
the committer's callback once it is durable; v1 awaits that in its connection's task.
"""

from __future__ import annotations

from functools import partial

import trio
from opentelemetry.trace import Span

from cmdbus_trio.admission import GateClosed, Shed, Slot
from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.committer import Ticket
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.protocol import RemoteProtocolError, Request
from cmdbus_trio.protocol import bus as codec
from cmdbus_trio.protocol.bus import Published
from cmdbus_trio.storage import StoreUnavailable
from cmdbus_trio.tracing import spans

from . import FaceContext
from ._handler import CloseConnection, V1Reply
from ._listen import serve as serve_connections


class IngestHandler:
    gated_ops = frozenset({"publish", "publish_batch"})
    large_reply_ops: frozenset[str] = frozenset()

    def __init__(self, ctx: FaceContext, bus: Bus) -> None:
        self.gate = ctx.gate
        self.committer = bus.committer
        self.bus_name = bus.log.name

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        try:
            record = codec.decode_v1_record(frame)
        except RemoteProtocolError:
            raise CloseConnection("protocol_error") from None
        span = spans.publishing(self.bus_name, [record], arrival)
        try:
            slot = await self._admit_v1(arrival)
        except BaseException as exc:
            spans.end(span, exc)
            raise
        publishing = self._publish(Ticket([(record, None, "record")]), slot, span)
        try:
            with trio.CancelScope(shield=True):  # accepted: answered once it is durable
                published = await publishing.outcome()
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

    def v2(self, request: Request, arrival: float) -> Deferred[bytes]:
        op = codec.decode_op(request.op, request.fields)
        records = (op.record,) if isinstance(op, codec.Publish) else op.records
        span = spans.publishing(self.bus_name, records, arrival)
        try:
            slot = self.gate.acquire_nowait(op.op, budget=request.budget, arrival=arrival)
        except Exception as exc:  # shed
            spans.end(span, exc)
            raise
        if isinstance(op, codec.Publish):
            ticket = Ticket([(op.record, op.msg_id, "record")])
        else:
            msg_ids = op.msg_ids or (None,) * len(op.records)
            pairs = enumerate(zip(op.records, msg_ids, strict=True))
            ticket = Ticket([(r, m, f"records[{i}]") for i, (r, m) in pairs])
        return self._publish(ticket, slot, span).map(partial(codec.publish_reply, request.id, op))

    def _publish(self, ticket: Ticket, slot: Slot, span: Span | None) -> Deferred[list[Published]]:
        publishing = self.committer.publish(ticket, slot)
        if span is None:
            return publishing

        def observe(outcome: list[Published] | Exception) -> None:
            waited = slot.admitted_at - slot.arrival
            spans.published(span, ticket.commit_records, waited, outcome)

        return publishing.observed(observe)


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    handler = IngestHandler(ctx, ctx.store("commands", Bus))
    await serve_connections(ctx, lambda _send: handler, task_status=task_status)
