"""A soak of `adaspark serve`: mixed HTTP traffic for a bounded time (issue 24, "Soak").

    .venv/bin/python benchmarks/soak.py --minutes 60 --out docs/results/soak

It starts `.venv/bin/adaspark serve` (default arm, the embedded model) on a free loopback port,
with a random API key and a fresh `--store` directory, waits for /health 200, then for
`--minutes` runs `--clients` client threads, each pausing a random `--pause` between requests:
chat turns from the evaluation conversations (each client carries its conversation on, its
replies and tool calls included), streamed or not, sometimes sampled, sometimes with tools; some
streams closed after a few chunks (cancelled); malformed requests that must get a 4xx; requests
that the server documents as accepted although odd (unknown fields, max_tokens past the
context: 200); a ~4k-token prompt every `--long-every` seconds; GET /metrics and
/v1/adaspark/state now and then. The server's RSS (/proc/PID/status VmRSS) is sampled every 10 s.
At the end the server gets SIGTERM, and the store it saved is checked as the engine would open
it (learned_store.restore into a fresh Scheduler, on a copy). SIGINT or SIGTERM to this script
ends the traffic early and still writes everything.

--out gets summary.json, rss.csv, server.log, cpu.txt and README.md. Exit status 1 when any
response was a 5xx (or a stream's server_error event, or a 5xx line in the server's log), the
server died, or the store check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adaspark.bench.conversations import (  # noqa: E402  (after the path, as a script)
    Conversation,
    load_conversations,
    neutral_tool_result,
)

CONVERSATIONS = Path("/work/shared/data/eval/conversations.jsonl")
CONTEXT = 8192  # the embedded model's context
LONG_TOKENS = 4000  # the long prompt's target size
CHARS_PER_TOKEN = 3.6  # first guess for the long prompt; calibrated from usage.prompt_tokens
MAX_BODY = 32 << 20  # the server's body cap (server/app.py MAX_BODY_BYTES)
RSS_EVERY_S = 10.0

# what a client sends, by weight (the long prompt comes on its own clock)
WEIGHTS = {"chat": 24, "chat_stream": 28, "cancelled": 10, "malformed": 20, "tolerated": 6,
           "metrics": 6, "state": 6}
CAPS = [128] * 8 + [32, 256]  # max_tokens: ~128 mostly
TOOL_TOOLS = 0.12  # share of chat requests of a toolless conversation sent with tools anyway
SAMPLED = 0.35  # share of chat requests with temperature / top_p / seed


@dataclass
class Planned:
    """One request: kind names it in the summary; expect: the status class it must get."""

    kind: str
    method: str
    path: str
    body: bytes | None = None
    stream: bool = False
    cancel_after: int | None = None  # close the stream after this many data chunks
    expect: str = "2xx"  # "2xx" or "4xx"
    headers: dict = field(default_factory=dict)  # a None value drops the client's header
    chunked: bool = False  # send the body without a Content-Length
    messages: list | None = None  # a conversation turn's messages: its reply carries it on


def dumps(value) -> bytes:
    return json.dumps(value).encode()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def deep_tool_call(depth: int = 200_000) -> list[dict]:
    """A tool call whose arguments nest past any parser's limit (issue 24 item 6's 500)."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "[" * depth}}
    return [*user("hi"), {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "{}"}]


def malformed(name: str) -> Planned:
    """The malformed request `name` (MALFORMED): each must be answered with a 4xx."""
    post = "/v1/chat/completions"
    hi = user("hi")
    bodies = {
        "bad_json": b'{"messages": [{"role": "user", "content": "hi"}',
        "not_json": b"hello, server",
        "messages_string": dumps({"messages": "hi"}),
        "empty_messages": dumps({"messages": []}),
        "no_messages": dumps({"max_tokens": 8}),
        "null_content": dumps({"messages": [{"role": "user", "content": None}]}),
        "bad_role": dumps({"messages": [{"role": "wizard", "content": "hi"}]}),
        "temperature_string": dumps({"messages": hi, "temperature": "hot"}),
        "temperature_range": dumps({"messages": hi, "temperature": 5}),
        "top_p_zero": dumps({"messages": hi, "top_p": 0}),
        "max_tokens_zero": dumps({"messages": hi, "max_tokens": 0}),
        "max_tokens_negative": dumps({"messages": hi, "max_tokens": -5}),
        "max_tokens_string": dumps({"messages": hi, "max_tokens": "many"}),
        "seed_float": dumps({"messages": hi, "seed": 3.5}),
        "stream_list": dumps({"messages": hi, "stream": [1]}),
        "n_range": dumps({"messages": hi, "n": 1000}),
        "tool_choice_forced": dumps({"messages": hi, "tool_choice": {
            "type": "function", "function": {"name": "f"}}}),
        "deep_tool_arguments": dumps({"messages": deep_tool_call(), "max_tokens": 8}),
        # ~40k tokens of text: refused before any prefill (context_length_exceeded)
        "over_context": dumps({"messages": user("lorem ipsum dolor sit amet " * 8000),
                               "max_tokens": 8}),
    }
    if name in bodies:
        return Planned(f"malformed:{name}", "POST", post, bodies[name], expect="4xx")
    body = dumps({"messages": hi, "max_tokens": 8})
    others = {
        "no_key": Planned("", "POST", post, body, headers={"authorization": None}),
        "wrong_key": Planned("", "POST", post, body, headers={"authorization": "Bearer nope"}),
        "unknown_route": Planned("", "GET", "/v1/nothing-here"),
        "wrong_method": Planned("", "GET", post),
        "over_cap": Planned("", "POST", post, b"[" + b" " * (MAX_BODY + 1024) + b"]"),
        "over_cap_chunked": Planned("", "POST", post, b"[" + b" " * (MAX_BODY + 1024) + b"]",
                                    chunked=True),
    }
    planned = others[name]
    planned.kind, planned.expect = f"malformed:{name}", "4xx"
    return planned


MALFORMED = ("bad_json", "not_json", "messages_string", "empty_messages", "no_messages",
             "null_content", "bad_role", "temperature_string", "temperature_range",
             "top_p_zero", "max_tokens_zero", "max_tokens_negative", "max_tokens_string",
             "seed_float", "stream_list", "n_range", "tool_choice_forced",
             "deep_tool_arguments", "over_context", "no_key", "wrong_key", "unknown_route",
             "wrong_method", "over_cap", "over_cap_chunked")
RARE = {"over_cap": 0.1, "over_cap_chunked": 0.1, "over_context": 0.3}  # 32 MiB bodies: rarely


def tolerated(name: str, messages: list[dict]) -> Planned:
    """Odd requests that the server documents as accepted (schemas.py: unknown fields are
    ignored; app.py: a reply runs to max_tokens or the end of the context): each must get 200.
    The over-long max_tokens is a stream closed after a few chunks, so it costs little."""
    post = "/v1/chat/completions"
    if name == "unknown_fields":
        extra = [{**m, "mood": "curious"} for m in messages]
        body = {"messages": extra, "max_tokens": 16, "user": "soak", "metadata": {"a": 1},
                "frobnicate": True}
        return Planned("tolerated:unknown_fields", "POST", post, dumps(body))
    if name == "max_tokens_past_context":
        body = {"messages": messages, "max_tokens": 10**9, "stream": True}
        return Planned("tolerated:max_tokens_past_context", "POST", post, dumps(body),
                       stream=True, cancel_after=12)
    raise ValueError(name)


TOLERATED = ("unknown_fields", "max_tokens_past_context")


def sampling(rng: random.Random) -> dict:
    """Sampling fields for a share of requests: temperature, top_p, seed, in some mix."""
    if rng.random() >= SAMPLED:
        return {}
    out = {"temperature": rng.choice([0.3, 0.7, 1.0, 1.3])}
    if rng.random() < 0.5:
        out["top_p"] = rng.choice([0.8, 0.9, 0.95])
    if rng.random() < 0.5:
        out["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.15:
        out["top_k"] = rng.choice([20, 40])
    return out


def long_prompt(conversations: list[Conversation], chars: int) -> str:
    """About `chars` characters of the conversations' longest turns, then a question."""
    texts = sorted((t for c in conversations for t in c.turns), key=len, reverse=True)
    out, total = [], 0
    for text in texts:
        if total >= chars:
            break
        piece = text[: chars - total]
        out.append(piece)
        total += len(piece) + 2
    return "\n\n".join(out) + "\n\nIn three sentences: what are the texts above about?"


class Dialogue:
    """A client's running conversation: the turns sent, the replies (tool calls and their
    results included) appended, the next conversation once one's turns run out."""

    def __init__(self, conversations: list[Conversation], rng: random.Random):
        self.conversations, self.rng = conversations, rng
        self.tool_sets = [c.openai_tools() for c in conversations if c.tools]
        self._start()

    def _start(self) -> None:
        self.conv = self.rng.choice(self.conversations)
        self.turn = 0
        self.messages: list[dict] = []
        if self.conv.system:
            self.messages.append({"role": "system", "content": self.conv.system})
        self.tools = self.conv.openai_tools()
        if self.tools is None and self.tool_sets and self.rng.random() < TOOL_TOOLS:
            self.tools = self.rng.choice(self.tool_sets)

    def next_messages(self) -> list[dict]:
        """The messages of the next turn (the conversation so far and its next user turn)."""
        if self.turn >= len(self.conv.turns):
            self._start()
        return [*self.messages, {"role": "user", "content": self.conv.turns[self.turn]}]

    def answered(self, sent: list[dict], reply: dict | None) -> None:
        """Carry the conversation on with the reply (None: the turn failed; drop it)."""
        self.turn += 1
        if reply is None:
            return
        self.messages = [*sent, reply]
        for call in reply.get("tool_calls") or ():
            result = neutral_tool_result(call["function"]["name"])
            self.messages.append({"role": "tool", "tool_call_id": call.get("id") or "call",
                                  "content": json.dumps(result)})


def chat(dialogue: Dialogue, rng: random.Random, stream: bool, cancel: bool) -> Planned:
    messages = dialogue.next_messages()
    body = {"messages": messages, "max_tokens": rng.choice(CAPS), **sampling(rng)}
    if dialogue.tools:
        body["tools"] = dialogue.tools
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    kind = "cancelled" if cancel else ("chat_stream" if stream else "chat")
    return Planned(kind, "POST", "/v1/chat/completions", dumps(body), stream=stream,
                   cancel_after=rng.randint(2, 8) if cancel else None, messages=messages)


def pick(rng: random.Random, dialogue: Dialogue) -> Planned:
    """The next request of a client's mix (WEIGHTS)."""
    kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    if kind in ("chat", "chat_stream", "cancelled"):
        return chat(dialogue, rng, stream=kind != "chat", cancel=kind == "cancelled")
    if kind == "malformed":
        while True:
            name = rng.choice(MALFORMED)
            if rng.random() < RARE.get(name, 1.0):
                return malformed(name)
    if kind == "tolerated":
        return tolerated(rng.choice(TOLERATED), user(rng.choice(dialogue.conv.turns)[:2000]))
    path = "/metrics" if kind == "metrics" else "/v1/adaspark/state"
    return Planned(kind, "GET", path)


def sweep(dialogue: Dialogue) -> list[Planned]:
    """Every malformed and every tolerated request once: a run of any length sees each kind."""
    messages = user(dialogue.conv.turns[0][:2000])
    return [*(malformed(name) for name in MALFORMED),
            *(tolerated(name, messages) for name in TOLERATED)]


def long_request(conversations: list[Conversation], chars: int, stream: bool) -> Planned:
    body = {"messages": user(long_prompt(conversations, chars)), "max_tokens": 64,
            "stream": stream}
    return Planned("long_prompt", "POST", "/v1/chat/completions", dumps(body), stream=stream)


def expected(expect: str, status: str) -> bool:
    """Whether `status` (an HTTP code, or this script's outcome of a 200) is what `expect`
    asks for: a whole reply (or a stream closed on purpose) for 2xx, any 4xx code for 4xx."""
    if expect == "2xx":
        return status in ("200", "200_cancelled")
    return len(status) == 3 and status.startswith("4")


class Tally:
    """Counts by kind and status, the unexpected answers, the 5xx, the long prompts' sizes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.unexpected: list[dict] = []
        self.server_errors: list[dict] = []
        self.transport_errors: list[dict] = []
        self.long_prompt_tokens: list[int] = []
        self.completion_tokens = 0
        self.latency_s: dict[str, list[float]] = defaultdict(list)

    def record(self, planned: Planned, status: str, latency: float, note: str = "",
               elapsed: float = 0.0) -> None:
        with self.lock:
            self.counts[planned.kind][status] += 1
            self.latency_s[planned.kind].append(latency)
            entry = {"t_s": round(elapsed, 1), "kind": planned.kind, "status": status,
                     "note": note[:500]}
            if status.startswith("5") or status == "stream_server_error":
                self.server_errors.append(entry)
            if status == "transport_error":
                self.transport_errors.append(entry)
            elif not expected(planned.expect, status):
                self.unexpected.append(entry)


class Client(threading.Thread):
    def __init__(self, index: int, base: str, key: str, conversations, tally: Tally,
                 stop: threading.Event, schedule: LongSchedule, pause: tuple[float, float],
                 t0: float, seed: int):
        super().__init__(name=f"soak-client-{index}", daemon=True)
        import httpx

        self.rng = random.Random(seed)
        self.key, self.tally, self.stop, self.schedule = key, tally, stop, schedule
        self.pause, self.t0 = pause, t0
        self.dialogue = Dialogue(conversations, self.rng)
        self.first = sweep(self.dialogue) if index == 0 else []  # the first client sweeps
        self.http = httpx.Client(base_url=base, timeout=httpx.Timeout(900.0, connect=10.0),
                                 headers={"authorization": f"Bearer {key}"})

    def run(self) -> None:
        try:
            for planned in self.first:
                if self.stop.is_set():
                    break
                self.send(planned)
            while not self.stop.is_set():
                planned = self.schedule.due() or pick(self.rng, self.dialogue)
                self.send(planned)
                self.stop.wait(self.rng.uniform(*self.pause))
        finally:
            self.http.close()

    def send(self, planned: Planned) -> None:
        import httpx

        start = time.monotonic()
        try:
            status, note, reply = self._exchange(planned)
        except httpx.HTTPError as err:
            status, note, reply = "transport_error", f"{type(err).__name__}: {err}", None
        except Exception as err:  # a reply this script cannot read: count it, keep going
            status, note, reply = "unreadable_reply", f"{type(err).__name__}: {err}", None
        self.tally.record(planned, status, time.monotonic() - start, note, start - self.t0)
        if planned.messages is not None:
            self.dialogue.answered(planned.messages, reply)
        if planned.kind == "long_prompt":
            tokens = self.schedule.calibrate(note)
            with self.tally.lock:
                self.tally.long_prompt_tokens.append(tokens)

    def _request(self, planned: Planned):
        headers = {"content-type": "application/json", **planned.headers}
        content = planned.body
        if planned.chunked and content is not None:  # a generator: sent without Content-Length
            body = content
            content = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))
        request = self.http.build_request(planned.method, planned.path, content=content,
                                          headers={k: v for k, v in headers.items() if v})
        for name in [k for k, v in headers.items() if v is None]:
            del request.headers[name]
        return request

    def _exchange(self, planned: Planned) -> tuple[str, str, dict | None]:
        """(status, note, the assistant message for a conversation turn or None)."""
        request = self._request(planned)
        response = self.http.send(request, stream=True)
        try:
            if response.status_code != 200 or not planned.stream:
                text = response.read().decode("utf-8", "replace")
                return self._plain(planned, response.status_code, text)
            return read_stream(response.iter_lines(), planned.cancel_after)
        finally:
            response.close()

    def _plain(self, planned: Planned, code: int, text: str) -> tuple[str, str, dict | None]:
        if code != 200 or planned.method == "GET":
            return str(code), text[:300] if code != 200 else "", None
        try:
            document = json.loads(text)
            message = document["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            return "200_bad_body", text[:300], None
        with self.tally.lock:
            self.tally.completion_tokens += document.get("usage", {}).get("completion_tokens", 0)
        note = json.dumps({"prompt_tokens": document.get("usage", {}).get("prompt_tokens")})
        reply = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
        return "200", note, reply


def read_stream(lines, cancel_after: int | None) -> tuple[str, str, dict | None]:
    """Read an SSE reply: ("200", note, message) when it ends with [DONE] (or was closed
    after `cancel_after` chunks: "200_cancelled"); a stream error event is "stream_error" or,
    for a server_error, "stream_server_error"."""
    text, calls, chunks, prompt_tokens = "", [], 0, None
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            message = {"role": "assistant", "content": None if calls else text}
            if calls:
                message["tool_calls"] = calls
            return "200", json.dumps({"prompt_tokens": prompt_tokens}), message
        event = json.loads(data)
        if "error" in event:
            kind = event["error"].get("type")
            status = "stream_server_error" if kind == "server_error" else "stream_error"
            return status, data[:300], None
        chunks += 1
        prompt_tokens = (event.get("usage") or {}).get("prompt_tokens", prompt_tokens)
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                calls.append({"id": call.get("id"), "type": "function",
                              "function": call["function"]})
        if cancel_after is not None and chunks >= cancel_after:
            return "200_cancelled", "", {"role": "assistant", "content": text}
    return "stream_truncated", f"no [DONE] after {chunks} chunks", None


class LongSchedule:
    """The ~4k-token prompt every `every` seconds, taken by whichever client asks first; its
    size calibrated from the server's prompt_tokens."""

    def __init__(self, conversations, every: float, first: float, t0: float):
        self.conversations, self.every = conversations, every
        self.next_at = t0 + first
        self.chars = int(LONG_TOKENS * CHARS_PER_TOKEN)
        self.lock = threading.Lock()
        self.sent = 0

    def due(self) -> Planned | None:
        with self.lock:
            if time.monotonic() < self.next_at:
                return None
            self.next_at += self.every
            self.sent += 1
            return long_request(self.conversations, self.chars, stream=self.sent % 2 == 0)

    def calibrate(self, note: str) -> int | None:
        """Scale the next long prompt by the server's count of this one's tokens (returned)."""
        tokens = prompt_tokens(note)
        if tokens:
            with self.lock:
                self.chars = int(self.chars * LONG_TOKENS / tokens)
        return tokens


def prompt_tokens(note: str) -> int | None:
    """The prompt_tokens in a 200's note, None when it has none (an error's note)."""
    try:
        return json.loads(note).get("prompt_tokens")
    except (ValueError, AttributeError):
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_s(pid: int) -> float | None:
    """The process's user + system CPU seconds so far (/proc/PID/stat utime, stime)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class RssSampler(threading.Thread):
    def __init__(self, pid: int, t0: float, stop: threading.Event):
        super().__init__(name="soak-rss", daemon=True)
        self.pid, self.t0, self.stop = pid, t0, stop
        self.samples: list[tuple[float, int, float]] = []  # (elapsed s, RSS KiB, CPU s)

    def sample(self) -> None:
        kib, cpu = rss_kib(self.pid), cpu_s(self.pid)
        if kib is not None and cpu is not None:
            self.samples.append((time.monotonic() - self.t0, kib, cpu))

    def run(self) -> None:
        while not self.stop.wait(RSS_EVERY_S):
            self.sample()


def rss_summary(samples: list[tuple[float, int, float]], minutes: float) -> dict:
    """Start (traffic begins), peak, end (before SIGTERM), in MiB, where it stood once the
    first tenth of the run had warmed the caches up, and the server's CPU seconds per second
    (cores busy, of the machine's)."""
    if not samples:
        return {}
    mib = [(t, kib / 1024) for t, kib, _ in samples]
    span = samples[-1][0] - samples[0][0]
    cores = (samples[-1][2] - samples[0][2]) / span if span > 0 else None
    warm = next((v for t, v in mib if t >= minutes * 6), mib[-1][1])
    peak = max(mib, key=lambda s: s[1])
    return {"start_mib": round(mib[0][1], 1), "after_first_tenth_mib": round(warm, 1),
            "peak_mib": round(peak[1], 1), "peak_at_s": round(peak[0]), "end_mib":
            round(mib[-1][1], 1), "samples": len(mib),
            "server_cpu_cores_busy": round(cores, 2) if cores is not None else None}


def check_store(directory: Path, arm: str = "adaspark,gate") -> dict:
    """The store as the engine opens it: one store-*.json, valid JSON in this build's format,
    keyed for the arm, and a state that learned_store.restore loads into a fresh Scheduler
    (run on a copy: a refused file would be set aside)."""
    from adaspark.learned_store import arm_family, restore
    from adaspark.scheduler.arm import Arm
    from adaspark.scheduler.round import Scheduler
    from adaspark.scheduler.store import FORMAT_VERSION, Store

    files = sorted(p.name for p in directory.iterdir())
    result: dict = {"files": files, "ok": False}
    stores = sorted(directory.glob("store-*.json"))
    if len(stores) != 1 or any(".rejected-" in name for name in files):
        result["problem"] = "expected exactly one store-*.json and no set-aside file"
        return result
    try:
        document = json.loads(stores[0].read_text(encoding="utf-8"))
    except ValueError as err:
        result["problem"] = f"not JSON: {err}"
        return result
    fingerprint, state = document.get("fingerprint") or {}, document.get("state")
    result.update(format=document.get("format"), expected_format=FORMAT_VERSION,
                  arm=fingerprint.get("arm"), bytes=stores[0].stat().st_size,
                  state_parts=sorted(state) if isinstance(state, dict) else None)
    if document.get("format") != FORMAT_VERSION or fingerprint.get("arm") != arm_family(arm):
        result["problem"] = "wrong format version or arm"
        return result
    if not isinstance(state, dict) or not state:
        result["problem"] = "no learned state saved"
        return result
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy2(stores[0], Path(tmp) / stores[0].name)
        store = Store(tmp, fingerprint)
        if store.path.name != stores[0].name:
            result["problem"] = f"the fingerprint names {store.path.name}, not the file's name"
            return result
        scheduler = Scheduler(Arm.parse(arm))
        refused = restore(scheduler, store)
    if refused:
        result["problem"] = refused
        return result
    result["round_trips"] = json.loads(json.dumps(scheduler.state_dict())) == state
    result["ok"] = True
    return result


def log_errors(log_text: str) -> list[str]:
    """Lines of the server's log that say a request got a 5xx or raised."""
    marks = ("Traceback", "Exception in ASGI", "internal error")
    lines = []
    for line in log_text.splitlines():
        access = '" 5' in line and "HTTP/1.1" in line
        if access or any(mark in line for mark in marks):
            lines.append(line)
    return lines


def start_server(port: int, key: str, store: Path, log_path: Path) -> subprocess.Popen:
    command = [str(ROOT / ".venv/bin/adaspark"), "serve", "--port", str(port), "--api-key", key,
               "--store", str(store)]
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115  (the child keeps it open)
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float = 900.0
                 ) -> tuple[float, str | None]:
    """Seconds until /health was 200, and the forward it names (native or torch)."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}) before /health was 200")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{base}/health", timeout=5.0)
            if response.status_code == 200:
                return time.monotonic() - start, response.json().get("forward")
        time.sleep(1.0)
    raise SystemExit(f"/health was not 200 within {timeout_s:.0f} s")


def clean_exit(code: int | None, log_text: str) -> bool:
    """uvicorn shuts down on SIGTERM, then re-raises the signal (server.py: raise_signal), so a
    clean stop is an exit by SIGTERM (-15) or 0, after its "Finished server process" line."""
    return code in (0, -signal.SIGTERM) and "Finished server process" in log_text


def stop_server(server: subprocess.Popen) -> dict:
    start = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
        code = server.wait()
        return {"exit_code": code, "stopped_in_s": None, "needed_sigkill": True}
    return {"exit_code": code, "stopped_in_s": round(time.monotonic() - start, 1),
            "needed_sigkill": False}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--pause", type=float, nargs=2, default=(2.0, 8.0), metavar=("MIN", "MAX"),
                        help="seconds a client waits between two requests, uniform (the "
                             "default keeps the engine busy about half the time on 2 cores)")
    parser.add_argument("--long-every", type=float, default=240.0,
                        help="seconds between two ~4k-token prompts")
    parser.add_argument("--conversations", type=Path, default=CONVERSATIONS)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def traffic(args, base: str, key: str, tally: Tally, stop: threading.Event) -> float:
    """Run the clients until --minutes pass or `stop` is set; returns the seconds it ran."""
    conversations = load_conversations(args.conversations)
    t0 = time.monotonic()
    schedule = LongSchedule(conversations, args.long_every, min(60.0, args.long_every), t0)
    clients = [Client(i, base, key, conversations, tally, stop, schedule, tuple(args.pause), t0,
                      args.seed * 100 + i) for i in range(args.clients)]
    for client in clients:
        client.start()
    stop.wait(args.minutes * 60)
    ran = time.monotonic() - t0
    stop.set()
    for client in clients:
        client.join(timeout=600)
    tally.long_prompts_sent = schedule.sent  # type: ignore[attr-defined]
    return ran


def write_outputs(args, summary: dict, sampler: RssSampler, key: str) -> None:
    out = args.out
    with open(out / "rss.csv", "w", encoding="utf-8") as f:
        f.write("elapsed_s,rss_mib,server_cpu_s\n")
        for t, kib, cpu in sampler.samples:
            f.write(f"{t:.1f},{kib / 1024:.1f},{cpu:.1f}\n")
    log = out / "server.log"
    log.write_text(log.read_text(encoding="utf-8", errors="replace").replace(key, "<key>"),
                   encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "cpu.txt").write_text(subprocess.run(["lscpu"], capture_output=True,
                                                text=True).stdout, encoding="utf-8")
    (out / "README.md").write_text(readme(summary), encoding="utf-8")


def readme(summary: dict) -> str:
    rss, store = summary["rss"], summary["store_check"]
    dirty = " with uncommitted changes" if summary["dirty"] else ""
    verdict = "loadable" if store.get("ok") else f"NOT loadable: {store.get('problem')}"
    lines = [
        "# Soak: mixed HTTP traffic against `adaspark serve`", "",
        f"- Command: `{summary['command']}`",
        f"- Date: {summary['started_utc']} to {summary['ended_utc']} UTC",
        f"- Commit: {summary['commit']}{dirty}",
        "- CPU: `cpu.txt` (`lscpu`)",
        "- Server: `adaspark serve` (default arm, the embedded model), an API key, a fresh "
        f"`--store` directory; forward: {summary['forward']}; its log is `server.log`.",
        "- Also running on the machine at times: the lead engineer's tests, benchmarks and a "
        "CI run.", "",
        "## Result", "",
        f"- Traffic: {summary['duration_s'] / 60:.1f} minutes, {summary['requests']} requests "
        f"from {summary['clients']} clients; counts by kind and status in `summary.json`.",
        f"- 5xx: {summary['5xx']} (responses, streams' server_error events and the server "
        f"log's 5xx lines); unexpected answers: {len(summary['unexpected'])}; transport "
        f"errors: {len(summary['transport_errors'])}.",
        f"- RSS (`rss.csv`, every {RSS_EVERY_S:.0f} s): start {rss.get('start_mib')} MiB, after "
        f"the first tenth {rss.get('after_first_tenth_mib')} MiB, peak {rss.get('peak_mib')} "
        f"MiB, end {rss.get('end_mib')} MiB.",
        f"- Store: {verdict} ({store.get('files')}); server exit {summary['server_stop']}.",
        f"- Passed: {summary['passed']}.", "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # end early, still write everything
        signal.signal(sig, lambda *_: stop.set())
    key = f"soak-{secrets.token_hex(8)}"
    port, store = free_port(), Path(tempfile.mkdtemp(prefix="soak-store-"))
    base = f"http://127.0.0.1:{port}"
    started = dt.datetime.now(dt.UTC)
    server = start_server(port, key, store, args.out / "server.log")
    tally = Tally()
    try:
        load_s, forward = wait_healthy(base, server)
        log_from = len((args.out / "server.log").read_text(encoding="utf-8", errors="replace"))
        sampled = threading.Event()  # the sampler runs on while the last requests finish
        sampler = RssSampler(server.pid, time.monotonic(), sampled)
        sampler.sample()
        sampler.start()
        ran = traffic(args, base, key, tally, stop)
        sampled.set()
        sampler.join()
        sampler.sample()
        died = server.poll() is not None
        stopped = {"exit_code": server.returncode, "died_during_run": True} if died \
            else stop_server(server)
    finally:
        if server.poll() is None:
            server.kill()
    store_check = check_store(store)
    shutil.rmtree(store, ignore_errors=True)
    log_text = (args.out / "server.log").read_text(encoding="utf-8", errors="replace")
    log_lines = log_errors(log_text[log_from:])  # before: the 503s of /health while loading
    fives = len(tally.server_errors) + len(log_lines)
    stopped["clean"] = not died and clean_exit(stopped.get("exit_code"), log_text)
    passed = fives == 0 and store_check["ok"] and stopped["clean"]
    summary = {
        "command": " ".join([".venv/bin/python", "benchmarks/soak.py", *(argv or sys.argv[1:])]),
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S"),
        "ended_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
        "model_load_s": round(load_s, 1), "forward": forward, "duration_s": round(ran, 1),
        "minutes_asked": args.minutes, "clients": args.clients, "pause_s": list(args.pause),
        "requests": sum(sum(c.values()) for c in tally.counts.values()),
        "counts": {kind: dict(sorted(c.items())) for kind, c in sorted(tally.counts.items())},
        "latency_s_median": {kind: round(sorted(v)[len(v) // 2], 2)
                             for kind, v in sorted(tally.latency_s.items())},
        "completion_tokens_non_streamed": tally.completion_tokens,
        "long_prompts_sent": getattr(tally, "long_prompts_sent", 0),
        "long_prompt_tokens": tally.long_prompt_tokens,
        "5xx": fives, "server_errors": tally.server_errors, "server_log_errors": log_lines[:50],
        "unexpected": tally.unexpected, "transport_errors": tally.transport_errors,
        "rss": rss_summary(sampler.samples, args.minutes), "server_stop": stopped,
        "store_check": store_check, "passed": passed,
    }
    write_outputs(args, summary, sampler, key)
    print(json.dumps({k: summary[k] for k in ("requests", "5xx", "rss", "passed")}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
