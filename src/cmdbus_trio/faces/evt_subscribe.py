"""The event subscribe face (:9108): a push stream of records after a cursor, no acks.

A subscription first catches up from the store, page by page under the face's Gate, until
it is near the end; then it registers with the live :class:`Hub` and catches up the rest;
then it streams live records, skipping any it already sent, so the boundary between
catch-up and live has no gap and no duplicate. v1: ``{"shard": n, "cursor": c}`` → frames
that are JSON arrays of ``{sort_key, subject, record}``. v2: ``subscribe {from, filter?}``
→ frames ``{"id", "ok": true, "records": [...]}``; when retention has deleted records after
the cursor, the first frame is ``{"id", "ok": true, "records": [], "deleted_through": D}``,
and so is the next frame whenever an eviction (``CMDBUS_EVT_MAX_BYTES``) overtakes a
subscriber still catching up.
No frame is larger than ``CMDBUS_MAX_REPLY_BYTES`` (a record larger than that goes alone).
A subscriber that falls more than ``CMDBUS_SUBSCRIBER_BUFFER`` records (or
``CMDBUS_SUBSCRIBER_BUFFER_BYTES``) behind gets ``busy`` (slow consumer) and is closed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence

import trio

from cmdbus_trio.bus import Bus
from cmdbus_trio.bus.subscriptions import Hub, fragment
from cmdbus_trio.protocol import ErrorCode, Request, encode_error, encode_frame
from cmdbus_trio.protocol import subscribe as codec
from cmdbus_trio.protocol.subjects import matches

from . import FaceContext
from ._handler import DRAIN_RETRY_AFTER_MS, CloseConnection, Sender, V1Reply
from ._listen import serve as serve_connections

CATCH_UP_PAGE = 500
MOST_PER_FRAME = 1000
FrameOf = Callable[[Sequence[bytes]], bytes]


class _Gaps:
    """Tells a v2 subscriber catching up from the store that records after its cursor
    were deleted (``deleted_through``), once for each new floor it meets."""

    def __init__(self, bus: Bus, head: bytes) -> None:
        self._bus = bus
        self._head = head
        self._told = 0

    def notice(self, after: int) -> bytes | None:
        deleted = self._bus.log.deleted_through
        if after >= deleted or deleted <= self._told:
            return None
        self._told = deleted
        return encode_frame(self._head + f'],"deleted_through":{deleted}}}'.encode())


class SubscribeHandler:
    gated_ops: frozenset[str] = frozenset()
    """A subscription takes a Gate slot per catch-up page, never for its life: a live
    subscriber holds no intake place."""
    large_reply_ops: frozenset[str] = frozenset()

    def __init__(self, ctx: FaceContext, bus: Bus, hub: Hub, send: Sender) -> None:
        self.ctx = ctx
        self.gate = ctx.gate
        self.bus = bus
        self.hub = hub
        self.send = send

    def holding(self) -> bool:
        return False

    def closed(self, outcome: str) -> None:
        pass  # a subscription holds nothing once its connection is gone

    async def v1(self, frame: bytes, arrival: float) -> V1Reply:
        try:
            request = codec.decode_v1(frame)
        except Exception:
            raise CloseConnection("protocol_error") from None
        if request.shard != self.ctx.config.shard:
            raise CloseConnection("protocol_error")  # docs/protocol.md: another shard closes
        await self._stream(
            request.cursor,
            None,
            lambda fragments: b"[" + b",".join(fragments) + b"]",
            gaps=None,
            traced=False,
        )
        raise CloseConnection("closed")  # slow consumer or drain: v1 can only close

    def v2(self, request: Request, arrival: float) -> Awaitable[bytes]:
        subscribe = codec.decode_op(request.op, request.fields)
        return self._v2(request.id, subscribe.after, subscribe.filter)

    async def _v2(self, request_id: int, after: int, tokens: tuple[str, ...] | None) -> bytes:
        head = f'{{"id":{request_id},"ok":true,"records":['.encode()
        completed = await self._stream(
            after,
            tokens,
            lambda f: head + b",".join(f) + b"]}",
            gaps=_Gaps(self.bus, head),
            traced=True,
        )
        if completed:  # the writer is draining
            raise CloseConnection(
                "closed",
                encode_error(
                    request_id,
                    ErrorCode.UNAVAILABLE,
                    "the writer is draining",
                    retry_after_ms=DRAIN_RETRY_AFTER_MS,
                ),
            )
        raise CloseConnection(
            "closed",
            encode_error(
                request_id,
                ErrorCode.BUSY,
                f"slow consumer: more than {self.hub.capacity} records behind",
                retry_after_ms=1000,
            ),
        )

    async def _stream(
        self,
        after: int,
        tokens: tuple[str, ...] | None,
        frame_of: FrameOf,
        *,
        gaps: _Gaps | None,
        traced: bool,
    ) -> bool:
        """Push records after ``after``; returns True when the stream ended by a drain,
        False when the subscriber was cut off (or went away). ``gaps``: how to tell a
        v2 subscriber of deleted records (v1 cannot be told); ``traced``: records carry
        their trace context (v2)."""
        # Catch up without buffering live records (a long history would overflow the
        # buffer), then register and catch up what was committed meanwhile: a record
        # committed before the registration is in the store, one after it in the buffer,
        # and one in both is skipped by its sort key.
        room = self.ctx.config.max_reply_bytes - len(frame_of([]))  # for records, a frame
        last = await self._catch_up(after, tokens, frame_of, room, gaps, traced)
        with self.hub.subscribe(tokens, traced) as live:
            last = await self._catch_up(last, tokens, frame_of, room, gaps, traced)
            async for batch in live.batches(MOST_PER_FRAME):
                fresh = [pushed for pushed in batch if pushed.sort_key > last]
                for run in _runs([pushed.piece(traced) for pushed in fresh], room):
                    if not await self.send(encode_frame(frame_of(run))):
                        return False
                if fresh:
                    last = fresh[-1].sort_key
            return not live.overflowed

    async def _catch_up(
        self,
        after: int,
        tokens: tuple[str, ...] | None,
        frame_of: FrameOf,
        room: int,
        gaps: _Gaps | None,
        traced: bool,
    ) -> int:
        """Push stored records after ``after`` until the end of the store, in frames
        carrying at most ``room`` bytes of records; returns the last sort key read.
        Before a page, a subscriber whose cursor is below what retention deleted is told
        so (before anything else, so one replaying from an old cursor knows it starts at
        the oldest kept)."""
        while True:
            notice = None if gaps is None else gaps.notice(after)
            if notice is not None and not await self.send(notice):
                raise CloseConnection("write_error")
            with await self.gate.acquire("subscribe") as slot:
                page = await slot.run_cancellable(self.bus.log.read_after, after, CATCH_UP_PAGE)
            chosen = [r for r in page if tokens is None or matches(tokens, r.subject)]
            fragments = [
                fragment(r.sort_key, r.subject, r.record, r.trace if traced else None)
                for r in chosen
            ]
            for run in _runs(fragments, room):
                if not await self.send(encode_frame(frame_of(run))):
                    raise CloseConnection("write_error")
            if page:
                after = page[-1].sort_key
            if len(page) < CATCH_UP_PAGE:
                return after


def _runs(fragments: list[bytes], room: int) -> Iterator[list[bytes]]:
    """``fragments`` in order, in runs whose comma-joined size fits ``room`` (a fragment
    larger than ``room`` goes alone)."""
    run: list[bytes] = []
    size = 0
    for piece in fragments:
        if run and size + 1 + len(piece) > room:
            yield run
            run, size = [], 0
        size += len(piece) + (1 if run else 0)
        run.append(piece)
    if run:
        yield run


async def serve(
    ctx: FaceContext, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    bus = ctx.store("events", Bus)
    hub = bus.hub
    if hub is None:
        raise TypeError("the event subscribe face needs the event bus's subscription hub")
    await serve_connections(
        ctx, lambda send: SubscribeHandler(ctx, bus, hub, send), task_status=task_status
    )
