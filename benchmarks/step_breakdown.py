"""Where each engine step's wall time goes, at 1 and N closed-loop clients on mixed work.

server_steps.py totals the parts of the steps (nested, so they overlap); this splits every step
of the server's engine thread into exclusive parts that sum to the step (adaspark/bench/
step_clock.py): waiting for work, admission (new requests' decodes and slots), prefill (the
forward, and the host work around it: the drafter's features, the first token), the shared
verify (the forward, and the host work around it: the picks and taps, the speculator's step
price and row budget and shared learning), per-request host work (plans and drafting, takes:
accept, commit, sampling; the speculator's per-round learning and the metrics), scheduling
(the step's own loop: each request's advance, with its stops, detokenising and streaming),
finishing (results, the metrics' observers), the learned store's saves. Per request it also
records the wait for admission (from its place's reservation, after the body is parsed, to its
submit: rendering and tokenising; from its submit to its admission: the queue). Per pass it
reports the tail as the batch empties: the steps run below N requests with none waiting, and
the wall from the pass's last admission to its end.

Per arm one server runs (`adaspark serve --arm ARM --parallel N --fresh`), this file run as
`step_breakdown.py --serve RECORD serve ARGS...` so the clock is installed in the server
process only (nothing is timed in a plain server); its slots are warmed at cap 16 on prompts the
passes do not send, then the requests run over one client, then over N clients
(concurrency.run_clients: closed loop, streaming), from the evaluation's first turns in the
order --seed shuffles them (concurrency.py's --prompts mixed: long documents beside short
chats; --short CHARS keeps only the short ones).

    .venv/bin/python benchmarks/step_breakdown.py --arms ar,adaspark+gate --clients 4 \\
        --requests 24 --cap 128 --short 2000 --json step_breakdown.json

Timing lives here, never in tests (tests/test_step_clock.py checks the accounting).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

ROOT = "schedule (step loop: advance, stops, detokenise, stream)"
IDLE = "waiting for work"
# (module, class, method, part): each wrapped method's own time (less its timed callees)
PARTS = [
    ("threading", "Condition", "wait", IDLE),
    ("adaspark.server.worker", "EngineWorker", "_drop_unwanted", "admission"),
    ("adaspark.server.worker", "EngineWorker", "_admit", "admission"),
    ("adaspark.batch", "Batch", "_prefill", "prefill: host"),
    ("adaspark.model.transformer", "Transformer", "prefill_many", "prefill: forward"),
    ("adaspark.batch", "Batch", "_run", "verify: host (shared)"),
    ("adaspark.model.transformer", "Transformer", "verify_many", "verify: forward"),
    ("adaspark.speculative", "Speculator", "price_step", "verify: speculator (shared)"),
    ("adaspark.speculative", "Speculator", "share_rows", "verify: speculator (shared)"),
    ("adaspark.speculative", "Speculator", "learn_shared_verify",
     "verify: speculator (shared)"),
    ("adaspark.sequence", "Decode", "row", "request: plan"),
    ("adaspark.speculative", "RoundDecode", "row", "request: plan"),
    ("adaspark.speculative", "RoundDecode", "_draft", "request: draft"),
    ("adaspark.sequence", "Decode", "take", "request: take (accept, commit, sample)"),
    ("adaspark.speculative", "RoundDecode", "take", "request: take (accept, commit, sample)"),
    ("adaspark.speculative", "Speculator", "report", "request: learn"),
    ("adaspark.server.watch", "Watch", "on_round", "metrics"),
    ("adaspark.server.watch", "Watch", "on_request", "metrics"),
    ("adaspark.server.worker", "EngineWorker", "_finish", "finish (results)"),
    ("adaspark.speculative", "Speculator", "save", "store save"),
]


def install(clock) -> None:
    """The step clock on the server's engine: every _serve_once a step, PARTS its phases; the
    requests' reservation, submit and admission times as events."""
    from adaspark.batch import Batch
    from adaspark.server.worker import EngineWorker

    clock.install(PARTS)

    def step_info(batch) -> None:
        clock.note(running=len(batch.running),
                   prefilling=sum(1 for seq in batch.running if seq.prefilling))

    def waiting(worker) -> None:
        clock.note(waiting=worker.waiting)

    clock.wrap(Batch, "step", ROOT, before=step_info)  # its own time: the step loop's
    clock.wrap(EngineWorker, "_serve_once", ROOT, root=True, before=waiting)
    # the requests' times: the event loop's reserve and submit (no step open there: not
    # timed), the engine thread's admission (inside _admit's part)
    clock.wrap(EngineWorker, "reserve", "admission",
               after=lambda place, *_, **__: clock.event("reserve", place=id(place)))
    clock.wrap(EngineWorker, "submit", "admission",
               before=lambda _, job, place=None: clock.event(
                   "submit", job=id(job), place=None if place is None else id(place)))
    clock.wrap(EngineWorker, "_next_job", "admission",
               after=lambda item, *_: item is None or clock.event(
                   "admit", job=id(item[0]), place=id(item[2])))


def serve(record_path: str, argv: list[str]) -> int:
    """In the server process: install the clock, run `adaspark serve`, write RECORD at exit."""
    import atexit
    from dataclasses import asdict

    from adaspark.bench.step_clock import StepClock
    from adaspark.cli import main

    clock = StepClock()
    install(clock)

    def write(*_) -> None:
        Path(record_path).write_text(json.dumps(
            {"steps": [asdict(s) for s in clock.steps], "events": clock.events}))
        if _:  # SIGTERM: uvicorn re-raises it after its graceful shutdown, to this handler
            sys.exit(0)

    atexit.register(write)
    signal.signal(signal.SIGTERM, write)
    return main(argv)


def admission_waits(events: list, start: float, end: float) -> dict:
    """Per request admitted in [start, end]: reservation to submit (rendering, tokenising) and
    submit to admission (the queue), seconds; their medians, p95s and sums."""
    from concurrency import percentile

    reserved, submitted, prepare, queue = {}, {}, [], []
    for what, when, details in events:
        if what == "reserve":
            reserved[details["place"]] = when
        elif what == "submit":
            submitted[details["job"]] = (when, details["place"])
        elif what == "admit" and start <= when <= end and details["job"] in submitted:
            at, place = submitted.pop(details["job"])
            queue.append(when - at)
            if place in reserved:  # its first choice: the place's own preparation
                prepare.append(at - reserved.pop(place))

    def summary(values: list[float]) -> dict:
        return {"n": len(values), "sum_s": sum(values),
                "median_s": statistics.median(values) if values else None,
                "p95_s": percentile(values, 0.95)}

    return {"prepare": summary(prepare), "queue": summary(queue)}


def clipped(step: dict, start: float, end: float) -> dict:
    """The step's part in [start, end]: a step waits for work at its start (the engine thread
    idles there between passes, and after a pass's last reply until the next), so what lies
    outside is taken from its wait, as far as that goes."""
    outside = max(0.0, start - step["start"]) + max(0.0, step["start"] + step["wall"] - end)
    cut = min(outside, step["parts"].get(IDLE, 0.0))
    if not cut:
        return step
    return {**step, "wall": step["wall"] - cut,
            "parts": {**step["parts"], IDLE: step["parts"][IDLE] - cut}}


def breakdown(record: dict, start: float, end: float, clients: int) -> dict:
    """The steps within [start, end] (clipped): their wall, each part's sum and share, by running
    count too; the tail (steps below `clients` running with none waiting; the wall after the
    last admission); the requests' admission waits."""
    steps = [clipped(s, start, end) for s in record["steps"]
             if s["start"] < end and s["start"] + s["wall"] > start]
    wall = sum(s["wall"] for s in steps)
    parts: Counter = Counter()
    for s in steps:
        parts.update(s["parts"])
    by_running = {}
    for n in sorted({s["info"].get("running", 0) for s in steps}):
        these = [s for s in steps if s["info"].get("running", 0) == n]
        mine: Counter = Counter()
        for s in these:
            mine.update(s["parts"])
        busy = [s["wall"] - s["parts"].get(IDLE, 0.0) for s in these]
        by_running[n] = {"steps": len(these), "wall_s": sum(s["wall"] for s in these),
                         "busy_step_ms_median": 1e3 * statistics.median(busy),
                         "parts_s": dict(mine)}
    underfilled = [s for s in steps if s["info"].get("running", 0) < clients
                   and not s["info"].get("waiting")]
    admits = [when for what, when, _ in record["events"]
              if what == "admit" and start <= when <= end]
    return {
        "clients": clients, "wall_s": end - start, "steps": len(steps), "in_steps_s": wall,
        "parts_s": dict(parts), "parts_share": {k: v / wall for k, v in parts.items()}
        if wall else {}, "by_running": by_running,
        "tail": {"underfilled_steps": len(underfilled),
                 "underfilled_s": sum(s["wall"] for s in underfilled),
                 "underfilled_idle_s": sum(s["parts"].get(IDLE, 0.0) for s in underfilled),
                 "after_last_admission_s": end - max(admits) if admits else None},
        "admission": admission_waits(record["events"], start, end),
    }


def show(arm: str, b: dict) -> None:
    print(f"{arm} at {b['clients']} client(s): {b['wall_s']:.2f} s, {b['steps']} steps, "
          f"{b['in_steps_s']:.2f} s in them")
    for part, seconds in sorted(b["parts_s"].items(), key=lambda kv: -kv[1]):
        print(f"  {part:<58} {seconds:8.3f} s {100 * b['parts_share'][part]:5.1f}%")
    for n, r in b["by_running"].items():
        print(f"  {n} running: {r['steps']} steps, {r['wall_s']:.2f} s, busy step median "
              f"{r['busy_step_ms_median']:.2f} ms")
    t, a = b["tail"], b["admission"]
    last = t["after_last_admission_s"]
    print(f"  tail: {t['underfilled_steps']} steps below {b['clients']} running with none "
          f"waiting, {t['underfilled_s']:.2f} s ({t['underfilled_idle_s']:.2f} s of it idle); "
          + ("no admission" if last is None else f"{last:.2f} s after the last admission"))
    for name, label in (("prepare", "reserve -> submit (render, tokenise)"),
                        ("queue", "submit -> admission (queue)")):
        s = a[name]
        if s["n"]:
            print(f"  {label}: {s['n']} requests, median {1e3 * s['median_s']:.1f} ms, p95 "
                  f"{1e3 * s['p95_s']:.1f} ms, sum {s['sum_s']:.2f} s")


def bench(arm: str, args, requests, out_dir: Path) -> dict:
    from concurrency import run_clients, summarise, warm_up_requests

    from adaspark.bench.servers import ServerProcess, free_port

    port, record = free_port(), out_dir / "record.json"
    command = [sys.executable, str(HERE), "--serve", str(record), "serve", "--arm", arm,
               "--host", "127.0.0.1", "--port", str(port), "--store", str(out_dir / "store"),
               "--fresh", "--parallel", str(args.clients)]
    passes = []
    with ServerProcess(command, port, out_dir / "server.log") as server:
        run_clients(server.url, warm_up_requests(requests, args.clients), args.clients, 16)
        for n in (1, args.clients):
            start = time.perf_counter()
            replies, wall = run_clients(server.url, requests, n, args.cap)
            passes.append((n, start, time.perf_counter(), summarise(n, replies, wall, None)))
    data = json.loads(record.read_text())
    out = {"arm": arm, "passes": []}
    for n, start, end, clients in passes:
        b = breakdown(data, start, end, n)
        b["aggregate_tok_s"] = clients["aggregate_tok_s"]
        b["failed"] = clients["failed"]
        out["passes"].append(b)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(argv[1], argv[2:])
    from concurrency import CONVERSATIONS, first_turns, mixed_order

    from adaspark.bench.conversations import load_conversations
    from adaspark.bench.runner import machine_description

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="ar,adaspark+gate")
    p.add_argument("--clients", type=int, default=4,
                   help="the second pass's closed-loop clients (= --parallel); the first has 1")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--cap", type=int, default=128)
    p.add_argument("--short", type=int, default=0, metavar="CHARS",
                   help="only first turns of at most CHARS characters (0: all, mixed lengths)")
    p.add_argument("--seed", type=int, default=0, help="the order of the mixed prompts")
    p.add_argument("--threads", type=int, default=2, help="the server's OMP_NUM_THREADS")
    p.add_argument("--data", type=Path, default=CONVERSATIONS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.clients < 2:
        p.error("--clients must be at least 2 (the first pass runs one client)")
    import os

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    requests = mixed_order(first_turns(load_conversations(args.data), args.short), args.seed)
    # the warm-up takes the first --clients prompts (marked so no prompt cache matches them)
    requests = requests[:args.requests]
    machine = machine_description()
    print(f"CPU: {machine.get('cpu')}; {len(requests)} mixed first turns (seed {args.seed}"
          f"{f', at most {args.short} characters' if args.short else ''}), cap {args.cap}, "
          f"1 then {args.clients} closed-loop clients", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="adaspark-step-breakdown-") as tmp:
        for arm in [a.replace("+", ",") for a in args.arms.split(",") if a]:
            r = bench(arm, args, requests, Path(tmp) / arm.replace(",", "+"))
            for b in r["passes"]:
                print(f"aggregate {b['aggregate_tok_s']:.1f} tok/s, {b['failed']} failed")
                show(arm, b)
            results.append(r)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine, "settings": vars(args) | {
            "data": str(args.data), "json": str(args.json)}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
