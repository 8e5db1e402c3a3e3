"""Watching the server learn: /metrics, /v1/adaspark/state, /dashboard and its data.

`Watch` hears every round (the speculator's observers) and every finished request (the
worker's observers), both on the engine thread, and keeps the Prometheus metrics (metrics.py)
and the latest snapshot of the scheduler's learned state. The snapshot is taken on the engine
thread, where the scheduler lives, at load, after every request and at most every
SNAPSHOT_EVERY_S during a long one, so a reader never sees a half-updated scheduler and never
waits for a request to end.

The state document (GET /v1/adaspark/state, and /dashboard/data for the page):
    model, arm, ready, snapshot_at (unix seconds), scheduler (scheduler/snapshot.py; null for
    the `ar` arm or while loading), served (totals from the metrics: requests, tokens, decode
    seconds, rounds by kind, accepted tokens by source), history (the last HISTORY requests:
    t, decode_tok_s, decode_tokens, rounds, mean_width, finish_reason).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adaspark.server.errors import error_response
from adaspark.server.metrics import KINDS, SOURCES, ServerMetrics

log = logging.getLogger("adaspark.server")

SNAPSHOT_EVERY_S = 1.0
HISTORY = 500
STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# the page may load and fetch from this server only (and draw its own SVG); data: is its empty
# favicon, which keeps the browser from asking the server for /favicon.ico
DASHBOARD_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                 "img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                 "frame-ancestors 'none'")


class Watch:
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.metrics = ServerMetrics()
        self.engine: Any = None
        self.arm: str | None = None
        self.snapshot: dict | None = None
        self.snapshot_at: float | None = None
        self._last = 0.0  # monotonic time of the last snapshot
        self.history: deque[dict] = deque(maxlen=HISTORY)

    @property
    def scheduler(self) -> Any:
        speculator = getattr(self.engine, "speculator", None)
        return None if speculator is None else speculator.scheduler

    def loader(self, load: Callable[[], Any]) -> Callable[[], Any]:
        """`load` followed by attach(), both on the engine thread."""
        def load_and_attach() -> Any:
            engine = load()
            self.attach(engine)
            return engine
        return load_and_attach

    def attach(self, engine: Any) -> None:
        self.engine = engine
        speculator = getattr(engine, "speculator", None)
        self.arm = "ar" if speculator is None else speculator.arm
        self.metrics.info.info({"model": self.model_id, "arm": self.arm})
        if speculator is not None:
            self.metrics.live.store = speculator.store
            speculator.observers.append(self.on_round)
        self._publish()

    def watch(self, worker: Any) -> None:
        self.metrics.live.worker = worker
        worker.observers.append(self.on_request)

    def _publish(self) -> None:
        scheduler = self.scheduler
        self.snapshot = None if scheduler is None else scheduler.snapshot()
        self.snapshot_at = time.time()
        self._last = time.monotonic()

    # ----- observers (engine thread): a bug here is logged, never breaks a request ----------
    def on_round(self, record: dict, plan: Any) -> None:
        try:
            self.metrics.observe_round(record, plan.depths)
            if time.monotonic() - self._last >= SNAPSHOT_EVERY_S:
                self._publish()
        except Exception:
            log.exception("metrics: a round could not be observed")

    def on_request(self, job: Any, result: Any) -> None:
        try:
            if result is None and job.cancel.is_set():  # cancelled before it started
                self.metrics.requests.labels(finish_reason="cancelled").inc()
                return
            self.metrics.observe_request(result, plain_rounds_here=self.scheduler is None)
            if result is not None:
                t = result.timings
                self.history.append({
                    "t": time.time(), "decode_tok_s": t.decode_tok_s,
                    "decode_tokens": t.decode_tokens, "mean_width": t.mean_width,
                    "rounds": t.draft_rounds + t.plain_rounds + t.ngram_rounds,
                    "finish_reason": result.finish_reason})
            if self.engine is not None:
                self._publish()
        except Exception:
            log.exception("metrics: a request could not be observed")

    # ----- readers (event loop) -------------------------------------------------------------
    def served(self) -> dict:
        m = self.metrics
        requests = sum(s.value for f in m.requests.collect() for s in f.samples
                       if s.name == "adaspark_requests_total")
        return {
            "requests": requests,
            "prompt_tokens": m.value("adaspark_prompt_tokens_total"),
            "completion_tokens": m.value("adaspark_completion_tokens_total"),
            "decode_tokens": m.value("adaspark_decode_tokens_total"),
            "decode_seconds": m.value("adaspark_decode_seconds_total"),
            "rounds": {k: m.value("adaspark_rounds_total", kind=k) for k in KINDS},
            "accepted": {s: m.value("adaspark_accepted_tokens_total", source=s)
                         for s in SOURCES},
        }

    def document(self) -> dict:
        return {"model": self.model_id, "arm": self.arm, "ready": self.engine is not None,
                "snapshot_at": self.snapshot_at, "scheduler": self.snapshot,
                "served": self.served(), "history": list(self.history)}


def _static(name: str) -> bytes:
    return resources.files("adaspark.server").joinpath("static", name).read_bytes()


def watch_routes(watch: Watch) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(watch.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/adaspark/state")
    async def state() -> JSONResponse:
        return JSONResponse(watch.document())

    @router.get("/dashboard/data")
    async def dashboard_data() -> JSONResponse:
        return JSONResponse(watch.document(), headers={"Cache-Control": "no-store"})

    @router.get("/dashboard")
    async def dashboard() -> Response:
        return Response(_static("dashboard.html"), media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": DASHBOARD_CSP})

    @router.get("/dashboard/static/{name}")
    async def dashboard_static(name: str) -> Response:
        if name not in STATIC:
            return error_response(404, f"no such dashboard file: {name}")
        return Response(_static(name), media_type=STATIC[name])

    return router
