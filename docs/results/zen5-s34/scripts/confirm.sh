#!/bin/bash
# Stage 4 against the shipped drafter once more: the 45 first turns (one pass) and a second
# short-subset pass, `avx512`, nothing else running.
cd /work/main
R=docs/results/zen5-s34
S4=data/drafter/stages/s34-stage4
log() { echo "$(date -u +%T) $*" >> $R/run-log.txt; }
log "confirm.sh start"
.venv/bin/python benchmarks/arms.py --subset first-turns --runs 1 --threads 2 \
  --arms "ar,adaspark+no-ngram,adaspark+no-ngram@$S4,adaspark+gate,adaspark+gate@$S4" \
  --json $R/first-turns-s4-avx512.json > $R/first-turns-s4-avx512.txt 2>&1
log "first turns done"
.venv/bin/python benchmarks/arms.py --runs 3 --threads 2 \
  --arms "ar,adaspark+no-ngram,adaspark+no-ngram@$S4,adaspark+gate,adaspark+gate@$S4" \
  --json $R/arms-s4-avx512-b.json > $R/arms-s4-avx512-b.txt 2>&1
log "confirm.sh done"
