"""The cold start in the simulator: arms against `ar` from an empty store on short first turns.

    .venv/bin/python -m adaspark.sim.coldstart --curve cpu-avx2 [--requests 10] [--seeds 5]
        [--arms adaspark,gate adaspark,gate,ladder ...] [--world sim|weak|nopay]
        [--reply 100,256] [--json]

Each seed is a fresh world and every arm starts from an empty store on it (common random
numbers, as `adaspark sim`). Per arm: the geometric mean over requests of its decode rate over
`ar`'s on the same request, for the first three requests and for all of them, the worst request,
and what its probe rounds lost: their time beyond what `ar` would have spent on their tokens (at
`ar`'s time per token on that request), as a share of the arm's decode time.

Worlds: `sim` is the simulator's drafter; `weak` a drafter right less often, on text that repeats
less, where speculation about breaks even (issue 22's AVX2 machine); `nopay` one that is almost
never right, where every drafted round loses.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace

from adaspark.scheduler.arm import Arm
from adaspark.sim.curves import CostCurve, load_curve
from adaspark.sim.process import World, WorldParams
from adaspark.sim.run import ArmResult, run_arm

FIRST_TURNS = WorldParams(reply=(100, 256))  # first turns under a 256-token cap
WORLDS = {
    "sim": FIRST_TURNS,
    "weak": replace(FIRST_TURNS, ease_mean=-0.6, repeat_rate=(0.02, 0.2)),
    "nopay": replace(FIRST_TURNS, ease_mean=-1.5, repeat_rate=(0.02, 0.1)),
}
DEFAULT_ARMS = ("adaspark,gate", "adaspark,gate,ladder", "adaspark")


@dataclass
class ColdStart:
    arm: str
    first3: float  # geometric mean of per-request rate / ar's, first three requests per seed
    overall: float  # the same over every request
    worst: float  # the lowest per-request ratio
    probe_loss: float  # probe rounds' time beyond ar's for their tokens / the arm's decode time


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _compare(arm: ArmResult, ar: ArmResult) -> tuple[list[float], float, float]:
    ratios, loss, time = [], 0.0, 0.0
    for mine, base in zip(arm.per_request, ar.per_request, strict=True):
        ratios.append(mine.rate / base.rate)
        loss += mine.probe_s - mine.probe_tokens / base.rate
        time += mine.time_s
    return ratios, loss, time


def cold_start(curve: CostCurve, arms=DEFAULT_ARMS, requests: int = 10, seeds: int = 5,
               params: WorldParams = FIRST_TURNS) -> list[ColdStart]:
    out = []
    bases = [run_arm(curve, World(s, params), Arm.parse("ar"), requests) for s in range(seeds)]
    for name in arms:
        first, every, loss, time = [], [], 0.0, 0.0
        for seed, base in enumerate(bases):
            result = run_arm(curve, World(seed, params), Arm.parse(name), requests)
            ratios, seed_loss, seed_time = _compare(result, base)
            first += ratios[:3]
            every += ratios
            loss, time = loss + seed_loss, time + seed_time
        out.append(ColdStart(Arm.parse(name).name, _geomean(first), _geomean(every), min(every),
                             loss / time))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaspark.sim.coldstart",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--curve", default="cpu-avx2")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--world", choices=sorted(WORLDS), default=None,
                        help="one world (default: all three)")
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS))
    parser.add_argument("--reply", default="100,256",
                        help="reply lengths, lowest,highest (default: first turns, cap 256)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    curve = load_curve(args.curve)
    low, high = (int(x) for x in args.reply.split(","))
    rows = []
    for world in [args.world] if args.world else sorted(WORLDS):
        params = replace(WORLDS[world], reply=(low, high))
        for r in cold_start(curve, args.arms, args.requests, args.seeds, params):
            rows.append({"world": world, **r.__dict__})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"curve {curve.name}: {args.requests} requests (replies {low}-{high} tokens) x "
          f"{args.seeds} seeds from an empty store; rate over ar's per request (geometric mean)")
    print(f"{'world':6s} {'arm':24s} {'first 3':>8s} {'all':>7s} {'worst':>7s} "
          f"{'probe loss':>11s}")
    for r in rows:
        print(f"{r['world']:6s} {r['arm']:24s} {r['first3']:8.3f} {r['overall']:7.3f} "
              f"{r['worst']:7.3f} {100 * r['probe_loss']:10.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
