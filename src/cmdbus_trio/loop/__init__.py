"""The loop's runtime: what keeps one trio loop fair and observable, for every room
above it.

- :mod:`~cmdbus_trio.loop.turns`: the data plane's share of each turn of the loop, and
  the control face's own share;
- :mod:`~cmdbus_trio.loop.steps`: work handed over by callbacks, run in short steps;
- :mod:`~cmdbus_trio.loop.batcher`: work queued on the loop, done in batches by one
  thread;
- :mod:`~cmdbus_trio.loop.heartbeat`: the heartbeat behind ``/livez`` and the loop lag;
- :mod:`~cmdbus_trio.loop.interpreter`: what serving sets in the interpreter (the GIL
  switch interval, the collector).

It imports nothing of the faces, the buses, the tier, storage or the protocol
(tests/test_layering.py): only the admission's offload helper, metrics and logs.
"""

from collections.abc import Callable, Coroutine
from typing import Any

Task = Callable[..., Coroutine[Any, Any, None]]
"""A background task: ``run(*, task_status)``, started in a supervised nursery."""
