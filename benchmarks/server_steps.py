"""Where the server's engine thread spends a pass of concurrent clients, over HTTP.

concurrency.py measures what the clients see; this says why. Per arm one server runs
(`adaspark serve --arm ARM --parallel P --fresh`) with its engine recorded: each step's wall
and thread CPU time, the requests it ran (prefilling or not) and the forward's thread count
(adaptive: adaspark/threads.py), and the wall and CPU time of the step's parts (the plans, the
takes, the shared verify and prefill forwards, the metrics' observers). As concurrency.py runs
it: a warm-up at cap 16, the requests one at a time, then over --clients clients; the
recording covers the last pass only. What only a server has shows here: the event loop beside
the engine thread, the client process beside the server (docs/results/zen3-s20/: the thread
governor took that client for a busy neighbour).

    .venv/bin/python benchmarks/server_steps.py --arms ar,adaspark+gate --clients 4 \\
        --requests 24 --short 500 --cap 64

The server is this file run as `server_steps.py --serve RECORD serve ARGS...`: it wraps the
engine's parts, then runs `adaspark serve ARGS`, and writes RECORD (JSON) when the server
exits. Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import atexit
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

# (owner module, class, method, part): the parts of a step timed in the server
PARTS = [
    ("adaspark.server.worker", "EngineWorker", "_admit", "admit"),
    ("adaspark.batch", "Batch", "_prefill", "prefill (step part)"),
    ("adaspark.model.transformer", "Transformer", "prefill_many", "prefill forward"),
    ("adaspark.model.transformer", "Transformer", "verify_many", "verify forward"),
    ("adaspark.speculative", "RoundDecode", "row", "plan (row)"),
    ("adaspark.speculative", "RoundDecode", "take", "take"),
    ("adaspark.sequence", "Decode", "take", "take (plain)"),
    ("adaspark.speculative", "Speculator", "report", "report (in take)"),
    ("adaspark.speculative", "Speculator", "price_step", "price_step"),
    ("adaspark.speculative", "Speculator", "share_rows", "share_rows"),
    ("adaspark.speculative", "Speculator", "learn_shared_verify", "learn_shared_verify"),
    ("adaspark.server.watch", "Watch", "on_round", "metrics: on_round (in report)"),
    ("adaspark.server.watch", "Watch", "on_request", "metrics: on_request"),
]


def serve(record_path: str, argv: list[str]) -> int:
    """In the server process: wrap the step and its parts, run `adaspark serve`."""
    import importlib

    from adaspark import threads
    from adaspark.batch import Batch
    from adaspark.cli import main

    steps: list[tuple] = []
    parts: dict[str, list[tuple]] = {}

    def wrap(owner, name: str, part: str) -> None:
        inner, calls = getattr(owner, name), parts.setdefault(part, [])

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                calls.append((start, time.perf_counter() - start, time.thread_time() - cpu))

        setattr(owner, name, timed)

    for module, cls, name, part in PARTS:
        wrap(getattr(importlib.import_module(module), cls), name, part)
    step = Batch.step

    def recorded(self):
        running = len(self.running)
        prefilling = sum(1 for seq in self.running if seq.prefilling)
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return step(self)
        finally:
            governor = threads._governor
            steps.append((start, time.perf_counter() - start, time.thread_time() - cpu,
                          running, prefilling, None if governor is None else governor.threads))

    Batch.step = recorded

    def write(*_) -> None:
        Path(record_path).write_text(json.dumps({"steps": steps, "parts": parts}))
        if _:  # SIGTERM: uvicorn re-raises it after its graceful shutdown, to this handler
            sys.exit(0)

    atexit.register(write)
    signal.signal(signal.SIGTERM, write)
    return main(argv)


def report(arm: str, record: dict, start: float, end: float) -> dict:
    """The steps and parts that began in [start, end] (perf_counter: one clock on Linux)."""
    steps = [s for s in record["steps"] if start <= s[0] <= end]
    wall = end - start
    out = {"arm": arm, "wall_s": wall, "steps": len(steps),
           "in_steps_s": sum(s[1] for s in steps), "steps_cpu_s": sum(s[2] for s in steps),
           "threads": dict(Counter(str(s[5]) for s in steps)), "by_running": {}, "parts": {}}
    for n in sorted({s[3] for s in steps}):
        these = [s for s in steps if s[3] == n]
        decoding = [s for s in these if s[4] == 0]  # no prompt chunk in the step
        out["by_running"][n] = {
            "steps": len(these), "wall_s": sum(s[1] for s in these),
            "decode_steps": len(decoding),
            "decode_step_ms_median": 1e3 * statistics.median([s[1] for s in decoding])
            if decoding else None,
            "decode_step_cpu_ms_median": 1e3 * statistics.median([s[2] for s in decoding])
            if decoding else None}
    for part, calls in record["parts"].items():
        calls = [c for c in calls if start <= c[0] <= end]
        if calls:
            out["parts"][part] = {"calls": len(calls), "wall_s": sum(c[1] for c in calls),
                                  "cpu_s": sum(c[2] for c in calls)}
    return out


def show(r: dict) -> None:
    print(f"{r['arm']}: {r['wall_s']:.2f} s, {r['steps']} steps, in steps {r['in_steps_s']:.2f} s "
          f"(engine thread CPU {r['steps_cpu_s']:.2f} s); forward threads by step "
          f"{r['threads']}")
    for n, b in r["by_running"].items():
        median = b["decode_step_ms_median"]
        print(f"  {n} running: {b['steps']} steps {b['wall_s']:.2f} s; decode-only steps "
              f"{b['decode_steps']}" + ("" if median is None else
                                        f", median {median:.2f} ms "
                                        f"(CPU {b['decode_step_cpu_ms_median']:.2f})"))
    for part, p in sorted(r["parts"].items()):
        print(f"  {part:<30} {p['calls']:6d} calls {p['wall_s']:6.2f} s (CPU {p['cpu_s']:5.2f})"
              f"  {1e3 * p['wall_s'] / p['calls']:.3f} ms a call")


def bench(arm: str, args, requests, out_dir: Path) -> dict:
    from concurrency import run_clients, summarise

    from adaspark.bench.servers import ServerProcess, free_port

    port, record = free_port(), out_dir / f"{arm.replace(',', '+')}.json"
    command = [sys.executable, str(HERE), "--serve", str(record), "serve", "--arm", arm,
               "--host", "127.0.0.1", "--port", str(port), "--store", str(out_dir / "store"),
               "--fresh", "--parallel", str(args.clients)]
    with ServerProcess(command, port, out_dir / "server.log") as server:
        run_clients(server.url, requests[:args.clients], args.clients, 16)  # warm every slot
        one = summarise(1, *run_clients(server.url, requests, 1, args.cap), None)
        start = time.perf_counter()
        many = summarise(args.clients, *run_clients(server.url, requests, args.clients,
                                                    args.cap), None)
        end = time.perf_counter()
    r = report(arm, json.loads(record.read_text()), start, end)
    r["aggregate_tok_s"] = {"1": one["aggregate_tok_s"],
                            str(args.clients): many["aggregate_tok_s"]}
    return r


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(argv[1], argv[2:])
    from concurrency import CONVERSATIONS, first_turns

    from adaspark.bench.conversations import load_conversations
    from adaspark.bench.runner import machine_description

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="ar,adaspark+gate")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (= --parallel)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--cap", type=int, default=64)
    p.add_argument("--short", type=int, default=500, metavar="CHARS")
    p.add_argument("--data", type=Path, default=CONVERSATIONS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    requests = first_turns(load_conversations(args.data), args.short)[:args.requests]
    print(f"CPU: {machine_description()['cpu']}; {len(requests)} requests, cap {args.cap}, "
          f"{args.clients} clients", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="adaspark-server-steps-") as tmp:
        for arm in [a.replace("+", ",") for a in args.arms.split(",") if a]:
            r = bench(arm, args, requests, Path(tmp) / arm.replace(",", "+"))
            agg = r["aggregate_tok_s"]
            print(f"aggregate tok/s: 1 client {agg['1']:.1f}, {args.clients} clients "
                  f"{agg[str(args.clients)]:.1f}", flush=True)
            show(r)
            results.append(r)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
