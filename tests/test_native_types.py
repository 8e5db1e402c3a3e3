"""The native kernels on every GGUF type they take besides Q4_0 / Q4_1 / Q8_0 (test_native.py):
Q5_0, Q5_1, the K-quants Q4_K, Q5_K, Q6_K, and dense F16 / BF16 / F32, on every build this CPU
runs, against float64 arithmetic on gguf's own dequantised values; and a tiny mixed-type llama
on the native forward against the float32 reference.

Blocks are random but valid: fp16 scale fields finite and of a sane size, every other byte
random, inputs a multiple of 256 so that the K-quants' super-blocks are real.

Tolerances come from the arithmetic. Integer types: activations are rounded to int8 per block
of 32 (at most half a step, amax/127/2, per input: times the block's sum of |w|), the integer
sums are exact, and a block's float steps (a few products and sums) round at most a few times
2^-24 of the terms |xq| (|d u| + |m|). Dense types: no activation rounding, two float32 fma
chains of k/2 terms and their sum, at most (k/2 + 2) 2^-24 of |x| |w|.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from adaspark.model import native
from adaspark.model.gguf import GGUFTensor
from adaspark.model.native import blocks
from adaspark.model.transformer import Transformer

Q = GGMLQuantizationType
BUILDS = native.runnable_isas()
INTEGER = [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
DENSE = [Q.F16, Q.BF16, Q.F32]
TYPES = INTEGER + DENSE

# per type: the byte offsets of its fp16 fields ("d" a scale, "m" a minimum) and the size of
# its codes' spread, so that d = sigma / spread gives weights of about sigma
FIELDS = {Q.Q4_0: ({0: "d"}, 4.6), Q.Q4_1: ({0: "d", 2: "m"}, 4.6), Q.Q8_0: ({0: "d"}, 74.0),
          Q.Q5_0: ({0: "d"}, 9.2), Q.Q5_1: ({0: "d", 2: "m"}, 9.2),
          Q.Q4_K: ({0: "d", 2: "dmin"}, 200.0), Q.Q5_K: ({0: "d", 2: "dmin"}, 400.0),
          Q.Q6_K: ({208: "d"}, 1370.0), Q.Q2_K: ({80: "d", 82: "dmin"}, 60.0)}
MIDDLE = {Q.Q4_1: 8.0, Q.Q5_1: 16.0, Q.Q4_K: 7.5, Q.Q5_K: 15.5, Q.Q2_K: 1.5}  # m = -MIDDLE d


def module_for(isa: str):
    module, why = native.load_isa(isa)
    if module is None:
        pytest.skip(f"native {isa} build not usable here: {why}")
    return module


def loaded_builds() -> list:
    return [m for m in (native.load_isa(isa)[0] for isa in BUILDS) if m is not None]


def random_tensor(qtype: Q, n: int, k: int, seed: int, sigma: float = 0.05) -> GGUFTensor:
    """A [n, k] tensor of random valid blocks of `qtype`, weights of about sigma."""
    rng = np.random.default_rng(seed)
    if qtype in DENSE:
        w = (rng.standard_normal((n, k)) * sigma).astype(np.float32)
        if qtype == Q.F16:
            return GGUFTensor("random", qtype, (n, k), w.astype(np.float16))
        if qtype == Q.BF16:
            bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # as GGUFReader gives it: bytes
            return GGUFTensor("random", qtype, (n, k), bits.view(np.uint8).reshape(n, 2 * k))
        return GGUFTensor("random", qtype, (n, k), w)
    inputs, size = (32 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1) else 256,
                    blocks.INTEGER[qtype][1] if qtype in blocks.INTEGER else 84)
    data = rng.integers(0, 256, (n, k // inputs, size), dtype=np.uint8)
    fields, spread = FIELDS[qtype]
    d = (sigma / spread * (0.5 + rng.random((n, k // inputs)))).astype(np.float32)
    values = {"d": d * rng.choice([-1, 1], d.shape) if qtype not in MIDDLE else d,
              "m": -MIDDLE.get(qtype, 0) * d * (0.8 + 0.4 * rng.random(d.shape)),
              "dmin": MIDDLE.get(qtype, 0) * d * (0.8 + 0.4 * rng.random(d.shape))}
    for at, name in fields.items():
        data[..., at:at + 2] = values[name].astype(np.float16)[..., None].view(np.uint8)
    return GGUFTensor("random", qtype, (n, k), data.reshape(n, -1))


def gguf_values(t: GGUFTensor) -> np.ndarray:
    """float64 [n, k] by gguf's own dequantiser."""
    return dequantize(np.ascontiguousarray(t.data), t.qtype).astype(np.float64).reshape(t.shape)


def rounded(x: np.ndarray) -> np.ndarray:
    """x as the kernel rounds it: per block of 32, int8 codes times amax/127 (float32)."""
    xb = x.reshape(len(x), -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
    codes = np.clip(np.rint((xb * inverse).astype(np.float32)), -127, 127)
    return (codes.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)


def check(t: GGUFTensor, x: np.ndarray, got: np.ndarray) -> None:
    """got = x W^T from the kernel, on gguf's values. Integer types, two bounds: against float64
    arithmetic on the kernel's rounded activations, float32 rounding only (so a code, scale or
    layout slip fails it), and from there to exact x, half a step per input times |w|."""
    w = gguf_values(t)
    x64 = x.astype(np.float64)
    n, k = t.shape
    if t.qtype in DENSE:
        excess = np.abs(got - x64 @ w.T) / ((k / 2 + 2) * 2**-24 * (np.abs(x64) @ np.abs(w).T))
        assert np.all(excess <= 1), (t.qtype.name, float(excess.max()))
        return
    b = blocks.unsigned_blocks(t)
    d, m = native._per_element(b)
    size = (np.abs(d * b[1]) + np.abs(m)).reshape(n, k).astype(np.float64)
    xq = rounded(x)
    excess = np.abs(got - xq @ w.T) / ((k // 32 + 4) * 2**-22 * (np.abs(xq) @ size.T))
    assert np.all(excess <= 1), (t.qtype.name, float(excess.max()))
    steps = np.abs(x64).reshape(len(x), k // 32, 32).max(-1) / 127
    rounding = np.einsum("rb,nb->rn", steps * (0.5 + 2**-20),
                         np.abs(w).reshape(n, k // 32, 32).sum(-1))
    assert np.all(np.abs(xq @ w.T - x64 @ w.T) <= rounding)


def activations(k: int, rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, k)) * np.logspace(-2, 2, rows)[:, None]).astype(np.float32)


@pytest.mark.parametrize("qtype", INTEGER)
def test_unpacked_blocks_are_ggufs_values(qtype):
    """d*u + m per element equals gguf's dequantised value up to its own float32 rounding."""
    t = random_tensor(qtype, 16, 512, seed=1)
    bits, u, d, m = blocks.unsigned_blocks(t)
    de, me = native._per_element((bits, u, d, m))
    ours = (de.astype(np.float64) * u + me).reshape(t.shape)
    size = (np.abs(de.astype(np.float64) * u) + np.abs(me)).reshape(t.shape)
    assert bits == {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}[qtype]
    assert int(u.max()) == (1 << bits) - 1  # random codes reach the top of their range
    assert np.all(np.abs(ours - gguf_values(t)) <= 2**-24 * size)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", TYPES)
def test_every_type_computes_the_float64_reference(isa, qtype):
    module = module_for(isa)
    t = random_tensor(qtype, 40, 512, seed=int(qtype))
    x = activations(512, 21, seed=2)
    weight = native.pack(module, [t])
    for rows in (1, 4, 21):
        got = weight.matmul(torch.from_numpy(x[:rows])).double().numpy()
        assert got.shape == (rows, 40)
        check(t, x[:rows], got)


@pytest.mark.parametrize("qtype,zero,halves,bits", [
    (Q.Q5_0, 16, 1, 5), (Q.Q5_1, 0, 1, 5), (Q.Q4_K, 0, 1, 4), (Q.Q5_K, 0, 1, 5),
    (Q.Q6_K, 32, 2, 6)])
def test_each_type_takes_its_packing(qtype, zero, halves, bits):
    """Codes keep their width (5 and 6 bits as a nibble plane and high-bit planes). Symmetric
    codes (Q5_0 around 16, Q6_K around 32) take the integer zero path; Q6_K's
    scales per 16 inputs make two integer sums a block; K-quant scales stay GGUF's factors (an
    fp16 per super-block times a 6- or 8-bit integer per block), Q5_0's GGUF's fp16."""
    module = module_for(BUILDS[0]) if BUILDS else pytest.skip("no native build runs here")
    part = native.pack(module, [random_tensor(qtype, 16, 256, seed=3)]).parts[0]
    assert (part.zero, part.halves, part.bits) == (zero, halves, bits)
    assert part.factors == (qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K)) and not part.f32


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_bit_identical_at_every_width(isa, qtype):
    """Widths 1..16 (and 16 rows in any order): every row as computed alone, AMX tiles or not."""
    module = module_for(isa)
    w = native.pack(module, [random_tensor(qtype, 33, 256, seed=4)])
    x = torch.from_numpy(activations(256, 16, seed=5))
    alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(16)])
    tiles = [True, False] if module.use_amx() else [False]
    try:
        for amx in tiles:
            module.use_amx(amx)
            for rows in range(1, 17):
                assert torch.equal(w.matmul(x[:rows]), alone[:rows]), (rows, amx)
            order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
            assert torch.equal(w.matmul(x[order]), alone[order])
    finally:
        module.use_amx(True)


def test_every_build_multiplies_every_type_bit_for_bit_alike():
    loaded = loaded_builds()
    if len(loaded) < 2:
        pytest.skip(f"{len(loaded)} native build usable here: nothing to compare")
    x = torch.from_numpy(activations(512, 9, seed=6))
    for qtype in TYPES:
        t = random_tensor(qtype, 24, 512, seed=7)
        results = [native.pack(m, [t]).matmul(x) for m in loaded]
        for got in results[1:]:
            assert torch.equal(got, results[0]), qtype.name


@pytest.mark.parametrize("isa", BUILDS)
def test_fused_parts_of_different_types_equal_separate_weights(isa):
    """q|k|v or gate|up whose parts differ in type: each part keeps its own packing."""
    module = module_for(isa)
    parts = [random_tensor(q, n, 512, seed=n) for q, n in
             [(Q.Q4_K, 40), (Q.Q6_K, 24), (Q.F16, 8), (Q.Q5_0, 17), (Q.Q4_0, 16), (Q.Q8_0, 9)]]
    for rows in (1, 7):
        x = torch.from_numpy(activations(512, rows, seed=rows))
        fused = native.pack(module, parts).matmul(x)
        alone = torch.cat([native.pack(module, [p]).matmul(x) for p in parts], 1)
        assert torch.equal(fused, alone), rows


GEMMA = Path("~/.cache/adaspark/models/gemma-3-270m-q4_k_m.gguf").expanduser()


@pytest.mark.skipif(not GEMMA.exists(), reason="no cached Q4_K_M GGUF of real weights")
@pytest.mark.parametrize("isa", BUILDS)
def test_real_k_quant_weights_compute_the_float64_reference(isa):
    """Real llama.cpp-quantised blocks (gemma-3-270m Q4_K_M, cached by the model tests: its
    architecture is not served, its matrices are plain GGUF): Q5_0, Q4_K, Q6_K."""
    module = module_for(isa)
    reader = GGUFReader(GEMMA)
    wanted = {"blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight"}
    tensors = [GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data)
               for t in reader.tensors if t.name in wanted]
    assert sorted(t.qtype.name for t in tensors) == ["Q4_K", "Q5_0", "Q6_K"]
    for t in tensors:
        x = activations(t.shape[1], 5, seed=9)
        check(t, x, native.pack(module, [t]).matmul(torch.from_numpy(x)).double().numpy())


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q4_K, Q.F16])
def test_error_scales_taken_in_row_chunks_are_the_whole_tensors(qtype):
    """The head's bounds are maxima over outputs: chunks of rows (which bound the load's
    temporaries) give the same numbers."""
    t = random_tensor(qtype, 40, 512, seed=10)
    assert torch.equal(native.error_scales(t, rows=16), native.error_scales(t, rows=10**6))


def test_the_error_scales_bound_a_dense_head():
    """A dense head's float32 chains: the head's bound (target.h) gets 4 sum|w| per block in its
    float budget, which covers (k/2 + 2) 2^-24 |x| |w| for every k."""
    t = random_tensor(Q.F16, 20, 512, seed=8)
    scales = native.error_scales(t).numpy()
    w = np.abs(gguf_values(t)).reshape(20, 16, 32).sum(-1).max(0)
    assert np.allclose(scales[0], w, rtol=1e-3) and np.allclose(scales[1], 4 * w, rtol=1e-3)


# --- a tiny llama of mixed types ------------------------------------------------------------------

DIM, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 300, 2
HD = DIM // HEADS
MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0,
         "ffn_gate": Q.Q5_1, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
SECOND = {"attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.Q8_0, "attn_output": Q.F32,
          "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_K}
SHAPES = {"attn_q": (HEADS * HD, DIM), "attn_k": (KV_HEADS * HD, DIM),
          "attn_v": (KV_HEADS * HD, DIM), "attn_output": (DIM, DIM), "ffn_gate": (FFN, DIM),
          "ffn_up": (FFN, DIM), "ffn_down": (DIM, FFN)}


def add_tensor(writer: GGUFWriter, name: str, t: GGUFTensor) -> None:
    if t.qtype in (Q.F16, Q.F32):
        writer.add_tensor(name, t.data)
    else:  # raw bytes: GGUFWriter takes the byte shape and the type
        writer.add_tensor(name, np.ascontiguousarray(t.data).view(np.uint8).reshape(t.shape[0], -1),
                          raw_dtype=t.qtype)


def write_mixed_llama(path, odd: dict[str, Q] | None = None):
    """A 2-layer llama whose matrices are of the K-quant / Q5 / Q6 / dense types above (odd: a
    few replaced, e.g. by a type the native forward does not take)."""
    writer = GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, DIM), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_vocab_size, VOCAB)]:
        add(value)
    rng = np.random.default_rng(0)
    norm = lambda: (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)  # noqa: E731
    add_tensor(writer, "token_embd.weight", random_tensor(Q.Q6_K, VOCAB, DIM, seed=1, sigma=1.0))
    writer.add_tensor("output_norm.weight", norm())
    add_tensor(writer, "output.weight", random_tensor(Q.F16, VOCAB, DIM, seed=2, sigma=0.1))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        for j, (part, qtype) in enumerate((MIXED if i == 0 else SECOND).items()):
            name = f"blk.{i}.{part}.weight"
            qtype = (odd or {}).get(name, qtype)
            n, k = SHAPES[part]
            add_tensor(writer, name, random_tensor(qtype, n, k, seed=10 * i + j, sigma=k**-0.5))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def mixed_path(tmp_path_factory):
    return write_mixed_llama(tmp_path_factory.mktemp("mixed") / "mixed.gguf")


@pytest.fixture(scope="module")
def mixed_reference(mixed_path):
    return Transformer.from_gguf(mixed_path, precision="reference", max_context=64)


PROMPT = [5, 17, 101, 33, 250, 7, 64, 199, 3, 42, 11, 290]


@pytest.mark.parametrize("isa", BUILDS)
def test_a_mixed_type_model_runs_natively_near_the_reference(isa, mixed_path, mixed_reference,
                                                             monkeypatch):
    """The native forward takes a file of Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, Q4_0, Q4_1, F16,
    BF16 and F32 matrices. Its logits differ from the float32 reference by the int8 rounding of
    the inputs of the 4 quantised matmuls per layer on a row's path (at most sqrt(32)/254 of a
    row each: a block's amax is at most sqrt(32) times its RMS, half a step of amax/127 per
    input) and the fp16 K/V cache (2^-11): their sum bounds a row's relative change where, as in
    this random model, the layers neither amplify nor cancel it."""
    module = module_for(isa)
    monkeypatch.setenv("ADASPARK_NATIVE", isa)
    fast = Transformer.from_gguf(mixed_path, precision="fast", max_context=64, calibrate=False)
    assert fast.native is not None, fast.native_note
    assert fast.native_isa == module.ISA and fast.native_note == ""
    got = fast.prefill(PROMPT, return_logits=True).logits
    mixed_reference.reset()
    want = mixed_reference.prefill(PROMPT, return_logits=True).logits
    bound = 4 * LAYERS * 32**0.5 / 254 + 2 * LAYERS * 2**-11
    error = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert float(error.max()) <= bound, float(error.max())
    assert float(error.max()) > 0  # the native forward ran, not the reference one


def test_a_type_the_native_forward_lacks_is_named(tmp_path, monkeypatch):
    """One Q2_K matrix: the whole model takes the torch path, and native_note says which."""
    if not BUILDS or loaded_builds() == []:
        pytest.skip("no native build runs here")
    path = write_mixed_llama(tmp_path / "odd.gguf", {"blk.1.ffn_up.weight": Q.Q2_K})
    model = Transformer.from_gguf(path, precision="fast", max_context=64, calibrate=False)
    assert model.native is None
    assert "blk.1.ffn_up.weight" in model.native_note and "Q2_K" in model.native_note
    assert "\n" not in model.native_note
