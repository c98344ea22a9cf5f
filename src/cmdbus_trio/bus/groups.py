"""The event bus's named consumer groups: every record goes to every group; the members
of one group compete for it (one :class:`Claims` per group).

Groups are persisted with the position they start after, so a restart keeps them and
their acks. A group is created from the configured defaults at start (from the
beginning) or by a v2 client naming it with ``from``: ``beginning`` or ``tail`` (only
records published after its creation).
"""

from __future__ import annotations

import re
from typing import Final

import attrs
import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import GateClosed, run_in_thread
from cmdbus_trio.protocol import FieldError
from cmdbus_trio.storage.buslog import BusLog

from .claims import Claims, open_claims, persist_low_water
from .committer import GroupCommitter

GROUP_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")


@attrs.define(eq=False)
class _Creation:
    done: trio.Event = attrs.field(factory=trio.Event)
    error: Exception | None = None


class ConsumerGroups:
    def __init__(
        self,
        log: BusLog,
        committer: GroupCommitter,
        *,
        ack_wait: float,
        max_deliver: int,
        limiter: trio.CapacityLimiter,
    ) -> None:
        self.log = log
        self.committer = committer
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self._limiter = limiter
        self.claims: dict[str, Claims] = {}
        self._creating: dict[str, _Creation] = {}  # groups whose history is loading
        self._nursery: trio.Nursery | None = None
        self._closed = False

    async def open(self, defaults: tuple[str, ...]) -> None:
        """Load the persisted groups and create the configured ones that are missing."""
        for name, start_after in (
            await run_in_thread(self.log.groups, limiter=self._limiter)
        ).items():
            await self._load(name, start_after)
        for name in defaults:
            if name not in self.claims:
                await self.get(name, "beginning")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every group's timers and the lag sampler (in the background nursery)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for claims in self.claims.values():
                nursery.start_soon(claims.run_timers)
            nursery.start_soon(self._sample_lag)
            task_status.started()

    async def get(self, name: str, start: str | None = None) -> Claims:
        """The group's coordinator; created when ``start`` is ``beginning`` or ``tail``.

        A creation loads the group's history in a thread; it holds up no other group and
        no other request, and a second request for the same group waits for it.

        Cancellation: only the wait stops; a creation that started completes (in the
        groups' nursery once :meth:`run` runs), so the group exists for the next request.

        Error handling: :class:`FieldError` for a bad name, an unknown group without
        ``start``, or a bad ``start``; the store's error if the creation failed.
        """
        while (claims := self.claims.get(name)) is None and name in self._creating:
            await self._creating[name].done.wait()
        if claims is not None:
            return claims
        if not GROUP_NAME.fullmatch(name):
            raise FieldError("group", "expected 1-128 letters, digits, '_' or '-'")
        if start is None:
            raise FieldError(
                "group",
                f"unknown group {name!r}; name it with from (beginning or tail) to create it",
            )
        if start not in ("beginning", "tail"):
            raise FieldError("from", "expected beginning or tail")
        created = self._creating[name] = _Creation()
        wanted = 0 if start == "beginning" else self.log.last_sort_key
        if self._nursery is None:  # at start-up, before run(): nobody else to wait
            await self._create(name, wanted, created)
        else:
            self._nursery.start_soon(self._create, name, wanted, created)
            await created.done.wait()
        if created.error is not None:
            raise created.error
        if (claims := self.claims.get(name)) is None:  # cancelled: the writer is stopping
            raise GateClosed(f"group {name!r}: the writer is draining")
        return claims

    async def _create(self, name: str, wanted: int, created: _Creation) -> None:
        try:
            start_after = await run_in_thread(
                self.log.create_group, name, wanted, limiter=self._limiter
            )
            await self._load(name, start_after)
        except Exception as exc:  # the requesters answer with it; the writer goes on
            created.error = exc
        finally:
            del self._creating[name]
            created.done.set()

    async def _load(self, name: str, start_after: int) -> None:
        claims = await open_claims(
            self.log,
            self.committer,
            name,
            start_after=start_after,
            ack_wait=self.ack_wait,
            max_deliver=self.max_deliver,
            limiter=self._limiter,
        )
        self.claims[name] = claims
        if self._closed:  # created while draining: it leases nothing
            claims.close()
        if self._nursery is not None:
            self._nursery.start_soon(claims.run_timers)

    def release(self, owner: object) -> None:
        for claims in self.claims.values():
            claims.release(owner)

    def close(self) -> None:
        self._closed = True
        for claims in self.claims.values():
            claims.close()

    async def _sample_lag(self) -> None:
        while True:
            for name, claims in sorted(self.claims.items()):
                metrics.EVENTS_GROUP_LAG.labels(group=name).set(claims.total)
                persist_low_water(claims, self.committer)
                await trio.lowlevel.checkpoint()  # many groups: one at a time per loop turn
            await trio.sleep(1.0)
