"""The lease that decides which member of a shard is primary, and the stores that hold it.

The store decides, not the members: a record changes only by compare-and-swap on the
version a member read, so of two members writing on the same version exactly one wins
and the other learns it lost. There is no consensus of our own; the store's (a file
system's ``link``, the Kubernetes API server's ``resourceVersion``) is the only one.

The record carries what a member needs to act on without asking the other: the holder
and its epoch, the duration, who is in sync, who held it last, and where the primary's
faces are. Time in the record is informational: each member judges expiry by its own
monotonic clock, from when it saw the version change (:mod:`cmdbus_trio.ha.elector`).

The stores block (a file system, an HTTP request): like storage, their entry points
refuse the event-loop thread and are called through the offload helper.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

LEASE_SETTING = "CMDBUS_HA_LEASE"


class LeaseError(Exception):
    """The lease store could not be read or written (unreachable, refused, malformed)."""


class LeaseConflict(LeaseError):
    """The record changed since the version the write named: another member wrote."""


def _faces(faces: Mapping[str, str]) -> dict[str, str]:
    return dict(faces)


@attrs.frozen
class LeaseRecord:
    holder: str | None
    """The primary's member name; None: released (handed over, or its holder stopped)."""
    epoch: int
    """Grows with every acquisition, also when the same member acquires it again."""
    duration_ms: int
    """How long the lease lasts after each renewal, by the observer's own clock."""
    renewed_at: float = 0.0
    """The holder's wall clock at the write (unix seconds): for people, never for expiry."""
    in_sync: str | None = None
    """The standby the primary counts on, or None: no standby is in sync, so only
    :attr:`last_primary` may take the lease."""
    last_primary: str | None = None
    """The member that held the lease last."""
    faces: Mapping[str, str] = attrs.field(factory=dict, converter=_faces)
    """The primary's faces, name to ``HOST:PORT`` (``ha``: its replication face)."""

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> LeaseRecord:
        """The record of a decoded JSON object; :class:`LeaseError` naming what is wrong."""
        if not isinstance(value, dict):
            raise LeaseError(f"the lease record is not an object: {value!r:.80}")
        try:
            record = cls(**value)
        except TypeError as exc:
            raise LeaseError(f"the lease record has unknown or missing fields: {exc}") from None
        for name, kind in _FIELD_TYPES.items():
            field = getattr(record, name)
            if not isinstance(field, kind) or isinstance(field, bool):
                raise LeaseError(f"the lease record's {name} is not {_KIND_NAMES[name]}")
        if not all(isinstance(v, str) for v in record.faces.values()):
            raise LeaseError("the lease record's faces are not addresses (strings)")
        if record.epoch < 0 or record.duration_ms < 1:
            raise LeaseError("the lease record's epoch or duration_ms is out of range")
        return record

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "holder": (str, type(None)),
    "epoch": int,
    "duration_ms": int,
    "renewed_at": (int, float),
    "in_sync": (str, type(None)),
    "last_primary": (str, type(None)),
    "faces": dict,
}
_KIND_NAMES = {
    "holder": "a name or null",
    "epoch": "an integer",
    "duration_ms": "an integer",
    "renewed_at": "a number",
    "in_sync": "a name or null",
    "last_primary": "a name or null",
    "faces": "an object",
}


@attrs.frozen
class Versioned:
    """A record as the store holds it, with the version a write must name to replace it."""

    record: LeaseRecord
    version: str


class LeaseStore(Protocol):
    """Where the members agree. Both methods block (call them in a worker thread)."""

    def describe(self) -> str:
        """The store, for logs and errors (``file:/path``, ``kubernetes:ns/name``)."""
        ...

    def read(self) -> Versioned | None:
        """The record and its version; None when there is none yet.
        :class:`LeaseError` when the store cannot answer."""
        ...

    def write(self, record: LeaseRecord, version: str | None) -> str:
        """Replace the record of ``version`` (None: create the first one) and return the
        new version. :class:`LeaseConflict` when the store holds another version (or,
        creating, any record): nothing was written."""
        ...


def open_lease_store(spec: str, service_account: Path | None = None) -> LeaseStore:
    """The store ``CMDBUS_HA_LEASE`` names: ``file:PATH`` or ``kubernetes:NAMESPACE/NAME``
    (the API server and credentials of a pod, from ``service_account`` when given).
    ValueError naming the setting when ``spec`` is neither, or a pod's credentials are
    missing."""
    from ._file_lease import FileLeaseStore  # (each store's imports only when used)
    from ._kube_api import SERVICE_ACCOUNT, KubeAPI
    from ._kube_lease import KubernetesLeaseStore

    kind, _, where = spec.partition(":")
    if kind == "file" and where:
        return FileLeaseStore(where)
    if kind == "kubernetes" and where.count("/") == 1 and all(where.split("/")):
        namespace, name = where.split("/")
        try:
            api = KubeAPI.in_cluster(service_account or SERVICE_ACCOUNT)
        except ValueError as exc:
            raise ValueError(f"{LEASE_SETTING}={spec} {exc}") from None
        return KubernetesLeaseStore(namespace, name, api)
    raise ValueError(
        f"{LEASE_SETTING} must be file:PATH or kubernetes:NAMESPACE/NAME, not {spec!r}"
    )
