"""The tier face (:9110): per-execution history, both dialects (docs/protocol.md, "Tier face").

``health`` is answered on the connection, without a Gate slot. Every other request is
admitted by the tier Gate (appends and deletes: the write lane, ``CMDBUS_TIER_WRITES``)
and then runs off the loop: an append is queued for the tier's group commit
(:mod:`cmdbus_trio.tier.committer`), whose thread checks its payloads, appends it with the
others waiting and encodes its reply; a read or a delete runs whole in one worker thread
call. An append has no task of its own: it waits for its slot as a callback
(``Gate.acquire_later``) and is answered by the commit's callback, since under overload
most appends wait, and a task each was a third of the loop's time. Reads work page by
page, checking for cancellation between pages, and stop adding records when the reply
would pass the reply cap (v2: fewer records and ``next_after``; v1: the documented text
error).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from functools import partial
from typing import Any

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import checked_pages, each_checked
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.protocol import (
    ErrorCode,
    FieldError,
    RemoteProtocolError,
    Request,
    UnsupportedOp,
    dumps,
    encode_frame,
    encode_ok,
)
from cmdbus_trio.protocol import pages as paging
from cmdbus_trio.protocol import tier as codec
from cmdbus_trio.storage.tier import Appending, AppendResult, NewRecord
from cmdbus_trio.tier.committer import AppendTicket, Tier
from cmdbus_trio.tracing import spans

from . import FaceContext
from ._handler import (
    FaceError,
    V1Reply,
    as_face_error,
)
from ._listen import serve as serve_connections

Pages = Iterator[paging.Fragments]
Appends = codec.Append | codec.AppendBatch
Reads = codec.ReadExecution | codec.Scan | codec.DeleteExecution
"""The requests run whole in one thread call (a delete too)."""

__all__ = ["TierHandler", "serve"]

_NO_ID = -1  # marks a v1 request in the thread functions


class TierHandler:
    gated_ops = frozenset({"append", "append_batch", "read_execution", "scan", "delete_execution"})
    large_reply_ops = frozenset({"read_execution", "scan"})

    def __init__(self, ctx: FaceContext, tier: Tier) -> None:
        self.ctx = ctx
        self.store = tier.store
        self.committer = tier.committer
        self.max_reply = ctx.config.max_reply_bytes

    # --- dialects ------------------------------------------------------------------------

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        try:
            request = codec.decode_v1(frame)
        except FieldError as exc:
            message = exc.op if isinstance(exc, UnsupportedOp) else exc.hint
            return V1Reply(
                "unknown", self._v1_text(codec.v1_error(exc.code, message)), exc.code.value
            )
        except RemoteProtocolError as exc:
            return V1Reply(
                "unknown", self._v1_text(codec.v1_error(ErrorCode.INVALID, exc.hint)), "invalid"
            )
        if isinstance(request, codec.Health):
            return V1Reply("health", encode_frame(codec.V1_HEALTH_REPLY))
        try:
            if isinstance(request, Appends):
                body = await self._append(request, _NO_ID, None, arrival).outcome()
            else:
                body = await self._run(request, arrival, None, _NO_ID)
        except Exception as exc:
            error = as_face_error(exc)
            if error is None:
                raise
            text = codec.v1_error(error.code, error.message, error.retry_after_ms)
            return V1Reply(request.op, self._v1_text(text), error.code.value)
        return V1Reply(request.op, encode_frame(body))

    def holding(self) -> bool:
        return False

    def closed(self, outcome: str) -> None:
        pass  # stateless: one handler serves every connection

    def _v1_text(self, text: bytes) -> bytes:
        return encode_frame(text[: self.max_reply])

    def v2(self, request: Request, arrival: float) -> Awaitable[bytes] | Deferred[bytes]:
        tier_request = codec.decode_op(request.op, request.fields)
        if isinstance(tier_request, codec.Health):
            return Deferred.of(encode_ok(request.id, {"status": "ok", "service": "tier-service"}))
        if isinstance(tier_request, Appends):
            return self._append(tier_request, request.id, request.budget, arrival)
        return self._run(tier_request, arrival, request.budget, request.id)

    async def _run(
        self, request: Reads, arrival: float, budget: float | None, request_id: int
    ) -> bytes:
        gate = self.ctx.gate_of(request.op)  # deletes: the write lane (CMDBUS_TIER_WRITES)
        span = spans.tier_op(request, arrival)
        waited = None
        try:
            with await gate.acquire(request.op, budget=budget, arrival=arrival) as slot:
                waited = slot.admitted_at - slot.arrival
                if isinstance(request, codec.DeleteExecution):
                    reply = await slot.run_to_completion(self._delete, request, request_id)
                else:
                    reply = await slot.run_cancellable(self._read, request, request_id)
        except BaseException as exc:
            spans.end(span, exc, waited=waited)
            raise
        spans.end(span, waited=waited)
        return reply

    def _append(
        self, request: Appends, request_id: int, budget: float | None, arrival: float
    ) -> Deferred[bytes]:
        """Its payloads checked and its reply encoded in the commit thread."""
        ticket = AppendTicket(
            partial(_appending, request),
            partial(self._append_reply, request, request_id),
            records=len(request.payloads) if isinstance(request, codec.AppendBatch) else 1,
        )
        lane = self.ctx.gate_of(request.op)
        span = spans.tier_op(request, arrival)
        replied = self.committer.append(ticket, lane, request.op, budget=budget, arrival=arrival)
        if span is None:
            return replied
        return replied.observed(lambda outcome: spans.end(span, outcome, waited=ticket.waited))

    # --- in the worker thread ------------------------------------------------------------

    def _reply(self, request_id: int, body: dict[str, Any]) -> bytes:
        return dumps(body) if request_id == _NO_ID else encode_ok(request_id, body)

    def _delete(self, request: codec.DeleteExecution, request_id: int) -> bytes:
        deleted = self.store.delete_execution(request.tier, request.execution_id)
        metrics.RETAINED.labels(store="tier", kind="records").inc(deleted)
        return self._reply(request_id, {"deleted": deleted})

    def _append_reply(
        self, request: Appends, request_id: int, results: list[AppendResult]
    ) -> bytes:
        bodies = [
            codec.append_body(r.global_sequence, r.log_record_count, r.deduplicated)
            for r in results
        ]
        if isinstance(request, codec.Append):
            return self._reply(request_id, bodies[0])
        return self._reply(request_id, codec.append_batch_body(bodies))

    def _read(self, request: codec.TierRequest, request_id: int) -> bytes:
        head: dict[str, Any] = {} if request_id == _NO_ID else {"id": request_id, "ok": True}
        if isinstance(request, codec.ReadExecution):
            count = self.store.execution_count(request.tier, request.execution_id)
            head |= {
                "action": f"{request.tier}-read-execution",
                "execution_id": request.execution_id,
                "exists": count is not None,
                "record_count": count or 0,
            }
            pages = self.store.iter_execution_encoded(
                request.tier, request.execution_id, after=request.after
            )
        elif isinstance(request, codec.Scan):
            pages = self.store.iter_scan_encoded(request.tier, after=request.after)
        else:
            raise AssertionError(request)
        with_returned = isinstance(request, codec.ReadExecution)
        if request_id == _NO_ID:
            return self._read_v1(head, pages, request.limit, with_returned)
        return self._read_v2(head, pages, request.limit, with_returned)

    def _read_v2(
        self, head: dict[str, Any], pages: Pages, limit: int, with_returned: bool
    ) -> bytes:
        return paging.page(
            head,
            checked_pages(pages),
            limit=limit,
            max_reply=self.max_reply,
            name="record",
            returned=with_returned,
        )

    def _read_v1(
        self, head: dict[str, Any], pages: Pages, limit: int, with_returned: bool
    ) -> bytes:
        # v1 has no paging: up to `limit` records, or the documented error with the size
        # the reply would have had (counted without keeping what does not fit).
        fragments: list[bytes] = []
        sizes = 0
        count = 0
        last = None
        more = False
        for sequence, fragment in each_checked(pages):
            if count == limit:
                more = True
                break
            sizes += len(fragment)
            count += 1
            last = sequence
            if sizes <= self.max_reply:  # past the cap the reply is refused anyway
                fragments.append(fragment)
        if with_returned:
            head["returned"] = count
        tail = {} if with_returned else {"next_after": last if more else None}
        total = paging.reply_size(head, sizes, count, tail)
        if total > self.max_reply:
            raise FaceError(ErrorCode.TOO_LARGE, codec.too_large_message(total, self.max_reply))
        return paging.with_records(head, fragments, tail)


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    handler = TierHandler(ctx, ctx.store("tier", Tier))
    await serve_connections(ctx, lambda _send: handler, task_status=task_status)


def _appending(request: Appends) -> Appending:
    """The request's records, each payload checked (in the commit thread: it parses the
    whole payload); a bad one refuses the request (an ``append_batch`` whole)."""
    if isinstance(request, codec.Append):
        event_id = codec.payload_event_id(request.payload)
        records = [NewRecord(request.payload, request.transaction_id, event_id)]
        return Appending(request.tier, request.execution_id, records, request.expected_version)
    records = [
        NewRecord(
            payload, request.transaction_id, codec.payload_event_id(payload, f"payloads[{i}]")
        )
        for i, payload in enumerate(request.payloads)
    ]
    return Appending(request.tier, request.execution_id, records)
