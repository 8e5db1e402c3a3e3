"""Decode speed with and without a response_format, per arm: what structured output costs.

The prompts: the first turn of each tool-use conversation of the evaluation (ToolACE, its tools
rendered by the chat template), whose schema is one call of one of its tools (the tool's name
and its parameters' schema), and a few JSON Schema and JSON-mode prompts of our own. Every arm
decodes every prompt free and under its schema; the runs interleave arms and modes (run 1: ar
free, ar schema, default free, default schema; run 2: the same ...), so a machine that speeds up
or slows down affects them alike. One engine per arm over all its runs (its learned state kept,
from an empty store), one loaded target for all.

Speed = reply tokens after the first / decode seconds (the engine's Timing), summed over the
prompts of a run; the table gives the mean over runs, each mode's speed over the arm's free
speed, and each arm over `ar` in the same mode. Issue 42's bar: `ar` under a schema keeps at
least 90% of its free speed, and the default arm's speed over `ar` under a schema is at least
its speed over `ar` free. Replies under a schema are checked: JSON that validates, and equal to
`ar`'s token for token.

    .venv/bin/python benchmarks/structured_output.py --runs 3 --max-tokens 128
    .venv/bin/python benchmarks/structured_output.py --arms ar,adaspark,gate,ngram --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from adaspark import cpuinfo
from adaspark.engine import Engine
from adaspark.errors import UserError
from adaspark.grammar import tool_call_schema
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import DEFAULT_ARM, load_speculator

CONVERSATIONS = Path(__file__).resolve().parents[2] / "shared/data/eval/conversations.jsonl"
OWN = [
    ("Give me a JSON object describing a person named Alice, aged 30, who lives in Paris.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"type": "string"},
                                       "hobbies": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}),
    ("List three books about the sea as JSON, each with a title, an author and a year.",
     {"type": "object", "properties": {"books": {"type": "array", "items": {
         "type": "object", "properties": {"title": {"type": "string"},
                                          "author": {"type": "string"},
                                          "year": {"type": "integer"}},
         "required": ["title", "author", "year"]}}}, "required": ["books"]}),
    ("Return a JSON object with the keys city and country for Tokyo.", None),  # JSON mode
]


def prompts(path: Path) -> list[dict]:
    """[{name, messages, tools, response_format, schema}]: the tool-use first turns, then OWN."""
    out = []
    for line in path.read_text().splitlines():
        conv = json.loads(line)
        if conv["source"] != "toolace" or not conv.get("tools"):
            continue
        messages = ([{"role": "system", "content": conv["system"]}] if conv.get("system")
                    else []) + [{"role": "user", "content": conv["turns"][0]}]
        schema = tool_call_schema(conv["tools"])
        out.append({"name": f"toolace/{conv['id']}", "messages": messages,
                    "tools": conv["tools"], "schema": schema,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "call", "schema": schema}}})
    for i, (text, schema) in enumerate(OWN):
        fmt = {"type": "json_object"} if schema is None else {
            "type": "json_schema", "json_schema": {"name": f"own{i}", "schema": schema}}
        out.append({"name": f"own/{i}", "messages": [{"role": "user", "content": text}],
                    "tools": None, "schema": schema or {"type": "object"},
                    "response_format": fmt})
    return out


def decode(engine: Engine, items: list[dict], structured: bool, max_tokens: int) -> list[dict]:
    replies = []
    for item in items:
        g = engine.generate(item["messages"], tools=item["tools"], max_tokens=max_tokens,
                            response_format=item["response_format"] if structured else None)
        replies.append({"name": item["name"], "tokens": g.token_ids, "text": g.text,
                        "finish": g.finish_reason, "decode_tokens": g.timings.decode_tokens,
                        "decode_s": g.timings.decode_s, "rows": g.timings.verified_rows,
                        "accepted": g.timings.accepted_tokens,
                        # rounds by kind: tokens a round, and how often each kind ran
                        "draft_rounds": g.timings.draft_rounds,
                        "ngram_rounds": g.timings.ngram_rounds,
                        "plain_rounds": g.timings.plain_rounds})
    return replies


def tok_s(replies: list[dict]) -> float:
    seconds = sum(r["decode_s"] for r in replies)
    return sum(r["decode_tokens"] for r in replies) / seconds if seconds else 0.0


def valid(reply: dict, schema: dict) -> bool:
    """A reply that ended on its own (a stop) in JSON valid under `schema` (JSON that parses,
    where the dev extra's jsonschema is not installed)."""
    try:
        value = json.loads(reply["text"])
    except ValueError:
        return False
    try:
        from jsonschema import validators
    except ImportError:
        return reply["finish"] == "stop"
    check = validators.validator_for(schema)
    check.check_schema(schema)  # as jsonschema.validate: a schema error is this script's bug
    return check(schema).is_valid(value) and reply["finish"] == "stop"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=f"ar,{DEFAULT_ARM}",
                   help="arms separated by ';' or spelled with '+' (adaspark+gate)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--conversations", type=Path, default=CONVERSATIONS)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write every reply here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = [a.replace("+", ",") for a in
            (args.arms.split(";") if ";" in args.arms else _split(args.arms))]
    path = resolve_model(args.model)
    gguf = read_gguf(path)
    target = Transformer(gguf)
    tok = Tokenizer.from_gguf(gguf)
    stores = Path(tempfile.mkdtemp(prefix="adaspark-structured-"))
    engines = {arm: Engine(target, tok, path, load_speculator(
        target, path, tok.stop_ids, ModelOptions(arm=arm, store=stores / arm.replace(",", "+"),
                                                 fresh=True))) for arm in arms}
    items = prompts(args.conversations)
    for item in list(items):  # a tool's schema the grammar library cannot compile: left out
        try:
            engines[arms[0]].grammar(item["response_format"])
        except UserError as err:
            print(f"{item['name']}: left out ({err})", file=sys.stderr)
            items.remove(item)
    print(f"{cpuinfo.name()}, {engines[arms[0]].forward}, torch threads "
          f"{torch.get_num_threads()}: {len(items)} prompts, cap {args.max_tokens}, "
          f"{args.runs} interleaved runs", file=sys.stderr)
    results: dict[tuple[str, str], list[list[dict]]] = {
        (arm, mode): [] for arm in arms for mode in ("free", "schema")}
    for run in range(args.runs):
        for arm, engine in engines.items():
            for mode in ("free", "schema"):
                start = time.perf_counter()
                replies = decode(engine, items, mode == "schema", args.max_tokens)
                results[arm, mode].append(replies)
                print(f"run {run + 1} {arm:>14} {mode:>6}: {tok_s(replies):6.1f} tok/s "
                      f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    mean = {key: statistics.fmean(tok_s(r) for r in runs) for key, runs in results.items()}
    base = "ar" if "ar" in arms else arms[0]
    print(f"\n{cpuinfo.name()}, {engines[base].forward}, {len(items)} prompts, "
          f"cap {args.max_tokens}, {args.runs} runs\n")
    print(f"| arm | free tok/s | schema tok/s | schema / free | free x {base} | "
          f"schema x {base} | schema replies valid | schema replies as {base} |")
    print("|---|---|---|---|---|---|---|---|")
    schemas = {item["name"]: item["schema"] for item in items}
    for arm in arms:
        free, schema = mean[arm, "free"], mean[arm, "schema"]
        replies = [r for run in results[arm, "schema"] for r in run]
        ok = sum(valid(r, schemas[r["name"]]) for r in replies)
        same = sum(a["tokens"] == b["tokens"]
                   for run_a, run_b in zip(results[arm, "schema"], results[base, "schema"],
                                           strict=True)
                   for a, b in zip(run_a, run_b, strict=True))
        print(f"| {arm} | {free:.1f} | {schema:.1f} | {schema / free:.3f} | "
              f"{free / mean[base, 'free']:.2f} | {schema / mean[base, 'schema']:.2f} | "
              f"{ok}/{len(replies)} | {same}/{len(replies)} |")
    print("\n| arm | mode | tokens a round | rows a round | ms a round | drafted / n-gram / "
          "plain rounds |\n|---|---|---|---|---|---|")
    for (arm, mode), runs in results.items():
        replies = [r for run in runs for r in run]
        kinds = [sum(r[f"{k}_rounds"] for r in replies) for k in ("draft", "ngram", "plain")]
        rounds = max(sum(kinds), 1)
        print(f"| {arm} | {mode} | {sum(r['decode_tokens'] for r in replies) / rounds:.2f} | "
              f"{sum(r['rows'] for r in replies) / rounds:.2f} | "
              f"{1000 * sum(r['decode_s'] for r in replies) / rounds:.2f} | "
              f"{' / '.join(f'{k / rounds:.2f}' for k in kinds)} |")
    if args.json:
        args.json.write_text(json.dumps({
            "cpu": cpuinfo.name(), "args": {k: str(v) for k, v in vars(args).items()},
            "results": {f"{a}|{m}": runs for (a, m), runs in results.items()}}) + "\n")
    return 0


def _split(spec: str) -> list[str]:
    """'ar,adaspark,gate,ngram' -> ['ar', 'adaspark,gate', 'ngram']: a modifier joins the arm
    before it."""
    from adaspark.scheduler.arm import Arm

    arms: list[str] = []
    for part in spec.split(","):
        if part in Arm.MODIFIERS and arms:
            arms[-1] += f",{part}"
        else:
            arms.append(part)
    return arms


if __name__ == "__main__":
    sys.exit(main())
