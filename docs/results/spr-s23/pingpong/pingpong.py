"""Two code trees' decode speed, finely alternated: one long-lived process per tree (the same
arm, its own empty store), each running the same few prompts when told, A B B A ..., so the
guest's drift (a third within minutes here) falls on both alike. Prints each turn's decode
tok/s (reply tokens after the first over the engine's decode seconds) and the median ratio.

    python pingpong.py ARM TURNS BASE_DIR NEW_DIR
"""

import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys, tempfile
from adaspark.engine import Engine
from adaspark.options import ModelOptions
eng = Engine.load(options=ModelOptions(arm=sys.argv[1], store=tempfile.mkdtemp()))
P = ["Explain how a refrigerator works, step by step.",
     "Write a short story about a lighthouse keeper.",
     "List ten tips for learning a new language, with a sentence on each.",
     "Summarise the causes of the French Revolution."]
print("ready", flush=True)
for line in sys.stdin:
    toks = secs = 0.0
    ids = []
    for p in P:
        g = eng.generate([{"role": "user", "content": p}], max_tokens=128)
        d = g.timings.as_dict(); toks += d["decode_tokens"]; secs += d["decode_s"]
        ids.append(g.token_ids)
    print(json.dumps({"tok_s": toks / secs, "ids": ids}), flush=True)
"""


def start(tree: str, arm: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.Popen([f"{tree}/.venv/bin/python", "-c", WORKER, arm], cwd=tree, env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def turn(p: subprocess.Popen) -> dict:
    p.stdin.write("go\n"); p.stdin.flush()
    return json.loads(p.stdout.readline())


def main() -> None:
    arm, turns, base, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    procs = {"base": start(base, arm), "new": start(new, arm)}
    for p in procs.values():
        turn(p)  # warm-up, not counted
    speed = {"base": [], "new": []}
    same = True
    for i in range(turns):
        order = ("base", "new") if i % 2 == 0 else ("new", "base")
        out = {rev: turn(procs[rev]) for rev in order}
        same &= out["base"]["ids"] == out["new"]["ids"]
        for rev in order:
            speed[rev].append(out[rev]["tok_s"])
        print(f"turn {i + 1}: base {speed['base'][-1]:.1f} new {speed['new'][-1]:.1f} tok/s",
              flush=True)
    ratios = [n / b for b, n in zip(speed["base"], speed["new"])]
    print(f"{arm}: median base {statistics.median(speed['base']):.1f}, new "
          f"{statistics.median(speed['new']):.1f} tok/s; new/base per turn: median "
          f"{statistics.median(ratios):.3f}, quartiles "
          f"{statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}"
          f"; same tokens every turn: {same}")
    for p in procs.values():
        p.stdin.close(); p.wait()


if __name__ == "__main__":
    main()
