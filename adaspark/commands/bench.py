"""`adaspark bench`: the paper's evaluation protocol against our server's arms or any URL."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from adaspark.bench.conversations import SUBSETS, load_conversations
from adaspark.bench.runner import run_bench
from adaspark.bench.servers import parse_external, plan_arms
from adaspark.errors import UserError
from adaspark.sampling import SamplingParams
from adaspark.scheduler.arm import Arm

DEFAULT_CONVERSATIONS = "../shared/data/eval/conversations.jsonl"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=Path, default=Path(DEFAULT_CONVERSATIONS),
                        help="conversations JSONL (default: %(default)s)")
    parser.add_argument("--arms", default="",
                        help=f"comma-separated: {', '.join(Arm.BASES)} (modifiers joined "
                             f"with '+': {', '.join(Arm.MODIFIERS)}; e.g. adaspark+gate), or a "
                             "--url name; adaspark runs first and again last")
    parser.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                        help="an external OpenAI-compatible server as an arm (repeatable)")
    parser.add_argument("--cap", type=int, default=1024, help="max tokens per reply")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"),
                        help="results directory; an existing one is resumed")
    parser.add_argument("--subset", choices=sorted(SUBSETS),
                        help="short: first two turns of the first conversation of each source; "
                             "first-turns: the first turn of every conversation")
    parser.add_argument("--once", action="store_true",
                        help="run adaspark once instead of before and after the other arms")
    parser.add_argument("--serve-args", default="",
                        help="extra arguments for every `adaspark serve` (e.g. '--model PATH')")
    parser.add_argument("--health-timeout", type=float, default=600.0,
                        help="seconds to wait for a started server's /health")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (0, the paper's protocol: greedy)")
    parser.add_argument("--seed", type=int, default=0,
                        help="base seed when sampling: each request gets one derived from it "
                             "and its conversation turn, the same for every arm")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds, so the arm's server is stopped on the way out


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if args.cap < 1:
        raise UserError("--cap must be at least 1")
    SamplingParams(temperature=args.temperature, seed=args.seed).check()
    external = parse_external(args.url)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms and not external:
        raise UserError("no arms: give --arms and/or --url NAME=URL")
    runs = plan_arms(arms, external, repeat_adaspark=not args.once)
    conversations = load_conversations(args.conversations)
    if args.subset:
        conversations = SUBSETS[args.subset](conversations)
    out = run_bench(
        conversations,
        runs,
        args.out,
        cap=args.cap,
        conversations_path=args.conversations,
        subset=args.subset,
        serve_args=shlex.split(args.serve_args),
        health_timeout_s=args.health_timeout,
        argv=["adaspark", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else None,
        progress=not args.no_progress,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(f"results in {out}; tables: adaspark report {out}")
    return 0
