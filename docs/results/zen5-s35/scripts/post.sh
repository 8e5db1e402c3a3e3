#!/bin/bash
# Session 35 after stage 5 (nothing else running): the Markov table against the bound's caps
# (draft_profile, both builds, stage 4 and the shipped drafter), stage 5's evaluation, then
# end to end: the shipped drafter, stage 4 and stage 5 in one interleaved run per build, short
# subset, and the 45 first turns on both builds.
cd /work/main
R=docs/results/zen5-s35
CK=${CK:-/root/drafter-s35/checkpoint}
S4=data/drafter/stages/s34-stage4
log() { echo "$(date -u +%T) $*" >> $R/run-log.txt; }
log "post.sh start (stage 5 checkpoint $CK)"
mkdir -p $R/profile $R/training
for isa in avx512 avx2; do
  for m in table bound; do
    for name in s4:$S4 shipped:adaspark/assets/drafters/smollm2-135m-instruct-dspark; do
      ADASPARK_NATIVE=$isa OMP_NUM_THREADS=2 .venv/bin/python benchmarks/draft_profile.py \
        --drafter ${name#*:} --markov $m > $R/profile/draft_profile-${name%%:*}-$m-$isa.txt 2>&1
    done
  done
  ADASPARK_NATIVE=$isa OMP_NUM_THREADS=2 .venv/bin/python benchmarks/draft_profile.py \
    --drafter $CK > $R/profile/draft_profile-s5-table-$isa.txt 2>&1
done
log "profiles done"
OMP_NUM_THREADS=2 .venv/bin/adaspark eval-drafter --work /root/eval-s31 --drafter $CK \
  --threads 2 --json > $R/training/eval-s35-torch.json 2> $R/training/eval-s35-torch.err
for isa in avx512 avx2; do
  for name in s5:$CK s4:$S4 shipped:adaspark/assets/drafters/smollm2-135m-instruct-dspark; do
    ADASPARK_NATIVE=$isa OMP_NUM_THREADS=2 .venv/bin/adaspark eval-drafter --work /root/eval-s31 \
      --drafter ${name#*:} --threads 2 --native --json \
      > $R/training/eval-${name%%:*}-native-$isa.json 2> $R/training/eval-${name%%:*}-native-$isa.err
  done
done
log "evaluations done; arms next"
arms="ar,adaspark+no-ngram,adaspark+no-ngram@$S4,adaspark+no-ngram@$CK,adaspark+gate,adaspark+gate@$S4,adaspark+gate@$CK"
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa .venv/bin/python benchmarks/arms.py --arms "$arms" --runs 3 --threads 2 \
    --json $R/arms-$isa.json > $R/arms-$isa.txt 2>&1
  log "arms short $isa done"
done
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa .venv/bin/python benchmarks/arms.py --arms "$arms" --runs 1 --threads 2 \
    --subset first-turns --json $R/first-turns-$isa.json > $R/first-turns-$isa.txt 2>&1
  log "first turns $isa done"
done
log "post.sh done"
