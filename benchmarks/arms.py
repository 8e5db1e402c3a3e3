"""Decode speed per arm on a subset of the evaluation, in one process: interleaved runs and ratios.

The short subset (the default) is the first two turns of the first conversation of each source
in the evaluation file; `--subset first-turns` is the first turn of every conversation. Every
arm decodes every conversation turn by turn (its own replies as history, so turn 2 reuses the
cached prefix), and the arms take turns conversation by conversation within each run (A B C,
then B C A on the next conversation, ...: `interleaved`), so a machine that speeds up or slows
down during the benchmark, even within a run, affects every arm alike. Each arm
keeps one engine (drafter, scheduler) over all its runs, starting from an empty learned store,
as the paper's arms do; all arms share one loaded target.

Speed = reply tokens after the first / decode seconds (the engine's Timing: every forward after
the first reply token), summed over the replies of a run; the table gives the mean over runs,
the ratio to `ar` (or to the first arm) and the round statistics.

    .venv/bin/python benchmarks/arms.py --arms ar,chain3,cost,adaspark --max-tokens 256
    .venv/bin/python benchmarks/arms.py --arms ar,adaspark --max-tokens 32 --runs 2 \\
        --drafter DIR --json out.json
    .venv/bin/python benchmarks/arms.py --arms ar,chain3@OLD_DIR,chain3@NEW_DIR  # drafter A/B
    .venv/bin/python benchmarks/arms.py --arms ar,adaspark+gate,adaspark+gate+own-noise \
        --temperature 0.7 --seed 1   # sampling; own-noise: the drafter drafts without the noise

With --temperature every reply samples with a seed derived from --seed and its conversation
turn, the same for every arm (so in reference precision every arm emits the same tokens).
Acceptance by position: of the rounds that drafted, the share whose accepted path reached
depth d (d = 1, 2, ...), from the rounds the engine reports; then, per drafting arm, its rounds
by rows verified (share of rounds and of round time, tokens accepted, median D and verify).
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

from adaspark.bench.conversations import SUBSETS, load_conversations
from adaspark.bench.interleave import interleaved
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.sampling import SamplingParams, derived_seed
from adaspark.scheduler.arm import Arm
from adaspark.scheduler.record import kind_of
from adaspark.speculative import load_speculator

CONVERSATIONS = Path(__file__).resolve().parents[2] / "shared/data/eval/conversations.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="ar,chain3,cost,adaspark",
                   help="comma-separated arms; modifiers with '+' (adaspark+plain); "
                        "ARM@DIR runs that arm with the drafter in DIR")
    p.add_argument("--max-tokens", type=int, default=256, help="reply cap per turn")
    p.add_argument("--runs", type=int, default=2, help="interleaved runs per arm")
    p.add_argument("--model", help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--drafter", help="drafter checkpoint (default: the shipped one)")
    p.add_argument("--precision", choices=("fast", "reference"), default="fast")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--conversations", default=str(CONVERSATIONS))
    p.add_argument("--subset", choices=sorted(SUBSETS), default="short")
    p.add_argument("--stores", metavar="DIR",
                   help="where each arm saves its learned store (default: a new temp dir)")
    p.add_argument("--json", metavar="FILE", help="also write every reply's numbers here")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="base seed when sampling")
    return p.parse_args(argv)


OWN_NOISE = "own-noise"  # arm suffix: when sampling, the drafter drafts on its own logits


def request_sampling(args, conv_key: str, turn: int) -> SamplingParams | None:
    """The same seed for a turn on every arm, another for every turn."""
    if args.temperature == 0:
        return None
    return SamplingParams(temperature=args.temperature, top_p=args.top_p,
                          seed=derived_seed(args.seed, conv_key, turn)).check()


def run_conversation(engine: Engine, conv, max_tokens: int, args=None) -> list[dict]:
    engine.reset()
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    replies = []
    for turn, text in enumerate(conv.turns):
        messages.append({"role": "user", "content": text})
        sampling = request_sampling(args, conv.key, turn) if args is not None else None
        gen = engine.generate(messages, tools=conv.openai_tools(), max_tokens=max_tokens,
                              request_id=f"{conv.key}#{turn}", sampling=sampling)
        messages.append({"role": "assistant", "content": gen.text})
        replies.append({"conversation": conv.key, "turn": turn, "tokens": gen.token_ids,
                        "finish": gen.finish_reason, **gen.timings.as_dict()})
    return replies


def summary(replies: list[dict]) -> dict:
    tokens = sum(r["decode_tokens"] for r in replies)
    seconds = sum(r["decode_s"] for r in replies)
    rounds = sum(r["draft_rounds"] + r["plain_rounds"] + r["ngram_rounds"] for r in replies)
    return {"tok_s": tokens / seconds if seconds else 0.0, "tokens": tokens,
            "rounds": rounds, "plain": sum(r["plain_rounds"] for r in replies),
            "rows_per_round": sum(r["verified_rows"] for r in replies) / max(rounds, 1),
            "tokens_per_round": tokens / max(rounds, 1)}


def by_source(results: dict[str, list[list[dict]]], sources: dict[str, str],
              base: str) -> list[str]:
    """Markdown rows: each arm's decode tok/s per source (every run's replies pooled), and
    every other arm over `base` on the same replies."""
    names = sorted(set(sources.values()))
    pooled = {arm: {name: summary([r for run in runs for r in run
                                   if sources[r["conversation"]] == name])["tok_s"]
                    for name in names}
              for arm, runs in results.items()}
    lines = [f"| arm | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for arm, speeds in pooled.items():
        cells = [f"{speeds[n]:.1f}" if arm == base else
                 f"{speeds[n] / pooled[base][n]:.2f}x" if pooled[base][n] else "-" for n in names]
        lines.append(f"| {arm} | {' | '.join(cells)} |")
    return lines


def by_width(records: list[dict]) -> list[dict]:
    """Rounds grouped by rows verified (round-log records: rows, accepted, D, verify, commit):
    each width's share of the rounds and of their time, drafted tokens accepted per round, and
    median D and verify in ms; the commonest widths first."""
    groups: dict[int, list[dict]] = {}
    for r in records:
        groups.setdefault(int(r["rows"]), []).append(r)
    total = sum(r["D"] + r["verify"] + r["commit"] for r in records) or 1.0
    out = [{"rows": rows, "rounds": len(g) / len(records),
            "time": sum(r["D"] + r["verify"] + r["commit"] for r in g) / total,
            "accepted": statistics.fmean(r["accepted"] for r in g),
            "D_ms": 1000 * statistics.median(r["D"] for r in g),
            "verify_ms": 1000 * statistics.median(r["verify"] for r in g)}
           for rows, g in groups.items()]
    return sorted(out, key=lambda w: (-w["rounds"], w["rows"]))


def by_node_source(records: list[dict]) -> dict | None:
    """The accepted draft tokens (the bonus not counted) by the source of their tree node, the
    paper's Table 7: the drafter alone, both (an n-gram candidate the drafter also proposed),
    the n-gram index alone; shares of their sum. None where no draft token was accepted."""
    counts = {source: sum(r.get(key) or 0 for r in records) for source, key in
              (("drafter", "accepted_drafter"), ("agreed", "agreed"),
               ("ngram", "accepted_ngram"))}
    accepted = sum(counts.values())
    if not accepted:
        return None
    return {"accepted": accepted, **{k: v / accepted for k, v in counts.items()}}


def by_kind(records: list[dict]) -> list[dict]:
    """Rounds grouped by kind (round-log records: plain, drafted, accepted, D, verify,
    commit): each kind's share of the rounds and of their time, committed tokens per round
    and the round time per committed token in ms (what a kind costs a token, to set against
    `ar`'s decode ms per token; the time outside rounds, mostly learning, is not in it)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(kind_of(r["plain"], r["drafted"]), []).append(r)
    seconds = {k: sum(r["D"] + r["verify"] + r["commit"] for r in g) for k, g in groups.items()}
    total = sum(seconds.values()) or 1.0
    out = []
    for kind, g in groups.items():
        tokens = sum(r["accepted"] + 1 for r in g)
        out.append({"kind": kind, "rounds": len(g) / len(records),
                    "time": seconds[kind] / total, "tokens_per_round": tokens / len(g),
                    "ms_per_token": 1000 * seconds[kind] / tokens})
    return sorted(out, key=lambda k: -k["rounds"])


def parse_arms(spec: str, default_drafter: str | None) -> dict[str, tuple[str, str | None]]:
    """label -> (arm, drafter dir) for "adaspark+gate,chain3@DIR": '+' joins modifiers, and
    '@DIR' gives one arm its own drafter (labelled by the folder's name), so that two drafters
    can be compared in one interleaved run."""
    out = {}
    for item in filter(None, (a.strip() for a in spec.split(","))):
        name, _, drafter = item.partition("@")
        arm = name.replace("+", ",")
        Arm.parse(arm.replace(f",{OWN_NOISE}", ""))
        label = f"{arm}@{Path(drafter).name}" if drafter else arm
        if label in out:
            raise SystemExit(f"arm {label!r} is named twice")
        out[label] = (arm, drafter or default_drafter)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = parse_arms(args.arms, args.drafter)
    arms = list(specs)
    subset = SUBSETS[args.subset](load_conversations(args.conversations))
    path = resolve_model(args.model)
    gguf = read_gguf(path)
    target = Transformer(gguf, precision=args.precision)
    tok = Tokenizer.from_gguf(gguf)
    stores = Path(args.stores or tempfile.mkdtemp(prefix="adaspark-arms-"))
    engines = {label: Engine(target, tok, path,
                             load_speculator(target, path, tok.stop_ids, ModelOptions(
                                 arm=arm.replace(f",{OWN_NOISE}", ""), drafter=drafter,
                                 store=stores / label, fresh=True)))
               for label, (arm, drafter) in specs.items()}
    depths: dict[str, list[int]] = {label: [] for label in engines}  # accepted, drafted rounds
    records: dict[str, list[dict]] = {label: [] for label in engines}  # every round's record
    for label, engine in engines.items():
        if engine.speculator is not None:
            engine.speculator.shared_noise = OWN_NOISE not in specs[label][0]
            engine.speculator.round_hook = lambda tr, d=depths[label]: (
                d.append(len(tr.outcome.tokens)) if tr.plan.drafted else None)
            engine.speculator.observers.append(
                lambda row, _plan, out=records[label]: out.append(row))
    print(f"{len(subset)} conversations x {max(len(c.turns) for c in subset)} turns, cap "
          f"{args.max_tokens}, {args.runs} interleaved runs, torch threads "
          f"{torch.get_num_threads()}, temperature {args.temperature}", file=sys.stderr)
    results: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    for run in range(args.runs):
        start = time.perf_counter()
        replies = interleaved(subset, arms, lambda arm, conv: run_conversation(
            engines[arm], conv, args.max_tokens, args))
        for arm in arms:
            results[arm].append(replies[arm])
            s = summary(replies[arm])
            print(f"run {run + 1} {arm:>12}: {s['tok_s']:6.1f} tok/s over {s['tokens']} tokens",
                  file=sys.stderr)
        print(f"run {run + 1}: {time.perf_counter() - start:.0f} s", file=sys.stderr)

    base = "ar" if "ar" in arms else arms[0]
    speeds = {arm: [summary(run)["tok_s"] for run in runs] for arm, runs in results.items()}
    mean = {arm: statistics.fmean(v) for arm, v in speeds.items()}
    first = results[arms[0]]
    print(f"\n| arm | decode tok/s (runs) | x {base} | tokens/round | rows/round | plain "
          f"rounds | replies as {arms[0]} |")
    print("|---|---|---|---|---|---|---|")
    for arm in arms:
        s = summary([r for run in results[arm] for r in run])
        same = sum(a["tokens"] == b["tokens"] for run_a, run_b in zip(results[arm], first,
                                                                     strict=True)
                   for a, b in zip(run_a, run_b, strict=True))
        total = sum(len(run) for run in first)
        runs = " / ".join(f"{v:.1f}" for v in speeds[arm])
        print(f"| {arm} | {mean[arm]:.1f} ({runs}) | {mean[arm] / mean[base]:.2f} | "
              f"{s['tokens_per_round']:.2f} | {s['rows_per_round']:.1f} | {s['plain']} | "
              f"{same}/{total} |")
    print(f"\nBy source (first row: {base} tok/s; every other row: the arm over {base}):\n")
    print("\n".join(by_source(results, {c.key: c.source for c in subset}, base)))
    print("\nAcceptance by position (drafted rounds whose accepted path reached depth d):\n")
    print("| arm | drafted rounds | " + " | ".join(f"d={d}" for d in range(1, 7)) + " |")
    print("|---|---|" + "---|" * 6)
    for arm, accepted in depths.items():
        if accepted:
            shares = [sum(a >= d for a in accepted) / len(accepted) for d in range(1, 7)]
            print(f"| {arm} | {len(accepted)} | " + " | ".join(f"{x:.3f}" for x in shares) + " |")
    print("\nRounds by rows verified (the six commonest widths of each drafting arm; accepted: "
          "drafted tokens per round, the bonus not counted):\n")
    print("| arm | rows | share of rounds | share of round time | accepted | median D ms | "
          "median verify ms |")
    print("|---|---|---|---|---|---|---|")
    widths = {arm: by_width(rows) for arm, rows in records.items() if rows}
    for arm, table in widths.items():
        for w in table[:6]:
            print(f"| {arm} | {w['rows']} | {w['rounds']:.1%} | {w['time']:.1%} | "
                  f"{w['accepted']:.2f} | {w['D_ms']:.2f} | {w['verify_ms']:.2f} |")
    base_ms = 1000 / mean[base] if mean[base] else 0.0
    print(f"\nRounds by kind (ms per token: the kind's round time over its committed tokens; "
          f"{base}: {base_ms:.2f} ms a token, everything counted):\n")
    print("| arm | kind | share of rounds | share of round time | tokens/round | ms per token |")
    print("|---|---|---|---|---|---|")
    kinds = {arm: by_kind(rows) for arm, rows in records.items() if rows}
    for arm, table in kinds.items():
        for k in table:
            print(f"| {arm} | {k['kind']} | {k['rounds']:.1%} | {k['time']:.1%} | "
                  f"{k['tokens_per_round']:.2f} | {k['ms_per_token']:.2f} |")
    print("\nAccepted draft tokens by their node's source (the paper's Table 7; the bonus "
          "not counted):\n")
    print("| arm | accepted draft tokens | drafter-only | both proposed | n-gram-only |")
    print("|---|---|---|---|---|")
    sources = {arm: by_node_source(rows) for arm, rows in records.items()}
    for arm, share in sources.items():
        if share:
            print(f"| {arm} | {share['accepted']:,} | {share['drafter']:.1%} | "
                  f"{share['agreed']:.1%} | {share['ngram']:.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results,
                                               "accepted_by_drafted_round": depths,
                                               "rounds_by_width": widths,
                                               "rounds_by_kind": kinds,
                                               "accepted_by_node_source": sources}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
