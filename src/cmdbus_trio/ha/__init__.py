"""High availability: a standby per shard.

The members of a shard agree on a primary through a lease in a store that decides
(:mod:`.lease`: a directory of versioned files, or a Kubernetes Lease); the rules of who
may take it and for how long are :mod:`.elector`'s, a state machine with no I/O.
"""

from .elector import Elector, Intent, Role, SyncMode
from .lease import (
    LeaseConflict,
    LeaseError,
    LeaseRecord,
    LeaseStore,
    Versioned,
    open_lease_store,
)

__all__ = [
    "Elector",
    "Intent",
    "LeaseConflict",
    "LeaseError",
    "LeaseRecord",
    "LeaseStore",
    "Role",
    "SyncMode",
    "Versioned",
    "open_lease_store",
]
