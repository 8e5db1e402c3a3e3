#!/usr/bin/env bash
# Issue 43's "no slower": benchmarks/arms.py in two worktrees (the base commit and the one-loop
# commit), alternated A B B A A B, one process per run; ab_table.py reads the JSONs.
#   bash docs/results/spr-s23/loop_ab.sh BASE_DIR NEW_DIR OUT [extra arms.py args]
set -euo pipefail
BASE=$1 NEW=$2 OUT=$3; shift 3
ARMS=${ARMS:-ar,adaspark+gate,adaspark,ngram,chain3}
CONV=$(cd "$(dirname "$0")/../../../.." && pwd)/shared/data/eval/conversations.jsonl
mkdir -p "$OUT"
for i in 1 2 3; do
  if [ $((i % 2)) = 1 ]; then ORDER="base new"; else ORDER="new base"; fi
  for rev in $ORDER; do
    if [ "$rev" = base ]; then DIR=$BASE; else DIR=$NEW; fi
    (cd "$DIR" && PYTHONPATH=$PWD .venv/bin/python benchmarks/arms.py --arms "$ARMS" --runs 1 \
      --threads 2 --max-tokens 256 --conversations "$CONV" --json "$OUT/$rev-$i.json" "$@" \
      > "$OUT/$rev-$i.txt" 2>&1)
  done
done
python3 "$(dirname "$0")/ab_table.py" "$OUT"
