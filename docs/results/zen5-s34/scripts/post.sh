#!/bin/bash
# Session 34's measurements after stage 4 (nothing else running): its evaluation (torch and
# native, both builds, the shipped drafter beside it), then end to end against stage 3 and
# the shipped drafter, short subset, both builds.
cd /work/main
R=docs/results/zen5-s34
CK=${CK:-/root/drafter-s34/checkpoint}
SHIPPED=adaspark/assets/drafters/smollm2-135m-instruct-dspark
log() { echo "$(date -u +%T) $*" >> $R/run-log.txt; }
log "post.sh start (stage 4 checkpoint $CK)"
mkdir -p $R/training
OMP_NUM_THREADS=2 .venv/bin/adaspark eval-drafter --work /root/eval-s31 --drafter $CK \
  --threads 2 --json > $R/training/eval-s34-torch.json 2> $R/training/eval-s34-torch.err
for isa in avx512 avx2; do
  for name in s34:$CK shipped:$SHIPPED; do
    ADASPARK_NATIVE=$isa OMP_NUM_THREADS=2 .venv/bin/adaspark eval-drafter --work /root/eval-s31 \
      --drafter ${name#*:} --threads 2 --native --json \
      > $R/training/eval-${name%%:*}-native-$isa.json 2> $R/training/eval-${name%%:*}-native-$isa.err
  done
done
log "evaluations done; arms next"
s3=data/drafter/stages/s33-stage3
arms="ar,adaspark+no-ngram,adaspark+no-ngram@$s3,adaspark+no-ngram@$CK,adaspark+gate,adaspark+gate@$s3,adaspark+gate@$CK"
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa .venv/bin/python benchmarks/arms.py --arms "$arms" --runs 3 --threads 2 \
    --json $R/arms-s4-$isa.json > $R/arms-s4-$isa.txt 2>&1
  log "arms $isa done"
done
log "post.sh done"
