#!/bin/bash
# Stage 3 against the shipped drafter on all the evaluation's first turns from empty stores,
# one interleaved pass, the machine's best build (then AVX2 if time allows), nothing else running.
set -e
out=${1:-docs/results/zen5-s34}
s3=data/drafter/stages/s33-stage3
arms="ar,adaspark+no-ngram,adaspark+no-ngram@$s3,adaspark+gate,adaspark+gate@$s3"
for build in ${BUILDS:-avx512}; do
  echo "$(date -u +%T) first turns $build start"
  ADASPARK_NATIVE=$build .venv/bin/python benchmarks/arms.py --subset first-turns --arms "$arms" \
    --runs 1 --threads 2 --json "$out/first-turns-s3-$build.json" > "$out/first-turns-s3-$build.txt" 2>&1
  echo "$(date -u +%T) first turns $build done"
done
