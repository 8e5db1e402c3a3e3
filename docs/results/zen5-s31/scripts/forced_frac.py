import json, sys
sys.path.insert(0, "/work/main/benchmarks")
import structured_output as so
from adaspark.grammar import GrammarCompiler, ResponseFormat
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
path = resolve_model(None); g = read_gguf(path); tok = Tokenizer.from_gguf(g)
comp = GrammarCompiler.for_tokenizer(tok)
d = json.load(open("docs/results/zen5-s31/structured/so-base-0.json"))
items = {i["name"]: i for i in so.prompts(so.CONVERSATIONS)}
tot = sole = 0
for r in d["results"]["ar|schema"][0]:
    st = comp.compile(ResponseFormat.parse(items[r["name"]]["response_format"])).start()
    s = []
    for t in r["tokens"]:
        if t in st.stop_ids: break
        s.append(st.sole() is not None)
        st.advance(t)
    tot += len(s); sole += sum(s)
    print(r["name"], len(s), sum(s), "".join("F" if x else "." for x in s)[:128])
print(tot, sole, sole / tot)
