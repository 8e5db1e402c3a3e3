import cProfile, pstats, sys, io, tempfile
from adaspark.engine import Engine
from adaspark.options import ModelOptions
arm = sys.argv[1]
eng = Engine.load(options=ModelOptions(arm=arm, store=tempfile.mkdtemp()))
msgs = [{"role": "user", "content": "List the planets of the solar system with one fact each."}]
eng.generate(msgs, max_tokens=32)
pr = cProfile.Profile()
pr.enable()
g = eng.generate(msgs, max_tokens=128)
pr.disable()
st = pstats.Stats(pr)
n = len(g.token_ids)
print(arm, "tokens", n, "calls", st.total_calls, "calls/token", round(st.total_calls / n, 1), "rounds", g.timings.as_dict())
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("ncalls").print_stats(30); print(s.getvalue()[-5000:])
