import sys, tempfile, collections
from pathlib import Path
import numpy as np
sys.path.insert(0, "/work/main/benchmarks")
import structured_output as so
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import load_speculator
arm = sys.argv[1]
path = resolve_model(None); g = read_gguf(path); t = Transformer(g); tok = Tokenizer.from_gguf(g)
e = Engine(t, tok, path, load_speculator(t, path, tok.stop_ids, ModelOptions(arm=arm, store=Path(tempfile.mkdtemp())/"s", fresh=True)))
C = collections.Counter()
def hook(tr):
    plan = tr.plan; tree = plan.tree
    if tree is None or not plan.drafted: return
    C["drafted"] += 1
    B, K = tree.B, tree.K
    acc = len(tr.outcome.tokens)
    C["acc"] += acc
    # the pick chain: node p*K is position p's pick
    forb = tree.forbidden
    first_bad = None
    if forb is not None:
        for p in range(B):
            if forb[p * K]:
                first_bad = p; break
    C[f"first_illegal_pick={first_bad}"] += 1
    # was the target's pick at the first rejected depth among the block's legal candidates?
    C["rows"] += plan.rows
    # the walk along the drafter's pick chain: accepted tokens along it
    toks = tr.outcome.tokens; bonus = tr.outcome.bonus
    d = 0
    while d < len(toks) and d < B and toks[d] == tree.token[d * K]:
        d += 1
    if d < B and d == len(toks):  # the walk ended at depth d on the chain: bonus = target's pick there
        cands = list(tree.token[d * K:(d + 1) * K])
        illegal_pick = forb is not None and forb[d * K]
        C[f"end_pick_illegal={bool(illegal_pick)}"] += 1
        if bonus in cands[1:]:
            C[f"target_in_siblings_pick_illegal={bool(illegal_pick)}"] += 1
e.speculator.round_hook = hook
items = so.prompts(so.CONVERSATIONS)
for mode in ("free", "schema", "free", "schema"):
    C.clear()
    so.decode(e, items, mode == "schema", 128)
    print(mode, dict(sorted(C.items())))
