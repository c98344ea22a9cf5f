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

import trio

from cmdbus_trio import metrics
from cmdbus_trio.admission import run_in_thread
from cmdbus_trio.protocol import FieldError
from cmdbus_trio.storage.buslog import BusLog

from .claims import Claims, open_claims, persist_low_water
from .committer import GroupCommitter

GROUP_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,128}")


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
        self._creating = trio.Lock()
        self._nursery: trio.Nursery | None = None

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

        Error handling: :class:`FieldError` for a bad name, an unknown group without
        ``start``, or a bad ``start``.
        """
        claims = self.claims.get(name)
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
        async with self._creating:
            if name not in self.claims:
                wanted = 0 if start == "beginning" else self.log.last_sort_key
                start_after = await run_in_thread(
                    self.log.create_group, name, wanted, limiter=self._limiter
                )
                await self._load(name, start_after)
        return self.claims[name]

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
        if self._nursery is not None:
            self._nursery.start_soon(claims.run_timers)

    def release(self, owner: object) -> None:
        for claims in self.claims.values():
            claims.release(owner)

    def close(self) -> None:
        for claims in self.claims.values():
            claims.close()

    async def _sample_lag(self) -> None:
        while True:
            for name, claims in sorted(self.claims.items()):
                metrics.EVENTS_GROUP_LAG.labels(group=name).set(sum(claims.lag().values()))
                persist_low_water(claims, self.committer)
            await trio.sleep(1.0)
