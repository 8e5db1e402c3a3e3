#!/bin/bash
# The final figures of session 14 at the session's last code commit, on the Zen 3 guest, one
# job at a time, nothing else running (the session's own earlier runs: *-start*, *-b6dd5ed*).
set -x
cd /work/main
Z=docs/results/zen3
P=.venv/bin/python
lscpu > $Z/cpu.txt
uptime > $Z/load-before.txt
$P benchmarks/native_ab.py --base df8294c --widths 1,2,4,8,16,64 --context 512 --reps 20 --threads 2 --prefill 256 --json $Z/native_ab-hybrid.json > $Z/native_ab-hybrid.txt 2>&1
$P benchmarks/verify_cost.py --quick --reps 25 --threads 2 --json --out $Z/verify_cost-final.json > /dev/null 2> $Z/verify_cost-final.log
$P benchmarks/concurrency.py --arms ar,adaspark+gate --clients 1,4 --requests 24 --short 500 --cap 64 --json $Z/concurrency-short-final.json > $Z/concurrency-short-final.txt 2>&1
g++ -O2 -o /tmp/int8_rate benchmarks/int8_rate.cpp && /tmp/int8_rate > $Z/int8-rate.txt 2>&1
$P benchmarks/qmatmul_rate.py --threads 1 --reps 40 > $Z/qmatmul-rate.txt 2>&1
$P benchmarks/arms.py --arms ar,adaspark+gate,adaspark,chain3 --runs 3 --threads 2 --json $Z/arms-final.json > $Z/arms-final.txt 2>&1
$P benchmarks/arms.py --subset first-turns --arms ar,adaspark+gate --runs 1 --threads 2 --json $Z/first-turns-final.json > $Z/first-turns-final.txt 2>&1
uptime > $Z/load-after.txt
echo DONE
