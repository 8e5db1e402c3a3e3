"""The online cost model's estimate of a verify against its measured time, after one request.

    .venv/bin/python benchmarks/cost_estimate.py --model FILE [--arm ngram] [--max-tokens 128]
                                                 [--prompt-tokens 400] [--together 2,4,8]
                                                 [--reps 9] [--json FILE]

From an empty learned store (a temporary one), one greedy request of `--max-tokens` on the arm,
and with `--together` then N requests like it served at once for each N (continuous batching: each
step's one call over N rows teaches the price of N rows, as a server's would; on a model whose
replies give the n-gram index nothing to propose, a random-weight file's, one request alone
verifies one row a round and teaches no width). Then, at the context the request ended at,
the scheduler's price of each width it measured (the
plain step's law for one row, each measured row class's law at its top) beside the median
time of a verify of that many rows at that context (a binary tree, no commit, widths
interleaved), and the median relative error. On a routed target every extra row brings its own
experts, so the curve rises faster than a dense one's (issue 46): the cost model must follow it
with no special case, and this is where that is checked. Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from adaspark import cpuinfo
from adaspark.engine import Engine
from adaspark.scheduler.cost import basis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_cost import verify_times  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "README.md"  # a prompt of real text


def estimates(engine: Engine, context: int) -> dict[int, float]:
    """Width -> the scheduler's price in ms at `context`: the plain law for 1 row, each measured
    row class at its top."""
    scheduler = engine.speculator.scheduler
    cost, phi = scheduler.cost, basis(context)
    out = {}
    plain = scheduler.plain_law.predict(context)
    if plain is not None:
        out[1] = plain
    for row_class in cost.classes:
        if row_class.measured:
            out[row_class.top] = row_class.price_basis(phi, cost.clock)
    return out


def measured_ms(engine: Engine, prompt: list[int], widths: list[int], reps: int
                ) -> dict[int, float]:
    """Median ms of a verify of each width at len(prompt) tokens of context."""
    engine.target.prefill(prompt)
    times = verify_times({"chosen": (engine.target, None)}, widths, reps)
    return {n: times[(n, "chosen")] for n in widths}


def served_together(engine: Engine, text: list[int], size: int, n: int, max_tokens: int
                    ) -> None:
    """n requests in one batch, stepped until all end (each in its own slot). Each prompt is
    another `size`-token window of the text: on a routed target, copies of one request would
    route every row of a step to the same experts, which no server's mix of users does."""
    engine.batch.max_slots = max(engine.batch.max_slots, n)
    step = max(1, (len(text) - size) // n)
    seqs = [engine.new_decode(text[i * step:i * step + size], max_tokens=max_tokens,
                              request_id=f"together-{n}-{i}") for i in range(n)]
    for seq in seqs:
        if not engine.batch.add(seq):
            raise SystemExit(f"a request of the batch of {n} failed: {seq.error}")
    while not all(seq.finished for seq in seqs):
        engine.batch.step()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--arm", default="ngram", help="the arm that serves the request")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--together", default="",
                   help="after the request, serve N at once for each N (e.g. 2,4,8)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="also write the result here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as store:
        engine = Engine.load(args.model, arm=args.arm, store=store)
        if engine.speculator is None:
            raise SystemExit(f"arm {args.arm!r} plans no trees: nothing to estimate")
        text = engine.tokenizer.encode(TEXT.read_text())
        prompt = text[: args.prompt_tokens]
        reply = engine.generate_ids(prompt, max_tokens=args.max_tokens)
        together = [int(n) for n in args.together.split(",") if n]
        for n in together:
            served_together(engine, text, len(prompt), n, args.max_tokens)
        context = len(prompt) + len(reply.token_ids)
        est = estimates(engine, context)
        if len(est) < 2:
            raise SystemExit(f"the request measured {sorted(est)} only: ask for more tokens")
        widths = sorted(est)
        got = measured_ms(engine, (prompt + list(reply.token_ids))[:context], widths, args.reps)
    errors = {n: est[n] / got[n] - 1 for n in widths}
    print(f"{cpuinfo.name()}, {engine.forward}, arm {args.arm}, one request of "
          f"{len(reply.token_ids)} tokens after {len(prompt)}"
          + (f", then {'/'.join(map(str, together))} at once" if together else "")
          + f"; context {context}")
    print("| rows | estimate ms | measured ms | error |\n|---|---|---|---|")
    for n in widths:
        print(f"| {n} | {est[n]:.2f} | {got[n]:.2f} | {100 * errors[n]:+.1f}% |")
    median = statistics.median(abs(e) for e in errors.values())
    print(f"median |error| {100 * median:.1f}% over {len(widths)} widths")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cpu": cpuinfo.name(), "forward": engine.forward, "model": args.model,
            "arm": args.arm, "together": together, "prompt_tokens": len(prompt),
            "reply_tokens": len(reply.token_ids),
            "context": context, "estimate_ms": est, "measured_ms": got, "errors": errors,
            "median_abs_error": median}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
