"""A/B of the native build against the same sources at another git revision, in one process.

    .venv/bin/python benchmarks/native_ab.py [--base REV] [--widths 1,2,5,8,16] [--context 300]
                                             [--reps 40] [--threads 2] [--prefill 500]
                                             [--model FILE] [--json FILE]

The native sources (adaspark/model/native/*.cpp, *.h) at REV (default HEAD) are built once
into the cache folder as a module of their own name, beside the working tree's build
(scripts/setup.sh); both load the embedded model and the shipped drafter and prefill the same
`--context` tokens of text. Then, interleaved (A B, B A, ...) so that a machine speeding up or
slowing down affects both alike: a verify of each width (a chain, the drafter's taps, forward and
head), the head alone on real final-normed rows, one draft, the drafter's catch-up of the
context's last 256 rows (where the context holds them), and with `--prefill N` a prefill of
the text's first N tokens from slot 0 (a chain of N rows in one forward), and with `--many N` a
continuous-batching step of N plain decodes (N sequences, one row each, contexts spread over
half to one and a half `--context`: gen-data's and the server's step). Prints medians, the
ratio new / base, and whether the two builds' outputs (argmax, draft candidates) are equal: a change
meant to keep the arithmetic must print `same`. `--model` times another (non-hybrid) GGUF
without a drafter: verify, head and prefill over fixed token ids. Timing lives here, never in
tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from adaspark import cpuinfo
from adaspark.model import native
from adaspark.model.gguf import read_gguf
from adaspark.model.native.build import compile_module
from adaspark.model.native.paths import HERE
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import load_speculator

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "README.md"  # real text, so the final-normed rows are a model's own


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision of the base sources")
    p.add_argument("--widths", default="1,2,5,8,16", help="verify rows to time")
    p.add_argument("--context", type=int, default=300, help="committed tokens before the rows")
    p.add_argument("--reps", type=int, default=40, help="interleaved repetitions")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--prefill", type=int, default=0,
                   help="also time one forward of this many rows from slot 0 (0: none)")
    p.add_argument("--many", type=int, default=0,
                   help="also time a step of this many sequences, one row each (0: none)")
    p.add_argument("--model", metavar="FILE",
                   help="another GGUF, timed without a drafter (default: the embedded model)")
    p.add_argument("--json", metavar="FILE", help="also write the medians here")
    return p.parse_args(argv)


def build_base(rev: str, isa: str) -> ModuleType:
    """The native sources at `rev`, built (once per revision) as adaspark_native_<isa>_ab."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", rev],
                         check=True, capture_output=True, text=True).stdout.strip()
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "adaspark" / "ab"
    src, out = root / f"src-{sha}", root / f"build-{sha}-{isa}"
    rel = HERE.relative_to(REPO)
    names = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{sha}:{rel}"],
                           check=True, capture_output=True, text=True).stdout.split()
    src.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith((".cpp", ".h")):
            blob = subprocess.run(["git", "-C", str(REPO), "show", f"{sha}:{rel}/{name}"],
                                  check=True, capture_output=True).stdout
            (src / name).write_bytes(blob)
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    print(f"building the native sources at {rev} ({sha}) for {isa} ...", file=sys.stderr)
    name = f"adaspark_native_{isa}_ab"
    module = compile_module(name, src / "module.cpp", out, isa)
    sys.modules[name] = module
    return module


def base_and_new(rev: str, isa: str) -> dict[str, ModuleType]:
    """{"base": the sources at `rev` built for `isa`, "new": the working tree's build of it}."""
    new, why = native.load_isa(isa)
    if new is None:
        raise SystemExit(f"{isa}: {why}")
    return {"base": build_base(rev, isa), "new": new}


def with_module(module: ModuleType, path: Path, gguf, tok: Tokenizer | None,
                context: list[int], max_context: int | None = None):
    """Target and drafter (none without `tok`) on `module`, the context prefilled into both."""
    load = native.load
    native.load = lambda: (module, "")
    try:
        target = Transformer(gguf, precision="fast", max_context=max_context)
        spec = tok and load_speculator(target, path, tok.stop_ids, ModelOptions(
            arm="adaspark", store=Path(tempfile.mkdtemp(prefix="adaspark-ab-")), fresh=True))
    finally:
        native.load = load
    if target.native is None:
        raise SystemExit("the native forward did not load on this model")
    if target.config.conv_layers:
        raise SystemExit("a hybrid's conv layers need their state: time it with verify_cost.py")
    if not spec:
        target.prefill(context)
        return target, None, None
    out = target.prefill(context, tap_layers=spec.drafter.tap_layers)
    spec.drafter.observe(out.hiddens)
    return target, spec.drafter, out.hiddens


def verify_picks(target: Transformer, chain: list[int], taps) -> list[int]:
    n = len(chain)
    return target.verify(chain, np.arange(n), np.tril(np.ones((n, n), dtype=bool)),
                         tap_layers=taps).argmax.tolist()


def head_picks(target: Transformer, rows: torch.Tensor) -> list[int]:
    return target.native.head(rows)[1].tolist()


def prefill_rows(target: Transformer, tokens: list[int]) -> bytes:
    """One native forward of `tokens` from slot 0, a chain; its final-normed rows' bytes (the
    tokens are the context's own, so the slots it rewrites get their K/V back bit for bit)."""
    n = len(tokens)
    out = target.native.forward(target.cache.k, target.cache.v, torch.tensor(tokens),
                                torch.arange(n), 0, torch.ones(n, n, dtype=torch.bool).tril(), [])
    return out[0].numpy().tobytes()


def draft_candidates(drafter, anchor: int) -> list[list[int]]:
    return drafter.draft(anchor).topk_ids.tolist()


def many_caches(target: Transformer, ids: list[int], n: int, context: int) -> list:
    """n more caches holding the text's first context/2 .. 3 context/2 tokens."""
    caches = []
    for s in range(n):
        cache = target.new_cache()
        with target.using(cache):
            target.prefill(ids[:max(1, int(context * (0.5 + s / max(1, n - 1))))])
        caches.append(cache)
    return caches


def step_many(target: Transformer, caches: list, token: int) -> list[int]:
    """One row each at the end of its cache (written, not committed: the next call rewrites it)."""
    one = ([token], np.array([0]), np.array([[True]]))
    return target.verify_many(caches, [one] * len(caches)).argmax.tolist()


CATCH_UP = 256  # rows of a catch-up: a prompt's features appended before its first draft


def catch_up(drafter, taps: dict) -> bytes:
    """The drafter's features of the context's last CATCH_UP rows (`taps`: the context's)
    appended in one call, what a request's first draft pays first; the keys' bytes."""
    n = drafter.length
    drafter.truncate(n - CATCH_UP)
    drafter.observe({i: h[n - CATCH_UP:n] for i, h in taps.items()})
    cache = drafter.cache
    return cache.k[:, :, n - CATCH_UP:n].numpy().tobytes()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    new, why = native.load()
    if new is None:
        raise SystemExit(f"no native build of the working tree: {why}")
    base = build_base(args.base, new.__name__.removeprefix("adaspark_native_"))  # its build
    path = resolve_model(args.model)
    gguf = read_gguf(path)
    if args.model:  # fixed ids: a synthetic file's vocabulary has no text
        tok, ids = None, [(13 * i) % 1000 + 100 for i in range(max(args.context + 64,
                                                                   args.prefill))]
    else:
        tok = Tokenizer.from_gguf(gguf)
        ids = tok.encode(TEXT.read_text(encoding="utf-8"))
    longest = (args.context * 3 + 1) // 2 if args.many else 0
    if len(ids) < max(args.context + 16, args.prefill, longest):
        raise SystemExit(f"{TEXT} holds {len(ids)} tokens; --context at most {len(ids) - 16} "
                         f"({len(ids) * 2 // 3} with --many), --prefill at most {len(ids)}")
    # with --many, caches sized like gen-data's (a reply's room past the longest context)
    room = max(1024, longest + 256, args.prefill) if args.many else None
    arms = {arm: with_module(module, path, gguf, tok, ids[:args.context], room)
            for arm, module in (("base", base), ("new", new))}
    many = {arm: many_caches(arms[arm][0], ids, args.many, args.context) for arm in arms
            if args.many}
    widths = [int(w) for w in args.widths.split(",")]
    rows = ids[args.context:args.context + max(widths)]
    target, drafter, _ = arms["base"]
    with torch.no_grad():  # final-normed rows of real text for the head alone
        finals = target.native.forward(target.cache.k, target.cache.v, torch.tensor(rows),
                                       torch.arange(len(rows)) + args.context, args.context,
                                       torch.ones(len(rows), len(rows), dtype=torch.bool).tril(),
                                       [])[0]
    times: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list] = {}

    def timed(arm: str, what: str, f, *args):
        start = time.perf_counter()
        out = f(*args)
        times.setdefault((arm, what), []).append(time.perf_counter() - start)
        outputs.setdefault((arm, what), out)

    for rep in range(args.reps):
        for arm in (("base", "new") if rep % 2 == 0 else ("new", "base")):
            target, drafter, taps = arms[arm]
            for n in widths:
                timed(arm, f"verify {n}", verify_picks, target, rows[:n],
                      drafter.tap_layers if drafter else [])
            for n in (1, 5, 8):
                timed(arm, f"head {n}", head_picks, target, finals[:n])
            if drafter:
                timed(arm, "draft", draft_candidates, drafter, rows[0])
            if drafter and args.context >= CATCH_UP:
                timed(arm, f"catch-up {CATCH_UP}", catch_up, drafter, taps)
            if args.prefill:
                timed(arm, f"prefill {args.prefill}", prefill_rows, target, ids[:args.prefill])
            if args.many:
                timed(arm, f"{args.many} sequences x 1 row", step_many, target, many[arm], rows[0])
    medians = {what: {arm: 1000 * statistics.median(times[(arm, what)]) for arm in arms}
               for what in dict.fromkeys(w for _, w in times)}
    print(f"{cpuinfo.name()}, torch threads {torch.get_num_threads()}, base {args.base}, "
          f"context {args.context}, {args.reps} interleaved reps; median ms\n")
    print("| call | base | new | new / base | outputs |\n|---|---|---|---|---|")
    for what, m in medians.items():
        same = outputs[("base", what)] == outputs[("new", what)]
        print(f"| {what} | {m['base']:.3f} | {m['new']:.3f} | {m['new'] / m['base']:.3f} | "
              f"{'same' if same else 'differ'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpuinfo.name(), "args": vars(args),
                                               "median_ms": medians}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
