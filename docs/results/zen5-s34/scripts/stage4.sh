#!/bin/bash
# Drafter stage 4: from stage 3 on tap shards 130-175 (unseen by every stage), shard 0 held out
# (hard-linked from stage 3's work directory: same replies, same taps). Nothing else runs.
set -e
cd /work/main
W=/root/drafter-s34
mkdir -p $W/data/train
[ -e $W/data/train/shard_00000.safetensors ] || \
  ln /root/drafter-s33/data/train/shard_00000.safetensors $W/data/train/
OMP_NUM_THREADS=2 .venv/bin/adaspark train-drafter --work $W --replies data/drafter/replies \
  --init-from data/drafter/stages/s33-stage3 --tap-shards 0,130-175 --heldout-shards 0 \
  --vocab-size 12288 --layers 1 --qk-norm --rope-style neox --markov-rank 128 --steps 60000 \
  --anchors 32 --seqs-per-step 4 --val-every 500 --minutes ${MINUTES:-50} --threads 2 \
  > $W/run.out 2>&1
