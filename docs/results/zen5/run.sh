#!/bin/bash
# Issue 22's figures on the Zen 5 guest at the session's code commit, one job at a time,
# nothing else running: the build this CPU picks (avx512) and the AVX2 build forced.
set -x
cd /work/main
Z=docs/results/zen5
P=.venv/bin/python
lscpu > $Z/cpu.txt
uptime > $Z/load-before.txt
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa $P benchmarks/verify_cost.py --quick --reps 25 --threads 2 --json --out $Z/verify_cost-final-$isa.json > /dev/null 2> $Z/verify_cost-final-$isa.log
done
$P benchmarks/qmatmul_rate.py --threads 1 --reps 40 > $Z/qmatmul-rate.txt 2>&1
g++ -O2 -o /tmp/int8_rate benchmarks/int8_rate.cpp && /tmp/int8_rate > $Z/int8-rate.txt 2>&1
for isa in avx512 avx2; do
  ADASPARK_NATIVE=$isa $P benchmarks/arms.py --arms ar,adaspark+gate,adaspark,chain3 --runs 3 --threads 2 --json $Z/arms-final-$isa.json > $Z/arms-final-$isa.txt 2>&1
  ADASPARK_NATIVE=$isa $P benchmarks/arms.py --subset first-turns --arms ar,adaspark+gate --runs 1 --threads 2 --json $Z/first-turns-final-$isa.json > $Z/first-turns-final-$isa.txt 2>&1
done
$P benchmarks/concurrency.py --arms ar,adaspark+gate --clients 1,4 --requests 24 --short 500 --cap 64 --json $Z/concurrency-short-final.json > $Z/concurrency-short-final.txt 2>&1
uptime > $Z/load-after.txt
echo DONE
