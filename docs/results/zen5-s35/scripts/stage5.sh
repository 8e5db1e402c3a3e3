#!/bin/bash
# Drafter stage 5: from stage 4 on tap shards 176-215 (unseen by every stage) and the tool-call
# shards 239-251 (stage 3 saw them; stage 4's window lacked them and ToolACE fell 2.33 -> 2.05),
# shard 0 held out (hard-linked from stage 3's work directory). Nothing else runs.
set -e
cd /work/main
W=/root/drafter-s35
mkdir -p $W/data/train
[ -e $W/data/train/shard_00000.safetensors ] || \
  ln /root/drafter-s33/data/train/shard_00000.safetensors $W/data/train/
OMP_NUM_THREADS=2 .venv/bin/adaspark train-drafter --work $W --replies data/drafter/replies \
  --init-from data/drafter/stages/s34-stage4 --tap-shards 0,176-215,239-251 --heldout-shards 0 \
  --vocab-size 12288 --layers 1 --qk-norm --rope-style neox --markov-rank 128 --steps 60000 \
  --anchors 32 --seqs-per-step 4 --val-every 500 --minutes ${MINUTES:-32} --threads 2 \
  > $W/run.out 2>&1
