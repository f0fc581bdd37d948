"""Admission and worker threads: at most ``parallel`` generations run, each on its own session
(KV cache) of one :class:`~edgemtp.Model`; up to ``queue`` more wait for a slot (first come,
first served); beyond that a request is refused at once with 429 and a ``Retry-After``.

A generation runs in a worker thread, not on the event loop: its forward passes are
onnxruntime (or torch) calls that release the GIL, so several run on several cores while the
loop keeps answering. The worker checks between forward passes whether its request was
cancelled (the client went away, the server is stopping) or ran out of time, and then closes
the generation, which hands its session back to the pool at once.

    event loop                          worker thread (one of `parallel`)
    ----------                          ---------------------------------
    admit: running + waiting < cap?     model.generation(ids, config)
    wait for a slot (FIFO)              for ids in gen:          # one forward pass each
    run_in_executor(work) ------------>     stop if cancelled or past the deadline
    <- text deltas (call_soon_threadsafe)   emit(text delta)
    <- GenerationResult                 gen.close()              # session back to the pool
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ..api import Model
from ..config import GenerationConfig
from ..engine import GenerationResult
from ..tokenizer import TextStream
from .requests import APIError

Emit = Callable[[str], None]  # called in the worker thread with each text delta


@dataclass(eq=False)
class Job:
    """One admitted request: what to generate, and how the worker is told to stop."""

    prompt_ids: list[int]
    config: GenerationConfig
    deadline: float  # time.monotonic() by which it must be done (the per-request time limit)
    cancelled: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    limit: str = "time_limit"  # what set the deadline: --timeout, or "shutdown"
    started: float | None = None  # monotonic time its worker took it

    def cancel(self) -> None:
        self.cancelled.set()


class StopText:
    """Text deltas that never show a stop string, as OpenAI's API returns them: the text ends
    before the first stop string. Up to ``len(longest stop) - 1`` characters are held back
    until the next delta shows they do not start one.

    >>> s = StopText(("THE END",))
    >>> s.push("and they lived. TH"), s.push("E END"), s.push("")
    ('and they liv', 'ed. ', '')
    >>> s.finish("and they lived. THE END")
    ''
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.hold = stops, max((len(s) for s in stops), default=1) - 1
        self.text, self.sent = "", 0
        self.cut: int | None = None  # where the first stop string begins, once seen

    def push(self, delta: str) -> str:
        if self.cut is not None:
            return ""
        start = max(len(self.text) - self.hold, 0)  # a new stop string ends in the delta
        self.text += delta
        self.cut = first_stop(self.text, self.stops, start)
        return self._upto(len(self.text) - self.hold if self.cut is None else self.cut)

    def finish(self, final: str) -> str:
        """The rest of the text once generation ended (``final``: the whole decoded text).
        Where ``final`` does not begin with what was sent (a byte-fallback tokenizer decodes
        a cut multi-byte character's run as U+FFFD, the whole characters before it too: the
        deltas had those characters), the pushed text is the whole text.

        >>> s = StopText(())
        >>> s.push("ab"), s.push("c\ufffd"), s.finish("ab\ufffd\ufffd\ufffd")
        ('ab', 'c\ufffd', '')
        """
        if not final.startswith(self.text[:self.sent]):
            final = self.text
        self.text = final
        cut = first_stop(final, self.stops)
        return self._upto(len(final) if cut is None else cut)

    def _upto(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:end], end
        return delta


def first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Where the first stop string in ``text[start:]`` begins, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


class Scheduler:
    """``parallel`` worker threads and a FIFO queue of at most ``queue`` waiting requests."""

    def __init__(self, model: Model, parallel: int, queue: int) -> None:
        self.model, self.parallel, self.queue = model, parallel, queue
        self.pool = ThreadPoolExecutor(parallel, thread_name_prefix="edgemtp-gen")
        self.slots = asyncio.Semaphore(parallel)
        self.running = self.waiting = 0
        self.draining = False  # set on SIGTERM: new requests get 503
        self.jobs: set[Job] = set()  # running
        self.queued: set[Job] = set()
        self._stopping: asyncio.Event | None = None  # set at the shutdown deadline
        self.shutdown_at: float | None = None
        self._mean_s = 1.0  # running mean of a generation's seconds, for Retry-After

    # -- admission -------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuse now (429 / 503) rather than queue past the bound."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="shutting_down", headers={"Retry-After": "5"})
        if self.running + self.waiting >= self.parallel + self.queue:
            raise APIError(429, f"the server is busy: {self.running} generations running and "
                                f"{self.waiting} queued (--parallel {self.parallel}, --queue "
                                f"{self.queue}); retry after {self.retry_after()} s",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.retry_after())})

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue ahead, at the recent mean pace."""
        return max(1, math.ceil(self._mean_s * (self.waiting + 1) / self.parallel))

    async def acquire(self, job: Job) -> None:
        """Wait for a slot (after :meth:`admit`); 503 when the time limit (or the shutdown's
        deadline, :meth:`begin_shutdown`) passes first."""
        self.admit()
        if self._stopping is None:
            self._stopping = asyncio.Event()
        self.waiting += 1
        self.queued.add(job)
        slot = asyncio.ensure_future(self.slots.acquire())
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({slot, stop}, timeout=max(job.deadline - time.monotonic(), 0),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:  # (also when this coroutine is cancelled: the client went away)
            self.waiting -= 1
            self.queued.discard(job)
            stop.cancel()
            if not slot.done():
                slot.cancel()
                await asyncio.wait({slot})
            took = slot.done() and not slot.cancelled() and slot.exception() is None
        if not took or job.deadline <= time.monotonic() and job.limit == "shutdown":
            if took:
                self.slots.release()
            if job.limit == "shutdown" or self._stopping.is_set():
                raise APIError(503, "the server shut down before this queued request got a "
                                    "slot (--shutdown-timeout)", type="server_error",
                               code="shutting_down", headers={"Retry-After": "5"})
            raise APIError(503, "the request waited in the queue past the server's time limit "
                                "(--timeout)", type="server_error", code="queue_timeout",
                           headers={"Retry-After": str(self.retry_after())})
        self.running += 1

    def begin_shutdown(self, timeout_s: float) -> None:
        """SIGTERM / Ctrl-C: new requests get 503; running generations get ``timeout_s`` more
        seconds, then stop after their current forward pass and answer with what they have
        (``finish_reason`` "length", ``usage.stop_reason`` "shutdown"); requests still queued
        then get 503. Called on the event loop's thread (uvicorn's signal handler)."""
        self.draining = True
        at = self.shutdown_at = time.monotonic() + timeout_s
        for job in list(self.jobs) + list(self.queued):
            if at < job.deadline:
                job.deadline, job.limit = at, "shutdown"

        def stop() -> None:
            if self._stopping is not None:
                self._stopping.set()
        try:
            asyncio.get_running_loop().call_later(timeout_s, stop)
        except RuntimeError:  # (no loop running: nothing is queued either)
            pass

    def release(self) -> None:
        self.running -= 1
        self.slots.release()

    # -- running ---------------------------------------------------------------------------

    async def run(self, job: Job, emit: Emit | None = None,
                  on_begin: Callable[[], None] | None = None) -> GenerationResult:
        """Run an acquired job in a worker thread (then :meth:`release` the slot). If this
        coroutine is cancelled, the worker stops after its current forward pass and the
        slot is released only once it has: a slot always means one free worker.
        ``on_begin`` is called in the worker once the generation is built (its drafter and
        plans: what refuses options the package cannot run), before its first forward pass."""
        loop = asyncio.get_running_loop()
        self.jobs.add(job)
        if self.shutdown_at is not None and self.shutdown_at < job.deadline:
            job.deadline, job.limit = self.shutdown_at, "shutdown"  # (acquired as it began)
        work = loop.run_in_executor(self.pool, self._work, job, emit, on_begin)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            job.cancel()
            await asyncio.wait([work])
            raise
        finally:
            self.jobs.discard(job)
            self.release()

    def _work(self, job: Job, emit: Emit | None, on_begin=None) -> GenerationResult:
        job.started = time.monotonic()
        model = self.model
        gen = model.generation(job.prompt_ids, job.config)
        if on_begin is not None:
            on_begin()
        before = job.prompt_ids[-1] if job.prompt_ids else None
        text = TextStream(model.tokenizer, before) if emit else None
        try:
            for ids in gen:
                if emit is not None and (delta := text.push(ids)):
                    emit(delta)
                if job.cancelled.is_set():
                    break
                if time.monotonic() > job.deadline:
                    job.timed_out = True
                    break
            if emit is not None and (rest := text.finish()):
                emit(rest)  # (a generation that ended inside a multi-byte character)
        finally:
            gen.close()  # the session goes back to the pool now, even on an error
        result = gen.result  # its text reads as after the prompt, as OpenAI's API and vLLM
        #                      give it (a SentencePiece model's first token keeps its space)
        self._mean_s += 0.2 * (time.monotonic() - job.started - self._mean_s)
        return result

    def close(self) -> None:
        """Cancel what still runs and wait for the workers (each stops within one step)."""
        self.draining = True
        for job in list(self.jobs):
            job.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
