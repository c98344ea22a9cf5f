"""The trio client: one class per face over a pipelined v2 connection.

    async with await TierClient.connect("127.0.0.1:9110") as tier:
        appended = await tier.append(7, '{"event_type": "step.done"}', timeout=2.0)

Any number of tasks may call one client at once: requests are pipelined with ids and
replies are matched to callers as they come, in any order. Whichever caller is waiting
reads the socket for everyone, so a client needs no background task and no nursery.
"""

from __future__ import annotations

import math
import ssl
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Generic, Self, TypeVar

import attrs
import trio

from cmdbus_trio.protocol import NEED_DATA

from . import _calls as calls
from ._calls import (
    Appended,
    Batch,
    BatchAppended,
    Call,
    DeadPage,
    Delivery,
    Lag,
    Page,
    Published,
    Record,
    TierRecord,
)
from ._core import LOCAL_GRACE, ClientProtocol, Reply, ServerHello, split_address
from ._errors import ClientError, ConnectionLost, DeadlineExceeded, ServerError
from ._retry import RetryPolicy
from ._shards import ClaimRounds, Rotation, ShardDelivery, ShardMap
from ._sockets import closed_by_peer

T = TypeVar("T")
RECEIVE_CHUNK = 1 << 16


@attrs.define
class _Slot:
    """Where replies to one request id land: one for a call, many for a subscription
    (at most one received chunk's worth, since the reading waits for the consumer)."""

    event: trio.Event = attrs.field(factory=trio.Event)
    replies: deque[Reply] = attrs.field(factory=deque)
    error: ClientError | None = None

    @property
    def done(self) -> bool:
        return bool(self.replies) or self.error is not None


class Connection:
    """A v2 connection to one data face, reconnected on the next call after it broke.

    Cancellation: a call cancelled while waiting forgets its request; a reply that comes
    later is dropped. A call cancelled while sending breaks the connection (part of a
    frame may be on the wire); the next call reconnects.

    Error handling: the server's error answers raise the :mod:`~cmdbus_trio.client`
    exception of their code; a lost connection raises :class:`ConnectionLost` for every
    call waiting on it; no reply within ``timeout`` raises :class:`DeadlineExceeded`.
    """

    def __init__(
        self,
        address: str,
        *,
        retry: RetryPolicy | None = None,
        client: str | None = None,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        split_address(address)
        self.address = address
        self.retry = retry
        self._client_name = client
        self._token = token
        self._ssl_context = ssl_context
        self._connect_timeout = connect_timeout
        self._stream: trio.abc.Stream | None = None
        self._transport: trio.SocketStream | None = None
        self._protocol = ClientProtocol()
        self._pending: dict[int, _Slot] = {}
        self._reading = False
        self._send_lock = trio.StrictFIFOLock()
        self._connect_lock = trio.Lock()
        self._closed = False

    @classmethod
    async def connect(cls, address: str, **options: Any) -> Self:
        """A connected client (the hello exchanged); raises :class:`ConnectionLost`."""
        connection = cls(address, **options)
        await connection._connected()
        return connection

    @property
    def server(self) -> ServerHello | None:
        return self._protocol.hello

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        self._break(ConnectionLost("the client was closed"))

    async def call(self, call: Call[T], *, timeout: float | None = None) -> T:
        """Run ``call``; ``timeout`` (seconds) is sent as its ``deadline_ms`` and bounds
        the wait for the reply and any retries."""
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        if self.retry is not None:
            self.retry.budget.record_request()
        attempt = 0
        while True:
            attempt += 1
            try:
                return call.parse(await self._attempt(call, deadline))
            except ClientError as error:
                if self.retry is None or not self.retry.should_retry(call, error, attempt):
                    raise
                pause = self.retry.delay(error, attempt)
                if trio.current_time() + pause >= deadline:
                    raise
                await trio.sleep(pause)

    async def _attempt(self, call: Call[Any], deadline: float) -> dict[str, Any]:
        stream = await self._connected()
        remaining = deadline - trio.current_time()
        if remaining <= 0:
            raise DeadlineExceeded(f"{call.op}: the time budget ran out before sending")
        request_id, frame = self._protocol.request(
            call.op, call.fields, deadline=None if call.wait else remaining
        )
        slot = self._pending[request_id] = _Slot()
        try:
            await self._send(stream, frame)
            local = remaining + LOCAL_GRACE + (call.wait or 0.0)
            with trio.move_on_after(local):
                return await self._wait(slot)
            raise DeadlineExceeded(f"{call.op}: no reply within {local:.3f} s")
        finally:
            if self._pending.get(request_id) is slot:  # ids restart when we reconnect
                del self._pending[request_id]

    async def _connected(self) -> trio.abc.Stream:
        async with self._connect_lock:
            if self._closed:
                raise ConnectionLost("the client was closed")
            if self._stream is not None:
                transport = self._transport
                idle = not self._pending and not self._reading
                if not (idle and transport and closed_by_peer(transport.socket.fileno())):
                    return self._stream
                # Idled out by the server: nothing was sent on it, reconnect.
                self._break(ConnectionLost(f"{self.address} closed the idle connection"))
            host, port = split_address(self.address)
            protocol = ClientProtocol(client=self._client_name, token=self._token)
            try:
                with trio.fail_after(self._connect_timeout):
                    transport = await trio.open_tcp_stream(host, port)
                    stream: trio.abc.Stream = transport
                    if self._ssl_context is not None:
                        stream = trio.SSLStream(transport, self._ssl_context, server_hostname=host)
                    try:
                        await stream.send_all(protocol.hello_frame())
                        while (event := protocol.next_event()) is NEED_DATA:
                            protocol.receive_data(await stream.receive_some(RECEIVE_CHUNK))
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
            except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else None
                raise ConnectionLost(
                    f"cannot connect to {self.address}: {cause or exc!r}"
                ) from None
            if not isinstance(event, ServerHello):
                await trio.aclose_forcefully(stream)
                raise ConnectionLost(f"{self.address} closed the connection during the hello")
            self._stream, self._transport, self._protocol = stream, transport, protocol
            return stream

    async def _send(self, stream: trio.abc.Stream, frame: bytes) -> None:
        async with self._send_lock:
            try:
                await stream.send_all(frame)
            except BaseException as exc:
                lost = ConnectionLost(f"sending to {self.address} failed: {exc!r}")
                self._break(lost)
                if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
                    raise lost from None
                raise

    async def _wait(self, slot: _Slot) -> dict[str, Any]:
        """Wait for ``slot``'s reply, reading the socket for every caller meanwhile if no
        other caller is reading it."""
        while not slot.done:
            if self._reading:
                await slot.event.wait()
                if not slot.done:  # woken to take over the reading
                    slot.event = trio.Event()
                continue
            self._reading = True
            try:
                while not slot.done:
                    await self._receive()
            finally:
                self._reading = False
                for other in self._pending.values():
                    if not other.done:
                        other.event.set()  # hand the reading over
                        break
        if slot.replies:
            reply = slot.replies.popleft()
            if reply.error is not None:
                raise reply.error
            assert reply.result is not None
            return reply.result
        assert slot.error is not None
        raise slot.error

    async def _receive(self) -> None:
        stream = self._stream
        if stream is None:
            return  # broken meanwhile: every slot has its error
        cause: Exception | None = None
        try:
            data = await stream.receive_some(RECEIVE_CHUNK)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            data, cause = b"", exc
        if self._stream is not stream:
            return  # broken (and perhaps reconnected) meanwhile: not this protocol's bytes
        try:
            self._protocol.receive_data(data)
            while (event := self._protocol.next_event()) is not NEED_DATA:
                if isinstance(event, Reply) and event.id is not None:
                    self._settle(event)
                elif isinstance(event, Reply):
                    assert event.error is not None
                    raise event.error  # about the connection: the server closes it
                else:
                    raise ConnectionLost(f"{self.address} closed the connection ({cause or 'EOF'})")
        except ClientError as error:
            self._break(error)

    def _settle(self, reply: Reply) -> None:
        slot = self._pending.get(reply.id) if reply.id is not None else None
        if slot is None:
            return  # its caller gave up (cancelled or timed out)
        slot.replies.append(reply)
        slot.event.set()

    def _break(self, error: ClientError) -> None:
        transport, self._stream, self._transport = self._transport, None, None
        if transport is not None:
            transport.socket.close()  # no await: callers may be cancelled already
        for slot in self._pending.values():
            if not slot.done:
                slot.error = error
                slot.event.set()

    async def _stream_replies(self, call: Call[T]) -> AsyncIterator[T]:
        """Send ``call`` and yield every reply frame to it (a subscription)."""
        stream = await self._connected()
        request_id, frame = self._protocol.request(call.op, call.fields)
        await self._send(stream, frame)
        slot = self._pending[request_id] = _Slot()
        try:
            while True:
                result = await self._wait(slot)
                if not slot.done:
                    slot.event = trio.Event()
                yield call.parse(result)
        finally:
            if self._pending.get(request_id) is slot:
                del self._pending[request_id]


class IngestClient(Connection):
    """The command (:9100) or event (:9103) ingest face."""

    async def publish(
        self, record: Record, *, msg_id: str | None = None, timeout: float | None = None
    ) -> Published:
        return await self.call(calls.publish(record, msg_id), timeout=timeout)

    async def publish_batch(
        self, records: Iterable[Record], *, timeout: float | None = None
    ) -> list[int]:
        return await self.call(calls.publish_batch(records), timeout=timeout)


class ClaimClient(Connection):
    """The command (:9101) or event (:9104) claim face. Leases belong to the connection:
    closing it releases them at once."""

    async def next(
        self,
        filter: str,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> Delivery | None:
        """The next record for ``filter``, or ``None`` after ``wait`` seconds without one.
        On the event face ``group`` is required; ``start`` (``beginning`` or ``tail``)
        creates the group when it is new."""
        call = calls.next_delivery(filter, wait=wait, group=group, start=start)
        return await self.call(call, timeout=timeout)

    async def ack(
        self, sort_key: int, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        return await self.call(calls.ack(sort_key, group), timeout=timeout)

    async def nack(
        self,
        sort_key: int,
        *,
        group: str | None = None,
        delay: float | None = None,
        timeout: float | None = None,
    ) -> bool:
        return await self.call(calls.nack(sort_key, group, delay), timeout=timeout)

    async def extend(
        self, sort_key: int, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        return await self.call(calls.extend(sort_key, group), timeout=timeout)

    async def lag(
        self, filter: str | None = None, *, group: str | None = None, timeout: float | None = None
    ) -> Lag:
        return await self.call(calls.lag(filter, group), timeout=timeout)

    async def dead(
        self,
        filter: str | None = None,
        *,
        group: str | None = None,
        limit: int | None = None,
        after: int | None = None,
        timeout: float | None = None,
    ) -> DeadPage:
        """A page of dead letters (up to ``limit``, 100 by default), oldest first; page
        on with ``after=page.next_after`` until it is ``None``."""
        return await self.call(calls.dead(filter, group, limit, after), timeout=timeout)

    async def requeue(
        self,
        sort_keys: Sequence[int] | None = None,
        *,
        filter: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Put dead letters back in the queue, with a fresh delivery count: those of
        ``sort_keys`` (at most 1,000), or every one matching ``filter``. Returns how many
        were requeued, durably."""
        return await self.call(
            calls.move_dead("requeue", sort_keys, filter, group), timeout=timeout
        )

    async def purge(
        self,
        sort_keys: Sequence[int] | None = None,
        *,
        filter: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Drop dead letters for good (selected as for :meth:`requeue`). Returns how many
        were purged, durably."""
        return await self.call(calls.move_dead("purge", sort_keys, filter, group), timeout=timeout)

    async def delete_group(self, group: str, *, timeout: float | None = None) -> bool:
        """Delete an event consumer group and all it recorded (event claim face only);
        False when there is no such group."""
        return await self.call(calls.delete_group(group), timeout=timeout)


class TierClient(Connection):
    """The tier face (:9110)."""

    async def append(
        self,
        execution_id: str | int,
        payload: str,
        *,
        tier: str | None = None,
        transaction_id: str | None = None,
        expected_version: int | None = None,
        timeout: float | None = None,
    ) -> Appended:
        call = calls.append(
            execution_id,
            payload,
            tier=tier,
            transaction_id=transaction_id,
            expected_version=expected_version,
        )
        return await self.call(call, timeout=timeout)

    async def append_batch(
        self,
        execution_id: str | int,
        payloads: Iterable[str],
        *,
        tier: str | None = None,
        transaction_id: str | None = None,
        timeout: float | None = None,
    ) -> BatchAppended:
        call = calls.append_batch(execution_id, payloads, tier=tier, transaction_id=transaction_id)
        return await self.call(call, timeout=timeout)

    async def delete_execution(
        self, execution_id: str | int, *, tier: str | None = None, timeout: float | None = None
    ) -> int:
        """Delete the execution's history in ``tier`` (default ``eventlog``), durably; the
        records deleted (0: it had none). For clean-up tooling: the tier keeps history
        unless told otherwise."""
        return await self.call(calls.delete_execution(execution_id, tier=tier), timeout=timeout)

    async def read_execution(
        self,
        execution_id: str | int,
        *,
        tier: str | None = None,
        after: int | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> Page:
        call = calls.read_execution(execution_id, tier=tier, after=after, limit=limit)
        return await self.call(call, timeout=timeout)

    async def scan(
        self,
        *,
        tier: str | None = None,
        after: int | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> Page:
        return await self.call(calls.scan(tier=tier, after=after, limit=limit), timeout=timeout)

    async def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        return await self.call(calls.tier_health(), timeout=timeout)

    async def read_all(
        self, execution_id: str | int, *, tier: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[TierRecord]:
        """Every record of the execution, page after page (``timeout`` per page)."""
        after: int | None = None
        while True:
            page = await self.read_execution(execution_id, tier=tier, after=after, timeout=timeout)
            for record in page.records:
                yield record
            if page.next_after is None:
                return
            after = page.next_after


class SubscribeClient(Connection):
    """The event subscribe face (:9108). A subscription holds its connection."""

    async def subscribe(self, start: int = 0, *, filter: str | None = None) -> AsyncIterator[Batch]:
        """Batches of records with sort key > ``start``: history first, then live.
        Raises :class:`Busy` when the server cut this subscriber off as too slow."""
        async for batch in self._stream_replies(calls.subscribe(start, filter)):
            yield batch


W = TypeVar("W", bound=Connection)


class _Writers(Generic[W]):
    """One client per shard's writer, closed together."""

    writers: Sequence[W]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for writer in self.writers:
            await writer.aclose()


class Router(_Writers[IngestClient]):
    """Publishes each record to the writer that owns its shard.

        router = Router(ShardMap.parse("0@10.0.0.1:9100,1@10.0.0.2:9100"))

    Connections open on first use and reconnect after a writer restarts. Errors carry
    ``error.shard``.
    """

    def __init__(self, shards: ShardMap, **options: Any) -> None:
        self.shards = shards
        self.writers = [IngestClient(address, **options) for address in shards.addresses]

    async def publish(
        self, record: Record, *, msg_id: str | None = None, timeout: float | None = None
    ) -> Published:
        shard = self.shards.shard_for(record["execution_id"])
        try:
            return await self.writers[shard].publish(record, msg_id=msg_id, timeout=timeout)
        except ClientError as error:
            raise self.shards.tag(error, shard) from None

    async def publish_batch(
        self, records: list[Record], *, timeout: float | None = None
    ) -> list[tuple[int, int]]:
        """One ``publish_batch`` per shard; ``(shard, sort_key)`` per record, in order."""
        keys: list[tuple[int, int]] = [(0, 0)] * len(records)
        for shard, indexes in sorted(self.shards.split(records).items()):
            try:
                sort_keys = await self.writers[shard].publish_batch(
                    [records[i] for i in indexes], timeout=timeout
                )
            except ClientError as error:
                raise self.shards.tag(error, shard) from None
            for index, sort_key in zip(indexes, sort_keys, strict=True):
                keys[index] = (shard, sort_key)
        return keys


class ShardedClaimClient(_Writers[ClaimClient]):
    """Claims from several writers fairly; see
    :class:`cmdbus_trio.client.blocking.ShardedClaimClient`."""

    def __init__(self, shards: ShardMap, **options: Any) -> None:
        self.shards = shards
        self.writers = [ClaimClient(address, **options) for address in shards.addresses]
        self._rotation = Rotation(shards.shard_count)

    async def next(
        self,
        filter: str,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> ShardDelivery | None:
        deadline = math.inf if wait is None else trio.current_time() + wait
        rounds = ClaimRounds(self.shards, self._rotation)
        while True:
            for shard in rounds.round():
                try:
                    delivery = await self.writers[shard].next(
                        filter, wait=0, group=group, start=start, timeout=timeout
                    )
                except ClientError as error:
                    rounds.failed(shard, error)  # raises unless the writer is down
                    continue
                if delivery is not None:
                    return rounds.served(shard, delivery)
            pause = rounds.pause(deadline - trio.current_time())
            if pause is None:
                return None
            await trio.sleep(pause)

    async def ack(
        self, claimed: ShardDelivery, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        try:
            return await self.writers[claimed.shard].ack(
                claimed.delivery.sort_key, group=group, timeout=timeout
            )
        except ClientError as error:
            raise self.shards.tag(error, claimed.shard) from None


__all__ = [
    "ClaimClient",
    "Connection",
    "IngestClient",
    "Router",
    "ServerError",
    "ShardedClaimClient",
    "SubscribeClient",
    "TierClient",
]
