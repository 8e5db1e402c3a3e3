"""`adaspark sim`: the scheduler on a cost curve, against every pinned width, with no model."""

from __future__ import annotations

import argparse
import json

from adaspark.errors import UserError
from adaspark.options import arm_type


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list-curves", action="store_true", help="name the shipped curves")
    parser.add_argument("--curve", help="shipped curve name, or a curve JSON file")
    parser.add_argument("--round-log", help="a recorded round log (JSON lines): simulate on the "
                        "verify times it measured instead of a curve")
    parser.add_argument("--requests", type=int, default=24, help="requests per arm (default 24)")
    parser.add_argument("--seed", type=int, default=0, help="seed of text, drafter and noise")
    parser.add_argument("--widths", help="pinned widths to sweep, comma-separated "
                        "(default: the ladder and a few widths between)")
    parser.add_argument("--arm", default="adaspark", type=arm_type,
                        help="the adaptive arm and its switches, e.g. adaspark,ratio "
                        "(the pinned arms are ARM:N)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes running arms at once (default: one per CPU)")
    parser.add_argument("--streams", help="multi-request mode: N request streams sharing one "
                        "verify call per step, comma-separated counts (e.g. 1,2,4,8)")
    parser.add_argument("--policies", help="multi-request mode's row policies, comma-separated "
                        "(default ar,fixed:4,fixed:8,solo,shared)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="multi-request mode: simulated seconds per run (default 20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _widths(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        widths = tuple(sorted({int(w) for w in text.split(",") if w.strip()}))
    except ValueError:
        raise UserError(f"--widths must be comma-separated integers, got {text!r}") from None
    if not widths or widths[0] < 1 or widths[-1] > 64:
        raise UserError(f"--widths must lie in 1..64, got {text!r}")
    return widths


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise UserError(f"--streams must be comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--streams must be at least 1 each, got {text!r}")
    return counts


def _run_multi(args: argparse.Namespace, curve) -> int:
    from adaspark.sim.multi import DEFAULT_POLICIES, DEFAULT_SECONDS, format_table, multi_sweep

    policies = (tuple(p.strip() for p in args.policies.split(",") if p.strip())
                if args.policies else DEFAULT_POLICIES)
    seconds = DEFAULT_SECONDS if args.seconds is None else args.seconds
    if not seconds > 0:
        raise UserError(f"--seconds must be positive, got {args.seconds}")
    rows = multi_sweep(curve, _counts(args.streams), policies, seconds, args.seed)
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{seconds:g} simulated seconds per run, seed {args.seed}")
        print(format_table(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    from adaspark.sim.curves import curve_from_round_log, curve_names, load_curve
    from adaspark.sim.run import PINNED_WIDTHS, sweep

    if args.list_curves:
        for name in curve_names():
            print(f"{name:14s} {load_curve(name).description}")
        return 0
    if bool(args.curve) == bool(args.round_log):
        raise UserError("give one of --curve NAME (see --list-curves) or --round-log FILE")
    if args.requests < 1:
        raise UserError(f"--requests must be at least 1, got {args.requests}")
    curve = load_curve(args.curve) if args.curve else curve_from_round_log(args.round_log)
    if args.streams:
        return _run_multi(args, curve)
    widths = _widths(args.widths) or PINNED_WIDTHS
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    result = sweep(curve, requests=args.requests, seed=args.seed, widths=widths, arm=args.arm,
                   workers=args.workers)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"curve {result['curve']}: {args.requests} requests, seed {args.seed}")
    print(f"  AdaSpark      {result['adaspark']:8.2f} tok/s")
    for n, rate in result["pinned"].items():
        mark = "  <- best pinned" if int(n) == result["best_pinned"] else ""
        share = rate / result["adaspark"]
        print(f"  pinned {n:>3s}    {rate:8.2f} tok/s  ({share:.3f}x AdaSpark){mark}")
    print(f"  AdaSpark / best pinned: {result['ratio_to_best']:.4f}")
    print(f"  widths chosen: {result['widths_chosen']}")
    if result["cost_error_median"] is not None:
        print(f"  cost model median |error|, second half: {100 * result['cost_error_median']:.2f}%")
    print(f"  AdaSpark rounds by kind: {result['rounds_by_kind']}")
    if result["logloss_fitted"] is not None:
        print(f"  log loss per label: fitted {result['logloss_fitted']:.4f}, "
              f"head-based {result['logloss_head']:.4f}")
    return 0
