import glob, json, statistics, sys
from collections import defaultdict
speed, tokens = defaultdict(list), defaultdict(dict)
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    rev = f.rsplit("/", 1)[1].split("-")[0]
    for arm, runs in json.load(open(f))["results"].items():
        for run in runs:
            speed[arm, rev].append(sum(r["decode_tokens"] for r in run) / sum(r["decode_s"] for r in run))
            tokens[arm].setdefault(rev, [r["tokens"] for r in run])
            assert tokens[arm][rev] == [r["tokens"] for r in run], (arm, rev, f)
ar = {rev: statistics.fmean(speed["ar", rev]) for rev in ("base", "new")}
print("| arm | base tok/s (runs) | new tok/s (runs) | new/base | x ar base | x ar new | same tokens as base | as ar |")
for arm in sorted({a for a, _ in speed}, key=lambda a: a != "ar"):
    b, n = speed[arm, "base"], speed[arm, "new"]
    print(f"| {arm} | {statistics.fmean(b):.1f} ({' / '.join(f'{x:.1f}' for x in b)}) | "
          f"{statistics.fmean(n):.1f} ({' / '.join(f'{x:.1f}' for x in n)}) | "
          f"{statistics.fmean(n) / statistics.fmean(b):.3f} | {statistics.fmean(b) / ar['base']:.3f} | "
          f"{statistics.fmean(n) / ar['new']:.3f} | {tokens[arm]['base'] == tokens[arm]['new']} | "
          f"{tokens[arm]['new'] == tokens['ar']['new']} |")
