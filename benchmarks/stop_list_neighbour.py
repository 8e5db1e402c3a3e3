"""A stop list at the bound beside an ordinary request: the neighbour's reply time (issue 40).

    .venv/bin/python benchmarks/stop_list_neighbour.py [--tokens 64] [--rounds 5] [--json FILE]

One server in this process (uvicorn on a loopback port; the embedded model, arm `ar`, parallel
2). A request with MAX_STOPS stop strings of MAX_STOP_CHARS characters, each a near miss of its
own reply (the reply's first characters, then one it never has), streams 4 x --tokens tokens, so
every token moves every stop's state as far as it can go. Each round times the ordinary greedy
request of --tokens tokens alone, beside the same stream without stops, and beside the stream
with the stop list (each stream started first, and still running when the ordinary one ends);
the conditions alternate, so drift affects all alike. Medians printed with the CPU
(stops_over_plain: what the stop list costs the neighbour); one past the bound is refused.
Before the cap, 4,000 stop strings of 2,000 characters made a 64-token neighbour take 2.3 s
instead of 0.35 s. Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from adaspark import cpuinfo
from adaspark.server import create_app
from adaspark.server.schemas import MAX_STOP_CHARS, MAX_STOPS

ORDINARY = [{"role": "user", "content": "Name three colours."}]
STOPPED = [{"role": "user", "content": "Tell me a long story about a dragon and a knight."}]


@contextlib.contextmanager
def serving():
    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path

    path = default_model_path(download=False)
    app = create_app(lambda: Engine.load(path, arm="ar"), model_id=path.stem, parallel=2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started or httpx.get(base + "/health").status_code != 200:
        time.sleep(0.1)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def timed(base: str, body: dict) -> float:
    start = time.perf_counter()
    response = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - start


def near_misses(text: str) -> list[str]:
    """MAX_STOPS stop strings of MAX_STOP_CHARS characters that the reply begins but never
    completes (each ends in a character no reply has)."""
    head = (text * (MAX_STOP_CHARS // max(1, len(text)) + 1))[:MAX_STOP_CHARS - 1]
    return [head[:MAX_STOP_CHARS - 1 - i] + "\x00" * (i + 1) for i in range(MAX_STOPS)]


def beside(base: str, ordinary: dict, stream_body: dict) -> tuple[float, bool]:
    """The ordinary request's time while `stream_body` streams; whether the stream was still
    running when it ended."""
    with httpx.stream("POST", base + "/v1/chat/completions", json=stream_body,
                      timeout=600) as stream:
        lines = stream.iter_lines()
        next(lines)  # decoding now
        took = timed(base, ordinary)
        after = [line for line in lines if line.startswith("data: {")]
    return took, len(after) > 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    ordinary = {"messages": ORDINARY, "max_tokens": args.tokens}
    plain = {"messages": STOPPED, "max_tokens": 4 * args.tokens, "stream": True}
    with serving() as base:
        url = base + "/v1/chat/completions"
        text = httpx.post(url, json={**plain, "stream": False},
                          timeout=600).json()["choices"][0]["message"]["content"]
        stopped = {**plain, "stop": near_misses(text)}
        past = httpx.post(url, json={**stopped, "stop": [*stopped["stop"], "x"]}, timeout=60)
        timed(base, ordinary)  # warm
        times: dict[str, list[float]] = {"alone": [], "beside_plain": [], "beside_stops": []}
        overlapped = []
        for _ in range(args.rounds):
            times["alone"].append(timed(base, ordinary))
            for name, body in (("beside_plain", plain), ("beside_stops", stopped)):
                took, still_running = beside(base, ordinary, body)
                times[name].append(took)
                overlapped.append(still_running)
    result = {"cpu": cpuinfo.name(), "tokens": args.tokens, "rounds": args.rounds,
              "stops": [MAX_STOPS, MAX_STOP_CHARS], "past_the_bound_status": past.status_code,
              **{f"{name}_s": statistics.median(values) for name, values in times.items()},
              "streams_outlasted_the_ordinary_request": all(overlapped)}
    result["stops_over_plain"] = result["beside_stops_s"] / result["beside_plain_s"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
