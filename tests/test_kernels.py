"""Repacking GGUF blocks for torch's int4 kernel, the exact fp32 linear, the kernel table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from adaspark.model import kernels
from adaspark.model.gguf import GGUFTensor
from adaspark.model.kernels import KernelTable, Linear, exact_linear, int4_planes

Q = GGMLQuantizationType
PACKED = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def quantised(qtype, rows=48, cols=128, seed=0):
    values = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    return GGUFTensor("w", qtype, (rows, cols), quants.quantize(values, qtype))


@pytest.mark.parametrize("qtype", PACKED)
def test_int4_planes_hold_the_gguf_values(qtype):
    t = quantised(qtype)
    q, scale, zero = int4_planes(t)
    assert q.min() >= 0 and q.max() <= 15
    groups = (q.reshape(t.shape[0], -1, 32).astype(np.float64) - 8) * scale[..., None] \
        + zero[..., None]
    values = groups.reshape(t.shape[0], -1)
    if qtype == Q.Q8_0:  # the high plane and the low plane add up
        values = values[:, :t.shape[1]] + values[:, t.shape[1]:]
    np.testing.assert_allclose(values, t.dequantize(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", PACKED)
def test_int4_kernel_matches_the_dense_weight(qtype):
    t = quantised(qtype)
    lin = Linear([t, quantised(qtype, seed=1)], "fast", torch.device("cpu"))
    x = torch.randn(5, 128).to(torch.bfloat16)
    dense = x.float() @ lin.bf16.float().T
    for kernel in ("int4", "bf16"):
        y = lin(x, kernel).float()
        assert y.shape == (5, 96)
        assert float((y - dense).norm() / dense.norm()) < 1e-2


def test_exact_linear_rows_do_not_depend_on_the_other_rows():
    w, x = torch.randn(960, 576), torch.randn(13, 576)
    whole = exact_linear(x, w, None)
    for rows in ([3], [0, 5], [1, 2, 7], [4, 0, 9, 12, 6], list(range(11))):
        assert torch.equal(exact_linear(x[rows], w, None), whole[rows])


def test_kernel_table_covers_every_width():
    table = KernelTable({1: "int4", 4: "int4", 8: "bf16", 64: "bf16"})
    assert [table.choose(n) for n in (1, 3, 4, 5, 8, 64, 500)] == \
        ["int4", "int4", "int4", "bf16", "bf16", "bf16", "bf16"]
    assert KernelTable.default().choose(1) == "int4"
    assert KernelTable.default().choose(64) == "bf16"


def test_calibration_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine
    linears = [Linear([quantised(Q.Q4_1, 64, 64)], "fast", torch.device("cpu"))]
    measured = kernels.calibrated_table(linears, "toy-model")
    assert set(measured.best.values()) <= {"int4", "bf16"}
    assert set(measured.best) == set(kernels.LADDER)
    assert list((tmp_path / "adaspark" / "kernels").glob("*.json"))

    def measure_again(*args, **kwargs):
        raise AssertionError("the cached calibration was not used")

    monkeypatch.setattr(kernels, "measure_kernels", measure_again)
    assert kernels.calibrated_table(linears, "toy-model").best == measured.best


def test_crossover_is_placed_where_the_ladder_costs_least():
    int4 = {1: 8.0, 2: 8.5, 4: 11.0, 8: 40.0, 16: 35.0, 32: 90.0}  # 8 rows: one slow sample
    bf16 = {1: 30.0, 2: 30.0, 4: 30.0, 8: 30.0, 16: 31.0, 32: 38.0}
    table = kernels.crossover_table({"int4": int4, "bf16": bf16})
    assert table == {1: "int4", 2: "int4", 4: "int4", 8: "bf16", 16: "bf16", 32: "bf16"}
    table = kernels.crossover_table({"int4": int4 | {8: 20.0}, "bf16": bf16})
    assert table[8] == "int4" and table[16] == "bf16"


def test_a_busy_machine_gets_the_default_table_and_nothing_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    linears = [Linear([quantised(Q.Q4_1, 64, 64)], "fast", torch.device("cpu"))]
    assert kernels.calibrated_table(linears, "toy-model").best == KernelTable.default().best
    assert not (tmp_path / "adaspark" / "kernels").exists()


def test_fast_forms_are_built_on_first_use():
    lin = Linear([quantised(Q.Q4_1)], "fast", torch.device("cpu"))
    assert "bf16" not in lin.__dict__ and "int4" not in lin.__dict__
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert lin(x, "int4").shape == (3, 48) and "int4" in lin.__dict__
    lin.build()
    assert "bf16" in lin.__dict__


@pytest.mark.slow
def test_the_torch_weights_are_built_at_load_only_for_the_torch_path(model_path, monkeypatch):
    """With the native forward they serve only the batched paths: a load skips them (seconds);
    without it every forward needs them, so the load builds them."""
    from adaspark.model.transformer import Transformer

    def built(m):
        return {("bf16" in lin.__dict__, "int4" in lin.__dict__) for lin in m.linears()}

    monkeypatch.setenv("ADASPARK_NATIVE", "off")
    assert built(Transformer.from_gguf(model_path, max_context=64, calibrate=False)) == {
        (True, True)}
    monkeypatch.delenv("ADASPARK_NATIVE")
    m = Transformer.from_gguf(model_path, max_context=64, calibrate=False)
    if m.native is None:
        pytest.skip(f"no native forward here: {m.native_note}")
    assert built(m) == {(False, False)}
