"""The generation slots of the model and the bounded first-come-first-served queue before them."""

from __future__ import annotations

import asyncio
from collections import deque


class QueueFull(Exception):
    """Every slot is busy and the queue holds its limit of waiting requests."""


class Slots:
    """``parallel`` generations at once; up to ``queue`` more requests wait, in arrival order.

    A released slot passes straight to the oldest waiter, so a request arriving later cannot
    overtake the queue. Only the event loop's thread calls these methods.
    """

    def __init__(self, parallel: int, queue: int) -> None:
        self.parallel = parallel
        self.queue = queue
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in line for one; QueueFull when the line is full."""
        if self.running < self.parallel and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.queue:
            raise QueueFull
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as the waiter went away
            raise

    def release(self) -> None:
        """Give the slot to the oldest waiter, or free it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot changes hands: running stays the same
                return
        self.running -= 1
