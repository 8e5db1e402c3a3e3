"""What a draft costs by the drafter's shape, against a one-row target step: issue 44's bar is a
draft at most 0.2x that step on every build, and the shape (draft vocabulary, decoder layers,
q/k RMSNorm with NeoX RoPE) is chosen against it.

    .venv/bin/python benchmarks/draft_shape.py [--context 512] [--reps 100]
        [--shapes shipped,8192x1,12288x1,16384x1,12288x2,12288x1qk] [--json OUT]

Each shape is a drafter of random weights (but for the Markov head's, below) on the
target's own build (native: ADASPARK_NATIVE=avx2 forces the AVX2 one), its context features
observed over `context` prompt positions. A rep is one one-row target verify at that context,
then one draft of each shape, in an order that rotates every rep, so a machine that speeds up
or slows down moves them alike; the verify also leaves the target's weights in the caches
before the drafts, as a round does. Prints each shape's median draft ms and its ratio to the
median one-row step. A shape is VxL (draft vocabulary x decoder layers), `qk` appended for q/k
RMSNorm and NeoX RoPE (the peers' form); `shipped` is the drafter the package ships, trained.
`h4` appended to any shape puts its head in Q4_1 blocks, not Q8_0 (`shippedh4`, `12288x1qkh4`).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time

import numpy as np
import torch
from safetensors.torch import load_file

from adaspark import cpuinfo
from adaspark.drafter.loading import DEFAULT_DRAFTER
from adaspark.drafter.model import DrafterConfig, DraftModel
from adaspark.drafter.runtime import Drafter
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer

SHAPE = re.compile(r"(\d+)x(\d+)(qk)?$")
HEAD4 = "h4"  # a shape's suffix: the head in Q4_1 blocks
TAPS = [1, 14, 27]  # the shipped drafter's target layers


@functools.cache
def shipped() -> dict[str, torch.Tensor]:
    """The shipped drafter's tensors (its Markov rows stand in for a trained head's)."""
    return load_file(str(DEFAULT_DRAFTER / "model.safetensors"))


def drafter_of(target: Transformer, path, spec: str, context: int) -> Drafter:
    """A random drafter of shape `spec` on the target's build ("shipped": the target's own)."""
    head_bits = 4 if spec.endswith(HEAD4) else 8
    spec = spec.removesuffix(HEAD4)
    if spec == "shipped":
        from adaspark.drafter.loading import load_drafter

        return load_drafter(target, path, head_bits=head_bits)
    m = SHAPE.fullmatch(spec)
    if m is None:
        raise SystemExit(f"shape {spec!r}: write VOCABxLAYERS, e.g. 12288x1 or 12288x1qk")
    vocab, layers, qk = int(m[1]), int(m[2]), bool(m[3])
    torch.manual_seed(0)
    ids = torch.arange(vocab)
    c = DrafterConfig(target_layers=TAPS, draft_vocab_size=vocab, n_layers=layers,
                      markov_rank=shipped()["markov_w2.weight"].shape[1], qk_norm=qk,
                      rope_style="neox" if qk else "interleaved")
    model = DraftModel(c, ids, target.embed(ids))
    with torch.no_grad():  # the shipped drafter's trained Markov rows, repeated to the shape's
        # vocabulary: how often a shortlist is provably exact, and so the Markov phase's cost,
        # depends on them (a fresh W2 is 0: every shortlist exact; random rows at the trained
        # spread cost ~1.5x the trained ones)
        for name, rows in (("markov_w1", model.markov_w1.weight), ("markov_w2",
                                                                     model.markov_w2.weight)):
            trained = shipped()[f"{name}.weight"]
            rows.copy_(trained[torch.arange(rows.shape[0]) % trained.shape[0]].float())
    # where the target has no native build, the drafter's torch path (as the engine's)
    return Drafter(model, target.embed, dtype=torch.float32, native=target.native_module,
                   positions=context + 2 * c.block_size,
                   embedding=getattr(target, "packed_embeddings", None), head_bits=head_bits)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--shapes", default="shipped,8192x1,12288x1,16384x1,12288x2,12288x1qk")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    target = Transformer.from_gguf(path, precision="fast", max_context=args.context + 16)
    shapes = args.shapes.split(",")
    drafters = {s: drafter_of(target, path, s, args.context) for s in shapes}
    out = target.prefill([(13 * i) % 1000 + 100 for i in range(args.context)], tap_layers=TAPS)
    for d in drafters.values():
        d.observe(out.hiddens)
        d.draft(int(out.argmax[-1]))  # the features appended, the buffers made
    anchor = int(out.argmax[-1])
    ms: dict[str, list[float]] = {"step": [], **{s: [] for s in shapes}}
    one = np.ones((1, 1), dtype=bool)
    for rep in range(args.reps + 3):
        target.truncate(args.context)
        start = time.perf_counter()
        target.verify([anchor], [0], one)
        step = time.perf_counter() - start
        if rep >= 3:
            ms["step"].append(1e3 * step)
        for s in shapes[rep % len(shapes):] + shapes[:rep % len(shapes)]:
            d = drafters[s]
            d.truncate(args.context)
            start = time.perf_counter()
            d.draft(anchor)
            if rep >= 3:
                ms[s].append(1e3 * (time.perf_counter() - start))
    med = {k: statistics.median(v) for k, v in ms.items()}
    isa = target.native_module.ISA if target.native_module is not None else "torch"
    print(f"{cpuinfo.name()}, {isa}, {args.threads} threads, context {args.context}, "
          f"{args.reps} reps: one-row target step {med['step']:.3f} ms (median)\n")
    print("| shape (vocab x layers) | draft ms | x one-row step |\n|---|---|---|")
    for s in shapes:
        print(f"| {s} | {med[s]:.3f} | {med[s] / med['step']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpuinfo.name(), "isa": isa, "context": args.context,
                       "reps": args.reps, "median_ms": med,
                       "ratio": {s: med[s] / med["step"] for s in shapes}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
