"""Trio-side coordinators of the buses: the group committer, the body reader, claims,
consumer groups and subscriptions."""

from __future__ import annotations

import attrs

from cmdbus_trio.storage.buslog import BusLog

from .bodies import BodyReader
from .claims import Claims
from .committer import GroupCommitter
from .groups import ConsumerGroups
from .subscriptions import Hub


@attrs.frozen
class Bus:
    """One bus as the faces see it: its log, the committer that appends to it, the reader
    of delivered bodies, and the claim coordinator of its consumers."""

    log: BusLog
    committer: GroupCommitter
    bodies: BodyReader
    claims: Claims | None = None
    """The command bus's single consumer group."""
    groups: ConsumerGroups | None = None
    """The event bus's named consumer groups."""
    hub: Hub | None = None
    """The event bus's live subscriptions."""
