"""The blocking client: the same faces and results as :mod:`cmdbus_trio.client.trio` over
a plain socket, for threads and scripts. It never imports trio.

    with TierClient.connect("127.0.0.1:9110") as tier:
        appended = tier.append(7, '{"event_type": "step.done"}', timeout=2.0)

One call at a time per client (a lock serializes threads); :meth:`Connection.call_many`
pipelines several requests in one round trip.
"""

from __future__ import annotations

import math
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, Self, TypeVar

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


SEND_WINDOW = 256 * 1024
"""Request bytes :meth:`Connection.call_many` sends before it reads their replies (a frame
larger than this goes alone): well within a socket's buffers, so sending never blocks on
a writer that waits for its replies to be read."""


def _send_windows(frames: Sequence[bytes], ids: Sequence[int]) -> Iterator[list[tuple[bytes, int]]]:
    window: list[tuple[bytes, int]] = []
    size = 0
    for frame, request_id in zip(frames, ids, strict=True):
        if window and size + len(frame) > SEND_WINDOW:
            yield window
            window, size = [], 0
        window.append((frame, request_id))
        size += len(frame)
    if window:
        yield window


class Connection:
    """A v2 connection to one data face, reconnected on the next call after it broke.

    Error handling: the server's error answers raise the :mod:`~cmdbus_trio.client`
    exception of their code; a lost connection raises :class:`ConnectionLost`; no reply
    within ``timeout`` raises :class:`DeadlineExceeded` (a reply that comes later is
    dropped).
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
        self._sock: socket.socket | None = None
        self._protocol = ClientProtocol()
        self._lock = threading.RLock()
        self._closed = False

    @classmethod
    def connect(cls, address: str, **options: Any) -> Self:
        connection = cls(address, **options)
        connection._connected()
        return connection

    @property
    def server(self) -> ServerHello | None:
        return self._protocol.hello

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._drop()

    def call(self, call: Call[T], *, timeout: float | None = None) -> T:
        """Run ``call``; ``timeout`` (seconds) is sent as its ``deadline_ms`` and bounds
        the wait for the reply and any retries."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.retry is not None:
            self.retry.budget.record_request()
        attempt = 0
        while True:
            attempt += 1
            try:
                outcome = self._exchange([call], deadline)[0]
                if isinstance(outcome, ClientError):
                    raise outcome
                return call.parse(outcome)
            except ClientError as error:
                if self.retry is None or not self.retry.should_retry(call, error, attempt):
                    raise
                pause = self.retry.delay(error, attempt)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)

    def call_many(
        self, batch: Sequence[Call[Any]], *, timeout: float | None = None
    ) -> list[Any | ServerError]:
        """Send every call at once and wait for all replies: each result, or the
        :class:`ServerError` that call got. No retries."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes = self._exchange(batch, deadline)
        return [
            outcome if isinstance(outcome, ClientError) else call.parse(outcome)
            for call, outcome in zip(batch, outcomes, strict=True)
        ]

    def _exchange(
        self, batch: Sequence[Call[Any]], deadline: float | None
    ) -> list[dict[str, Any] | ServerError]:
        with self._lock:
            sock = self._connected()
            frames, ids = [], []
            for call in batch:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(f"{call.op}: the time budget ran out before sending")
                request_id, frame = self._protocol.request(
                    call.op, call.fields, deadline=None if call.wait else remaining
                )
                frames.append(frame)
                ids.append(request_id)
            wait = max((call.wait or 0.0) for call in batch)
            local = None if deadline is None else deadline + LOCAL_GRACE + wait
            if local is not None and not math.isfinite(local):
                local = None  # a `next` that waits until a record comes
            replies: dict[int, dict[str, Any] | ServerError] = {}
            # One window at a time: a blocking socket cannot read while it sends, and the
            # writer stops reading a connection whose unsent replies pass its cap, so a
            # batch sent whole could wait on itself until the writer's read timeout.
            for window in _send_windows(frames, ids):
                try:
                    sock.sendall(b"".join(frame for frame, _ in window))
                except OSError as exc:
                    self._drop()
                    raise ConnectionLost(f"sending to {self.address} failed: {exc!r}") from None
                wanted = {request_id for _, request_id in window}
                while not wanted <= replies.keys():
                    reply = self._next_reply(local, batch[0].op)
                    if reply.id in wanted and reply.id not in replies:
                        replies[reply.id] = reply.error if reply.error else reply.result or {}
            return [replies[request_id] for request_id in ids]

    def _next_reply(self, local_deadline: float | None, op: str) -> Reply:
        """The next reply frame; raises on a connection-level error, EOF or timeout."""
        sock = self._sock
        while True:
            if sock is None:
                raise ConnectionLost(f"connection to {self.address} lost")
            try:
                event = self._protocol.next_event()
            except ClientError:
                self._drop()
                raise
            if isinstance(event, Reply) and event.id is not None:
                return event
            if isinstance(event, Reply):
                self._drop()
                assert event.error is not None
                raise event.error  # about the connection: the server closes it
            if event is not NEED_DATA:
                self._drop()
                raise ConnectionLost(f"{self.address} closed the connection")
            if local_deadline is not None:
                remaining = local_deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(f"{op}: no reply in time")
                sock.settimeout(remaining)
            else:
                sock.settimeout(None)
            try:
                data = sock.recv(RECEIVE_CHUNK)
            except TimeoutError:
                raise DeadlineExceeded(f"{op}: no reply in time") from None
            except OSError as exc:
                self._drop()
                raise ConnectionLost(f"receiving from {self.address} failed: {exc!r}") from None
            self._protocol.receive_data(data)

    def _connected(self) -> socket.socket:
        if self._closed:
            raise ConnectionLost("the client was closed")
        if self._sock is not None:
            if not closed_by_peer(self._sock.fileno()):
                return self._sock
            self._drop()  # idled out by the server: nothing was sent on it, reconnect
        host, port = split_address(self.address)
        protocol = ClientProtocol(client=self._client_name, token=self._token)
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.address}: {exc!r}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._protocol = sock, protocol
        try:
            if self._ssl_context is not None:
                sock = self._sock = self._ssl_context.wrap_socket(sock, server_hostname=host)
            sock.sendall(protocol.hello_frame())
            while (event := protocol.next_event()) is NEED_DATA:
                protocol.receive_data(sock.recv(RECEIVE_CHUNK))
        except (OSError, ClientError) as exc:
            self._drop()
            if isinstance(exc, ServerError):
                raise
            raise ConnectionLost(f"hello with {self.address} failed: {exc!r}") from None
        if not isinstance(event, ServerHello):
            self._drop()
            raise ConnectionLost(f"{self.address} closed the connection during the hello")
        return sock

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _stream_replies(self, call: Call[T]) -> Iterator[T]:
        with self._lock:
            sock = self._connected()
            request_id, frame = self._protocol.request(call.op, call.fields)
            try:
                sock.sendall(frame)
            except OSError as exc:
                self._drop()
                raise ConnectionLost(f"sending to {self.address} failed: {exc!r}") from None
            while True:
                reply = self._next_reply(None, call.op)
                if reply.id != request_id:
                    continue
                if reply.error is not None:
                    raise reply.error
                yield call.parse(reply.result or {})


class IngestClient(Connection):
    """The command (:9100) or event (:9103) ingest face."""

    def publish(
        self, record: Record, *, msg_id: str | None = None, timeout: float | None = None
    ) -> Published:
        return self.call(calls.publish(record, msg_id), timeout=timeout)

    def publish_batch(
        self, records: Iterable[Record], *, timeout: float | None = None
    ) -> list[int]:
        return self.call(calls.publish_batch(records), timeout=timeout)


class ClaimClient(Connection):
    """The command (:9101) or event (:9104) claim face. Leases belong to the connection:
    closing it releases them at once."""

    def next(
        self,
        filter: str,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> Delivery | None:
        """The next record for ``filter``, or ``None`` after ``wait`` seconds without one."""
        call = calls.next_delivery(filter, wait=wait, group=group, start=start)
        return self.call(call, timeout=timeout)

    def ack(self, sort_key: int, *, group: str | None = None, timeout: float | None = None) -> bool:
        return self.call(calls.ack(sort_key, group), timeout=timeout)

    def nack(
        self,
        sort_key: int,
        *,
        group: str | None = None,
        delay: float | None = None,
        timeout: float | None = None,
    ) -> bool:
        return self.call(calls.nack(sort_key, group, delay), timeout=timeout)

    def extend(
        self, sort_key: int, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        return self.call(calls.extend(sort_key, group), timeout=timeout)

    def lag(
        self, filter: str | None = None, *, group: str | None = None, timeout: float | None = None
    ) -> Lag:
        return self.call(calls.lag(filter, group), timeout=timeout)

    def dead(
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
        return self.call(calls.dead(filter, group, limit, after), timeout=timeout)

    def requeue(
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
        return self.call(calls.move_dead("requeue", sort_keys, filter, group), timeout=timeout)

    def purge(
        self,
        sort_keys: Sequence[int] | None = None,
        *,
        filter: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Drop dead letters for good (selected as for :meth:`requeue`). Returns how many
        were purged, durably."""
        return self.call(calls.move_dead("purge", sort_keys, filter, group), timeout=timeout)

    def delete_group(self, group: str, *, timeout: float | None = None) -> bool:
        """Delete an event consumer group and all it recorded (event claim face only);
        False when there is no such group."""
        return self.call(calls.delete_group(group), timeout=timeout)


class TierClient(Connection):
    """The tier face (:9110)."""

    def append(
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
        return self.call(call, timeout=timeout)

    def append_batch(
        self,
        execution_id: str | int,
        payloads: Iterable[str],
        *,
        tier: str | None = None,
        transaction_id: str | None = None,
        timeout: float | None = None,
    ) -> BatchAppended:
        call = calls.append_batch(execution_id, payloads, tier=tier, transaction_id=transaction_id)
        return self.call(call, timeout=timeout)

    def delete_execution(
        self, execution_id: str | int, *, tier: str | None = None, timeout: float | None = None
    ) -> int:
        """Delete the execution's history in ``tier`` (default ``eventlog``), durably; the
        records deleted (0: it had none). For clean-up tooling: the tier keeps history
        unless told otherwise."""
        return self.call(calls.delete_execution(execution_id, tier=tier), timeout=timeout)

    def read_execution(
        self,
        execution_id: str | int,
        *,
        tier: str | None = None,
        after: int | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> Page:
        call = calls.read_execution(execution_id, tier=tier, after=after, limit=limit)
        return self.call(call, timeout=timeout)

    def scan(
        self,
        *,
        tier: str | None = None,
        after: int | None = None,
        limit: int | None = None,
        timeout: float | None = None,
    ) -> Page:
        return self.call(calls.scan(tier=tier, after=after, limit=limit), timeout=timeout)

    def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self.call(calls.tier_health(), timeout=timeout)

    def read_all(
        self, execution_id: str | int, *, tier: str | None = None, timeout: float | None = None
    ) -> Iterator[TierRecord]:
        """Every record of the execution, page after page (``timeout`` per page)."""
        after: int | None = None
        while True:
            page = self.read_execution(execution_id, tier=tier, after=after, timeout=timeout)
            yield from page.records
            if page.next_after is None:
                return
            after = page.next_after


class SubscribeClient(Connection):
    """The event subscribe face (:9108). A subscription holds its connection."""

    def subscribe(self, start: int = 0, *, filter: str | None = None) -> Iterator[Batch]:
        """Batches of records with sort key > ``start``: history first, then live."""
        return self._stream_replies(calls.subscribe(start, filter))


W = TypeVar("W", bound=Connection)


class _Writers(Generic[W]):
    """One client per shard's writer, closed together."""

    writers: Sequence[W]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class Router(_Writers[IngestClient]):
    """Publishes each record to the writer that owns its shard; connections open on
    first use and reconnect after a writer restarts. Errors carry ``error.shard``."""

    def __init__(self, shards: ShardMap, **options: Any) -> None:
        self.shards = shards
        self.writers = [IngestClient(address, **options) for address in shards.addresses]

    def publish(
        self, record: Record, *, msg_id: str | None = None, timeout: float | None = None
    ) -> Published:
        shard = self.shards.shard_for(record["execution_id"])
        try:
            return self.writers[shard].publish(record, msg_id=msg_id, timeout=timeout)
        except ClientError as error:
            raise self.shards.tag(error, shard) from None

    def publish_batch(
        self, records: list[Record], *, timeout: float | None = None
    ) -> list[tuple[int, int]]:
        """One ``publish_batch`` per shard; ``(shard, sort_key)`` per record, in order.
        A shard's failure raises (tagged) after the shards before it were published."""
        keys: list[tuple[int, int]] = [(0, 0)] * len(records)
        for shard, indexes in sorted(self.shards.split(records).items()):
            try:
                sort_keys = self.writers[shard].publish_batch(
                    [records[i] for i in indexes], timeout=timeout
                )
            except ClientError as error:
                raise self.shards.tag(error, shard) from None
            for index, sort_key in zip(indexes, sort_keys, strict=True):
                keys[index] = (shard, sort_key)
        return keys


class ShardedClaimClient(_Writers[ClaimClient]):
    """Claims from several writers (one claim address per shard) fairly: round robin
    over the shards with pending work, so none is starved. When no shard has a record it
    asks again after a pause (10 ms, doubling to 250 ms) until ``wait`` passes; a
    writer that is down is skipped (and retried next round) while others serve."""

    def __init__(self, shards: ShardMap, **options: Any) -> None:
        self.shards = shards
        self.writers = [ClaimClient(address, **options) for address in shards.addresses]
        self._rotation = Rotation(shards.shard_count)

    def next(
        self,
        filter: str,
        *,
        wait: float | None = None,
        group: str | None = None,
        start: str | None = None,
        timeout: float | None = None,
    ) -> ShardDelivery | None:
        deadline = math.inf if wait is None else time.monotonic() + wait
        rounds = ClaimRounds(self.shards, self._rotation)
        while True:
            for shard in rounds.round():
                try:
                    delivery = self.writers[shard].next(
                        filter, wait=0, group=group, start=start, timeout=timeout
                    )
                except ClientError as error:
                    rounds.failed(shard, error)  # raises unless the writer is down
                    continue
                if delivery is not None:
                    return rounds.served(shard, delivery)
            pause = rounds.pause(deadline - time.monotonic())
            if pause is None:
                return None
            time.sleep(pause)

    def ack(
        self, claimed: ShardDelivery, *, group: str | None = None, timeout: float | None = None
    ) -> bool:
        try:
            return self.writers[claimed.shard].ack(
                claimed.delivery.sort_key, group=group, timeout=timeout
            )
        except ClientError as error:
            raise self.shards.tag(error, claimed.shard) from None


__all__ = [
    "ClaimClient",
    "Connection",
    "IngestClient",
    "Router",
    "ShardedClaimClient",
    "SubscribeClient",
    "TierClient",
]
