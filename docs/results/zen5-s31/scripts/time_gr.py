import sys, tempfile, time, collections
from pathlib import Path
sys.path.insert(0, "/work/main/benchmarks")
import structured_output as so
from adaspark import constrained, grammar
from adaspark.scheduler import round as rnd
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import load_speculator
T = collections.Counter(); N = collections.Counter()
def wrap(mod, name):
    f = getattr(mod, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[name] += time.perf_counter() - t; N[name] += 1; return r
    setattr(mod, name, w)
wrap(constrained, "path_picks")
wrap(grammar.GrammarState, "survey")
wrap(grammar.GrammarState, "allowed")
wrap(constrained, "masked"); wrap(constrained, "pick"); wrap(grammar.GrammarState, "legal"); wrap(grammar.GrammarState, "take"); wrap(grammar.GrammarState, "advance")
arm = sys.argv[1]
path = resolve_model(None); g = read_gguf(path); t = Transformer(g); tok = Tokenizer.from_gguf(g)
e = Engine(t, tok, path, load_speculator(t, path, tok.stop_ids, ModelOptions(arm=arm, store=Path(tempfile.mkdtemp())/"s", fresh=True)))
items = so.prompts(so.CONVERSATIONS)
so.decode(e, items, True, 128); T.clear(); N.clear()
r = so.decode(e, items, True, 128)
ds = sum(x["decode_s"] for x in r); rounds = sum(x["draft_rounds"]+x["ngram_rounds"]+x["plain_rounds"] for x in r)
print(arm, "tok/s", so.tok_s(r), "decode_s", ds, "rounds", rounds)
for k in T: print(f"  {k}: {T[k]*1e3:.1f} ms total, {N[k]} calls, {T[k]/rounds*1e3:.3f} ms/round")
