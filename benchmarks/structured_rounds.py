"""What a response_format does to the default arm's rounds, in counts (no clock is read here):
the structured_output.py prompts decoded free and under their schema on one engine, and per
mode the rounds' kinds (plain, n-gram, drafted), tokens and rows per round, the rows that could
not be accepted, the candidates the grammar forbade or made certain (forced chains appended),
how many of those took rows and were accepted, and the grammar library's calls per round.

The scheduler's decisions still follow its measured prices and rates, so two runs on a busy
machine need not give the same rounds; the counts say what the rounds were made of.

    .venv/bin/python benchmarks/structured_rounds.py --max-tokens 64 --runs 2
    .venv/bin/python benchmarks/structured_rounds.py --arm ngram --prompts 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from structured_output import CONVERSATIONS, prompts

from adaspark import grammar as grammar_mod
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.scheduler.round import FORCED_BUCKET, FORCED_LOGIT_P
from adaspark.scheduler.tree import NGRAM
from adaspark.speculative import DEFAULT_ARM, RoundTrace, load_speculator

MATCHER_CALLS = ("validate_tokens", "try_consume_tokens", "compute_ff_tokens", "compute_bitmask",
                 "consume_token", "rollback")


class _CountingMatcher:
    """An llguidance matcher that counts the calls the engine makes on it."""

    def __init__(self, matcher: Any, calls: Counter):
        self._m, self._calls = matcher, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._m, name)
        if name not in MATCHER_CALLS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def count_matcher_calls(calls: Counter) -> None:
    """Every GrammarState made from now on counts its matcher's calls into `calls`."""
    init = grammar_mod.GrammarState.__init__

    def wrapped(self, matcher, compiler):
        init(self, _CountingMatcher(matcher, calls), compiler)

    grammar_mod.GrammarState.__init__ = wrapped


def round_counts(trace: RoundTrace) -> dict[str, int]:
    """One round's counts from its plan and outcome."""
    plan, out = trace.plan, trace.outcome
    c = {"rounds": 1, "tokens": len(trace.emitted), "rows": plan.rows,
         "plain": int(plan.tree is None and plan.rows == 1),
         "drafted": int(plan.drafted), "accepted": len(out.tokens)}
    c["ngram_round"] = int(not plan.drafted and plan.rows > 1)
    tree = plan.tree
    if tree is None or plan.layout is None:
        return c
    placed = plan.layout.nodes[1:]
    accepted = np.asarray(out.nodes, dtype=np.int64)
    forced = (tree.kind == NGRAM) & (tree.bucket == FORCED_BUCKET) & (
        tree.logit_p == FORCED_LOGIT_P)
    certain = np.zeros(tree.n_nodes, dtype=bool) if tree.certain is None else tree.certain
    forbidden = np.zeros(tree.n_nodes, dtype=bool) if tree.forbidden is None else tree.forbidden
    c.update({
        "nodes": tree.n_nodes, "nodes_forbidden": int(forbidden.sum()),
        "nodes_forbidden_drafter": int(forbidden[: tree.n_drafter].sum()),
        "nodes_forbidden_ngram": int(forbidden[tree.n_drafter:].sum()),
        "nodes_ngram": int(tree.n_nodes - tree.n_drafter - forced.sum()),
        "nodes_certain": int(certain.sum()), "nodes_forced": int(forced.sum()),
        "rows_certain": int(certain[placed].sum()), "rows_forced": int(forced[placed].sum()),
        "rows_forbidden": int(forbidden[placed].sum()),
        "accepted_certain": int(certain[accepted].sum()) if accepted.size else 0,
        "accepted_forced": int(forced[accepted].sum()) if accepted.size else 0,
        "rows_unaccepted": plan.rows - 1 - len(out.tokens),
        "forced_chains": int(len({int(tree.parent[i]) for i in np.flatnonzero(forced)
                                  if not forced[tree.parent[i]] or tree.parent[i] < 0})),
    })
    # the survey's work by node kind: a legality check on every node whose parent is legal, a
    # forced-token look-up below every legal node none of whose candidates is legal
    legal = ~forbidden
    parent_legal = np.where(tree.parent < 0, True, legal[np.maximum(tree.parent, 0)])
    has_legal_kid = np.zeros(tree.n_nodes + 1, dtype=bool)
    has_legal_kid[tree.parent[legal] + 1] = True
    leaf = legal & ~has_legal_kid[1:] & ~forced
    names = {0: "pick", 1: "sibling", 2: "ngram"}
    kind = np.where(forced, 3, tree.kind)
    for k, name in {**names, 3: "forced"}.items():
        c[f"checked_{name}"] = int((parent_legal & (kind == k)).sum())
        c[f"legal_leaf_{name}"] = int((leaf & (kind == k)).sum())
        c[f"rows_{name}"] = int((kind[placed] == k).sum())
    # where the forced chains hang: below the anchor, a pick, a sibling or an n-gram node
    root = forced & ~np.where(tree.parent < 0, False, forced[np.maximum(tree.parent, 0)])
    for node in np.flatnonzero(root).tolist():
        p = int(tree.parent[node])
        below = "anchor" if p < 0 else names[int(tree.kind[p])]
        chain = [node]
        while (nxt := np.flatnonzero((tree.parent == chain[-1]) & forced)).size:
            chain.append(int(nxt[0]))
        c[f"forced_below_{below}"] = c.get(f"forced_below_{below}", 0) + len(chain)
        c[f"forced_rows_below_{below}"] = c.get(f"forced_rows_below_{below}", 0) + int(
            np.isin(chain, placed).sum())
    # the labelled parents (the accepted path's) whose drafted pick the grammar forbids while
    # a sibling is legal: there the target's pick is among the legal siblings or none
    for parent in out.labelled_parents.tolist() if out.labelled_parents is not None else ():
        kids = np.flatnonzero((tree.parent == parent) & (tree.kind != NGRAM))
        if kids.size and forbidden[kids[0]] and not forbidden[kids[1:]].all():
            c["parents_pick_forbidden"] = c.get("parents_pick_forbidden", 0) + 1
            c["parents_pick_forbidden_sibling_accepted"] = c.get(
                "parents_pick_forbidden_sibling_accepted", 0) + int(
                np.isin(kids[1:], accepted).any())
            target = int(out.parent_targets[list(out.labelled_parents).index(parent)])
            right = kids[1:][tree.token[kids[1:]] == target]
            if right.size:  # the target's pick was a legal sibling: placed or not
                key = "placed" if np.isin(right, placed).any() else "unplaced"
                c[f"parents_pick_forbidden_sibling_right_{key}"] = c.get(
                    f"parents_pick_forbidden_sibling_right_{key}", 0) + 1
    if plan.gate_bucket is not None:
        c[f"gate_bucket_{plan.gate_bucket}"] = 1
        c[f"gate_bucket_{plan.gate_bucket}_{'drafted' if plan.drafted else 'undrafted'}"] = 1
        if forced[:1].any() and not plan.drafted:
            c["gate_forced_anchor_undrafted"] = 1
        if tree.n_drafter == 0 and forced.any() and tree.n_nodes and forced[0]:
            c["gate_bucket_from_forced"] = 1
    return c


def watch_gate_trees(sched: Any, seen: list) -> None:
    """Record, for every n-gram tree the gate reads, whether its first node (the proposal
    whose evidence is the gate's bucket) is forbidden by the request's grammar."""
    build = sched._ngram_tree

    def wrapped(stop_ids):
        tree = build(stop_ids)
        seen.append(bool(tree.n_nodes and tree.forbidden is not None and tree.forbidden[0]))
        return tree

    sched._ngram_tree = wrapped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", default=DEFAULT_ARM)
    p.add_argument("--runs", type=int, default=2, help="free then schema, this many times")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=None, help="only the first N prompts")
    p.add_argument("--conversations", type=Path, default=CONVERSATIONS)
    p.add_argument("--model", default=None)
    p.add_argument("--json", type=Path, default=None, help="every round's counts")
    args = p.parse_args(argv)
    calls: Counter = Counter()
    count_matcher_calls(calls)
    path = resolve_model(args.model)
    gguf = read_gguf(path)
    target = Transformer(gguf)
    tok = Tokenizer.from_gguf(gguf)
    store = Path(tempfile.mkdtemp(prefix="adaspark-structured-rounds-")) / "store"
    spec = load_speculator(target, path, tok.stop_ids,
                           ModelOptions(arm=args.arm, store=store, fresh=True))
    engine = Engine(target, tok, path, spec)
    items = prompts(args.conversations)[: args.prompts]
    rounds: list[dict] = []
    gate_seen: list[bool] = []
    watch_gate_trees(spec.scheduler, gate_seen)

    records: list[dict] = []
    spec.observers.append(lambda row, plan: records.append(row))

    def hook(trace: RoundTrace) -> None:
        c = round_counts(trace)
        if gate_seen:
            c["gate_first_proposal_forbidden"] = int(gate_seen[-1])
            if gate_seen[-1]:
                c["gate_first_proposal_forbidden_" + ("drafted" if trace.plan.drafted else
                                                      "undrafted")] = 1
            gate_seen.clear()
        c["labels"] = int(records[-1].get("labels") or 0)
        # what the plan expected to accept, in thousandths (summed, it sets against accepted)
        c["pred_S_milli"] = round(1000 * float(records[-1].get("pred_S") or 0.0))
        rounds.append(c)

    spec.round_hook = hook
    totals: dict[str, Counter] = {}
    per_round: list[dict] = []
    for run in range(args.runs):
        for mode in ("free", "schema"):
            for item in items:
                before = dict(calls)
                rounds.clear()
                engine.generate(item["messages"], tools=item["tools"],
                                max_tokens=args.max_tokens,
                                response_format=item["response_format"]
                                if mode == "schema" else None)
                total = totals.setdefault(mode, Counter())
                for r in rounds:
                    total.update(r)
                    per_round.append({"run": run, "mode": mode, "prompt": item["name"], **r})
                for name in MATCHER_CALLS:
                    total[f"calls_{name}"] += calls[name] - before.get(name, 0)
    print(f"arm {args.arm}, {len(items)} prompts, cap {args.max_tokens}, {args.runs} runs")
    keys = sorted({k for t in totals.values() for k in t})
    print(f"| count | {' | '.join(totals)} |\n|---|{'---|' * len(totals)}")
    for key in ["rounds", *(k for k in keys if k != "rounds")]:
        print(f"| {key} | " + " | ".join(str(t[key]) for t in totals.values()) + " |")
    print("\nper round")
    for key in ("tokens", "rows", "accepted", "plain", "drafted", "ngram_round",
                "rows_unaccepted", "rows_certain", "accepted_certain", "rows_forced",
                "accepted_forced", "nodes_forbidden", "calls_validate_tokens",
                "calls_try_consume_tokens", "calls_consume_token", "calls_rollback",
                "calls_compute_ff_tokens", "calls_compute_bitmask"):
        print(f"| {key} | " + " | ".join(f"{t[key] / max(t['rounds'], 1):.3f}"
                                         for t in totals.values()) + " |")
    if args.json:
        args.json.write_text(json.dumps({"totals": totals, "rounds": per_round}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
