"""The count of generation requests let in: ``parallel`` running and up to ``queue`` waiting."""

from __future__ import annotations


class QueueFull(Exception):
    """Every slot is busy and the queue holds its limit of waiting requests."""


class Slots:
    """``parallel`` generations at once; up to ``queue`` more requests wait. Past both, a
    request is turned away (QueueFull).

    The line itself is the engine thread's (``Scheduler``), in arrival order, so a slot that
    frees passes to the oldest waiting request there; this counts the requests let in until
    their responses end. Only the event loop's thread calls these methods.
    """

    def __init__(self, parallel: int, queue: int) -> None:
        self.parallel = parallel
        self.queue = queue
        self._admitted = 0

    @property
    def running(self) -> int:
        return min(self._admitted, self.parallel)

    @property
    def waiting(self) -> int:
        return self._admitted - self.running

    def admit(self) -> None:
        """Let a request in, to run or wait; QueueFull when the line is full."""
        if self._admitted >= self.parallel + self.queue:
            raise QueueFull
        self._admitted += 1

    def release(self) -> None:
        """The request let in has ended."""
        self._admitted -= 1
