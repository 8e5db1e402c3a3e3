#!/bin/bash
# The session-12 figures, run in one quiet window, one job at a time (nothing else ran).
set -x
cd /work/main
S=~/.cache/adaspark/synthetic
A=docs/results/arms-xeon; N=docs/results/ngram-arm; C=docs/results/concurrency; K=docs/results/kquants
mkdir -p $A $N $C $K
lscpu > $A/cpu.txt; for d in $N $C $K; do cp $A/cpu.txt $d/cpu.txt; done
uptime > $A/load-before.txt
P=.venv/bin/python
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa $P benchmarks/verify_cost.py --quick --reps 7 --threads 2 --json > $A/verify_cost-$isa.json 2> $A/verify_cost-$isa.log
done
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa $P benchmarks/arms.py --arms ar,adaspark+gate,adaspark,chain3 --runs 3 --threads 2 --json $A/arms-$isa.json > $A/arms-$isa.txt 2>&1
done
$P benchmarks/concurrency.py --arms ar,adaspark+gate,llama-server --clients 1,4 --requests 8 --cap 64 --json $C/clients-1-4-v2.json > $C/clients-1-4-v2.txt 2>&1
$P benchmarks/arms.py --model $S/smollm2-135m-Q4_K_M.gguf --subset first-turns --arms ar,ngram --runs 2 --threads 2 --json $N/first-turns-Q4_K_M.json > $N/first-turns-Q4_K_M.txt 2>&1
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa $P benchmarks/arms.py --subset first-turns --arms ar,adaspark+gate --runs 1 --threads 2 --json $A/first-turns-$isa.json > $A/first-turns-$isa.txt 2>&1
done
$P benchmarks/concurrency.py --arms ar,adaspark+gate --clients 8 --requests 8 --cap 64 --mixed 200 --json $C/mixed-200.json > $C/mixed-200.txt 2>&1
for ft in Q5_K_M Q8_0 F16; do
  $P benchmarks/vs_llamacpp.py --model $S/smollm2-135m-$ft.gguf --runs 2 --prompts 3 --max-tokens 128 --out $K/vs_llamacpp-smollm2-$ft.json > $K/vs_llamacpp-smollm2-$ft.txt 2>&1
done
$P benchmarks/vs_llamacpp.py --model ~/.cache/adaspark/models/gemma-3-270m-q4_k_m.gguf --raw --runs 2 --prompts 3 --max-tokens 128 --out $K/vs_llamacpp-gemma3-270m-raw.json > $K/vs_llamacpp-gemma3-270m-raw.txt 2>&1
uptime > $A/load-after.txt
echo DONE
