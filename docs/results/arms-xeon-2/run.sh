#!/bin/bash
# The session-13 figures, run in one quiet window, one job at a time (nothing else ran).
set -x
cd /work/main
S=~/.cache/adaspark/synthetic
A=docs/results/arms-xeon-2; C=docs/results/concurrency; K=docs/results/kquants
mkdir -p $A
lscpu > $A/cpu.txt
uptime > $A/load-before.txt
P=.venv/bin/python
for isa in avx2 avx512; do
  ADASPARK_NATIVE=$isa $P benchmarks/verify_cost.py --quick --reps 7 --threads 2 --json > $A/verify_cost-$isa.json 2> $A/verify_cost-$isa.log
done
for isa in avx2 avx512; do
  ADASPARK_NATIVE=$isa $P benchmarks/arms.py --arms ar,adaspark+gate,adaspark,chain3 --runs 3 --threads 2 --json $A/arms-$isa.json > $A/arms-$isa.txt 2>&1
done
# 32 requests per N: with 8, the last wave of 4 clients runs a request or two alone for much of
# its time, and the aggregate measures that tail more than 4 clients at once
$P benchmarks/concurrency.py --arms ar,adaspark+gate,llama-server --clients 1,2,4 --requests 32 --cap 64 --json $C/clients-1-2-4-v3.json > $C/clients-1-2-4-v3.txt 2>&1
$P benchmarks/vs_llamacpp.py --model $S/smollm2-135m-F16.gguf --runs 2 --prompts 3 --max-tokens 128 --out $K/vs_llamacpp-smollm2-F16-v2.json > $K/vs_llamacpp-smollm2-F16-v2.txt 2>&1
for isa in avx2 avx512; do
  ADASPARK_NATIVE=$isa $P benchmarks/arms.py --subset first-turns --arms ar,adaspark+gate --runs 1 --threads 2 --json $A/first-turns-$isa.json > $A/first-turns-$isa.txt 2>&1
done
uptime > $A/load-after.txt
echo DONE
