"""Network faces of the data plane, one module per face.

Each face is ``async def serve(ctx: FaceContext, *, task_status)``: it listens on
``ctx.bind``, reports its bound ``host:port`` through ``task_status``, serves until
``ctx.draining`` is set, then stops accepting, lets its in-flight requests finish and
returns. It knows nothing of SQL: store work goes through ``ctx.gate`` slots.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Mapping
from typing import Protocol, TypeVar

import attrs
import trio

from cmdbus_trio.admission import ByteBudget, Gate
from cmdbus_trio.config import Bind, Config

T = TypeVar("T")


@attrs.frozen
class FaceContext:
    name: str
    bind: Bind
    config: Config
    gate: Gate
    draining: trio.Event
    stores: Mapping[str, object] = attrs.field(factory=dict)
    """The open stores by name (``tier``, ``commands``, …); see :meth:`store`."""
    pending_bytes: ByteBudget | None = None
    """The face's budget of request bytes taken in (parsed and not yet answered)."""
    lanes: Mapping[str, Gate] = attrs.field(factory=dict)
    """Ops admitted by a Gate of their own instead of :attr:`gate` (the tier face's
    writes): a flood of the other ops never sheds them."""

    def gate_of(self, op: str) -> Gate:
        return self.lanes.get(op, self.gate)

    @property
    def room(self) -> int:
        """Requests a connection may read ahead: the least room of the face's Gates
        (frames are batched before they are parsed, so any of them may be for the
        fullest one)."""
        return min(gate.room for gate in (self.gate, *self.lanes.values()))

    def v1_trusted(self, stream: trio.abc.Stream) -> bool:
        """The peer may speak v1 though an auth token is set (``allow_v1`` and a
        ``v1_cidrs`` address)."""
        if not self.config.allow_v1:
            return False
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if not isinstance(stream, trio.SocketStream):
            return False
        try:
            peer = stream.socket.getpeername()
        except OSError:
            return False
        if not isinstance(peer, tuple):
            return False
        address = ipaddress.ip_address(peer[0])
        return any(address in network for network in self.config.v1_cidrs)

    def store(self, name: str, kind: type[T]) -> T:
        """The open store ``name``, which must be a ``kind`` (a wiring bug otherwise)."""
        store = self.stores.get(name)
        if not isinstance(store, kind):
            raise TypeError(f"the {self.name} face needs the {name} {kind.__name__}, got {store!r}")
        return store


class FaceServe(Protocol):
    def __call__(
        self, ctx: FaceContext, *, task_status: trio.TaskStatus[str] = ...
    ) -> Awaitable[None]: ...
