"""Prometheus metrics of the server, through prometheus-client, in a registry of its own per app.

Per request (counted when the engine finishes it): requests by finish reason, prompt, reused and
completion tokens, prefill and decode seconds and decode tokens. Per round (the speculator's
round observer): rounds by kind, verified rows and accepted tokens (histograms), verify and
draft seconds by width (rows verified), commit seconds, acceptance by block position, accepted
tokens by source, the draft gate's decisions, and the acceptance model's predicted against
realised tokens. Read at scrape time: requests waiting and running, learned-store saves,
refusals and failed saves (the reply is delivered, the last good store kept); Python's garbage
collections by generation (prometheus-client's GC collector) and the objects frozen out of
their reach at load (memory.freeze_loaded_heap). The `ar` arm has
no rounds of its own: its 1-row rounds are counted per request, and have no per-round times.

Round kinds: `probe` (a width measured for the cost model), `plain` (one row, no draft),
`drafted` (a tree with the drafter's block), `ngram` (a tree from the n-gram index alone).
"""

from __future__ import annotations

import gc
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ROWS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.012, 0.016, 0.025, 0.05, 0.1,
                   0.25, 1.0)
MAX_POSITION = 16  # deeper block positions are counted at this one
KINDS = ("probe", "plain", "drafted", "ngram")
SOURCES = ("drafter", "ngram", "both")


def round_kind(record: dict) -> str:
    """A round's kind from its round-log record (adaspark/bench/rounds.py)."""
    if record.get("chosen_by") == "probe":
        return "probe"
    if record.get("plain"):
        return "plain"
    return "drafted" if record.get("drafted") else "ngram"


class _Live:
    """Values read when scraped: the worker's queue and the learned store's counters."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.store: Any = None

    def collect(self):
        waiting = GaugeMetricFamily("adaspark_requests_waiting",
                                    "Requests queued behind the running one")
        running = GaugeMetricFamily("adaspark_requests_running", "Requests the engine is running")
        worker = self.worker
        waiting.add_metric([], 0 if worker is None else worker.waiting)
        running.add_metric([], 0 if worker is None else worker.running)
        saves = CounterMetricFamily("adaspark_store_saves",
                                    "Learned-store saves (one after every speculative request)")
        rejections = CounterMetricFamily("adaspark_store_rejections",
                                         "Learned-store files refused and set aside")
        failures = CounterMetricFamily("adaspark_store_save_failures",
                                       "Learned-store saves that failed (the last good store "
                                       "stays; the reply was delivered)")
        store = self.store
        saves.add_metric([], 0 if store is None else store.saves)
        rejections.add_metric([], 0 if store is None else store.rejections)
        failures.add_metric([], 0 if store is None else store.save_failures)
        frozen = GaugeMetricFamily("adaspark_gc_frozen_objects", "Python objects out of the "
                                   "garbage collector's reach since the model loaded")
        frozen.add_metric([], gc.get_freeze_count())
        return [waiting, running, saves, rejections, failures, frozen]


class ServerMetrics:
    def __init__(self) -> None:
        # no `_created` series beside every counter: they double the page for nothing a
        # scraper needs (the client's switch is process-wide; this process is the server)
        disable_created_metrics()
        self.registry = r = CollectorRegistry()
        self.live = _Live()
        r.register(self.live)
        GCCollector(registry=r)  # python_gc_collections_total{generation}: a full one stalls
        self.info = Info("adaspark_server", "The model and arm this server runs", registry=r)
        self.requests = Counter("adaspark_requests", "Requests the engine finished, by finish "
                                "reason (error: the engine raised)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("adaspark_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.reused_tokens = Counter("adaspark_reused_prompt_tokens", "Prompt tokens found in "
                                     "the KV cache (prefix reuse)", registry=r)
        self.completion_tokens = Counter("adaspark_completion_tokens", "Reply tokens",
                                         registry=r)
        self.decode_tokens = Counter("adaspark_decode_tokens", "Tokens produced by decode "
                                     "rounds (after the prefill's first token)", registry=r)
        self.decode_seconds = Counter("adaspark_decode_seconds", "Seconds spent decoding",
                                      registry=r)
        self.prefill_seconds = Counter("adaspark_prefill_seconds", "Seconds spent in prefill",
                                       registry=r)
        self.rounds = Counter("adaspark_rounds", "Decode rounds by kind", ["kind"], registry=r)
        self.verified_rows = Histogram("adaspark_round_verified_rows", "Rows verified per "
                                       "round, the anchor included", buckets=ROWS_BUCKETS,
                                       registry=r)
        self.accepted = Histogram("adaspark_round_accepted_tokens", "Drafted tokens accepted "
                                  "per round (the bonus token excluded)",
                                  buckets=ACCEPTED_BUCKETS, registry=r)
        self.accepted_by_source = Counter("adaspark_accepted_tokens", "Drafted tokens accepted, "
                                          "by who proposed them", ["source"], registry=r)
        self.verify_seconds = Histogram("adaspark_verify_seconds", "The target's verify forward, "
                                        "by rows verified", ["width"], buckets=SECONDS_BUCKETS,
                                        registry=r)
        self.draft_seconds = Histogram("adaspark_draft_seconds", "D: drafter forward and plan, "
                                       "by rows verified", ["width"], buckets=SECONDS_BUCKETS,
                                       registry=r)
        self.commit_seconds = Histogram("adaspark_commit_seconds", "Accept walk and cache "
                                        "commits", buckets=SECONDS_BUCKETS, registry=r)
        self.position_verified = Counter("adaspark_block_position_verified", "Tree rounds that "
                                         "verified a row at this depth", ["position"],
                                         registry=r)
        self.position_accepted = Counter("adaspark_block_position_accepted", "Tree rounds whose "
                                         "accepted path reached this depth", ["position"],
                                         registry=r)
        self.gate = Counter("adaspark_gate_decisions", "Draft gate decisions by n-gram evidence "
                            "bucket (-1: no proposal)", ["bucket", "decision"], registry=r)
        self.predicted_accepted = Counter("adaspark_predicted_accepted_tokens", "The acceptance "
                                          "model's expected accepted tokens, priced tree rounds",
                                          registry=r)
        self.realised_accepted = Counter("adaspark_realised_accepted_tokens", "Accepted tokens "
                                         "of the same rounds", registry=r)
        # labelled children made once (every label exists from the start, at 0): a round then
        # costs plain increments, not label look-ups
        self._kinds = {kind: self.rounds.labels(kind=kind) for kind in KINDS}
        self._sources = [(self.accepted_by_source.labels(source=source), key) for source, key
                         in zip(SOURCES, ("accepted_drafter", "accepted_ngram", "agreed"),
                                strict=True)]
        self._verified_at = [self.position_verified.labels(position=str(p))
                             for p in range(1, MAX_POSITION + 1)]
        self._accepted_at = [self.position_accepted.labels(position=str(p))
                             for p in range(1, MAX_POSITION + 1)]
        self._widths: dict[int, tuple[Any, Any]] = {}

    def observe_round(self, record: dict, depths) -> None:
        """One round: its round-log record and the plan's row depths."""
        rows, accepted = record["rows"], record["accepted"]
        by_width = self._widths.get(rows)
        if by_width is None:
            by_width = self._widths[rows] = (self.verify_seconds.labels(width=str(rows)),
                                             self.draft_seconds.labels(width=str(rows)))
        self._kinds[round_kind(record)].inc()
        self.verified_rows.observe(rows)
        self.accepted.observe(accepted)
        by_width[0].observe(record["verify"])
        by_width[1].observe(record["D"])
        self.commit_seconds.observe(record["commit"])
        for counter, key in self._sources:
            if record[key]:
                counter.inc(record[key])
        if rows > 1:
            for counter in self._verified_at[:int(max(depths))]:
                counter.inc()
            for counter in self._accepted_at[:accepted]:
                counter.inc()
        if record.get("gate_bucket") is not None:
            decision = "draft" if record.get("drafted") else "skip"
            self.gate.labels(bucket=str(record["gate_bucket"]), decision=decision).inc()
        if record.get("pred_S") is not None:
            self.predicted_accepted.inc(record["pred_S"])
            self.realised_accepted.inc(accepted)

    def observe_request(self, result: Any, plain_rounds_here: bool) -> None:
        """A finished request (the engine's Generation, None when it raised); with
        plain_rounds_here (the `ar` arm) its rounds are counted from its timings."""
        if result is None:
            self.requests.labels(finish_reason="error").inc()
            return
        t = result.timings
        self.requests.labels(finish_reason=result.finish_reason).inc()
        self.prompt_tokens.inc(t.prompt_tokens)
        self.reused_tokens.inc(t.reused_tokens)
        self.completion_tokens.inc(len(result.token_ids))
        self.decode_tokens.inc(t.decode_tokens)
        self.decode_seconds.inc(t.decode_s)
        self.prefill_seconds.inc(t.prefill_s)
        if plain_rounds_here and t.plain_rounds:
            self._kinds["plain"].inc(t.plain_rounds)
            for _ in range(t.plain_rounds):
                self.verified_rows.observe(1)
                self.accepted.observe(0)

    def value(self, name: str, **labels: str) -> float:
        """One sample's value now (0 when absent)."""
        return self.registry.get_sample_value(name, labels) or 0.0
