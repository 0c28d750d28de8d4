"""The engine thread: one ``weightlift.Batch`` stepped in a loop, with requests joining between
steps (continuous batching) and leaving when they end or their client goes.

The line of requests waiting for a slot is kept here too, in arrival order: a generation that
ends in a step hands its slot to the oldest waiting request before the next step, with no trip
through the event loop. So the requests of a busy server join together, and a step never runs
with a slot idle while a request waits (a slot handed over through the event loop stayed idle
for a step or two, and the requests after it joined a step apart, each join a prefill step).

Only this thread calls the model, so the event loop never waits on it: a request hands its call
over and reads its events from an ``asyncio.Queue`` that this thread fills.

Besides generations it runs calls: one-off work on the model (an embedding, a tokenizer lookup)
that takes no slot. They run between steps, in arrival order, one before each step while
generations run (all at once when none do): a call waits for no slot, and the generations
running are held back by at most one call a step, however many calls arrive.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import weightlift

# Seconds the idle thread waits for work before looking whether it should stop.
IDLE_POLL = 0.1


def _send(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """Run ``fn(*args)`` on ``loop`` (from the engine thread); False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # asyncio's "Event loop is closed"
        return False
    return True


@dataclass
class Job:
    """One request's generation: its call, and the events the engine thread sends back."""

    method: str
    kwargs: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[str, Any, Any]] = field(default_factory=asyncio.Queue)
    id: int | None = None
    cancelled: bool = False

    def post(self, kind: str, value: Any = None, timings: Any = None) -> None:
        """Send an event to the request (from the engine thread). When the request's event
        loop has closed (the server stopped past its graceful timeout), nobody listens: the job
        is marked cancelled instead, for the engine thread to end it."""
        if not _send(self.loop, self.events.put_nowait, (kind, value, timings)):
            self.cancelled = True

    async def next(self) -> tuple[str, Any, Any]:
        """The next event: ``started``, ``chunk``, ``whole``, ``end`` or ``error``."""
        return await self.events.get()


@dataclass
class Call:
    """One-off work on the model: ``fn(model)``, run on the engine thread between steps; its
    result or exception settles ``future`` on the request's event loop."""

    fn: Callable[[weightlift.Model], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    def settle(self, value: Any, error: BaseException | None) -> None:
        """Hand the outcome to the request (from the engine thread); nothing when it left."""

        def set() -> None:
            if self.future.done():  # cancelled: its client went away
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        _send(self.loop, set)


class Scheduler:
    """``parallel`` generations of ``model`` stepped together on one thread."""

    def __init__(self, model: weightlift.Model, parallel: int) -> None:
        self.model = model
        self.batch = weightlift.Batch(model, parallel)
        self._inbox: queue.SimpleQueue[tuple[str, Job | Call]] = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}
        # submitted, waiting for a slot (a cancelled one is dropped when its turn comes)
        self._waiting: deque[Job] = deque()
        self._calls: deque[Call] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightlift-batch", daemon=True)
        self._thread.start()

    def submit(self, method: str, kwargs: dict[str, Any]) -> Job:
        """Start ``model.<method>(**kwargs)`` in the batch once a slot is free (requests wait
        in line, in the order submitted); its first event says whether it started (``started``)
        or was refused (``error``, the exception)."""
        job = Job(method, kwargs, asyncio.get_running_loop())
        self._inbox.put(("start", job))
        return job

    def call(self, fn: Callable[[weightlift.Model], Any]) -> asyncio.Future[Any]:
        """Run ``fn(model)`` on the engine thread between steps (see the module); the future
        gives what it returns or raises."""
        loop = asyncio.get_running_loop()
        call = Call(fn, loop, loop.create_future())
        self._inbox.put(("call", call))
        return call.future

    def cancel(self, job: Job) -> None:
        """End ``job`` at once (its client left): its slot is free before the next start, and
        a job still waiting for a slot never starts."""
        job.cancelled = True
        self._inbox.put(("cancel", job))

    def close(self) -> None:
        """Stop the thread after its current step; running generations end unanswered."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._take(block=not self._jobs and not self._calls and not self._waiting)
                self._admit()
                if self._calls:
                    self._call(self._calls.popleft())
                if self._jobs:
                    self._step()
            except Exception as e:  # a fault of the loop itself: answer everyone, go on
                for job in self._jobs.values():
                    job.post("error", e)
                    if job.id is not None:
                        self.batch.cancel(job.id)
                self._jobs.clear()

    def _take(self, *, block: bool) -> None:
        """Start and cancel what the requests asked for, in the order they asked; waits for
        work when ``block``."""
        try:
            what, job = self._inbox.get(timeout=IDLE_POLL) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(job, Call):
                self._calls.append(job)
            elif what == "cancel" and job.id is not None:
                self.batch.cancel(job.id)
                self._jobs.pop(job.id, None)
            elif what == "start" and not job.cancelled:
                self._waiting.append(job)
            try:
                what, job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _call(self, call: Call) -> None:
        if call.future.done():  # its client went away before it ran
            return
        try:
            value = call.fn(self.model)
        except Exception as e:  # the request's own error, answered as a generation's
            call.settle(None, e)
            return
        call.settle(value, None)

    def _admit(self) -> None:
        """Start waiting jobs, oldest first, while the batch has free slots."""
        while self._waiting and len(self._jobs) < self.batch.parallel:
            job = self._waiting.popleft()
            if not job.cancelled:
                self._start(job)

    def _start(self, job: Job) -> None:
        try:
            job.id = getattr(self.model, job.method)(**job.kwargs, batch=self.batch)
        except Exception as e:  # the request's own error (a bad field, a prompt too long)
            job.post("error", e)
            return
        self._jobs[job.id] = job
        job.post("started", job.id)

    def _step(self) -> None:
        try:
            events = self.batch.step()
        except Exception as e:  # the shared forward call failed: every generation has ended
            for ended in self._jobs.values():
                ended.post("error", e)
            self._jobs.clear()
            return
        for id, kind, value, timings in events:
            job = self._jobs.get(id)
            if job is None:
                continue
            job.post(kind, value, timings)
            if kind in ("whole", "end", "error"):
                del self._jobs[id]
            elif job.cancelled:  # its client went away (or its loop closed)
                self.batch.cancel(id)
                del self._jobs[id]


__all__ = ["Call", "Job", "Scheduler"]
