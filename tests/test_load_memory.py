"""What a load of the embedded model costs in memory where the native forward runs (issue 25):
no float32 or torch-format copy of a packed matrix is kept, the mapped file's pages are let go
once packed, packing works a chunk of rows at a time, and the KV cache's pages come in as the
context fills; the reader keeps a metadata array as one part, not one per element, and the
tokenizer is built before the weights are packed, and the file's vocabulary lists are
dropped once it is built. So the peak RSS a fresh process sees, above what its imports alone
cost, stays within 1.5x the GGUF's size (the issue's bound).

The embedding rows the native forward reads are decoded from the packed table; they must be
gguf's dequantised values exactly for every type the kernels take (the outputs stay those of
the float32 table they replace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_native_types import random_tensor

from adaspark.model import native
from adaspark.model.gguf import read_gguf
from adaspark.model.native import blocks
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer

Q = GGMLQuantizationType
LOADABLE_TYPES = [*blocks.INTEGER, *blocks.DENSE]

PEAK = """
import json, sys
from adaspark.memory import resident_bytes as status
from adaspark.engine import Engine
from adaspark.model import native, transformer  # noqa: F401  (imports: the baseline)
module, why = native.load()
out = {"native": module is not None, "why": why, "base": status()}
if sys.argv[1] == "load":
    engine = Engine.load(arm="ar")
    cache = engine.target.cache
    out.update(after=status(), kv=2 * cache.k.numel() * cache.k.element_size(),
               forward=engine.forward)
print(json.dumps(out))
"""


def run_fresh(what: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PEAK), what], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def net_peak_and_bounds() -> tuple[int, int, dict]:
    """A fresh load's peak RSS above a fresh imports-only process's, the GGUF's size, and the
    load's report."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads /proc/self/status")
    imports = run_fresh("imports")
    if not imports["native"]:
        pytest.skip(f"the native forward does not run here: {imports['why']}")
    loaded = run_fresh("load")
    assert loaded["forward"].startswith("native-")
    return (loaded["after"]["VmHWM"] - imports["base"]["VmHWM"],
            resolve_model(None).stat().st_size, loaded)


def test_a_load_peaks_within_one_and_a_half_times_the_gguf():
    net_peak, size, loaded = net_peak_and_bounds()
    t = read_gguf(resolve_model(None)).tensors["token_embd.weight"]
    table = 4 * t.shape[0] * t.shape[1]  # float32 [vocab, dim]
    # the packed weights are about the file's size; the float32 table, the file's resident
    # pages or the cache (preallocated for the whole context, untouched at load) on top would
    # each break this, and so would the reader's per-element metadata parts (~35 MiB) or the
    # tokenizer's build peaking on top of the packed weights (~6 MiB)
    assert loaded["kv"] > table and table > size / 2
    assert net_peak <= 1.5 * size, (net_peak / 2**20, size / 2**20)


@pytest.mark.parametrize("qtype", LOADABLE_TYPES, ids=lambda q: q.name)
def test_packed_rows_are_ggufs_dequantised_rows_exactly(qtype):
    module, why = native.load()
    if module is None:
        pytest.skip(why)
    t = random_tensor(qtype, 37, 512, seed=11)  # a part group of 5 rows, all scale paths
    w = native.pack(module, [t])
    ids = torch.tensor([36, 0, 17, 16, 15, 17])
    got = w.rows(ids).numpy()
    want = t.dequantize()[ids.numpy()]
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_rows_of_a_fused_weight_come_from_their_own_part():
    module, _ = native.load()
    if module is None:
        pytest.skip("no native build")
    parts = [random_tensor(Q.Q4_K, 20, 256, seed=1), random_tensor(Q.Q8_0, 9, 256, seed=2)]
    w = native.pack(module, parts)
    want = np.concatenate([p.dequantize() for p in parts])
    assert np.array_equal(w.rows(torch.arange(29)).numpy(), want)
    with pytest.raises(RuntimeError, match="out of range"):
        w.rows(torch.tensor([29]))


def test_the_native_embedding_lookup_is_the_float32_tables(model_path):
    model = Transformer.from_gguf(model_path, max_context=64, calibrate=False)
    if model.native is None:
        pytest.skip(model.native_note)
    tokens = torch.tensor([[0, 5, model.config.vocab_size - 1], [42, 42, 7]])
    native_rows = model.embed(tokens)
    assert "tok_embeddings" not in model.__dict__  # the lookup made no float32 table
    assert torch.equal(native_rows, model.tok_embeddings[tokens])


def write_metadata_file(path, endian) -> None:
    """A GGUF with every kind of metadata array the reader packs as one part, and a small and a
    large tensor."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama", endianess=endian)
    w.add_array("t.strings", ["a", "", "Ġhé", "naïve 🙂", "x" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_string("t.string", "plain")
    w.add_uint32("t.scalar", 9)
    w.add_tensor("small", np.arange(16, dtype=np.float32))
    w.add_tensor("large", np.arange(1 << 15, dtype=np.float32))  # 128 KiB: stays mapped
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_compact_metadata_arrays_read_as_ggufs_reader_reads_them(tmp_path, endian):
    from gguf import GGUFEndian, GGUFReader

    path = tmp_path / "meta.gguf"
    write_metadata_file(path, GGUFEndian[endian])
    want = {k: f.contents() for k, f in GGUFReader(path).fields.items()}
    f = read_gguf(path)
    assert f.metadata == want
    assert f.metadata["t.strings"] == ["a", "", "Ġhé", "naïve 🙂", "x" * 300]
    assert f.metadata["t.ints"] == [3, -1, 7]
    small, large = f.tensors["small"].data, f.tensors["large"].data
    # a norm-sized tensor is a copy (reading it maps no neighbours); a matrix stays mapped
    assert not np.shares_memory(small, f.mapped) and np.shares_memory(large, f.mapped)
    assert np.array_equal(small, np.arange(16)) and np.array_equal(large, np.arange(1 << 15))


def test_the_embedded_models_metadata_is_ggufs_readers(model_path):
    from gguf import GGUFReader

    want = {k: f.contents() for k, f in GGUFReader(model_path).fields.items()}
    got = read_gguf(model_path).metadata
    assert got == want and len(got["tokenizer.ggml.merges"]) > 40_000
