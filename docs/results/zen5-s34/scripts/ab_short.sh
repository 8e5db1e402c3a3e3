#!/bin/bash
# Stage 3 against the shipped drafter end to end: the short subset, both builds, one after
# the other, nothing else running. Usage: bash ab_short.sh OUTDIR
set -e
out=${1:-docs/results/zen5-s34}
s3=data/drafter/stages/s33-stage3
arms="ar,adaspark+no-ngram,adaspark+no-ngram@$s3,adaspark+gate,adaspark+gate@$s3,adaspark,adaspark@$s3"
for build in avx512 avx2; do
  echo "$(date -u +%T) arms $build start"
  ADASPARK_NATIVE=$build .venv/bin/python benchmarks/arms.py --arms "$arms" --runs 3 --threads 2 \
    --json "$out/arms-s3-$build.json" > "$out/arms-s3-$build.txt" 2>&1
  echo "$(date -u +%T) arms $build done"
done
