#!/usr/bin/env bash
# Session 23's measurements after the A/B, one at a time, nothing else running:
#   bash docs/results/spr-s23/run_rest.sh   (from the repository root)
set -uo pipefail
O=docs/results/spr-s23
PY=.venv/bin/python
XG=${XG:-/tmp/i42xg}  # xgrammar kept out of the project venv (it pulls transformers and triton)
PYTHONPATH=$XG $PY benchmarks/grammar_mask_cost.py --repeat 5 --verify > $O/grammar_mask_cost.txt 2>&1
$PY benchmarks/structured_output.py --runs 3 --max-tokens 128 --threads 2 \
  --json $O/structured_output.json > $O/structured_output.txt 2>&1
$PY benchmarks/stop_list_neighbour.py --tokens 64 --rounds 5 --json $O/stop_list_neighbour.json \
  > $O/stop_list_neighbour.txt 2>&1
PYTHONPATH=.:tests $PY - > $O/store_save_ms.txt 2>&1 <<'PYEOF'
import tempfile, time
from test_learned_store import learn_rounds
from test_store_writers import FINGERPRINT, Scheduler, SharedState, Store
s = Scheduler("adaspark"); learn_rounds(s, 0, 200)
sh = SharedState(s, Store(tempfile.mkdtemp(), FINGERPRINT)); sh.save()
times = []
for _ in range(50):
    t = time.perf_counter(); sh.save(); times.append((time.perf_counter() - t) * 1e3)
times.sort()
print(f"one save of a 200-round scheduler state under the lock, with the merge: median "
      f"{times[25]:.2f} ms, min {times[0]:.2f}, max {times[-1]:.2f} (50 saves)")
PYEOF
ADASPARK_NATIVE=avx2 $PY benchmarks/arms.py --arms ar,adaspark+gate,adaspark,ngram --runs 3 \
  --threads 2 --json $O/arms-avx2.json > $O/arms-avx2.txt 2>&1
$PY benchmarks/soak.py --minutes 5 --clients 8 --out $O/soak-8clients > $O/soak-8clients.log 2>&1
echo "soak rc=$?" >> $O/soak-8clients.log
bash benchmarks/fuzz_server.sh $O/fuzz 240 > $O/fuzz.log 2>&1
echo "fuzz rc=$?" >> $O/fuzz.log
echo all done
