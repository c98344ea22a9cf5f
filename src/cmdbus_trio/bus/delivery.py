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
from typing import Any

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import Gate, Shed
from cmdbus_trio.logs import event
from cmdbus_trio.loop.deferred import Deferred
from cmdbus_trio.storage.buslog import StoredRecord

from . import Bus
from .claims import Claims, Delivery
from .committer import Ticket

log = logging.getLogger(__name__)


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
        patient: bool = False,
    ) -> tuple[Delivery, StoredRecord]:
        """Wait for a matching record, lease it, then read its body under a Gate slot.

        The wait for a record is the client's (``timeout_ms``, or unbounded): the Gate
        and the request's budget see the request only once a record is handed to it, so
        a parked consumer holds no slot, and its budget is not spent by waiting. A
        ``next`` that is then shed gives its record back as if it had never been
        delivered (its delivery count restored, not ``redelivered``), offered to the
        parked consumers once the Gate frees a slot (see :meth:`Claims.give_back`).

        Cancellation: nothing stays leased when cancelled while waiting; once its slot
        is had, the body is read whatever is cancelled (a batch takes a hop, not a
        client's patience).

        Error handling: :class:`Shed` when admission refuses, unless ``patient`` (v1,
        which has no way to say ``busy``): then it waits ``retry_after`` and tries again.
        :class:`GateClosed` when the writer drains or the group is deleted; the store's
        errors, the record given back.
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

    def ack(self, group: Any, sort_key: int) -> Deferred[bool]:
        """Make the ack of a record this connection holds durable: group-committed like a
        publish; True once the commit is settled, False at once when the connection holds
        no record by that key. Once the commit settles, the claim index forgets the
        record, or, if the commit failed, redelivers it and the outcome is the error.

        Error handling: :class:`FieldError` naming the group field (raised)."""
        claims = self.groups.known(group)
        if claims is None or not claims.begin_ack(sort_key, self):
            return Deferred.of(False)
        acked: Deferred[bool] = Deferred()

        def settled(ticket: Ticket) -> None:
            if ticket.error is None:
                claims.finish_ack(sort_key)
                acked.settle(True)
            else:
                claims.abort_ack(sort_key)
                acked.settle(ticket.error)

        self.bus.committer.enqueue(Ticket(acks=[(claims.group, sort_key)], on_settled=settled))
        return acked

    def nack(self, group: Any, sort_key: int, delay: float | None = None) -> bool:
        """End this connection's lease of the record: it redelivers after ``delay``
        seconds (None: the group's ``ack_wait``). False when the connection holds no
        record by that key.

        Error handling: :class:`FieldError` naming the group field."""
        claims = self.groups.known(group)
        if claims is None:
            return False
        return claims.nack(sort_key, self, claims.ack_wait if delay is None else delay)

    def nack_held(self, sort_key: int) -> bool:
        """v1's ``Nack`` naming no group: in whichever group this connection holds it."""
        return any(claims.nack(sort_key, self, claims.ack_wait) for claims in self._used.values())

    def extend(self, group: Any, sort_key: int) -> bool:
        """Renew this connection's lease of the record for :attr:`lease_seconds`; False
        when the connection holds no record by that key.

        Error handling: :class:`FieldError` naming the group field."""
        claims = self.groups.known(group)
        return claims is not None and claims.extend(sort_key, self)

    @property
    def lease_seconds(self) -> float:
        """How long a lease lasts (``CMDBUS_ACK_WAIT_MS``), from its delivery or renewal."""
        return self.groups.ack_wait
