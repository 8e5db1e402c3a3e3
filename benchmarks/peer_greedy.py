"""Greedy replies of ours and llama.cpp's on the same GGUF and prompt token ids, compared to the
first difference: a peer check of whole replies, where benchmarks/peer_logits.py checks logits.

For each of N prompts both engines decode M tokens greedily (ours: Engine.load's forward, arm
`ar`; llama.cpp: peer_logits' worker, temp 0). Per prompt: how many tokens are equal before the
first difference and, there, from the common context, each side's top-2 logit margin and its
margin over the other side's token, set against peer_logits' head bound (its docstring derives
it from both engines' activation rounding): a parting whose two margins sum to at most the
pair's bound is a near tie that rounding decides ("near_tie"). The verdict the issue asks for,
"greedy tokens equal llama.cpp's to the first near tie", holds when no prompt parts otherwise.

With --raw (a base model, no chat template) the prompts are the evaluation's first turns as text
to continue, as `adaspark generate --raw` reads them.

    .venv/bin/python benchmarks/peer_greedy.py --model FILE --raw --prompts 4 --max-tokens 64 \\
        --out greedy.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pl = _sibling("peer_logits")  # its worker, bound and greedy comparison
vs = pl.vs


def verdict(items: list[dict]) -> dict:
    """Counts over the prompts' greedy comparisons (peer_logits.Check.greedy's dicts)."""
    parted = [g["first_difference"] for g in items if g["first_difference"] is not None]
    # a reply cut short by a stop token on one side only parts without a difference to price
    uneven = sum(g["first_difference"] is None and len(g["ours"]) != len(g["llamacpp"])
                 for g in items)
    not_ties = sum(not d["near_tie"] for d in parted)
    return {"prompts": len(items), "identical": len(items) - len(parted) - uneven,
            "parted_at_near_tie": len(parted) - not_ties, "parted_not_near_tie": not_ties,
            "parted_by_length": uneven,
            "argmaxes_not_picked": sum(not d["argmaxes_picked"] for d in parted),
            "equal_to_first_near_tie": not_ties == 0 and uneven == 0}


def line(i: int, g: dict) -> str:
    d = g["first_difference"]
    head = f"  prompt {i}: {g['same_tokens']} equal of {g['reply_tokens'][0]}/" \
           f"{g['reply_tokens'][1]}"
    if d is None:
        return head
    return (f"{head}; parts at {d['position']}: ours {d['ours_token']} (top-2 margin "
            f"{d['ours_top2_margin']:.4f}, over theirs {d['ours_margin']:.4f}), llama.cpp "
            f"{d['llamacpp_token']} ({d['llamacpp_top2_margin']:.4f}, "
            f"{d['llamacpp_margin']:.4f}); bound {d['pair_head_bound']:.4f}, max |ours - "
            f"llama.cpp| there {d['max_abs_difference']:.4f}: "
            f"{'near tie' if d['near_tie'] else 'NOT a near tie'}")


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    venv = Path(args.venv) if args.venv else vs.default_venv()
    if not vs.venv_python(venv).exists():
        raise SystemExit(f"no llama.cpp at {venv}: benchmarks/vs_llamacpp.py --build-only")
    model = Path(args.model)
    worker = pl.LogitsWorker(venv, model, args.threads, args.n_ctx)
    try:
        check = pl.Check(model, worker, args.n_ctx, reference=False)
        items = []
        for i, ids in enumerate(pl.prompt_ids(check.engine.tokenizer, args)):
            g = {"prompt_tokens": len(ids), **check.greedy(ids, args.max_tokens)}
            g["texts"] = [check.engine.tokenizer.decode(g["ours"]),
                          check.engine.tokenizer.decode(g["llamacpp"])]
            items.append(g)
            print(line(i, g), file=sys.stderr, flush=True)
    finally:
        worker.close()
    return {"model": str(model), "forward": check.forward, "head_type": check.head_type,
            "raw": args.raw, "max_tokens": args.max_tokens, "threads": args.threads,
            "llamacpp_version": worker.info["version"],
            "llamacpp_system_info": worker.info["system_info"],
            "near_tie_definition": "at the first difference, ours picks t and llama.cpp s: "
                                   "(l_t - l_s) + (l'_s - l'_t) <= B_t + B_s, B the LM head's "
                                   "rounding bound of benchmarks/peer_logits.py (computed on "
                                   "our final-normed row)",
            "prompts": items, "summary": verdict(items)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pl.add_peer_arguments(p, 64, "greedy reply tokens per prompt")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
