"""The one thread that owns the engine: loads it, then runs the requests, several at once.

Every request is a Job queued in arrival order; the engine (its KV caches, its learned store) is
only ever touched from the engine thread, which runs the engine's Batch (batch.py) for every arm:
between two steps, queued jobs join the running batch while fewer than `parallel` run, so each
step verifies every running request's rows (one row for `ar`, or its round's tree: each drafting
request drafts on its own slot's drafter first) in one forward. Past `parallel` running, jobs
wait in the queue (the metrics' waiting gauge); past `queue_limit` waiting, submit() refuses
them (QueueFull: the server's 429).

Cancellation is a flag: a running request sees it at its next step (its slot is free from that
step on); a queued one is dropped without touching the engine. A request that fails fails alone.

Admission is by place: a request takes one (reserve(); QueueFull when parallel + queue_limit
are held) at arrival, before its prompt is tokenised and before a stream's 200 goes out, and
holds it while its n choices run, so no choice ever finds the queue full and a stream never
learns of a full queue after its status. The n choices are n jobs queued together under the
place, each its own sequence in the batch (side by side, as vLLM runs them): they never take
more than the batch's `parallel` slots (the batch's own bound, whatever n is), and a slot goes
to the oldest waiting request none of whose choices runs yet before it goes to another choice
of a request already running (_next_job), so a request of many choices fills only the slots
no other request waits for, and a later request waits for at most one choice to end. The
choices share their prompt's prefill: where slots have no drafters (Batch.shares_prompts), a
choice waits while its request's running choices all still prefill, then joins with the K/V of
one whose prompt is in copied to its slot (Batch.join's source), and prefills the prompt's last
token only (exact: a prompt over a cached prefix equals its whole prefill, docs/batching.md;
choices one after another reused the same prefix from the slot before). A place
whose client left (its cancel flag) no longer counts, nor does its queued job (the waiting
gauge): live clients are not refused for requests nobody waits for, which the engine thread
drops between steps.

Shutdown (close(), the server's lifespan exit on SIGTERM): no new job is taken, the queued ones
are dropped, the running ones are cancelled and end at their next step; then the engine thread
saves the learned state one last time (Speculator.close: the saves that waited for other
requests, and the rounds of the requests cut short) and ends; close() waits for it, at most
SHUTDOWN_S. A bug that escapes even the step's catch-all stops the engine thread: `fault` says
so (the server's /health answers 503), every admitted and queued request gets EngineStopped,
and so does every later one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("adaspark.server")

# prompt tokens of arrivals admitted between two steps (their first chunks run before the
# step's verify, which the running requests' next tokens wait for, so arrivals join a few at a
# time; a long prompt goes on a chunk per step)
PREFILL_PER_STEP = 512
MAX_PARALLEL = 8  # past this a CPU step is compute-bound: more rows only slow every request
RAM_SHARE = 0.25  # of the memory available at load, at most this much goes to KV slots
# close() waits this long for the engine thread: its current step (every running request is
# cancelled at its next one) and the last save; a longer wait is logged and the exit goes on
SHUTDOWN_S = 60.0
# nothing has run for this long: the learned state's refit and save that waited run now (a
# closed-loop client's next request comes sooner, and starts without waiting for them)
IDLE_SAVE_S = 0.25


class Cancelled(Exception):
    """The client went away before its request reached the engine."""


class QueueFull(Exception):
    """As many requests wait as the queue holds: come back later."""


class Place:
    """A request's place in the worker (see the module's docstring); `cancel` is the request's
    flag, set when its client leaves. Usable as a context manager that gives it back."""

    def __init__(self, worker: EngineWorker, cancel: threading.Event):
        self.worker, self.cancel = worker, cancel

    def submit(self, job: Job) -> Future:
        """Queue one of the request's jobs (never QueueFull: the place was taken already)."""
        return self.worker.submit(job, place=self)

    def release(self) -> None:
        """Give the place back (again: a no-op)."""
        with self.worker._wake:
            self.worker._places.discard(self)

    def __enter__(self) -> Place:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class EngineStopped(Exception):
    """The engine thread stopped after an internal error (logged); the server must restart."""


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    request_id: str | None = None  # names the request in the engine's round log
    on_text: Callable[[str], None] | None = None  # called on the engine thread with new text
    cancel: threading.Event = field(default_factory=threading.Event)
    sampling: Any = None  # a SamplingParams; None: greedy
    response_format: Any = None  # a compiled grammar.Grammar; None: free text


def available_memory() -> int | None:
    """Bytes of memory available now (Linux: MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_parallel(slot_bytes: int, cores: int | None = None,
                     memory: int | None = None) -> int:
    """Requests decoding at once when --parallel is not given: two per core (a CPU step is
    bound by reading the weights, so a few more rows cost little: 4 rows cost 1.3-1.7x one on
    2 cores), at most MAX_PARALLEL, and no more KV slots than RAM_SHARE of `memory` holds."""
    cores = cores or len(os.sched_getaffinity(0))
    n = min(MAX_PARALLEL, 2 * cores)
    if memory is not None and slot_bytes > 0:
        n = min(n, int(memory * RAM_SHARE // slot_bytes))
    return max(1, n)


def slot_bytes(engine: Any) -> int:
    """The bytes of one request's KV slot (the engine's own cache's size)."""
    return int(engine.target.cache.nbytes)


def _wanted(job: Job, future: Future) -> bool:
    return not job.cancel.is_set() and not future.cancelled()


class EngineWorker:
    """parallel: requests decoding at once (None: default_parallel); queue_limit: requests
    waiting at most (None: 8 per running slot)."""

    def __init__(self, load: Callable[[], Any], parallel: int | None = None,
                 queue_limit: int | None = None):
        if parallel is not None and parallel < 1:
            raise ValueError(f"parallel must be at least 1, not {parallel}")
        self.engine: Any = None
        self.load_error: str | None = None
        self.parallel = parallel
        self.queue_limit = queue_limit
        self.last_result: Any = None  # the engine's record of the latest finished request
        self._queue: deque[tuple[Job, Future, Place]] = deque()
        # id(Decode) -> (the Decode, its job, its future, its request's place): admitted, not
        # yet settled
        self._running: dict[int, tuple[Any, Job, Future, Place]] = {}
        self._places: set[Place] = set()  # taken and not given back
        self._wake = threading.Condition()
        self._closed = False
        self.fault: str | None = None  # why the engine thread stopped serving (a bug), if it did
        # called on the engine thread after each job: (job, result), or (job, None) when the
        # job raised or was cancelled before it started (the server's metrics)
        self.observers: list[Callable[[Job, Any], None]] = []
        self._thread = threading.Thread(target=self._main, args=(load,), daemon=True,
                                        name="adaspark-engine")
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def waiting(self) -> int:
        """Jobs submitted, not yet started, and still wanted (the metrics' queue gauge)."""
        return sum(1 for job, future, _ in list(self._queue) if _wanted(job, future))

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def held(self) -> int:
        """Places taken by requests whose clients are still there."""
        return sum(1 for place in list(self._places) if not place.cancel.is_set())

    @property
    def full(self) -> bool:
        """True when the next reserve() would be refused: queue_limit requests would still
        wait once every slot ran one (jobs join the batch only between steps)."""
        if self.queue_limit is None or self.parallel is None:
            return False
        return self.held >= self.parallel + self.queue_limit

    def reserve(self, cancel: threading.Event | None = None) -> Place:
        """A place for a request whose flag is `cancel`; QueueFull when the worker is full."""
        with self._wake:
            if self.full:
                raise QueueFull(f"{self.held} requests hold the server's places already")
            place = Place(self, cancel if cancel is not None else threading.Event())
            self._places.add(place)
        return place

    def submit(self, job: Job, place: Place | None = None) -> Future:
        """Queue `job` under its request's `place`; its Future gets the engine's Generation (or
        its error). Without a place, the job takes one of its own until it settles (QueueFull
        when there is none)."""
        future: Future = Future()
        with self._wake:
            if self.fault is not None:
                future.set_exception(EngineStopped(self.fault))
                return future
            if self._closed:
                future.set_exception(Cancelled())
                return future
            if place is None:
                place = self.reserve(job.cancel)
                future.add_done_callback(lambda _: place.release())
            elif place not in self._places:
                raise ValueError("submit under a place that was given back")
            self._queue.append((job, future, place))
            self._wake.notify()
        return future

    # ----- the engine thread ---------------------------------------------------------------
    def _main(self, load: Callable[[], Any]) -> None:
        try:
            engine = load()
        except Exception as err:  # reported by /health and every request, and logged
            self.load_error = str(err) or type(err).__name__
            log.error("model failed to load: %s", self.load_error)
            self._drop_queue()
            return
        if self.parallel is None:
            self.parallel = default_parallel(slot_bytes(engine), memory=available_memory())
        if self.queue_limit is None:
            self.queue_limit = 8 * self.parallel
        engine.batch.max_slots = self.parallel
        speculator = getattr(engine, "speculator", None)
        if speculator is not None:  # a lone request's save waits for an idle moment
            speculator.idle_saves = True
        self.engine = engine
        try:
            while self._serve_once():
                pass
        except Exception:  # the step's own recovery failed: stop, and say so to everyone
            log.exception("the engine thread stopped after an internal error")
            self._stop_serving("the engine stopped after an internal error; restart the server")
        finally:
            self._last_save(engine)
        self._drop_queue()

    def _stop_serving(self, why: str) -> None:
        """No request will run again: /health reports it, every admitted request and every
        queued or later one gets EngineStopped (none waits for an engine that is gone)."""
        error = EngineStopped(why)
        with self._wake:
            self.fault, self._closed = why, True
        for _, job, future, _ in list(self._running.values()):
            self._settle(job, future, None, error)
        self._running.clear()
        while (item := self._next_job()) is not None:
            item[1].set_exception(error)

    @staticmethod
    def _last_save(engine: Any) -> None:
        """The learned state's last save, on this thread (the engine's only one), after the
        last step: what waited for other requests and the rounds of requests cut short."""
        speculator = getattr(engine, "speculator", None)
        if speculator is None:
            return
        try:
            speculator.close()
        except Exception:  # noqa: BLE001 - the exit goes on; the last good store stays
            log.exception("the learned state's last save failed")

    def _serve_once(self) -> bool:
        """Admit what may start, then one step; False once closed and nothing runs."""
        batch = self.engine.batch
        speculator = getattr(self.engine, "speculator", None)
        idle = False
        with self._wake:
            while not self._closed and not self._queue and not batch.running:
                if speculator is None or not speculator.unsaved:
                    self._wake.wait()
                elif not self._wake.wait(IDLE_SAVE_S):  # still nothing to do: save now
                    idle = not self._closed and not self._queue
                    break
            closed = self._closed
        if idle:
            speculator.idle()  # logs its own failures
            return True
        if closed and not batch.running:
            return False
        try:
            self._drop_unwanted()
            if not closed:
                self._admit(batch)
            finished = batch.step()  # after close(): the cancelled requests end here
        except Exception as err:  # a bug outside any one request: end every admitted one
            log.exception("engine step failed")
            for seq, *_ in list(self._running.values()):
                if not seq.finished:
                    batch.drop(seq, err)
                self._finish(seq)  # a reply that had finished is still delivered
            batch.running = []
            return True
        for seq in finished:
            self._finish(seq)
        return True

    def _next_job(self, admitting: bool = False) -> tuple[Job, Future, Place] | None:
        """The next queued job still wanted, its future marked running (no longer
        cancellable: the client's side may cancel a waiting one): the oldest of a request none
        of whose choices runs, else the oldest (another choice of a running request); the
        cancelled ones are dropped on the way. admitting: a choice whose request's running
        choices all still prefill waits (its prompt is then copied, not prefilled again:
        _admit), and None when only such choices wait."""
        while True:
            with self._wake:
                at = self._pick(admitting)
                if at is None:
                    return None
                job, future, place = self._queue[at]
                del self._queue[at]
            if future.set_running_or_notify_cancel() and not job.cancel.is_set():
                return job, future, place
            self._settle(job, future, None, Cancelled())

    def _pick(self, admitting: bool) -> int | None:
        """The queue index _next_job takes (under the lock)."""
        if not self._queue:
            return None
        siblings: dict[int, list[Any]] = {}
        for seq, _, _, place in self._running.values():
            siblings.setdefault(id(place), []).append(seq)
        for i, item in enumerate(self._queue):
            if id(item[2]) not in siblings:
                return i
        if not admitting or not self.engine.batch.shares_prompts:
            return 0
        return next((i for i, item in enumerate(self._queue)
                     if not all(seq.prefilling for seq in siblings[id(item[2])])), None)

    def _source(self, place: Place) -> Any:
        """A running choice of the place's request whose prompt is in (None: none)."""
        return next((seq for seq, _, _, other in self._running.values()
                     if other is place and not seq.prefilling and not seq.finished), None)

    def _drop_unwanted(self) -> None:
        """Settle and drop the queued jobs whose clients left (their places count no more, so
        the queue may hold any number of them: it is swept every step)."""
        with self._wake:
            if all(_wanted(job, future) for job, future, _ in self._queue):
                return
            unwanted = [item for item in self._queue if not _wanted(*item[:2])]
            self._queue = deque(item for item in self._queue if _wanted(*item[:2]))
        for job, future, _ in unwanted:
            future.set_running_or_notify_cancel()
            self._settle(job, future, None, Cancelled())

    def _admit(self, batch: Any) -> None:
        budget = PREFILL_PER_STEP
        while budget > 0 and not batch.full and (item := self._next_job(True)) is not None:
            job, future, place = item
            source = self._source(place)  # another choice: its prompt is copied
            try:
                seq = self.engine.new_decode(
                    job.prompt_ids, max_tokens=job.max_tokens, stop=job.stop,
                    on_text=job.on_text, should_stop=job.cancel.is_set,
                    request_id=job.request_id, sampling=job.sampling,
                    response_format=job.response_format)
            except Exception as err:  # a request the engine refuses (e.g. too long)
                self._settle(job, future, None, err)
                continue
            self._running[id(seq)] = (seq, job, future, place)
            if not batch.join(seq, source):  # its first chunk runs in the next step
                self._finish(seq)
            budget -= min(len(seq.prompt) - seq.timing.reused_tokens, batch.prefill_chunk)

    def _finish(self, seq: Any) -> None:
        _, job, future, _ = self._running.pop(id(seq))
        if seq.error is not None:
            self._settle(job, future, None, seq.error)
            return
        try:
            result = self.engine.result(seq)
        except Exception as err:  # noqa: BLE001 - this request's result only
            log.exception("a finished request's result failed")
            self._settle(job, future, None, err)
            return
        self._settle(job, future, result)

    def _settle(self, job: Job, future: Future, result: Any,
                error: BaseException | None = None) -> None:
        """Observers first (the metrics count a request before its client hears of it)."""
        if result is not None:
            self.last_result = result
        for observe in self.observers:
            try:
                observe(job, result)
            except Exception:  # noqa: BLE001 - a metric's bug must not stop the engine
                log.exception("a request observer failed")
        if future.cancelled():  # given up while it waited: nobody to tell
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _drop_queue(self) -> None:
        while (item := self._next_job()) is not None:
            item[1].set_exception(Cancelled())

    def close(self, timeout: float | None = SHUTDOWN_S) -> bool:
        """Take no more work, stop the running requests at their next step, drop the queued
        ones; then wait up to `timeout` for the engine thread's last save and end. True when
        it ended (False: still loading, or a step longer than the wait; logged)."""
        with self._wake:
            self._closed = True
            # a copy first: the engine thread may change it meanwhile
            for _, job, *_ in list(self._running.values()):
                job.cancel.set()
            self._wake.notify()
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine thread did not end within %.0f s of shutdown; exiting "
                        "without its last save", timeout)
            return False
        return True
