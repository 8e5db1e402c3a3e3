import time, statistics as st, torch, numpy as np
torch.set_num_threads(2)
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer
path = resolve_model(None); t = Transformer(read_gguf(path))
t.prefill(list(range(100, 400)))
one = np.ones((1, 1), dtype=bool)
cfg = {"none": (), "one": (14,), "three": (1, 14, 27), "last": (29,)}
print(t.config.n_layers if hasattr(t.config, "n_layers") else "")
res = {k: [] for k in cfg}
for i in range(2000):
    for k, taps in cfg.items():
        s = time.perf_counter(); t.verify([500 + i % 100], [0], one, taps); res[k].append(time.perf_counter() - s)
for k, v in res.items():
    print(k, "median %.3f ms" % (1000 * st.median(v)))
