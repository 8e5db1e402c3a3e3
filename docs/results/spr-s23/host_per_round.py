import cProfile, pstats, sys, tempfile, time
from adaspark.engine import Engine
from adaspark.options import ModelOptions
arm = sys.argv[1]
eng = Engine.load(options=ModelOptions(arm=arm, store=tempfile.mkdtemp()))
P = ["Explain how a refrigerator works, step by step.", "Write a short story about a lighthouse keeper.",
     "List ten tips for learning a new language, with a sentence on each.", "Summarise the causes of the French Revolution."]
for p in P[:1]:
    eng.generate([{"role": "user", "content": p}], max_tokens=64)
pr = cProfile.Profile(); toks = 0; rounds = 0
pr.enable()
for p in P:
    g = eng.generate([{"role": "user", "content": p}], max_tokens=256)
    toks += len(g.token_ids); d = g.timings.as_dict(); rounds += d.get("draft_rounds", 0) + d.get("plain_rounds", 0) + d.get("ngram_rounds", 0)
pr.disable()
st = pstats.Stats(pr)
native = sum(v[2] for k, v in st.stats.items() if "adaspark_native" in k[2] or "native_avx" in k[2])
total = st.total_tt
print(f"{arm}: tokens {toks} rounds {rounds} total {total:.3f}s native {native:.3f}s host {total-native:.3f}s host/round {(total-native)/max(rounds,1)*1e3:.3f} ms calls/round {st.total_calls/max(rounds,1):.0f}")
