"""Who is primary: the election rules, as a state machine over the lease and a clock.

The rules are Kubernetes leader election's and Patroni's, with the synchronous standby
added. :class:`Elector` decides; it does no I/O. A driver reads the lease (in a thread),
hands each reading to :meth:`Elector.observe` with the monotonic time, asks
:meth:`Elector.intent` what to write, writes it by compare-and-swap, and reports the
result (:meth:`Elector.wrote`, :meth:`Elector.conflicted`). So every rule is tested with
a clock the test moves.

Expiry is judged by each member's own monotonic clock, never by the time in the record:
a standby counts a lease's duration from when it saw the version last change, so a lease
renewed at the primary's time ``t`` expires for the standby no sooner than ``t +
duration``. The primary counts its hold from when it *started* the write that renewed
it, and stops holding a :data:`MARGIN_FRACTION` of the duration before that: a primary
whose renewals fail stops acknowledging before any standby may take over, whatever the
two clocks' rates (within the margin).

Who may take a lease that expired (or was released): the member it names in sync, or,
when none is in sync, only the member that held it last (it has everything that was
acknowledged; a standby not in sync may lack some). With ``CMDBUS_HA_SYNC=off`` any
member may (a failover may then lose the last records), and an operator's forced
promotion waives the rule (it says what it may lose). No member ever takes a lease that
has not expired by its own clock, forced or not: that is what keeps one primary.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from .lease import LeaseRecord, Versioned

MARGIN_FRACTION = 0.2
"""Of the duration: a primary stops holding this long before its lease could expire."""
MIN_MARGIN = 0.2
"""Seconds: the margin at least, whatever the duration."""


class SyncMode(enum.Enum):
    ON = "on"
    STRICT = "strict"
    OFF = "off"


class Role(enum.Enum):
    STARTING = "starting"
    STANDBY = "standby"
    PRIMARY = "primary"
    DRAINING = "draining"


@attrs.frozen
class Intent:
    """A write the elector wants: ``record`` over ``version`` (None: create)."""

    record: LeaseRecord
    version: str | None
    acquiring: bool
    """True: it takes the lease (a new epoch); False: it renews or changes what it holds."""


class Elector:
    """One member's view of the lease.

    What it knows: :attr:`epoch`, :attr:`primary`, :attr:`in_sync`, :meth:`holds`."""

    def __init__(
        self,
        name: str,
        duration: float,
        mode: SyncMode = SyncMode.ON,
        faces: Mapping[str, str] | None = None,
        *,
        empty: bool = False,
    ) -> None:
        if duration <= 0:
            raise ValueError("the lease duration must be positive")
        self.name = name
        self.duration = duration
        self.mode = mode
        self.faces = dict(faces or {})
        self.empty = empty
        """This member's data dir holds nothing of the shard yet: it never takes a lease
        that was written before (it would serve nothing of what was acknowledged); it
        catches up as a standby first."""
        self.seen: Versioned | None = None
        """The lease as last read or written."""
        self._seen_at = 0.0  # when ``seen``'s version first appeared to this member
        self._held_until = -1.0  # monotonic: this member holds the lease until then
        self._held_epoch = -1  # the epoch it holds it in
        self._releasing = False
        self.taken_from: LeaseRecord | None = None
        """The lease as it was before this member last took it (None: it created it)."""
        self.forced = False
        """An operator's forced promotion: take the lease without being in sync."""

    # --- what the member knows -------------------------------------------------------------

    @property
    def margin(self) -> float:
        return max(self.duration * MARGIN_FRACTION, MIN_MARGIN)

    @property
    def renew_every(self) -> float:
        """How often the holder renews, and a standby reads, the lease."""
        return self.duration / 3

    @property
    def epoch(self) -> int:
        return 0 if self.seen is None else self.seen.record.epoch

    @property
    def primary(self) -> str | None:
        """The holder as last seen (it may have expired meanwhile)."""
        return None if self.seen is None else self.seen.record.holder

    @property
    def in_sync(self) -> str | None:
        return None if self.seen is None else self.seen.record.in_sync

    @property
    def held_until(self) -> float:
        """Monotonic: when this member stops holding the lease unless it renews it."""
        return self._held_until

    def holds(self, now: float) -> bool:
        """This member is primary now: it holds the lease and its own deadline has not
        passed (:data:`MARGIN_FRACTION` before the lease could expire elsewhere)."""
        return now < self._held_until

    def expired(self, now: float) -> bool:
        """The lease is free to take, by this member's clock: released, never written,
        or not renewed for its duration since this member saw it change."""
        if self.seen is None or self.seen.record.holder is None:
            return True
        duration = self.seen.record.duration_ms / 1000
        return now >= self._seen_at + duration

    def may_take(self) -> bool:
        """The rules allow this member to take the lease once it is free (the module
        docstring): it is in sync, or was primary last with none in sync, or sync is
        off, or an operator forced it."""
        if self.seen is None:
            return True  # never written: the first member to start creates it
        if self.empty:
            return False
        if self.mode is SyncMode.OFF or self.forced:
            return True
        record = self.seen.record
        if record.in_sync is not None:
            return record.in_sync == self.name
        return record.last_primary in (None, self.name)

    # --- the driver's calls ------------------------------------------------------------------

    def observe(self, current: Versioned | None, now: float) -> None:
        """What a read of the lease found at ``now``."""
        if current is None:
            self.seen = None
            return
        if self.seen is None or current.version != self.seen.version:
            self._seen_at = now
        self.seen = current
        if current.record.holder != self.name or current.record.epoch != self._held_epoch:
            self._held_until = -1.0  # someone else's (or an earlier epoch of ours)

    def intent(self, now: float, wall: float) -> Intent | None:
        """The write to make now, given the lease last observed: renew what this member
        holds, take it (free, and allowed), release it (:meth:`release`), or nothing.

        ``wall`` is the wall clock, written for people to read."""
        seen = self.seen
        if self._releasing:
            if seen is None or seen.record.holder != self.name or not self.holds(now):
                return None
            return Intent(self._released(seen.record, wall), seen.version, acquiring=False)
        if seen is not None and seen.record.holder == self.name and self.holds(now):
            renewed = attrs.evolve(seen.record, renewed_at=wall, faces=self.faces)
            return Intent(renewed, seen.version, acquiring=False)
        if seen is not None and seen.record.holder == self.name:
            # Its own, from before a restart or a lapse: nobody else took it meanwhile,
            # so it has all that was acknowledged (if its data dir is its own).
            allowed = not self.empty
        else:
            allowed = self.expired(now) and self.may_take()
        if not allowed:
            return None
        epoch = 1 if seen is None else seen.record.epoch + 1
        record = LeaseRecord(
            holder=self.name,
            epoch=epoch,
            duration_ms=round(self.duration * 1000),
            renewed_at=wall,
            in_sync=None,  # none at first: it acknowledges without waiting for a standby
            last_primary=self.name,
            faces=self.faces,
        )
        return Intent(record, None if seen is None else seen.version, acquiring=True)

    def change_sync(self, now: float, wall: float, standby: str | None) -> Intent | None:
        """The write that records ``standby`` in sync (None: no standby in sync), while
        this member holds the lease; None when it does not hold it (it may not act)."""
        seen = self.seen
        if seen is None or seen.record.holder != self.name or not self.holds(now):
            return None
        if self.mode is SyncMode.OFF:
            standby = None
        record = attrs.evolve(seen.record, in_sync=standby, renewed_at=wall)
        return Intent(record, seen.version, acquiring=False)

    def wrote(self, intent: Intent, version: str, started: float, now: float) -> None:
        """``intent`` was written as ``version``: the write was started at ``started``
        (monotonic), so the hold is counted from then, not from its answer."""
        if intent.acquiring:
            self.taken_from = self.seen.record if self.seen is not None else None
        self.seen = Versioned(intent.record, version)
        self._seen_at = now
        if intent.record.holder == self.name:
            self._held_epoch = intent.record.epoch
            self._held_until = started + intent.record.duration_ms / 1000 - self.margin
        else:
            self._held_until = -1.0

    def conflicted(self) -> None:
        """A write lost to another member's: this member holds nothing until it reads
        the lease again."""
        self._held_until = -1.0

    def release(self) -> None:
        """Hand the lease over: the next :meth:`intent` writes it with no holder (the
        standby in sync, or this member on its return, may take it at once)."""
        self._releasing = True

    def resume(self) -> None:
        """After a hand-over, as a standby: this member may take the lease again (by the
        rules) once the new holder lets it go. Until then it never takes it back, so a
        member stopping is not made primary again by its own last turns."""
        self._releasing = False

    def _released(self, record: LeaseRecord, wall: float) -> LeaseRecord:
        return attrs.evolve(record, holder=None, renewed_at=wall, faces={})
