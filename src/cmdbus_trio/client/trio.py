"""The trio client: one class per face over a pipelined v2 connection.

    async with await TierClient.connect("127.0.0.1:9110") as tier:
        appended = await tier.append(7, '{"event_type": "step.done"}', timeout=2.0)

Any number of tasks may call one client at once: requests are pipelined with ids and
replies are matched to callers as they come, in any order. Whichever caller is waiting
reads the socket for everyone, so a client needs no background task and no nursery.
"""

from __future__ import annotations

from ._errors import ServerError
from ._trio_connection import Connection
from ._trio_faces import (
    ClaimClient,
    IngestClient,
    Router,
    ShardedClaimClient,
    SubscribeClient,
    TierClient,
)

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
