"""The blocking client: the same faces and results as :mod:`cmdbus_trio.client.trio` over
a plain socket, for threads and scripts. It never imports trio.

    with TierClient.connect("127.0.0.1:9110") as tier:
        appended = tier.append(7, '{"event_type": "step.done"}', timeout=2.0)

One call at a time per client (a lock serializes threads); :meth:`Connection.call_many`
pipelines several requests in one round trip.
"""

from __future__ import annotations

from . import _blocking_faces, _blocking_sharded
from ._blocking_connection import Connection
from ._blocking_faces import *  # noqa: F403  # the faces: _blocking_faces.__all__
from ._blocking_sharded import *  # noqa: F403  # the sharded clients: _blocking_sharded.__all__
from ._errors import ServerError

__all__ = ["Connection", "ServerError", *_blocking_faces.__all__, *_blocking_sharded.__all__]
