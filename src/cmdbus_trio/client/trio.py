"""The trio client: one class per face over a pipelined v2 connection.

    async with await TierClient.connect("127.0.0.1:9110") as tier:
        appended = await tier.append(7, '{"event_type": "step.done"}', timeout=2.0)

Any number of tasks may call one client at once: requests are pipelined with ids and
replies are matched to callers as they come, in any order. Whichever caller is waiting
reads the socket for everyone, so a client needs no background task and no nursery.
"""

from __future__ import annotations

from . import _trio_faces, _trio_sharded
from ._errors import ServerError
from ._trio_connection import Connection
from ._trio_faces import *  # noqa: F403  # the faces: _trio_faces.__all__
from ._trio_sharded import *  # noqa: F403  # the sharded clients: _trio_sharded.__all__

__all__ = ["Connection", "ServerError", *_trio_faces.__all__, *_trio_sharded.__all__]
