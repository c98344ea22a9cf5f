"""Admission by bytes: what a face's frames may hold while they are parsed and served."""

from __future__ import annotations

from collections import deque

import trio

from cmdbus_trio import metrics


class ByteBudget:
    """Bytes lent to requests (a face's frames being parsed and committed), at most
    ``total`` at once, to the oldest asker first. A request larger than the whole budget
    waits for all of it, so it is admitted alone rather than never.

    ``acquire`` / ``acquire_nowait`` / ``release`` as a semaphore of bytes: what a Gate
    is to requests, this is to their size (frames are parsed before a Gate sees them).
    """

    def __init__(self, name: str, total: int) -> None:
        if total < 1:
            raise ValueError(f"total must be >= 1 byte, got {total}")
        self.name = name
        self.total = total
        self.lent = 0
        self._waiting: deque[tuple[int, trio.Event]] = deque()
        metrics.PENDING_BYTES.labels(face=name).set_function(lambda: self.lent)
        metrics.PENDING_BYTES_WAITERS.labels(face=name).set_function(lambda: self.waiting)

    def _fit(self, size: int) -> int:
        return min(size, self.total)

    def acquire_nowait(self, size: int) -> int:
        """Lend ``size`` bytes now (returns what was lent: the size, at most the total).

        Error handling: raises :class:`trio.WouldBlock` when they are not free, or
        somebody asked first."""
        size = self._fit(size)
        if self._waiting or self.lent + size > self.total:
            raise trio.WouldBlock
        self.lent += size
        return size

    async def acquire(self, size: int) -> int:
        """Wait for ``size`` bytes, behind those who asked first; returns what was lent.

        Cancellation: nothing is lent when cancelled while waiting (bytes handed over
        just before are given back)."""
        try:
            lent = self.acquire_nowait(size)
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.checkpoint()
            return lent
        size = self._fit(size)
        ask = (size, trio.Event())
        self._waiting.append(ask)
        try:
            await ask[1].wait()
        except BaseException:
            if ask[1].is_set():
                self.release(size)
            else:
                self._waiting.remove(ask)
                self._hand_out()  # those behind it may fit now
            raise
        return size

    @property
    def waiting(self) -> int:
        """Askers queued for bytes."""
        return len(self._waiting)

    def release(self, lent: int) -> None:
        self.lent -= lent
        self._hand_out()

    def _hand_out(self) -> None:
        while self._waiting and self.lent + self._waiting[0][0] <= self.total:
            size, granted = self._waiting.popleft()
            self.lent += size
            granted.set()
