#!/bin/bash
# The arms with arms.py's per-conversation interleaving (ab712b6): the short subset, 3 runs, and
# the 45 first turns, one pass, on both builds; alone.
R=docs/results/zen5-s36/arms
log() { echo "$(date +%T) $*" >> docs/results/zen5-s36/arms/log.txt; }
for isa in avx512 avx2; do
  log "short $isa"
  ADASPARK_NATIVE=$isa .venv/bin/python benchmarks/arms.py --arms ar,adaspark+gate,adaspark,ngram,adaspark+no-ngram \
    --runs 3 --threads 2 --json $R/short-$isa.json > $R/short-$isa.txt 2>&1
done
for isa in avx512 avx2; do
  log "first turns $isa"
  ADASPARK_NATIVE=$isa .venv/bin/python benchmarks/arms.py --arms ar,adaspark+gate,adaspark+no-ngram \
    --runs 1 --threads 2 --subset first-turns --json $R/first-turns-$isa.json > $R/first-turns-$isa.txt 2>&1
done
log done
