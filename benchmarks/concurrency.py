"""Many users at once: N concurrent streaming clients over HTTP against `adaspark serve`.

For each arm one server runs (`adaspark serve --arm ARM --parallel P --fresh`, P the largest N
unless --parallel says otherwise); for each N in --clients, N client threads share one queue
of requests, the first turns of the evaluation's conversations (system prompt and tools
included, greedy, capped at --cap tokens), each client taking the next request when its last
one has finished. Per N: aggregate tok/s (every completion token over the wall time from the
first request to the last reply), per-request decode tok/s (client clock: tokens over first to
last streamed delta; median), time to first token (median, p95), and whether every reply equals
the N = 1 reply to the same request (a reply may differ where the server reused another cached
prefix for it: see docs/batching.md). Every arm batches its requests' rows into one forward per
step: one row each for plain decoding (`ar`), each request's round (its own draft first, for a
drafting arm) for the speculative arms (docs/batching.md).

    .venv/bin/python benchmarks/concurrency.py --arms ar,adaspark+gate --clients 1,2,4,8
    .venv/bin/python benchmarks/concurrency.py --arms ar --clients 1,4 --requests 8 --cap 64 \\
        --json out.json     # a smoke run
    .venv/bin/python benchmarks/concurrency.py --arms ar --clients 8 --mixed 200

--short CHARS keeps the first turns of at most CHARS characters (the aggregate of long prompts is
mostly prefill, which batching does not make cheaper; and a server that keeps past prompts in a
RAM prompt cache, as llama-server does, prefills the N > 1 passes' repeated prompts for free).

After the table, per arm: the p95 time to first token over N = 1, beside the p95 that the N = 1
pass's own first tokens predict if every N prompts arrived together and prefilled one after
another at their solo cost (wave_ttft): on a CPU, where a prefill is compute-bound, no server
can give the last prompt of such a wave its first token before the others' prefills are done.

--mixed M then sends M mixed requests over the largest N clients (streamed and not, some
cancelled after three deltas, some malformed) and reports 5xx answers (there should be none),
completed replies equal to the same request sent alone, and the server's peak RSS.

--arrivals poisson --concurrency N sends the requests open-loop instead. Per arm, one client
runs them back to back (the solo pass, the N = 1 row), then the same requests arrive at the
times of a Poisson process (benchmarks/arrivals.py) whose rate keeps about N in flight: by
Little's law, the completion rate of N closed-loop clients on the first arm (a calibration pass,
its numbers in the row's rate_from; or --rate), kept for every later arm, so that with the same
--seed every arm gets the same arrival times. A request is sent at its time whether or not
earlier replies have come. Each pass runs on a fresh server of the arm (empty store and caches)
whose slots are warmed on prompts neither pass sends, so no prompt cache (llama-server's RAM
cache included) prefills a measured prompt for free. The Poisson row (N shown as ~N): the same
figures, wall from the first arrival to the last reply, plus the rate, the mean number in flight
that was measured (Little's law: every request's time over the wall) and how late the latest
dispatch was. After the table, per arm: its aggregate, per-request decode speed and first token
(median, p95) over its solo pass's, and its aggregate over llama-server's under the same
arrivals (when `llama-server` is an arm). The server's --parallel defaults to N, so a burst past
N waits for a slot, as in service.

    .venv/bin/python benchmarks/concurrency.py --arms ar,adaspark+gate,llama-server \\
        --arrivals poisson --concurrency 4 --prompts mixed --requests 45 --cap 128

--prompts mixed takes the first turns (after --short, if given) in an order shuffled by --seed
instead of file order, so that every stretch of the run, and every --requests prefix, mixes the
sources' prompt lengths (the file groups them: LongBench's long documents come last).

--interleave measures one client with the arms side by side: every arm's server up at once, each
request sent to every arm in turn, the first arm rotating, so the machine's drift over the run
lands on every arm alike; per arm its aggregate over the seconds its own requests took, and its
per-request speed over the first arm's (geometric mean). Issue 41's short-reply bar:

    .venv/bin/python benchmarks/concurrency.py --arms ar,adaspark+gate --clients 1 \\
        --requests 24 --short 500 --cap 64 --interleave

The arm `llama-server` runs llama.cpp's own server (built once by benchmarks/llama_server.py
from the sources vs_llamacpp.py builds: `--parallel P`, continuous batching, the same GGUF and
threads) through the same clients, so the two engines are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from adaspark.bench.client import ChatClient, StreamedReply
from adaspark.bench.conversations import Conversation, load_conversations
from adaspark.bench.interleave import interleaved
from adaspark.bench.runner import machine_description
from adaspark.bench.servers import LocalServer
from adaspark.bench.stats import geomean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arrivals import mean_in_flight, poisson_arrivals, run_arrivals  # noqa: E402
from llama_server import LlamaServer, ensure_built  # noqa: E402

CONVERSATIONS = Path(__file__).resolve().parents[2] / "shared/data/eval/conversations.jsonl"
LLAMA_SERVER = "llama-server"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="ar,adaspark+gate",
                   help="comma-separated arms, modifiers with '+' (adaspark+gate); "
                        "`llama-server`: llama.cpp's own server (benchmarks/llama_server.py)")
    p.add_argument("--clients", default=None,
                   help="comma-separated concurrent clients (default 1,2,4,8; closed loop)")
    p.add_argument("--arrivals", choices=("clients", "poisson"), default="clients",
                   help="clients: closed loop, each client asks again when its reply ends; "
                        "poisson: one client, then open-loop Poisson arrivals (--concurrency)")
    p.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="with --arrivals poisson: the mean number of requests in flight the "
                        "rate is set for (Little's law: the completion rate of N closed-loop "
                        "clients on the first arm)")
    p.add_argument("--rate", type=float, default=None, metavar="PER_S",
                   help="with --arrivals poisson: this arrival rate instead of the derived one")
    p.add_argument("--seed", type=int, default=0,
                   help="the seed of the arrival times and of --prompts mixed's order")
    p.add_argument("--prompts", choices=("file-order", "mixed"), default="file-order",
                   help="file-order: the first turns in file order; mixed: shuffled by --seed, "
                        "so every stretch of the run mixes short prompts and long documents")
    p.add_argument("--requests", type=int, default=16,
                   help="requests per N (first turns, in --prompts order; at least N); with "
                        "--arrivals poisson, the requests of the solo pass and the arrivals")
    p.add_argument("--cap", type=int, default=128, help="reply cap (max_tokens)")
    p.add_argument("--short", type=int, default=0, metavar="CHARS",
                   help="only first turns of at most CHARS characters (messages and tools): "
                        "short prompts, where the steps are decode rather than prefill")
    p.add_argument("--parallel", type=int, default=None,
                   help="the server's --parallel (default: the largest N; with --arrivals "
                        "poisson, --concurrency)")
    p.add_argument("--threads", type=int, default=2, help="the server's OMP_NUM_THREADS")
    p.add_argument("--data", type=Path, default=CONVERSATIONS, help="conversations JSONL")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded one)")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument("--mixed", type=int, default=0, metavar="M",
                   help="then M mixed requests (streamed, not, cancelled, malformed)")
    p.add_argument("--interleave", action="store_true",
                   help="one client; every arm's server up at once, each request sent to "
                        "every arm in turn (see interleaved_pass)")
    args = p.parse_args(argv)
    if args.interleave and (args.arrivals == "poisson" or args.mixed
                            or (args.clients or "1") != "1"):
        p.error("--interleave runs one client (--clients 1) in closed loop, without --mixed")
    if args.arrivals == "poisson":
        if args.concurrency is None or args.concurrency < 1:
            p.error("--arrivals poisson needs --concurrency N, N at least 1")
        if args.clients is not None:
            p.error("--clients is for --arrivals clients; poisson runs one client, then the "
                    "arrivals at --concurrency")
        if args.rate is not None and not args.rate > 0:
            p.error("--rate must be positive")
        if args.requests < 2:
            p.error("--arrivals poisson needs --requests of at least 2")
    else:
        if args.concurrency is not None or args.rate is not None:
            p.error("--concurrency and --rate are for --arrivals poisson")
        args.clients = args.clients or "1,2,4,8"
    return args


def first_turn(conv: Conversation) -> tuple[list[dict], list[dict] | None]:
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    return [*messages, {"role": "user", "content": conv.turns[0]}], conv.openai_tools()


def first_turns(conversations: list[Conversation], short: int = 0) -> list:
    """The conversations' first turns in file order; with `short`, only those of at most
    `short` characters."""
    requests = [first_turn(c) for c in conversations]
    return [r for r in requests if prompt_chars(r) <= short] if short else requests


def mixed_order(requests: list, seed: int) -> list:
    """The requests in an order shuffled by `seed` (the same seed, the same order)."""
    shuffled = list(requests)
    random.Random(seed).shuffle(shuffled)
    return shuffled


def prompt_chars(request: tuple[list[dict], list[dict] | None]) -> int:
    """The characters a first turn sends: its messages' text and its tools' JSON."""
    messages, tools = request
    return sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def wave_ttft(solo: list[float | None], n: int) -> list[float]:
    """First tokens as the N = 1 pass's predict them if every n requests arrived together (as
    they do here: capped replies end together, so the clients ask again together) and each
    wave's prompts prefilled one after another, shortest first, at what each cost alone: where
    a prefill is compute-bound, a forward of several prompts costs about their sum, so the
    k-th of a wave waits for its own prefill and the k - 1 before it. The part of a first token
    one prompt does not add to another's (the request's handling, the first step) is taken as
    the fastest solo first token, an overestimate, which keeps the prediction low. Requests in
    queue order, waves of n consecutive ones; failed ones are left out."""
    times = [t for t in solo if t is not None]
    if not times:
        return []
    fixed, predicted = min(times), []
    for w in range(0, len(times), n):
        waited = 0.0
        for t in sorted(times[w:w + n]):
            waited += t - fixed
            predicted.append(fixed + waited)
    return predicted


def run_clients(url: str, requests: list[tuple[list[dict], list[dict] | None]], n: int,
                cap: int) -> tuple[list[StreamedReply | None], float]:
    """The requests over n concurrent clients; their replies (None: failed) and wall seconds."""
    todo: queue.Queue = queue.Queue()
    for i, request in enumerate(requests):
        todo.put((i, request))
    replies: list[StreamedReply | None] = [None] * len(requests)

    def client() -> None:
        with ChatClient(url) as chat:
            while True:
                try:
                    i, (messages, tools) = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    replies[i] = chat.stream_chat(messages, max_tokens=cap, tools=tools)
                except Exception as err:  # counted as a failure, the others go on
                    print(f"  request {i} failed: {err}", file=sys.stderr)

    threads = [threading.Thread(target=client) for _ in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies, time.perf_counter() - start


def summarise(n: int, replies: list[StreamedReply | None], wall_s: float,
              solo: list[StreamedReply | None] | None, predict_waves: bool = True) -> dict:
    """predict_waves: the tail of synchronised waves of n prompts (closed-loop clients)."""
    done = [r for r in replies if r is not None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    speeds = [r.tok_s for r in done if r.tok_s is not None]
    tokens = sum(r.completion_tokens for r in done)
    same, waves = None, None
    if solo is not None:
        same = sum(1 for a, b in zip(replies, solo, strict=True)
                   if a is not None and b is not None and a.text == b.text)
        waves = (percentile(wave_ttft([None if r is None else r.ttft_s for r in solo], n), 0.95)
                 if predict_waves else None)
    return {"clients": n, "requests": len(replies), "failed": len(replies) - len(done),
            "tokens": tokens, "wall_s": wall_s, "aggregate_tok_s": tokens / wall_s,
            "decode_tok_s_median": statistics.median(speeds) if speeds else None,
            "ttft_median_s": statistics.median(ttft) if ttft else None,
            "ttft_p95_s": percentile(ttft, 0.95), "same_as_solo": same,
            # the p95 the solo first tokens predict for waves of n prompts (wave_ttft)
            "ttft_p95_waves_s": waves,
            # each request's, in request order (None: failed): where the tail comes from
            "ttft_s": [None if r is None else r.ttft_s for r in replies]}


def make_server(arm: str, parallel: int, args, out_dir: Path):
    """Our `adaspark serve --arm ARM`, or llama.cpp's llama-server for the arm `llama-server`."""
    log = out_dir / f"{arm.replace(',', '+')}.log"
    if arm == LLAMA_SERVER:
        from adaspark.model.sources import resolve_model

        return LlamaServer(resolve_model(args.model), log, parallel, args.threads)
    extra = ["--parallel", str(parallel)] + (["--model", str(args.model)] if args.model else [])
    return LocalServer(arm, log, out_dir / f"store-{arm.replace(',', '+')}", fresh=True,
                       round_log=None, extra_args=extra)


def interleaved_pass(chats: dict, requests: list, cap: int
                     ) -> tuple[dict[str, list[StreamedReply | None]], dict[str, float]]:
    """--interleave: each request to every arm's server in turn (chats: arm -> ChatClient), one
    at a time (bench.interleave: the first arm rotating), so the machine's drift lands on every
    arm alike (the arms' passes one after another put tens of seconds between them, and a
    shared machine drifts by more than the arms differ). Per arm: its replies (None: failed)
    and the seconds its requests took, first byte to last, its wall for the aggregate."""
    seconds = dict.fromkeys(chats, 0.0)

    def one(arm: str, request: tuple) -> list[StreamedReply | None]:
        i, (messages, tools) = request
        start, reply = time.perf_counter(), None
        try:
            reply = chats[arm].stream_chat(messages, max_tokens=cap, tools=tools)
        except Exception as err:  # counted as a failure, the others go on
            print(f"  {arm}: request {i} failed: {err}", file=sys.stderr)
        seconds[arm] += time.perf_counter() - start
        return [reply]

    return interleaved(list(enumerate(requests)), list(chats), one), seconds


def paired_ratio(replies: list, base: list) -> float | None:
    """The geometric mean over requests of one arm's decode speed over the base arm's on the
    same request (both answered, both with a speed)."""
    ratios = [a.tok_s / b.tok_s for a, b in zip(replies, base, strict=True)
              if a is not None and b is not None and a.tok_s and b.tok_s]
    return geomean(ratios) if ratios else None


def bench_interleaved(arms: list[str], requests, args, out_dir: Path) -> list[dict]:
    """Every arm's server at once (--parallel 1), each warmed on a prompt of the work, then
    interleaved_pass over the requests. Rows as one client's, each with its paired speed over
    the first arm's and how many of its replies equal the first arm's."""
    work = requests[:args.requests]
    with contextlib.ExitStack() as stack:
        servers = {arm: stack.enter_context(make_server(arm, 1, args, out_dir)) for arm in arms}
        for arm, server in servers.items():
            print(f"{arm}: the server's forward is {server.forward}, --parallel 1", flush=True)
            run_clients(server.url, work[:1], 1, min(args.cap, 16))
        chats = {arm: stack.enter_context(ChatClient(server.url))
                 for arm, server in servers.items()}
        replies, seconds = interleaved_pass(chats, work, args.cap)
    first = replies[arms[0]]
    rows = []
    for arm in arms:
        row = {"arm": arm, "parallel": 1, "forward": servers[arm].forward, "interleaved": True,
               **summarise(1, replies[arm], seconds[arm], None),
               "paired_over_first": paired_ratio(replies[arm], first),
               "same_as_first": sum(1 for a, b in zip(replies[arm], first, strict=True)
                                    if a is not None and b is not None and a.text == b.text)}
        rows.append(row)
        print(table_row(row), flush=True)
    for row in rows[1:]:
        print(f"{row['arm']} over {arms[0]}, interleaved: aggregate "
              f"{row['aggregate_tok_s'] / rows[0]['aggregate_tok_s']:.3f}x, per request "
              f"(geometric mean) {fmt(row['paired_over_first'], '.3f')}x; replies equal to "
              f"{arms[0]}'s {row['same_as_first']}/{row['requests']}")
    return rows


def bench_arm(arm: str, clients: list[int], requests, args, out_dir: Path) -> list[dict]:
    parallel = args.parallel or max(clients)
    server = make_server(arm, parallel, args, out_dir)
    rows, solo = [], None
    with server:
        print(f"{arm}: the server's forward is {server.forward}, --parallel {parallel}", flush=True)
        # warm every slot up (a slot's first prefills run slower than its later ones)
        run_clients(server.url, requests[:parallel], parallel, min(args.cap, 16))
        for n in clients:
            replies, wall = run_clients(server.url, requests[:max(n, args.requests)], n,
                                        args.cap)
            if n == 1:
                solo = replies
            base = solo[:len(replies)] if solo is not None and len(solo) >= len(replies) else None
            row = {"arm": arm, "parallel": parallel, "forward": server.forward,
                   **summarise(n, replies, wall, base)}
            rows.append(row)
            print(table_row(row), flush=True)
        if args.mixed:
            rows.append(mixed_check(server, arm, requests, args.mixed, max(clients), args.cap))
    return rows


def summarise_arrivals(concurrency: int, replies: list[StreamedReply | None],
                       spans: list[tuple[float, float]], wall_s: float,
                       solo: list[StreamedReply | None] | None, offsets: list[float],
                       rate_per_s: float, seed: int) -> dict:
    """The Poisson pass's row: summarise's figures (failed requests left out of them; no wave
    prediction: these arrivals come one at a time), the arrivals, the mean number in flight
    measured, and the latest dispatch's lateness (how open the loop really was)."""
    row = summarise(concurrency, replies, wall_s, solo, predict_waves=False)
    return {**row, "arrivals": "poisson",
            "rate_per_s": rate_per_s, "seed": seed, "arrival_span_s": offsets[-1],
            "in_flight_mean": mean_in_flight(spans, wall_s),
            "late_max_s": max(sent - due for (sent, _), due in zip(spans, offsets, strict=True))}


def run_poisson(url: str, requests: list, offsets: list[float],
                cap: int) -> tuple[list[StreamedReply | None], list[tuple[float, float]], float]:
    """The requests at their arrival times, each on a client of its own."""
    chats = [ChatClient(url) for _ in requests]
    try:
        for chat in chats:  # the model id asked before the clock starts, not at each arrival
            chat.model()

        def send(i: int) -> StreamedReply:
            messages, tools = requests[i]
            return chats[i].stream_chat(messages, max_tokens=cap, tools=tools)

        return run_arrivals(offsets, send)
    finally:
        for chat in chats:
            chat.close()


def warm_up_requests(requests: list, n: int) -> list:
    """The first n requests with a line before their first message: prompts of the same
    lengths that no pass sends, so that warming the slots leaves no cache holding a measured
    prompt (a prefix cache would then prefill it for free)."""
    return [([{**messages[0], "content": "(warm-up)\n" + messages[0]["content"]}, *messages[1:]],
             tools) for messages, tools in requests[:n]]


def bench_arm_arrivals(arm: str, requests, args, out_dir: Path,
                       rate_per_s: float | None) -> tuple[list[dict], float]:
    """One client over the requests (the solo row), then the same requests at Poisson times,
    each pass on a fresh server of the arm (empty store, empty caches) whose slots are warmed
    on prompts the passes do not send: llama-server's RAM prompt cache would otherwise give the
    second pass every prompt the first sent, long documents included, and our slots the last
    few. Without a rate, it is calibrated (calibrated_rate). Returns the rows and the rate
    used."""
    parallel = args.parallel or args.concurrency
    work = requests[:args.requests]
    warm = warm_up_requests(requests, parallel)
    with make_server(arm, parallel, args, out_dir) as server:
        print(f"{arm}: the server's forward is {server.forward}, --parallel {parallel}", flush=True)
        run_clients(server.url, warm, parallel, min(args.cap, 16))
        solo, solo_wall = run_clients(server.url, work, 1, args.cap)
        solo_row = {"arm": arm, "parallel": parallel, "forward": server.forward,
                    **summarise(1, solo, solo_wall, None),
                    "request_mean_s": solo_wall / len(work)}
    print(table_row(solo_row), flush=True)
    calibration = None
    if rate_per_s is None:
        rate_per_s, calibration = calibrated_rate(arm, work, warm, parallel, args, out_dir)
    offsets = poisson_arrivals(len(work), rate_per_s, args.seed)
    with make_server(arm, parallel, args, out_dir) as server:
        run_clients(server.url, warm, parallel, min(args.cap, 16))
        replies, spans, wall = run_poisson(server.url, work, offsets, args.cap)
        row = {"arm": arm, "parallel": parallel, "forward": server.forward,
               **summarise_arrivals(args.concurrency, replies, spans, wall, solo, offsets,
                                    rate_per_s, args.seed)}
        if calibration is not None:
            row["rate_from"] = calibration  # the closed-loop pass the rate was taken from
        print(table_row(row), flush=True)
        rows = [solo_row, row]
        if args.mixed:
            rows.append(mixed_check(server, arm, requests, args.mixed, args.concurrency,
                                    args.cap))
    return rows, rate_per_s


def calibrated_rate(arm: str, work, warm, parallel: int, args, out_dir: Path
                    ) -> tuple[float, dict]:
    """The arrival rate that keeps about --concurrency requests in flight on this arm: N
    closed-loop clients keep exactly N in flight, so by Little's law their completion rate
    (requests over the pass's wall) is the arrival rate whose mean in flight is N at the
    loaded latency. (N over the solo request time would assume N requests cost one's time:
    on two cores it kept twice N waiting.) Measured on a fresh server, as the passes are."""
    with make_server(arm, parallel, args, out_dir) as server:
        run_clients(server.url, warm, parallel, min(args.cap, 16))
        replies, wall = run_clients(server.url, work, args.concurrency, args.cap)
    done = sum(1 for r in replies if r is not None)
    if not done:
        raise SystemExit(f"{arm}: every request of the calibration pass failed, so no arrival "
                         f"rate follows from it (see {arm}'s server log)")
    rate = done / wall
    print(f"arrivals: {rate:.3f} a second, seed {args.seed} (the completion rate of "
          f"{args.concurrency} closed-loop clients on {arm}: {done} requests in {wall:.1f} s; "
          "the same for every arm)", flush=True)
    return rate, {"clients": args.concurrency, "requests": done, "wall_s": wall}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare_arrivals(rows: list[dict]) -> list[dict]:
    """Per arm with a Poisson row: its aggregate, median per-request decode speed and first
    token (median, p95) over its solo pass's, and its aggregate over llama-server's Poisson
    row (the same arrival times) when llama-server ran."""
    solo = {r["arm"]: r for r in rows
            if r.get("clients") == 1 and "aggregate_tok_s" in r and "arrivals" not in r}
    poisson = {r["arm"]: r for r in rows if r.get("arrivals") == "poisson"}
    reference = poisson.get(LLAMA_SERVER)
    out = []
    for arm, row in poisson.items():
        one = solo.get(arm, {})
        out.append({
            "arm": arm, "concurrency": row["clients"], "in_flight_mean": row["in_flight_mean"],
            **{f"{key}_over_solo": ratio(row[key], one.get(key))
               for key in ("aggregate_tok_s", "decode_tok_s_median", "ttft_median_s",
                           "ttft_p95_s")},
            "aggregate_over_llama_server": (None if reference is None or arm == LLAMA_SERVER
                                            else ratio(row["aggregate_tok_s"],
                                                       reference["aggregate_tok_s"]))})
    return out


def comparison_line(c: dict) -> str:
    line = (f"{c['arm']}: Poisson ~{c['concurrency']} (measured {c['in_flight_mean']:.2f} in "
            f"flight) over one client: aggregate {fmt(c['aggregate_tok_s_over_solo'], '.2f')}x, "
            f"request decode {fmt(c['decode_tok_s_median_over_solo'], '.2f')}x, first token "
            f"median {fmt(c['ttft_median_s_over_solo'], '.2f')}x, "
            f"p95 {fmt(c['ttft_p95_s_over_solo'], '.2f')}x")
    if c["aggregate_over_llama_server"] is not None:
        line += (f"; aggregate {c['aggregate_over_llama_server']:.2f}x llama-server's under the "
                 f"same arrivals")
    return line


MIXED = ("stream", "plain", "stream", "cancel", "malformed", "plain")  # request i: MIXED[i % 6]
MALFORMED = (b"{not json", b'{"messages": []}',
             b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}')


def mixed_request(http: httpx.Client, kind: str, request, cap: int, i: int) -> dict:
    """One request of the mixed run: its kind, HTTP status, reply text (None: none), and
    whether the server failed it (a 5xx, or a server error inside the stream)."""
    messages, tools = request
    body = {"model": "m", "messages": messages, "max_tokens": cap, "temperature": 0,
            **({"tools": tools} if tools else {})}
    url = "/v1/chat/completions"
    if kind == "malformed":
        r = http.post(url, content=MALFORMED[i % len(MALFORMED)],
                      headers={"content-type": "application/json"})
        return {"kind": kind, "status": r.status_code, "text": None,
                "server_error": r.status_code >= 500}
    if kind == "plain":
        r = http.post(url, json=body)
        ok = r.status_code == 200
        return {"kind": kind, "status": r.status_code, "server_error": r.status_code >= 500,
                "text": json.dumps(r.json()["choices"][0]["message"]) if ok else None}
    text, deltas, failed = "", 0, False
    with http.stream("POST", url, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            failed |= chunk.get("error", {}).get("type") == "server_error"
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or "") + json.dumps(delta.get("tool_calls") or "")
                text += piece
                deltas += bool(piece)
            if kind == "cancel" and deltas >= 3:
                break  # leaving the stream closes the connection: the server cancels it
    return {"kind": kind, "status": r.status_code, "server_error": failed or r.status_code >= 500,
            "text": text if kind == "stream" else None}


def run_mixed(url: str, jobs: list[tuple[int, str, object]], n: int, cap: int) -> list[dict]:
    """jobs (index, kind, request) over n clients; one result dict per job, by position."""
    todo: queue.Queue = queue.Queue()
    for position, job in enumerate(jobs):
        todo.put((position, job))
    results: list[dict] = [{}] * len(jobs)

    def client() -> None:
        with httpx.Client(base_url=url, timeout=3600) as http:
            while True:
                try:
                    position, (i, kind, request) = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[position] = mixed_request(http, kind, request, cap, i)
                except Exception as err:  # the connection broke: counted, the others go on
                    results[position] = {"kind": kind, "status": None, "text": None,
                                         "server_error": True, "error": repr(err)}

    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def peak_rss_mb(pid: int | None) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def mixed_check(server: LocalServer, arm: str, requests, m: int, n: int, cap: int) -> dict:
    """M mixed requests over n clients against the same requests' completed kinds alone."""
    jobs = [(i, MIXED[i % len(MIXED)], requests[i % len(requests)]) for i in range(m)]
    completed = [job for job in jobs if job[1] in ("stream", "plain")]
    solo = dict(zip([job[0] for job in completed], run_mixed(server.url, completed, 1, cap),
                    strict=True))
    start = time.perf_counter()
    results = run_mixed(server.url, jobs, n, cap)
    wall = time.perf_counter() - start
    kinds = {kind: sum(r["kind"] == kind for r in results) for kind in set(MIXED)}
    same = sum(1 for (i, _, _), r in zip(jobs, results, strict=True)
               if i in solo and r["text"] is not None and r["text"] == solo[i]["text"])
    row = {"arm": arm, "mixed": m, "clients": n, "wall_s": wall, "kinds": kinds,
           "server_errors": sum(r["server_error"] for r in results),
           "malformed_4xx": sum(1 for r in results if r["kind"] == "malformed"
                                and r["status"] is not None and 400 <= r["status"] < 500),
           "completed_same_as_solo": same, "completed": len(completed),
           "peak_rss_mb": peak_rss_mb(server.pid)}
    print(f"{arm}: {m} mixed requests over {n} clients in {wall:.1f} s: "
          f"{row['server_errors']} server errors, malformed answered 4xx "
          f"{row['malformed_4xx']}/{kinds['malformed']}, completed replies equal alone "
          f"{same}/{len(completed)}, server peak RSS {fmt(row['peak_rss_mb'], '.0f')} MB",
          flush=True)
    return row


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_row(r: dict) -> str:
    same = "-" if r["same_as_solo"] is None else f"{r['same_as_solo']}/{r['requests']}"
    n = f"~{r['clients']}" if r.get("arrivals") == "poisson" else r["clients"]
    return (f"{r['arm']:<16} {n:>3} {r['requests']:>4} {r['failed']:>3} "
            f"{r['aggregate_tok_s']:>9.1f} {fmt(r['decode_tok_s_median'], '>9.1f')} "
            f"{fmt(r['ttft_median_s'], '>8.3f')} {fmt(r['ttft_p95_s'], '>8.3f')} {same:>7}")


HEADER = (f"{'arm':<16} {'N':>3} {'reqs':>4} {'err':>3} {'agg tok/s':>9} {'req tok/s':>9} "
          f"{'ttft med':>8} {'ttft p95':>8} {'=solo':>7}")


def main(argv=None) -> int:
    args = parse_args(argv)
    poisson = args.arrivals == "poisson"
    clients = [1] if poisson else sorted({int(c) for c in args.clients.split(",")})
    arms = [a.replace("+", ",") for a in args.arms.split(",") if a]
    conversations = load_conversations(args.data)
    requests = first_turns(conversations, args.short)
    if args.prompts == "mixed":
        requests = mixed_order(requests, args.seed)
    need = max(args.parallel or args.concurrency, args.requests) if poisson else max(
        max(clients), args.requests)
    if len(requests) < need:
        requests = (requests * (need // len(requests) + 1))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
    if LLAMA_SERVER in arms:
        ensure_built()
    machine = machine_description()
    what = (f"{args.requests} requests, one client then Poisson arrivals keeping about "
            f"{args.concurrency} in flight" if poisson else f"{args.requests} requests per N")
    print(f"CPU: {machine.get('cpu')}; server threads {args.threads}; cap {args.cap}; "
          f"{what} (first turns of {args.data.name}"
          f"{f', at most {args.short} characters' if args.short else ''}"
          f"{f', mixed by seed {args.seed}' if args.prompts == 'mixed' else ''})")
    print(HEADER)
    rows = []
    rate = args.rate
    with tempfile.TemporaryDirectory(prefix="adaspark-concurrency-") as tmp:
        if args.interleave:
            rows += bench_interleaved(arms, requests, args, Path(tmp))
        elif poisson:  # the first arm's calibration pass sets the rate every arm then gets
            for arm in arms:
                arm_rows, rate = bench_arm_arrivals(arm, requests, args, Path(tmp), rate)
                rows += arm_rows
        else:
            for arm in arms:
                rows += bench_arm(arm, clients, requests, args, Path(tmp))
    comparison = compare_arrivals(rows) if poisson else None
    for c in comparison or []:
        print(comparison_line(c))
    for arm in [] if poisson else arms:  # rows by N (a mixed run's row has no aggregate)
        by_n = {r["clients"]: r for r in rows if r["arm"] == arm and "aggregate_tok_s" in r}
        solo, more = by_n.get(1), [by_n[n] for n in sorted(by_n) if n != 1]
        if solo is None or not more:
            continue
        print(f"{arm}: aggregate over N=1: " + ", ".join(
            f"N={r['clients']}: {r['aggregate_tok_s'] / solo['aggregate_tok_s']:.2f}x"
            for r in more))
        tails = [r for r in more if r["ttft_p95_s"] and r["ttft_p95_waves_s"]]
        if solo["ttft_p95_s"] and tails:
            p1 = solo["ttft_p95_s"]
            print(f"{arm}: p95 time to first token over N=1: " + ", ".join(
                f"N={r['clients']}: {r['ttft_p95_s'] / p1:.2f}x (waves of N prompts prefilled "
                f"one after another at their solo cost: {r['ttft_p95_waves_s'] / p1:.2f}x)"
                for r in tails))
    if args.json is not None:
        out = {"machine": machine, "settings": vars(args) | {
            "data": str(args.data), "json": str(args.json)}, "rows": rows}
        if comparison is not None:
            out["comparison"] = comparison
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
