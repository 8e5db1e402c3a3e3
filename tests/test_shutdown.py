"""A shutdown keeps what was learned (server/worker.py, server/app.py's lifespan, speculative.py's
close): SIGTERM to `adaspark serve` in the middle of a load of concurrent requests (default arm,
the shipped drafter) ends the server cleanly, and the learned store on disk then counts every
round the engine ran, the rounds of the requests cut short and of the saves that were waiting
for other requests included (before: the engine thread was a daemon never joined, with no last
save, and those were lost). The round log is the witness: one line per round learned."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from adaspark.scheduler.store import Store

pytestmark = pytest.mark.slow

PROMPTS = ["Count from 1 to 40, separated by commas.", "List the days of the week, twice.",
           "Write a haiku about the sea.", "Name ten animals."]
COUNTING = ", ".join(str(i) for i in range(1, 30)) + ","  # the model counts on and on
CLI = "from adaspark.cli import main; raise SystemExit(main())"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stored_rounds(directory: Path) -> int:
    (path,) = directory.glob("store-*.json")
    store = Store(directory, json.loads(path.read_text())["fingerprint"])
    state = store.load()
    assert store.rejection is None
    return state["rounds"]


def rounds_of(reply: dict) -> int:
    t = reply["timings"]
    return t["draft_rounds"] + t["plain_rounds"] + t["ngram_rounds"]


def test_sigterm_mid_load_saves_every_round_served(tmp_path):
    stores, log, port = tmp_path / "stores", tmp_path / "rounds.jsonl", free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", CLI, "serve", "--port", str(port), "--store", str(stores),
         "--round-log", str(log), "--parallel", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    done: list[dict] = []
    stop = threading.Event()

    def client(i: int) -> None:  # asks again and again until the server goes away
        n = i
        while not stop.is_set():  # client 0 short replies; the others long ones, which
            # outlast uvicorn's 3 s grace and are cut short by the shutdown
            if i == 0:
                route, body = "/v1/chat/completions", {"max_tokens": 48, "messages": [
                    {"role": "user", "content": PROMPTS[n % len(PROMPTS)]}]}
            else:
                route, body = "/v1/completions", {"prompt": COUNTING, "max_tokens": 3000}
            try:
                reply = httpx.post(base + route, json=body, timeout=300)
            except httpx.HTTPError:
                return
            if reply.status_code != 200:
                return
            done.append(reply.json())
            n += 1

    try:
        deadline = time.monotonic() + 300
        while True:  # the model loads
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        clients = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for thread in clients:
            thread.start()
        while len(done) < 3:  # replies have ended beside others (their saves wait), and
            assert time.monotonic() < deadline, "no replies"  # long ones are in flight
            time.sleep(0.05)
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
        stop.set()
        for thread in clients:
            thread.join(timeout=300)
    finally:
        stop.set()
        if server.poll() is None:
            server.kill()
            server.wait()
    err = server.stderr.read()
    # uvicorn re-raises the signal once its shutdown is complete (the exit says SIGTERM)
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in err, err
    logged = len(log.read_text().splitlines())
    served = sum(rounds_of(reply) for reply in done)
    assert served > 0 and logged > served  # the long replies' rounds: cut short, unreported
    assert stored_rounds(stores) == logged, err
    assert [p.name for p in stores.iterdir() if ".tmp-" in p.name] == []


def test_closing_the_worker_ends_in_flight_requests_and_saves_their_rounds(tmp_path):
    """In one process: close() with requests mid-reply cancels them, joins the engine thread
    and returns after its last save, which has every round (before: close() only set flags)."""
    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path
    from adaspark.server.worker import EngineWorker, Job

    engine = Engine.load(default_model_path(download=False), arm="adaspark,gate",
                         store=tmp_path, fresh=True)
    sched = engine.speculator.scheduler
    worker = EngineWorker(lambda: engine, parallel=2, queue_limit=2)
    futures = [worker.submit(Job(engine.tokenizer.encode_chat(
        [{"role": "user", "content": p}]), 2000, [])) for p in PROMPTS[:3]]
    deadline = time.monotonic() + 300
    while sched.rounds_learned < 8:  # both running requests are mid-reply
        assert time.monotonic() < deadline, "no rounds"
        time.sleep(0.01)
    assert worker.close() is True
    results = [f.exception() or f.result() for f in futures[:2]]
    assert [r.finish_reason for r in results] == ["cancelled", "cancelled"]
    assert futures[2].exception() is not None  # the queued one was dropped, never run
    assert stored_rounds(tmp_path) == sched.rounds_learned > 0
    with pytest.raises(Exception):  # noqa: B017 - closed: no more work is taken
        worker.submit(Job([1, 2, 3], 4, [])).result(timeout=10)
