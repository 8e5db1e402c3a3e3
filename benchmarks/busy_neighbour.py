"""Plain decode speed on a shared machine: a busy neighbour on one core, thread policies.

    .venv/bin/python benchmarks/busy_neighbour.py [--base REV] [--rounds 3] [--tokens 128]
                                                  [--threads 2] [--json FILE]

Each measurement is a child process (OpenMP reads its wait policy at start) that loads the
embedded model, prefills 32 tokens and times `--tokens` plain decode steps (1-row verify +
commit), calling `adaspark.threads.adapt()` before each step as the engine's decode loops do.
Conditions: the machine quiet, or one neighbour process spinning on a core; policies: `adaptive`
(the default: the thread governor), `spin` (every thread, OpenMP's spinning waits:
ADASPARK_THREADS pins the count) and `passive` (every thread, OMP_WAIT_POLICY=PASSIVE); builds:
the working tree's native build and, with --base, the native sources at REV (built as
benchmarks/native_ab.py does). Rounds interleave every combination, so drift affects all
alike; medians printed. Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPIN = "while True: pass"


def measure(base: str | None, tokens: int, n_threads: int) -> float:
    """In the child: tok/s of plain decode on the working tree's build, or REV's."""
    import torch

    from adaspark import threads as governor
    from adaspark.model import native
    from adaspark.model.sources import resolve_model
    from adaspark.model.transformer import Transformer

    torch.set_num_threads(n_threads)
    if base:
        sys.path.insert(0, str(HERE))
        from native_ab import build_base  # the same build of another revision's sources

        module = build_base(base, native.load()[0].__name__.removeprefix("adaspark_native_"))
        native.load = lambda: (module, "")
    model = Transformer.from_gguf(resolve_model(None), precision="fast", max_context=1024)
    token = int(model.prefill([(7 * i) % 1000 + 100 for i in range(32)]).argmax[-1])
    for _ in range(5):
        model.verify([token], [0], [[True]])
    start = time.perf_counter()
    for _ in range(tokens):
        governor.adapt()
        token = int(model.verify([token], [0], [[True]]).argmax[0])
        model.commit([0])
    return tokens / (time.perf_counter() - start)


def child(build: str, policy: str, args) -> float:
    env = dict(os.environ)
    env.pop("ADASPARK_THREADS", None)
    if policy != "adaptive":
        env["ADASPARK_THREADS"] = str(args.threads)
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    base = args.base if build == "base" else ""
    out = subprocess.run([sys.executable, __file__, "--child", base, "--tokens", str(args.tokens),
                          "--threads", str(args.threads)], env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="also the native sources at this git revision")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", metavar="REV", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(measure(args.child or None, args.tokens, args.threads))
        return 0
    from adaspark import cpuinfo

    builds = ["new", "base"] if args.base else ["new"]
    combos = list(itertools.product(("quiet", "busy"), ("adaptive", "spin", "passive"), builds))
    speeds: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for neighbour, policy, build in combos if r % 2 == 0 else combos[::-1]:
            spinner = (subprocess.Popen([sys.executable, "-c", SPIN]) if neighbour == "busy"
                       else None)
            try:
                speeds.setdefault((neighbour, policy, build), []).append(child(build, policy, args))
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    print(f"{cpuinfo.name()}, {args.threads} threads, {args.tokens} tokens, {args.rounds} "
          f"interleaved rounds; plain decode tok/s, median (all rounds)\n")
    print("| neighbour | policy | build | tok/s | rounds |\n|---|---|---|---|---|")
    rows = []
    for key in combos:
        v = speeds[key]
        name = f"base {args.base}" if key[2] == "base" else "working tree"
        print(f"| {key[0]} | {key[1]} | {name} | {statistics.median(v):.1f} | "
              f"{' / '.join(f'{x:.1f}' for x in v)} |")
        rows.append({"neighbour": key[0], "policy": key[1], "build": name, "tok_s": v})
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpuinfo.name(), "args": vars(args),
                                               "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
