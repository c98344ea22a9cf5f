"""Delivery to one consumer (a connection of a claim face): leases, slots, bodies, acks.

A :class:`Consumer` is the connection's side of the consumer groups it claims from. It
owns the lifecycle of what the connection holds: a ``next`` waits in memory for a
matching record, leases it, takes a Gate slot, reads its body with the others asked for
meanwhile (:mod:`cmdbus_trio.bus.bodies`), and gives the record back if any of that
fails; an ``ack`` is durable, group-committed like a publish, before it is answered; the
connection's leases end the moment it closes. The claim faces decode a request, call
this, and encode what it returns.

Each op has one way to complete. ``next`` waits (for a record, then a slot), so it is a
task's; ``ack`` completes when its commit is settled, by the committer's callback (a
:class:`~cmdbus_trio.loop.deferred.Deferred`); ``nack`` and ``extend`` complete at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import Gate, Shed, Slot
from cmdbus_trio.logs import event
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.protocol.claim import LeaseTokens
from cmdbus_trio.protocol.trace import TraceContext
from cmdbus_trio.storage.buslog import StoredRecord
from cmdbus_trio.tracing import spans

from . import Bus
from ._leases import with_tokens
from .claims import Claims, Delivery
from .committer import Ticket

log = logging.getLogger(__name__)

Encode: TypeAlias = Callable[[Delivery, str, TraceContext | None], bytes]
"""How a claim face encodes a delivery: from the lease, the stored record's JSON text and
the trace context it was published with."""


class Consumer:
    """One connection's leases, in every consumer group it claims from (it is their
    owner). ``face`` names the connection's face in metrics and the log; ``gate`` admits
    its deliveries."""

    def __init__(self, bus: Bus, gate: Gate, face: str) -> None:
        self.bus = bus
        self.gate = gate
        self.face = face
        self.groups = bus.groups
        self._used: dict[str, Claims] = {}  # the groups this connection claimed from

    async def group(self, group: Any, start: Any = None) -> Claims:
        """The coordinator a request's ``group`` (and ``from``) fields name, waiting for
        its creation if the request creates it (see :meth:`ConsumerGroups.resolve`).

        Error handling: :class:`FieldError` naming the field."""
        claims = await self.groups.resolve(group, start)
        self._used[claims.group] = claims
        return claims

    def holding(self) -> bool:
        """The connection holds a lease (it is not idle while it does)."""
        return any(claims.holds(self) for claims in self._used.values())

    def release(self, outcome: str) -> int:
        """The connection closed (``outcome``: why): its leases redeliver at once. Said in
        the log and a metric: the worker, if it did not close the connection itself,
        finds its ack refused. Returns how many were released."""
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
        return released

    async def next(
        self,
        claims: Claims,
        filter_tokens: tuple[str, ...],
        budget: float | None,
        *,
        encode: Encode,
        most: int = 1,
        room: int | None = None,
        patient: bool = False,
    ) -> list[bytes]:
        """Wait for a matching record, lease it and up to ``most - 1`` more that match
        then, read their bodies under one Gate slot, and return each delivery as
        ``encode`` makes it (from the lease, the stored JSON text and the record's trace
        context), in lease order.
        ``room``: bytes the encoded deliveries may take, with a comma between two; the
        first is taken whatever its size (its reply is then ``too_large``, as a single
        one's), and those that do not fit after it are given back.

        Each record is leased on its own (its own lease, delivery count, redelivery).
        The wait for a record is the client's (``timeout_ms``, or unbounded): the Gate
        and the request's budget see the request only once a record is handed to it, so
        a parked consumer holds no slot, and its budget is not spent by waiting. A
        ``next`` that is then shed gives its records back as if they had never been
        delivered (their delivery counts restored, not ``redelivered``), offered to the
        parked consumers once the Gate frees a slot (see :meth:`Claims.give_back`).

        Cancellation: nothing stays leased when cancelled while waiting; once its slot
        is had, the bodies are read whatever is cancelled (a batch takes a hop, not a
        client's patience).

        Error handling: :class:`Shed` when admission refuses, unless ``patient`` (v1,
        which has no way to say ``busy``): then it waits ``retry_after`` and tries again.
        :class:`GateClosed` when the writer drains or the group is deleted; the store's
        errors, the records given back.
        """
        while True:
            leased = [await claims.next(filter_tokens, self)]
            if most > 1:
                leased += claims.next_many_nowait(filter_tokens, self, most - 1)
            try:
                slot = await self.gate.acquire("next", budget=budget)
            except Shed as shed:
                for delivery in leased:
                    claims.give_back(delivery.sort_key, self, offer=False)
                self.gate.when_free(claims.offer_held)
                if not patient:
                    raise
                await trio.sleep((shed.retry_after_ms or 1000 * self.gate.shed_after) / 1000)
                continue
            except BaseException:
                self._give_back(claims, leased)
                raise
            with slot:
                try:
                    with trio.CancelScope(shield=True):
                        bodies = await self.bus.bodies.read_many([d.sort_key for d in leased])
                except BaseException:
                    self._give_back(claims, leased)  # never delivered
                    raise
            handed = self._handed(claims, leased, bodies, encode, room, slot)
            if handed:
                return handed
            # Every one evicted (CMDBUS_EVT_MAX_BYTES) while this waited for its slot:
            # the group forgot and counted them; take the next ones.

    def _handed(
        self,
        claims: Claims,
        leased: list[Delivery],
        bodies: list[StoredRecord | Exception],
        encode: Encode,
        room: int | None,
        slot: Slot,
    ) -> list[bytes]:
        """The deliveries whose bodies were read, encoded, within ``room``; the others
        given back. An error reading any but an evicted record gives them all back.
        ``slot``: the one they were read under (its wait is each ``deliver`` span's)."""
        failed = next(
            (
                body
                for delivery, body in zip(leased, bodies, strict=True)
                if isinstance(body, Exception) and not _evicted(claims, delivery, body)
            ),
            None,
        )
        if failed is not None:  # an evicted record is no error: the group forgot it
            self._give_back(claims, leased)
            raise failed
        handed: list[bytes] = []
        used = -1  # no comma before the first
        full = False
        for delivery, body in zip(leased, bodies, strict=True):
            if isinstance(body, Exception):
                continue  # evicted while this waited for its slot
            if not full:
                encoded = encode(delivery, body.record, body.trace)
                full = bool(handed) and room is not None and used + 1 + len(encoded) > room
            if full:  # this one and the rest, oldest first, go to the next request
                claims.give_back(delivery.sort_key, self)
                continue
            used += 1 + len(encoded)
            handed.append(encoded)
            spans.delivered(
                self.face,
                claims.group,
                delivery,
                body.trace,
                slot.arrival,
                slot.admitted_at - slot.arrival,
            )
        return handed

    def _give_back(self, claims: Claims, leased: list[Delivery]) -> None:
        for delivery in leased:
            claims.give_back(delivery.sort_key, self)

    def ack(
        self,
        group: Any,
        sort_keys: Sequence[int],
        trace: TraceContext | None = None,
        leases: LeaseTokens = None,
    ) -> Deferred[list[bool]]:
        """Make the acks of records this connection holds durable, in one group commit
        (with the publishes and acks queued meanwhile). For each key in order: True once
        the commit is settled, False when the connection holds no record by that key
        (answered at once when it holds none). Once the commit settles, the claim index
        forgets the records, or, if the commit failed, redelivers them and the outcome
        is the error. ``trace``: the acking worker's context, the parent of the ``ack``
        span. ``leases``: the token of the lease to settle for each key, where given (a
        key held by another lease of this connection is then False).

        Error handling: :class:`FieldError` naming the group field (raised)."""
        claims = self.groups.known(group)
        group_name = _group_name(claims, group)
        span = spans.settling("ack", self.face, group_name, len(sort_keys), trace)
        begun = (
            [False] * len(sort_keys)
            if claims is None
            else claims.begin_acks(sort_keys, self, leases)
        )
        if claims is None or not any(begun):
            spans.settled(span, begun)
            return Deferred.of(begun)
        started = [key for key, ok in zip(sort_keys, begun, strict=True) if ok]
        acked: Deferred[list[bool]] = Deferred()

        def settled(ticket: Ticket) -> None:
            if ticket.error is None:
                claims.finish_acks(started)
            else:
                for key in started:
                    claims.abort_ack(key)
            outcome = begun if ticket.error is None else ticket.error
            spans.settled(span, outcome)
            acked.settle(outcome)

        acks = [(claims.group, key) for key in started]
        self.bus.committer.enqueue(Ticket(acks=acks, on_settled=settled))
        return acked

    def nack(
        self,
        group: Any,
        sort_keys: Sequence[int],
        delay: float | None = None,
        trace: TraceContext | None = None,
        leases: LeaseTokens = None,
    ) -> list[bool]:
        """End this connection's leases of the records: each redelivers after ``delay``
        seconds (None: the group's ``ack_wait``). For each key: False when the
        connection holds no record by it.

        Error handling: :class:`FieldError` naming the group field."""
        claims = self.groups.known(group)
        group_name = _group_name(claims, group)
        span = spans.settling("nack", self.face, group_name, len(sort_keys), trace)
        if claims is None:
            nacked = [False] * len(sort_keys)
        else:
            wait = claims.ack_wait if delay is None else delay
            named = with_tokens(sort_keys, leases)
            nacked = [claims.nack(key, self, wait, token) for key, token in named]
        spans.settled(span, nacked)
        return nacked

    def nack_held(self, sort_key: int) -> bool:
        """v1's ``Nack`` naming no group: in whichever group this connection holds it."""
        return any(claims.nack(sort_key, self, claims.ack_wait) for claims in self._used.values())

    def extend(
        self, group: Any, sort_keys: Sequence[int], leases: LeaseTokens = None
    ) -> list[bool]:
        """Renew this connection's leases of the records for :attr:`lease_seconds`. For
        each key: False when the connection holds no record by it.

        Error handling: :class:`FieldError` naming the group field."""
        claims = self.groups.known(group)
        if claims is None:
            return [False] * len(sort_keys)
        return [claims.extend(key, self, token) for key, token in with_tokens(sort_keys, leases)]

    def refusals(
        self,
        op: str,
        group: Any,
        sort_keys: Sequence[int],
        outcomes: Sequence[bool],
        leases: LeaseTokens = None,
    ) -> list[str | None] | None:
        """Why each settle (``op``: ``ack``, ``nack``, ``extend``) of the keys that
        ``outcomes`` says were refused was refused (:meth:`Claims.refusal`), None for
        the others; None when none was. Each refusal is counted."""
        if all(outcomes):
            return None
        claims = self.groups.known(group)
        why: list[str | None] = []
        named = with_tokens(sort_keys, leases)
        for (sort_key, token), settled in zip(named, outcomes, strict=True):
            reason = None
            if not settled:
                reason = "not_leased" if claims is None else claims.refusal(sort_key, self, token)
                metrics.SETTLES_REFUSED.labels(self.face, op, reason).inc()
            why.append(reason)
        return why

    @property
    def lease_seconds(self) -> float:
        """How long a lease lasts (``CMDBUS_ACK_WAIT_MS``), from its delivery or renewal."""
        return self.groups.ack_wait


def _group_name(claims: Claims | None, group: Any) -> str:
    """The group a request named, for a span (one it did not resolve as sent)."""
    return claims.group if claims is not None else str(group)


def _evicted(claims: Claims, delivery: Delivery, body: Exception) -> bool:
    """The body is gone because the record was evicted (``CMDBUS_EVT_MAX_BYTES``) after
    it was leased: the group forgot and counted it."""
    return isinstance(body, LookupError) and delivery.sort_key <= claims.evicted_through
