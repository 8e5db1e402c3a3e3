#!/bin/bash
# Session 33's measurements after the training stage (nothing else running): the stage's
# evaluation, then the Markov bound's second level on and off, interleaved.
cd /work/main
R=docs/results/zen5-s33
CK=${CK:-/root/drafter-s33/checkpoint}
log() { echo "$(date +%T) $*" >> $R/run-log.txt; }
log "post.sh start (stage 3 checkpoint $CK)"
mkdir -p $R/training $R/markov
for name in s33:$CK s32:data/drafter/stages/s32-stage2 shipped:adaspark/assets/drafters/smollm2-135m-instruct-dspark; do
  OMP_NUM_THREADS=2 .venv/bin/adaspark eval-drafter --work /root/eval-s31 --drafter ${name#*:} \
    --threads 2 --json > $R/training/eval-${name%%:*}-torch.json 2> $R/training/eval-${name%%:*}-torch.err
done
for isa in avx512 avx2; do
  for name in s33:$CK shipped:adaspark/assets/drafters/smollm2-135m-instruct-dspark; do
    ADASPARK_NATIVE=$isa OMP_NUM_THREADS=2 .venv/bin/adaspark eval-drafter --work /root/eval-s31 \
      --drafter ${name#*:} --threads 2 --native --json \
      > $R/training/eval-${name%%:*}-native-$isa.json 2> $R/training/eval-${name%%:*}-native-$isa.err
  done
done
log "evaluations done; draft_profile A/B next"
for rep in 1 2; do
  for isa in avx2 avx512; do
    for d in $CK shipped; do
      tag=$(basename $(dirname $d))-$isa-r$rep; [ $d = shipped ] && tag=shipped-$isa-r$rep
      args=(); [ $d != shipped ] && args=(--drafter $d)
      for arm in on off; do
        extra=(); [ $arm = off ] && extra=(--no-markov-refine)
        ADASPARK_NATIVE=$isa OMP_NUM_THREADS=2 .venv/bin/python benchmarks/draft_profile.py \
          "${args[@]}" "${extra[@]}" --json > $R/markov/profile-$tag-$arm.json 2>&1
      done
    done
  done
done
log "post.sh done"
