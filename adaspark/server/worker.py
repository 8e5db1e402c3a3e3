"""The one thread that owns the engine: loads it, then runs requests one at a time.

A single-worker executor gives arrival order and mutual exclusion for free: loading is its first
job, every request is queued behind the one before it, and the engine (its KV cache, its learned
store) is only ever touched from that thread. Cancellation is a flag the engine checks between
tokens; a request cancelled while still queued is skipped without touching the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("adaspark.server")


class Cancelled(Exception):
    """The client went away before its request reached the engine."""


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    request_id: str | None = None  # names the request in the engine's round log
    on_text: Callable[[str], None] | None = None  # called on the engine thread with new text
    cancel: threading.Event = field(default_factory=threading.Event)
    sampling: Any = None  # a SamplingParams; None: greedy


class EngineWorker:
    def __init__(self, load: Callable[[], Any]):
        self.engine: Any = None
        self.load_error: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaspark-engine")
        self._running: Job | None = None
        self.last_result: Any = None  # the engine's record of the latest finished request
        self.waiting = 0  # submitted jobs not yet started (the metrics' queue gauge)
        self._count = threading.Lock()
        # called on the engine thread after each job: (job, result), or (job, None) when the
        # job raised or was cancelled before it started (the server's metrics)
        self.observers: list[Callable[[Job, Any], None]] = []
        self._executor.submit(self._load, load)

    def _load(self, load: Callable[[], Any]) -> None:
        try:
            self.engine = load()
        except Exception as err:  # reported by /health and every request, and logged
            self.load_error = str(err) or type(err).__name__
            log.error("model failed to load: %s", self.load_error)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def running(self) -> int:
        return int(self._running is not None)

    def submit(self, job: Job) -> Future:
        with self._count:
            self.waiting += 1
        return self._executor.submit(self._run, job)

    def _run(self, job: Job) -> Any:
        with self._count:
            self.waiting -= 1
        try:
            result = self._generate(job)
        except BaseException:
            self._observe(job, None)
            raise
        self._observe(job, result)
        return result

    def _observe(self, job: Job, result: Any) -> None:
        for observe in self.observers:
            observe(job, result)

    def _generate(self, job: Job) -> Any:
        if job.cancel.is_set():
            raise Cancelled()
        self._running = job
        try:
            self.last_result = self.engine.generate(
                job.prompt_ids,
                max_tokens=job.max_tokens,
                stop=job.stop,
                on_text=job.on_text,
                should_stop=job.cancel.is_set,
                request_id=job.request_id,
                sampling=job.sampling,
            )
            return self.last_result
        finally:
            self._running = None

    def close(self) -> None:
        """Stop the running request at its next token and drop the queued ones."""
        running = self._running
        if running is not None:
            running.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
