#!/bin/bash
# The session-11 figures, run in one quiet window, one job at a time.
set -x
cd /work/main
S=~/.cache/adaspark/synthetic
K=docs/results/kquants; C=docs/results/concurrency
mkdir -p $K $C
lscpu > $K/cpu.txt; cp $K/cpu.txt $C/cpu.txt
uptime > $K/load-before.txt
.venv/bin/python benchmarks/concurrency.py --arms ar,adaspark+gate,ngram,llama-server --clients 1,4 --requests 8 --cap 64 --json $C/clients-1-4.json > $C/clients-1-4.txt 2>&1
for ft in Q4_K_M Q6_K; do
  .venv/bin/python benchmarks/vs_llamacpp.py --model $S/smollm2-135m-$ft.gguf --runs 2 --prompts 3 --max-tokens 128 --out $K/vs_llamacpp-smollm2-$ft.json > $K/vs_llamacpp-smollm2-$ft.txt 2>&1
done
.venv/bin/python benchmarks/vs_llamacpp.py --model $S/qwen3-1.7b-Q4_K_M.gguf --runs 1 --prompts 2 --max-tokens 48 --out $K/vs_llamacpp-qwen3-1.7b-Q4_K_M.json > $K/vs_llamacpp-qwen3-1.7b-Q4_K_M.txt 2>&1
.venv/bin/python benchmarks/verify_cost.py --model $S/qwen3-1.7b-Q4_K_M.gguf --quick --reps 3 --threads 2 --out $K/verify_cost-qwen3-1.7b-Q4_K_M.json > $K/verify_cost-qwen3-1.7b-Q4_K_M.txt 2>&1
uptime > $K/load-after.txt
echo DONE
