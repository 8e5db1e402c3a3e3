"""Build data/drafter/pool.jsonl.gz: the prompt pool of `adaspark gen-data` (see
data/drafter/README.md for what it holds and where each part comes from).

    .venv/bin/python scripts/build_drafter_pool.py --mirrors /work/.mirror

Inputs: ../shared/data/train/prompts.jsonl (already deduplicated against the evaluation pool),
../shared/data/eval/conversations.jsonl (to deduplicate the new sources against), and git
snapshots of the source repositories (`fetch github:OWNER/NAME`, read at the pinned commits
below with `git show`). Deterministic: the same inputs give the same file.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import subprocess
from pathlib import Path

from adaspark.drafter.pool import EvalGuard

# repository -> the commit read (the one ../shared/data/provenance_commits.txt names, where it
# names one)
COMMITS = {
    "mtbench101+mt-bench-101": "bc18b3e2c18c99164e11528f1a79c92083db5953",
    "zaego123+ToolACE_data": "5f6a01de7fef49add7be213a7f19b07832452b0f",
    "ghchen99+ConvFinQA-llm-eval": "050518f427ada84101e12604fecc92fb925368b3",
    "en-jai-neer+CompressKV": "5882b959a16b5deced314da52a493429fccfff5f",
    "Open-Assistant+oasst-model-eval": "ce935dee6922ec75d5a4006dd1c3595b39a01fdf",
}
# training-prompt sources chained into conversations (a later turn: another prompt of the same
# family, as MT-Bench-101's topic shifts and follow-ups do); tool prompts stay single
CHAIN_FAMILIES = ("gpteacher/roleplay", "gpteacher/codegen", "gsm8k", "flan_cot",
                  "awesome-chatgpt-prompts", "self_instruct", "oasst/prompt_lottery",
                  "openai/human_eval", "fastchat")
TURNS_WEIGHTS = {1: 0.5, 2: 0.35, 3: 0.15}
LONGBENCH_PROMPT = ("You are given several news passages. Write a one-page summary of all "
                    "news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the "
                    "news.\n\nSummary:")  # LongBench's own multi_news prompt (as in eval)
SKIP_FIRST = {"mt_bench_101": 2, "multi_news": 10}  # per task: the evaluation took the first


def show(mirrors: Path, repo: str, path: str) -> bytes:
    return subprocess.run(["git", "-C", str(mirrors / repo / "repo"), "show",
                           f"{COMMITS[repo]}:{path}"], check=True, capture_output=True).stdout


def clean(conv: dict, guard: EvalGuard) -> dict | None:
    """The conversation unless it overlaps the evaluation pool: its first turn, or any later
    turn of 40 characters or more (short generic follow-ups, "what about in 2008?", stay)."""
    first, *rest = conv["turns"]
    if guard.hits(first) or any(len(t) >= 40 and guard.hits(t) for t in rest):
        return None
    return conv


def mt_bench_101(mirrors, guard):
    rows = [json.loads(line) for line in
            show(mirrors, "mtbench101+mt-bench-101", "data/subjective/mtbench101.jsonl")
            .decode().splitlines() if line.strip()]
    seen = collections.Counter()
    for r in rows:  # file order, as the evaluation's rule reads it
        seen[r["task"]] += 1
        if seen[r["task"]] <= SKIP_FIRST["mt_bench_101"]:
            continue
        yield {"source": f"mt_bench_101/{r['task']}", "turns": [h["user"] for h in r["history"]]}


def toolace(mirrors, train_items):
    """Rows 8-99 (the training file's): every user turn, with the row's tools and system text
    from the training file (this copy of the rows lost its tool lists)."""
    rows = json.loads(show(mirrors, "zaego123+ToolACE_data", "sharegpt_func_fixed.json"))
    by_first = {it["prompt"]: it for it in train_items if it["source"] == "toolace/rows_8_99"}
    for r in rows:
        turns = [m["value"] for m in r["conversations"] if m["from"] == "human"]
        item = by_first.get(turns[0]) if turns else None
        if item is not None:
            yield {"source": "toolace/rows_8_99", "turns": turns, "tools": item["tools"],
                   "system": item.get("system")}


def convfinqa(mirrors, train_items):
    """Rows 8-99: the training file's first turn (report and first question), then the row's
    further questions."""
    rows = json.loads(show(mirrors, "ghchen99+ConvFinQA-llm-eval",
                           "data/output/predictions_first_100.json"))
    firsts = [it for it in train_items if it["source"] == "convfinqa/train_rows_8_99"]
    for r in rows:
        qs = [q["question"] for q in r["conversation"]]
        pre = " ".join(r["financial_report"]["pre_text"])[:60]
        match = [it for it in firsts if it["prompt"].endswith(f"Question: {qs[0]}")
                 and pre[:40] in it["prompt"]]
        if len(match) == 1 and len(qs) > 1:
            yield {"source": "convfinqa/train_rows_8_99", "turns": [match[0]["prompt"], *qs[1:]]}


def multi_news(mirrors, max_chars):
    rows = [json.loads(line) for line in
            show(mirrors, "en-jai-neer+CompressKV", "data/LongBench/multi_news.jsonl")
            .decode().splitlines() if line.strip()]
    for r in rows[SKIP_FIRST["multi_news"]:]:
        if len(r["context"]) <= max_chars:
            yield {"source": "longbench/multi_news",
                   "turns": [LONGBENCH_PROMPT.format(context=r["context"])]}


def oasst_chains(mirrors, train_items):
    """The best-ranked chain's user turns of each en_100_tree tree whose first prompt the
    training file holds (those were deduplicated already)."""
    known = {it["prompt"] for it in train_items if it["source"] == "oasst/en_100_tree"}
    text = show(mirrors, "Open-Assistant+oasst-model-eval",
                "model_eval/manual/data/en_100_tree.jsonl").decode()
    for line in text.splitlines():
        m, turns = json.loads(line)["prompt"], []
        while m:
            if m["role"] == "prompter":
                turns.append(m["text"])
            replies = [r for r in m.get("replies", []) if not r.get("deleted")]
            if not replies:
                break
            m = min(replies, key=lambda r: 99 if r.get("rank") is None else r["rank"])
        if turns and turns[0] in known:
            yield {"source": "oasst/en_100_tree", "turns": turns}


def chained(train_items, taken: set[str], seed: int, rounds: int):
    """The training prompts as conversations: every prompt of a chat family in `rounds`
    groupings (round 0: 1-3 turns by TURNS_WEIGHTS; each later round: 2-3 turns, so its later
    turns answer the same prompts after other openings: other contexts, other replies; their
    opening turns repeat round 0's, whose replies gen-data reuses), every other prompt alone;
    none of `taken` (their conversation is built from its own source)."""
    families = collections.defaultdict(list)
    for it in train_items:
        if it["prompt"] in taken:
            continue
        family = next((f for f in CHAIN_FAMILIES if it["source"].startswith(f)), None)
        if family is None or it.get("tools") or it.get("system"):
            yield {k: v for k, v in it.items() if v is not None and k != "prompt"} | {
                "turns": [it["prompt"]]}
        else:
            families[family].append(it)
    for r in range(rounds):
        rng = random.Random(f"{seed}/{r}")
        weights = TURNS_WEIGHTS if r == 0 else {2: 0.6, 3: 0.4}
        for family in CHAIN_FAMILIES:
            items = list(families[family])
            rng.shuffle(items)
            at = 0
            while at < len(items):
                n = rng.choices(list(weights), list(weights.values()))[0]
                group = items[at:at + n]
                at += n
                if r > 0 and len(group) < 2:
                    continue
                source = group[0]["source"] if n == 1 else f"chain{r or ''}/{family}"
                yield {"source": source, "turns": [it["prompt"] for it in group]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    p.add_argument("--shared", type=Path, default=Path("../shared/data"))
    p.add_argument("--out", type=Path, default=Path("data/drafter/pool.jsonl.gz"))
    p.add_argument("--long-chars", type=int, default=14000, help="longest multi_news context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chain-rounds", type=int, default=4,
                   help="groupings of the chat families' prompts into conversations")
    args = p.parse_args()

    train_items = [json.loads(line) for line in
                   (args.shared / "train/prompts.jsonl").read_text().split("\n") if line.strip()]
    guard = EvalGuard.from_conversations(args.shared / "eval/conversations.jsonl")
    multi = [*mt_bench_101(args.mirrors, guard), *toolace(args.mirrors, train_items),
             *convfinqa(args.mirrors, train_items), *oasst_chains(args.mirrors, train_items),
             *multi_news(args.mirrors, args.long_chars)]
    kept = [c for c in multi if clean(c, guard) is not None]
    taken = {c["turns"][0] for c in kept}  # first turns now opening a conversation of their own
    pool = kept + list(chained(train_items, taken, args.seed, args.chain_rounds))
    seen, out = set(), []
    for c in pool:  # each conversation once
        key = json.dumps([c["turns"], c.get("tools"), c.get("system")])
        if key not in seen:
            seen.add(key)
            out.append({k: v for k, v in c.items() if v is not None})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:  # mtime 0: the same bytes every build
        f.write("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in out).encode())
    by = collections.Counter(c["source"].split("/")[0] if not c["source"].startswith("chain")
                             else c["source"].split("/")[0] for c in out)
    turns = collections.Counter(len(c["turns"]) for c in out)
    firsts = {c["turns"][0] for c in out}
    print(f"{len(out)} conversations, {sum(len(c['turns']) for c in out)} user turns, "
          f"{len(firsts) + sum(len(c['turns']) - 1 for c in out)} distinct prompts in context "
          f"({len(multi) - len(kept)} new-source conversations dropped as evaluation overlap)")
    print("turns per conversation:", dict(sorted(turns.items())))
    for source, n in by.most_common():
        print(f"  {source}: {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
