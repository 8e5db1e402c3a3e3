"""The native forward (adaspark/model/native): its quantised matmul against a float64
dequantised reference, and rows that do not depend on the other rows of a call, on every build
this CPU runs (native.runnable_isas(): AVX-512 VNNI, AVX-VNNI, AVX2 where the CPU has them).

Tolerances come from the arithmetic: activations are rounded to int8 per block of 32 (an error
of at most half a step, dx/2, per input), integer dot products are exact, and the float terms
(two products and a sum per block) round at most a few times 2^-24 of their own size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from adaspark import cpuinfo
from adaspark.model import native
from adaspark.model.gguf import GGUFTensor, read_gguf

BUILDS = native.runnable_isas()


def module_for(isa: str):
    module, why = native.load_isa(isa)
    if module is None:
        pytest.skip(f"native {isa} build not usable here: {why}")
    return module


@pytest.fixture(scope="module")
def gguf(model_path):
    return read_gguf(model_path)


def random_tensor(qtype: str, n: int, k: int, seed: int) -> GGUFTensor:
    """A GGUF tensor of random blocks: fp16 scales, random codes (Q4_1 with random minimums)."""
    rng = np.random.default_rng(seed)
    blocks = n * k // 32
    scale = (rng.standard_normal(blocks) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == "Q8_0":
        codes = rng.integers(-128, 128, (blocks, 32)).astype(np.int8).view(np.uint8)
        data = np.concatenate([scale, codes], 1)
    else:
        codes = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
        if qtype == "Q4_1":
            low = (rng.standard_normal(blocks) * 0.1).astype(np.float16).view(np.uint8)
            data = np.concatenate([scale, low.reshape(-1, 2), codes], 1)
        else:
            data = np.concatenate([scale, codes], 1)
    return GGUFTensor("random", GGMLQuantizationType[qtype], (n, k), data.reshape(-1))


def quantised(x: np.ndarray) -> np.ndarray:
    """x [rows, k] float32 as the kernel rounds it: per block of 32, int8 codes times amax/127
    (float32 steps, ties to even), returned in float64."""
    xb = x.reshape(len(x), -1, 32).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    step = amax / np.float32(127)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
    codes = np.clip(np.rint((xb * inverse).astype(np.float32)), -127, 127)
    return (codes.astype(np.float64) * step.astype(np.float64)).reshape(x.shape)


def check_against_float64(t: GGUFTensor, x: np.ndarray, got: np.ndarray) -> None:
    """got = x W^T from the kernel. Two bounds: the kernel against float64 arithmetic on the
    rounded activations (float32 rounding only: a few 2^-24 of the terms' size, so an integer
    or layout slip fails it), and the rounded activations against exact x (half a step per
    input times |w|)."""
    bits, u, d, m = native.unsigned_blocks(t)
    n, nb, _ = u.shape
    w = t.dequantize().astype(np.float64)
    xq = quantised(x)
    on_rounded = xq @ w.T
    terms = np.abs(xq) @ (np.abs(d[..., None] * u) + np.abs(m[..., None])).reshape(n, -1).T
    assert np.all(np.abs(got - on_rounded) <= (nb + 4) * 2**-22 * terms), \
        float(np.max(np.abs(got - on_rounded) / terms))
    steps = np.abs(x.astype(np.float64)).reshape(len(x), nb, 32).max(-1) / 127
    weight_sums = np.abs(w).reshape(n, nb, 32).sum(-1)
    half_steps = np.einsum("rb,nb->rn", steps * (0.5 + 2**-20), weight_sums)
    assert np.all(np.abs(on_rounded - x.astype(np.float64) @ w.T) <= half_steps)


CASES = [("Q4_1", 48, 576), ("Q4_0", 40, 96), ("Q8_0", 33, 576), ("Q4_1", 16, 1536)]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype,n,k", CASES)
def test_random_weights_match_the_float64_reference(isa, qtype, n, k):
    module = module_for(isa)
    t = random_tensor(qtype, n, k, seed=n + k)
    x = np.random.default_rng(1).standard_normal((7, k)).astype(np.float32)
    got = native.pack(module, [t]).matmul(torch.from_numpy(x)).double().numpy()
    assert got.shape == (7, n)
    check_against_float64(t, x, got)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight",
                                  "token_embd.weight"])
def test_real_weights_match_the_float64_reference(isa, gguf, name):
    module = module_for(isa)
    t = gguf.tensors[name]
    rows = t if t.shape[0] <= 4096 else GGUFTensor(t.name, t.qtype, (4096, t.shape[1]),
                                                   t.data.reshape(t.shape[0], -1)[:4096])
    x = np.random.default_rng(2).standard_normal((3, t.shape[1])).astype(np.float32)
    got = native.pack(module, [rows]).matmul(torch.from_numpy(x)).double().numpy()
    check_against_float64(rows, x, got)


@pytest.mark.parametrize("isa", BUILDS)
def test_fused_outputs_equal_separate_weights(isa, gguf):
    module = module_for(isa)
    parts = [gguf.tensors[f"blk.2.attn_{p}.weight"] for p in "qkv"]
    x = torch.randn(5, 576)
    fused = native.pack(module, parts).matmul(x)
    alone = torch.cat([native.pack(module, [p]).matmul(x) for p in parts], 1)
    assert torch.equal(fused, alone)


@pytest.mark.parametrize("isa", BUILDS)
def test_a_row_does_not_depend_on_the_rows_beside_it(isa, gguf):
    module = module_for(isa)
    w = native.pack(module, [gguf.tensors["blk.4.ffn_gate.weight"]])
    x = torch.randn(33, 576) * torch.logspace(-2, 2, 33)[:, None]
    alone = torch.cat([w.matmul(x[i:i + 1]) for i in range(33)])
    for rows in (1, 2, 3, 4, 5, 8, 13, 16, 33):
        assert torch.equal(w.matmul(x[:rows]), alone[:rows]), rows
    order = torch.randperm(33, generator=torch.Generator().manual_seed(0))
    assert torch.equal(w.matmul(x[order]), alone[order])


def test_every_x86_build_is_offered_where_the_cpu_runs_it():
    flags = cpuinfo.flags()
    if {"avx2", "fma"} <= flags:
        assert "avx2" in BUILDS
    if {"avx2", "fma", "avx_vnni"} <= flags:
        assert "avxvnni" in BUILDS
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        assert BUILDS[0] == "avx512"


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "fma", "f16c"}, ["avx2"]),  # Zen 3, Haswell..Comet Lake
    ({"avx2", "fma", "f16c", "avx_vnni"}, ["avxvnni", "avx2"]),  # Alder Lake and later clients
    ({"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
     ["avx512", "avxvnni", "avx2"]),  # Sapphire Rapids
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}, ["avx2"]),  # Skylake-X: no VNNI
    ({"avx", "sse4_2"}, []),
])
def test_each_cpu_class_is_offered_the_builds_it_can_run(monkeypatch, flags, expected):
    monkeypatch.setattr(native.cpuinfo, "flags", lambda text=None: set(flags))
    assert native.runnable_isas() == expected


def test_bad_inputs_are_refused(gguf):
    module = module_for(BUILDS[0]) if BUILDS else pytest.skip("no native build runs here")
    w = native.pack(module, [gguf.tensors["blk.0.attn_q.weight"]])
    with pytest.raises(RuntimeError, match="float32"):
        w.matmul(torch.randn(2, 100))
    with pytest.raises(RuntimeError, match="wrong size"):
        module.QWeight(4, 16, 64, torch.zeros(3, dtype=torch.uint8),
                       torch.zeros(32, dtype=torch.float16), torch.zeros(32, dtype=torch.float16))
    with pytest.raises(ValueError, match="cannot be packed"):  # a type no kernel takes
        native.pack(module, [GGUFTensor("f", GGMLQuantizationType.Q2_K, (1, 256),
                                        np.zeros(84, np.uint8))])


def test_a_stale_build_is_not_loaded(monkeypatch):
    native.load_isa.cache_clear()
    monkeypatch.setattr(native, "source_hash", lambda: "0" * 64)
    try:
        module, why = native.load_isa("avx2")
        assert module is None and ("older" in why or "no avx2 build" in why)
    finally:
        native.load_isa.cache_clear()


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("ADASPARK_NATIVE", "off")
    assert native.load() == (None, "turned off by ADASPARK_NATIVE=off")


def block_minimums(t: GGUFTensor) -> np.ndarray:
    """[N, nb] float64 |m| of each block, read from the GGUF block header (fp16 d first; Q4_1's
    fp16 m next; Q4_0 and Q8_0 centre their codes on 8 and 128): the offset the kernel's
    float terms may carry besides d*u."""
    n, k = t.shape
    header = t.data.reshape(n, k // 32, -1)[..., :4].copy().view(np.float16).astype(np.float64)
    zero = {"Q4_0": 8, "Q8_0": 128}.get(t.qtype.name)
    return np.abs(header[..., 1] if zero is None else zero * header[..., 0])


def reference_bound(t: GGUFTensor, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x W^T in float64 from gguf's own dequantiser (not ours), and how far a correct kernel
    may be from it: int8 rounding of the activations moves each input by at most half its
    block's step (amax/127, times 1 + 2^-20 for the float32 step and scaling), so an output
    by at most sum over blocks of step/2 * sum |w| over the block; the float32 block terms
    (|xq| (|w| + 2|m|) at most) add at most (blocks + 4) * 2^-22 of their sum."""
    from gguf.quants import dequantize

    n, k = t.shape
    w = dequantize(t.data, t.qtype).astype(np.float64).reshape(n, k)
    x64 = x.astype(np.float64)
    steps = np.abs(x64).reshape(len(x), k // 32, 32).max(-1) / 127
    weight_sums = np.abs(w).reshape(n, k // 32, 32).sum(-1)
    rounding = np.einsum("rb,nb->rn", steps * (0.5 + 2**-20), weight_sums)
    xq_size = np.abs(x64) + np.repeat(steps, 32, axis=1) / 2
    terms = xq_size @ (np.abs(w) + 2 * np.repeat(block_minimums(t), 32, axis=1)).T
    return x64 @ w.T, rounding + (k // 32 + 4) * 2**-22 * terms


def agreement_cases(gguf) -> list[GGUFTensor]:
    """A real Q4_1 matrix of the model and small random Q8_0 / Q4_0 ones (the other packings)."""
    return [gguf.tensors["blk.3.ffn_down.weight"], random_tensor("Q8_0", 40, 192, seed=8),
            random_tensor("Q4_0", 24, 96, seed=9)]


@pytest.mark.parametrize("isa", BUILDS)
def test_every_build_computes_the_float64_reference_of_the_gguf_weights(isa, gguf):
    """Each build this CPU runs, on its own: one row (decode) and 21 rows of activations at
    scales 1e-2..1e2, each output within the arithmetic's bound of float64 x W^T."""
    module = module_for(isa)
    for t in agreement_cases(gguf):
        rng = np.random.default_rng(t.shape[1])
        x = (rng.standard_normal((21, t.shape[1])) * np.logspace(-2, 2, 21)[:, None])
        x = x.astype(np.float32)
        weight = native.pack(module, [t])
        want, bound = reference_bound(t, x)
        for rows in (1, 21):
            got = weight.matmul(torch.from_numpy(x[:rows])).double().numpy()
            assert got.shape == (rows, t.shape[0])
            excess = np.abs(got - want[:rows]) / bound[:rows]
            assert np.all(excess <= 1), (t.qtype.name, rows, float(excess.max()))


def test_every_build_multiplies_bit_for_bit_alike(gguf):
    """Integer sums are exact and each output's float steps are the same sequence in every
    build (VNNI, AVX2): a row's matmul result does not depend on the instruction set. Each
    build's own correctness is the test above; this one needs two builds to compare."""
    loaded = [m for m in (native.load_isa(isa)[0] for isa in BUILDS) if m is not None]
    if len(loaded) < 2:
        pytest.skip(f"{len(loaded)} native build usable here: nothing to compare")
    for t in agreement_cases(gguf):
        x = torch.randn(21, t.shape[1])
        results = [native.pack(m, [t]).matmul(x) for m in loaded]
        for got in results[1:]:
            assert torch.equal(got, results[0])


@pytest.mark.parametrize("isa", BUILDS)
def test_every_row_count_of_each_packing_gives_each_row_alone(isa, gguf):
    """Every pass width of the kernels for each integer packing (Q4_0 / Q4_1 / Q8_0 on every
    build: 8 rows a pass and each remainder of 1-7, its own kernel per width; other packings 4
    a pass; AMX from 5 rows): every row of a call comes out with the bits it has alone."""
    module = module_for(isa)
    for i, t in enumerate(agreement_cases(gguf)):
        w = native.pack(module, [t])
        x = torch.randn(17, t.shape[1]) * torch.logspace(-2, 2, 17)[:, None]
        alone = torch.cat([w.matmul(x[r:r + 1]) for r in range(17)])
        for rows in range(2, 18):
            assert torch.equal(w.matmul(x[:rows]), alone[:rows]), (i, rows)


@pytest.mark.parametrize("qtype,zero", [("Q8_0", 128), ("Q4_0", 8), ("Q4_1", 0)])
def test_symmetric_blocks_are_multiplied_in_integers(qtype, zero):
    """Q8_0 (m = -128 d) and Q4_0 (m = -8 d) take the integer path (sum(u*q) - zero*sum(q));
    Q4_1's free minimums keep their float term. Both stay near the float64 reference."""
    module = module_for(BUILDS[0]) if BUILDS else pytest.skip("no native build runs here")
    t = random_tensor(qtype, 32, 96, seed=5)
    w = native.pack(module, [t])
    assert w.zero == zero
    x = np.random.default_rng(6).standard_normal((5, 96)).astype(np.float32)
    check_against_float64(t, x, w.matmul(torch.from_numpy(x)).double().numpy())


@pytest.mark.parametrize("qtype,n,k", CASES)
def test_amx_tiles_give_the_vnni_path_bits(qtype, n, k):
    """Where the CPU and OS allow AMX, calls of 5 rows or more use the tiles: the same integer
    sums and float steps as vpdpbusd, so the same bits; both near the float64 reference."""
    module = module_for("avx512") if "avx512" in BUILDS else None
    if module is None or not module.use_amx():
        pytest.skip("no AMX tiles here (CPU, OS or ADASPARK_AMX=off)")
    t = random_tensor(qtype, n, k, seed=3 * n + k)
    w = native.pack(module, [t])
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((33, k)).astype(np.float32))
    try:
        for rows in (5, 8, 16, 17, 21, 24, 33):  # one row tile, or several (the last overlapping)
            tiles = w.matmul(x[:rows])
            module.use_amx(False)
            vnni = w.matmul(x[:rows])
            module.use_amx(True)
            assert torch.equal(tiles, vnni), rows
        check_against_float64(t, x.numpy(), tiles.double().numpy())
    finally:
        module.use_amx(True)
