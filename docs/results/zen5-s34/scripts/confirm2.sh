#!/bin/bash
# The 45 first turns again, the shipped drafter against stage 4: a second `avx512` pass and an
# `avx2` pass, nothing else running.
cd /work/main
R=docs/results/zen5-s34
S4=data/drafter/stages/s34-stage4
log() { echo "$(date -u +%T) $*" >> $R/run-log.txt; }
for build in avx512 avx2; do
  log "confirm2.sh first turns $build start"
  ADASPARK_NATIVE=$build .venv/bin/python benchmarks/arms.py --subset first-turns --runs 1 --threads 2 \
    --arms "ar,adaspark+no-ngram,adaspark+no-ngram@$S4,adaspark+gate,adaspark+gate@$S4" \
    --json $R/first-turns-s4-$build-b.json > $R/first-turns-s4-$build-b.txt 2>&1
done
log "confirm2.sh done"
