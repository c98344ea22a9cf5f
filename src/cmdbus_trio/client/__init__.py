"""Python clients of the data faces.

- :mod:`cmdbus_trio.client.trio`: trio clients, pipelined (many tasks share one).
- :mod:`cmdbus_trio.client.blocking`: the same over plain sockets; never imports trio.

Both speak v2 through one sans-io core, raise the exceptions below (one per error code),
return the attrs results below, and take an opt-in :class:`RetryPolicy`. This package's
``__init__`` imports neither transport, so importing the blocking one stays trio-free.
"""

from cmdbus_trio.protocol.bus import Published
from cmdbus_trio.protocol.tier import TierRecord

from ._calls import (
    Appended,
    Batch,
    BatchAppended,
    Call,
    DeadPage,
    Delivery,
    Lag,
    Page,
    Record,
    Subscribed,
)
from ._errors import (
    Busy,
    CannotConnect,
    ClientClosed,
    ClientError,
    Conflict,
    ConnectionLost,
    DeadlineExceeded,
    InternalError,
    Invalid,
    ServerError,
    TooLarge,
    Unavailable,
    Unsupported,
)
from ._retry import ReconnectStatistics, RetryBudget, RetryPolicy, RetryStatistics
from ._shards import ShardDelivery, ShardMap

__all__ = [
    "Appended",
    "Batch",
    "BatchAppended",
    "Busy",
    "Call",
    "CannotConnect",
    "ClientClosed",
    "ClientError",
    "Conflict",
    "ConnectionLost",
    "DeadPage",
    "DeadlineExceeded",
    "Delivery",
    "InternalError",
    "Invalid",
    "Lag",
    "Page",
    "Published",
    "ReconnectStatistics",
    "Record",
    "RetryBudget",
    "RetryPolicy",
    "RetryStatistics",
    "ServerError",
    "ShardDelivery",
    "ShardMap",
    "Subscribed",
    "TierRecord",
    "TooLarge",
    "Unavailable",
    "Unsupported",
]
