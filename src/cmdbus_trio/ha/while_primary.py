"""A command run while this member is primary (``CMDBUS_HA_WHILE_PRIMARY``), such as
Litestream's ``replicate``: only the primary's stores are replicated off the node.

Litestream writes into the stores it replicates and checkpoints them, and it reads a
store's WAL as it grows, so it must never run while the member's follower rewrites the
stores (a standby applies the primary's pages to them as they are). So the member runs it
itself: started once it serves as primary, stopped (``SIGTERM``, then ``SIGKILL`` after
:data:`STOP_GRACE_S`) as soon as it is deposed or hands over, and always before it follows
another member. One that exits on its own is logged, counted and started again.

When the member stops serving by a drain (SIGTERM), the command is stopped after the last
write and before the stores close (:meth:`WhilePrimary.stop`): SQLite's last close folds
the WAL into the database and deletes it, and Litestream's last sync, as it exits, must
have read that WAL to its end first.

Before each start, the member may fold every store's WAL into its database and cut it
back to nothing (:func:`truncate_wals`, with ``CMDBUS_CHECKPOINTS=litestream``).
Litestream carries on from the WAL position it last copied when the frames there are
still the ones it read. A member killed with its Litestream can leave frames Litestream
never read; if a checkpoint then copies them into the database and a writer starts the
WAL again over them (the next term, on the same member), Litestream (0.5.17) carries on
from the new WAL's first frame and its replica lacks those pages: a corrupt replica. A
WAL cut back to nothing is one it cannot mistake: its first sync copies the whole store.

Cancellation: :meth:`WhilePrimary.run` stops the command before it returns, whatever
ended it.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

from cmdbus_trio import metrics
from cmdbus_trio.ha.keeper import Offload
from cmdbus_trio.logs import event
from cmdbus_trio.storage._sqlite import SqliteStore

log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
"""How long the command has to exit after SIGTERM before it is killed. Short: the member
waits for it before it hands the lease over, and after it was deposed the new primary
starts its own once the lease expired (the lease's margin, a fifth of it)."""
RESTART_AFTER_S = 1.0
"""How long after the command exited on its own it is started again."""
TRUNCATE_TRIES = 20
"""Times a WAL's truncation is tried before the command starts, each waiting up to
``WAL_TRIM_WAIT_MS`` (100 ms) for readers still on the WAL: two seconds at most."""


class WhilePrimary:
    """``command``, run over one term as primary: :meth:`run` once the member serves,
    :meth:`stop` before its stores close."""

    def __init__(
        self, command: Sequence[str], *, before_start: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.command = command
        self.before_start = before_start
        """Awaited before each start of the command (:func:`truncate_wals`)."""
        self._stop = trio.Event()
        self._ran = False
        self._stopped = trio.Event()

    async def run(self, until: trio.Event) -> None:
        """Run the command until ``until`` is set or :meth:`stop` is called (or this is
        cancelled), again each time it exits on its own; it is stopped before this
        returns. Once stopped, it is not run again."""
        if self._stop.is_set():
            return
        self._ran = True
        try:
            async with trio.open_nursery() as nursery:

                async def stop_when(event: trio.Event) -> None:
                    await event.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(stop_when, until)
                nursery.start_soon(stop_when, self._stop)
                nursery.start_soon(_keep_running, self.command, self.before_start)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop the command and wait until it has exited (at once if it never ran)."""
        self._stop.set()
        if self._ran:
            await self._stopped.wait()


async def truncate_wals(stores: Mapping[str, SqliteStore], offload: Offload) -> None:
    """Every store's WAL folded into its database and cut back to nothing (see the
    module's docstring), or, when readers kept one from it for :data:`TRUNCATE_TRIES`
    tries, a warning: Litestream then carries on from the WAL it last read."""
    truncated = []
    for name, store in stores.items():
        for _ in range(TRUNCATE_TRIES):
            if await offload(store.truncate_wal):
                truncated.append(name)
                break
        else:
            why = "readers held the WAL: Litestream carries on from the WAL it last read"
            event(log, logging.WARNING, "wal_not_truncated", store=name, why=why)
    event(log, logging.INFO, "wals_truncated", stores=truncated)


async def _keep_running(
    command: Sequence[str], before_start: Callable[[], Awaitable[None]] | None
) -> None:
    while True:
        if before_start is not None:
            await before_start()
        try:
            process = await trio.lowlevel.open_process(list(command), stdin=subprocess.DEVNULL)
        except OSError as exc:  # (gone, or no longer executable, since the writer started)
            ended = f"did not start: {exc}"
        else:
            event(log, logging.INFO, "while_primary_started", command=shlex.join(command),
                  pid=process.pid)  # fmt: skip
            try:
                ended = f"exited with code {await process.wait()}"
            finally:
                with trio.CancelScope(shield=True):
                    await _stop(process)
        metrics.HA_WHILE_PRIMARY_EXITS.inc()
        why = f"while this member is primary: started again in {RESTART_AFTER_S} s"
        event(log, logging.ERROR, "while_primary_exited", command=command[0], ended=ended,
              why=why)  # fmt: skip
        await trio.sleep(RESTART_AFTER_S)


async def _stop(process: trio.Process) -> None:
    if process.returncode is not None:
        return
    process.terminate()
    with trio.move_on_after(STOP_GRACE_S):
        await process.wait()
        event(log, logging.INFO, "while_primary_stopped", pid=process.pid,
              code=process.returncode)  # fmt: skip
        return
    process.kill()
    await process.wait()
    event(log, logging.WARNING, "while_primary_killed", pid=process.pid,
          why=f"it did not exit within {STOP_GRACE_S} s of SIGTERM")  # fmt: skip
