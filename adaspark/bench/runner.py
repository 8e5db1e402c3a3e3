"""The resumable multi-arm runner: every conversation, turn by turn, over HTTP, per arm.

Output directory layout:

    run.json                 the run's settings and every invocation (argv, time, machine)
    results.jsonl            one line per timed reply, one line per finished conversation
    rounds/<arm>/part-K.jsonl  the server's round log, one file per server start
    stores/<arm>/            each arm's own learned store directory (started --fresh)
    logs/<arm>.log           each server's stdout and stderr

Each arm carries its own replies as history. A tool turn (the model calls one of the
conversation's tools, as a structured `tool_calls` or as ToolACE's text form `[Name(...)]`) gets
the recorded tool result, or `neutral_tool_result` when none was recorded, and the reply after it
is timed as a second reply of the same turn (Appendix A).

Resuming: a conversation counts as done for an arm once its `conversation` line is written.
Replies of a conversation that was cut off are dropped and the conversation is run again from its
first turn, because later turns depend on the arm's earlier replies. An arm with done
conversations restarts on its own store without --fresh, so it keeps what it had learned.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

from tqdm import tqdm

from adaspark.bench.client import ChatClient, ServerReplyError, StreamedReply
from adaspark.bench.conversations import Conversation, neutral_tool_result
from adaspark.bench.servers import ArmRun, LocalServer
from adaspark.errors import UserError
from adaspark.sampling import derived_seed

RESULTS = "results.jsonl"
RUN_FILE = "run.json"


def text_tool_calls(text: str, tool_names: list[str]) -> list[str]:
    """Tools called in ToolACE's text form, `[Name(a=1), Other(b=2)]`, in the order called."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return []
    found = [(body.find(f"{name}("), name) for name in tool_names]
    return [name for position, name in sorted(found) if position >= 0]


def _tool_content(conv: Conversation, turn: int, name: str) -> str:
    recorded = conv.recorded_tool_result(turn)
    if recorded is None:
        recorded = [neutral_tool_result(name)]
    return recorded if isinstance(recorded, str) else json.dumps(recorded)


def _tool_messages(conv: Conversation, turn: int, reply: StreamedReply) -> list[dict] | None:
    """The assistant's call and the tool's answer, or None when the reply called no tool."""
    if not conv.tools:
        return None
    if reply.tool_calls:
        calls = []
        for i, call in enumerate(reply.tool_calls):
            calls.append({**call, "id": call.get("id") or f"call_{turn}_{i}", "type": "function"})
        messages = [{"role": "assistant", "content": reply.text or None, "tool_calls": calls}]
        for call in calls:
            content = _tool_content(conv, turn, call["function"]["name"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        return messages
    names = text_tool_calls(reply.text, conv.tool_names())
    if not names:
        return None
    recorded = conv.recorded_tool_result(turn)
    if recorded is not None:
        content = recorded if isinstance(recorded, str) else json.dumps(recorded)
    else:
        content = json.dumps([neutral_tool_result(name) for name in names])
    return [{"role": "assistant", "content": reply.text}, {"role": "tool", "content": content}]


def reply_record(
    run: ArmRun, conv: Conversation, turn: int, index: int, reply: StreamedReply, cap: int
) -> dict:
    tokens = reply.completion_tokens
    return {
        "kind": "reply",
        "arm": run.label,
        "conversation": conv.key,
        "source": conv.source,
        "category": conv.category,
        "turn": turn,
        "reply": index,
        "turn_done": True,  # set False below when a tool reply follows
        "cap": cap,
        "text": reply.text,
        "reasoning": reply.reasoning,
        "tool_calls": reply.tool_calls or None,
        "finish_reason": reply.finish_reason,
        "completion_tokens": tokens,
        "prompt_tokens": reply.prompt_tokens,
        "tokens_source": reply.tokens_source,
        "deltas": reply.deltas,
        "ttft_s": reply.ttft_s,
        "decode_s": reply.decode_s,
        "tok_s": reply.tok_s,
        "reached_cap": reply.finish_reason == "length" or tokens >= cap,
        "timings": reply.timings,
        "usage": reply.usage,
        "response_id": reply.response_id,
    }


def request_sampling(temperature: float, seed: int, conv: Conversation, turn: int,
                     index: int) -> dict | None:
    """Sampling fields for one request: a seed of its own, the same for every arm."""
    if temperature <= 0:
        return None
    return {"temperature": temperature, "seed": derived_seed(seed, conv.key, turn, index)}


def converse(client: ChatClient, run: ArmRun, conv: Conversation, cap: int,
             temperature: float = 0.0, seed: int = 0):
    """Yield one record per timed reply of one conversation, carrying the arm's own history."""
    messages: list[dict] = [{"role": "system", "content": conv.system}] if conv.system else []
    tools = conv.openai_tools()
    for turn, user in enumerate(conv.turns):
        messages.append({"role": "user", "content": user})
        reply = client.stream_chat(messages, max_tokens=cap, tools=tools,
                                   sampling=request_sampling(temperature, seed, conv, turn, 0))
        record = reply_record(run, conv, turn, 0, reply, cap)
        tool_turn = _tool_messages(conv, turn, reply)
        if tool_turn is None:
            messages.append({"role": "assistant", "content": reply.text})
            yield record
            continue
        record["turn_done"] = False
        yield record
        messages += tool_turn
        answer = client.stream_chat(messages, max_tokens=cap, tools=tools,
                                    sampling=request_sampling(temperature, seed, conv, turn, 1))
        messages.append({"role": "assistant", "content": answer.text})
        yield {**reply_record(run, conv, turn, 1, answer, cap), "after_tool": True}


def machine_description() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus_usable": usable,
        "memory": memory,
        "python": platform.python_version(),
    }


class ResultsFile:
    """results.jsonl: appended line by line, flushed at once so a kill loses at most one line."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / RESULTS

    def load(self) -> list[dict]:
        if not self.path.exists():
            return []
        records = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the half-written last line of a killed run
        return records

    def done(self) -> set[tuple[str, str]]:
        return {
            (r["arm"], r["conversation"])
            for r in self.load()
            if r.get("kind") == "conversation" and r.get("status") == "done"
        }

    def drop_unfinished(self) -> int:
        """Keep only lines of finished conversations; returns how many lines were dropped."""
        if not self.path.exists():
            return 0
        records = self.load()
        done = self.done()
        keep = [r for r in records if (r.get("arm"), r.get("conversation")) in done]
        torn = not self.path.read_bytes().endswith(b"\n") and self.path.stat().st_size > 0
        if len(keep) == len(records) and not torn:
            return 0
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
        os.replace(tmp, self.path)
        return len(records) - len(keep)

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def record_invocation(out_dir: Path, settings: dict, argv: list[str] | None) -> None:
    """Write run.json; refuse to resume a directory whose run used other settings."""
    path = out_dir / RUN_FILE
    run = json.loads(path.read_text()) if path.exists() else {"settings": settings}
    old = run["settings"]
    defaults = {"temperature": 0.0, "seed": 0}  # runs recorded before sampling were greedy
    for key in ("conversations_sha256", "cap", "subset", "temperature", "seed"):
        if old.get(key, defaults.get(key)) != settings.get(key, defaults.get(key)):
            raise UserError(
                f"{out_dir} holds a run with {key}={old.get(key)!r}, not {settings.get(key)!r}; "
                "use another --out"
            )
    old["arms"] = list(dict.fromkeys(old.get("arms", []) + settings["arms"]))
    old.setdefault("external", {}).update(settings.get("external", {}))
    run.setdefault("invocations", []).append(
        {"argv": argv, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "machine": machine_description()}
    )
    path.write_text(json.dumps(run, indent=2) + "\n")


def run_bench(
    conversations: list[Conversation],
    runs: list[ArmRun],
    out_dir: Path,
    cap: int,
    conversations_path: Path,
    subset: str | None = None,
    serve_args: list[str] = (),
    health_timeout_s: float = 600.0,
    argv: list[str] | None = None,
    progress: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
) -> Path:
    """Run every arm over every conversation; skip what `out_dir` already holds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "conversations": str(conversations_path),
        "conversations_sha256": _sha256(conversations_path),
        "subset": subset,
        "cap": cap,
        "temperature": temperature,
        "seed": seed,
        "arms": [r.label for r in runs],
        "external": {r.label: r.url for r in runs if r.url},
    }
    record_invocation(out_dir, settings, argv)
    results = ResultsFile(out_dir)
    results.drop_unfinished()
    done = results.done()
    for run in runs:
        todo = [c for c in conversations if (run.label, c.key) not in done]
        if not todo:
            continue
        turns = sum(len(c.turns) for c in conversations)
        bar = tqdm(total=turns, desc=run.label, unit="turn", disable=not progress)
        bar.update(turns - sum(len(c.turns) for c in todo))
        try:
            if run.url:
                with ChatClient(run.url) as client:
                    if not client.reachable():
                        raise UserError(f"arm {run.label}: no server answers at {run.url} "
                                        "(/health or /v1/models)")
                    _run_arm(client, run, todo, cap, results, bar, None, temperature, seed)
            else:
                fresh = not any(arm == run.label for arm, _ in done)
                server = _local_server(run, out_dir, fresh, serve_args, health_timeout_s)
                with server, ChatClient(server.url) as client:
                    check_forward(out_dir, run.label, server.forward, server.log_path)
                    _run_arm(client, run, todo, cap, results, bar, server, temperature, seed)
        finally:
            bar.close()
    return out_dir


FORWARDS = "forwards.json"  # arm label -> the forward its server ran (its /health)


def check_forward(out_dir: Path, label: str, forward: str | None, log_path: Path) -> None:
    """Record which forward an arm's server runs, and refuse one that differs from the other
    arms' in this directory: a stale native build makes a server fall back to the torch path
    with one log line, and arms on different forwards would be compared as if alike."""
    if forward is None:
        return
    path = out_dir / FORWARDS
    try:
        seen = json.loads(path.read_text()) if path.exists() else {}
    except ValueError as err:
        raise UserError(f"{path} is corrupt ({err}); remove it to record the forwards again"
                        ) from None
    other = {arm: f for arm, f in seen.items() if arm != label and f != forward}
    if other:
        arm, theirs = next(iter(other.items()))
        raise UserError(
            f"arm {label}'s server runs the {forward} forward but {arm} ran on {theirs}: the arms "
            f"of one bench must share a forward (a stale native build? run scripts/setup.sh); "
            f"its log: {log_path}")
    seen[label] = forward
    path.write_text(json.dumps(seen, indent=1, sort_keys=True) + "\n")


def _local_server(run, out_dir, fresh, serve_args, health_timeout_s) -> LocalServer:
    rounds_dir = out_dir / "rounds" / run.file_stem
    rounds_dir.mkdir(parents=True, exist_ok=True)
    part = len(list(rounds_dir.glob("part-*.jsonl")))
    (out_dir / "stores").mkdir(exist_ok=True)
    return LocalServer(
        run.arm,
        log_path=out_dir / "logs" / f"{run.file_stem}.log",
        store=out_dir / "stores" / run.file_stem,  # a directory: one file per fingerprint
        fresh=fresh,
        round_log=rounds_dir / f"part-{part}.jsonl",
        extra_args=list(serve_args),
        health_timeout_s=health_timeout_s,
    )


def _run_arm(client, run, todo, cap, results, bar, server: LocalServer | None,
             temperature: float = 0.0, seed: int = 0) -> None:
    for conv in todo:
        records = []
        try:
            for record in converse(client, run, conv, cap, temperature, seed):
                records.append(record)
                results.append(record)
                if record["turn_done"]:
                    bar.update(1)
                if record["tok_s"]:
                    bar.set_postfix(tok_s=f"{record['tok_s']:.1f}")
        except ServerReplyError as err:
            if server is not None and not server.alive():
                raise UserError(
                    f"arm {run.label}: the server died during {conv.key}: {err}; "
                    f"its log: {server.log_path}\n{server.log_tail()}"
                ) from None
            # the conversation's history is broken from here on: record why and move on
            results.append({"kind": "conversation", "arm": run.label, "conversation": conv.key,
                            "status": "error", "error": str(err), "replies": len(records)})
            bar.update(len(conv.turns) - sum(r["turn_done"] for r in records))
            tqdm.write(f"{run.label} {conv.key}: {err}")
            continue
        results.append({"kind": "conversation", "arm": run.label, "conversation": conv.key,
                        "status": "done", "replies": len(records)})
