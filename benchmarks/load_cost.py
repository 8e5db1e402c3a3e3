"""What loading a GGUF costs: wall time and peak resident memory, against the file's size.

    .venv/bin/python benchmarks/load_cost.py --model FILE [--model FILE ...] [--runs 2]
                                             [--arm ar] [--json FILE]

Each load runs in a fresh process (`Engine.load(FILE, arm=...)`, what `adaspark serve` does
before it answers), beside a fresh process that only imports the same modules: the load's peak
RSS (VmHWM) above the imports' is what the model itself holds at its worst. Load time is the
wall clock around Engine.load, file cache warm (a first untimed load reads the file in, so every
run after it sees the same page cache; a cold disk is the disk's figure, not the engine's).
One load at a time: two at once on two cores would time each other. Timing lives here, never
in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from adaspark import cpuinfo

CHILD = """
import json, sys, time
from adaspark.memory import resident_bytes as status
from adaspark.engine import Engine
from adaspark.model import native, transformer  # noqa: F401  (imports: the baseline)
out = {"base": status()}
if sys.argv[1] != "-":
    start = time.perf_counter()
    engine = Engine.load(sys.argv[1], arm=sys.argv[2])
    out.update(load_s=time.perf_counter() - start, after=status(), forward=engine.forward)
print(json.dumps(out))
"""


def fresh(model: str, arm: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), model, arm],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"loading {model} failed (exit {done.returncode}):\n"
                         f"{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def measure(model: Path, runs: int, arm: str) -> dict:
    fresh(str(model), arm)  # untimed: the file into the page cache
    imports = [fresh("-", arm)["base"]["VmHWM"] for _ in range(runs)]
    loads = [fresh(str(model), arm) for _ in range(runs)]
    base = statistics.median(imports)
    peaks = [r["after"]["VmHWM"] - base for r in loads]
    size = model.stat().st_size
    return {"model": str(model), "file_mb": size / 2**20, "forward": loads[0]["forward"],
            "load_s": [round(r["load_s"], 2) for r in loads],
            "load_s_median": statistics.median(r["load_s"] for r in loads),
            "imports_mb": base / 2**20,
            "peak_mb": [round(p / 2**20, 1) for p in peaks],
            "peak_over_file": statistics.median(peaks) / size}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="a GGUF (repeatable)")
    p.add_argument("--runs", type=int, default=2, help="timed loads per file")
    p.add_argument("--arm", default="ar", help="the arm loaded beside the target")
    p.add_argument("--json", metavar="FILE", help="also write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not os.path.exists("/proc/self/status"):
        raise SystemExit("reads /proc/self/status (Linux)")
    rows = []
    print("| file | MB | forward | load s (median) | peak RSS over imports, MB | / file |")
    print("|---|---|---|---|---|---|")
    for model in args.model:
        r = measure(Path(model).expanduser(), args.runs, args.arm)
        rows.append(r)
        print(f"| {Path(model).name} | {r['file_mb']:.0f} | {r['forward']} | "
              f"{r['load_s_median']:.2f} | {statistics.median(r['peak_mb']):.0f} | "
              f"{r['peak_over_file']:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpuinfo.name(), "arm": args.arm,
                                               "runs": args.runs, "files": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
