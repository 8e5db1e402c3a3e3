"""benchmarks/peer_logits.py against llama.cpp itself: the embedded SmolLM2 (Q4_1), its Q8_0 and
Q4_K_M re-quantisations by llama.cpp's quantiser (made here), and synthetic models.

Needs llama.cpp's venv (benchmarks/vs_llamacpp.py --build-only builds it into the user cache);
CI has none, and every test here skips with that reason."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from adaspark.model import synthetic as syn

SPEC = importlib.util.spec_from_file_location(
    "peer_logits", Path(__file__).resolve().parents[1] / "benchmarks" / "peer_logits.py")
pl = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(pl)

pytestmark = pytest.mark.usefixtures("one_thread")


def _llamacpp_missing() -> str | None:
    python = syn.llamacpp_python()
    if not python.exists():
        return f"llama.cpp's venv is absent ({python.parent.parent}; CI has none: " \
               "benchmarks/vs_llamacpp.py --build-only builds it)"
    if subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode:
        return f"llama_cpp does not import in {python}"
    return None


needs_llamacpp = pytest.mark.skipif(bool(_llamacpp_missing()), reason=_llamacpp_missing() or "")


@pytest.fixture(scope="module")
def embedded_family(tmp_path_factory, model_path):
    """name -> path: the embedded Q4_1 and llama.cpp's Q8_0 and Q4_K_M of it."""
    root = tmp_path_factory.mktemp("requantised")
    family = {"Q4_1": model_path}
    for ftype in ("Q8_0", "Q4_K_M"):
        family[ftype] = syn.requantize(model_path, root / f"smol.{ftype}.gguf", ftype)
    return family


def peer(model: Path, *extra: str) -> dict:
    return pl.run(pl.parse_args(["--model", str(model), "--prompts", "1", "--max-tokens", "8",
                                 "--threads", "1", "--n-ctx", "256",
                                 "--conversations", "/nonexistent", *extra]))


@needs_llamacpp
@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q4_K_M"])
def test_embedded_model_and_requantisations_match_llamacpp(embedded_family, name):
    """Every position within the head's rounding bound (measured max ratio 0.36 for Q4_1, 0.73
    for Q4_K_M), argmaxes parting only at near ties (Q4_K_M: 5 of 44 positions, all near ties),
    greedy replies equal or parting at a near tie."""
    from adaspark.model.gguf import read_gguf

    path = embedded_family[name]
    if name != "Q4_1":  # llama.cpp wrote the types its ftype names
        types = {t.qtype for t in read_gguf(path).tensors.values()}
        assert (Q.Q4_K in types and Q.Q6_K in types) if name == "Q4_K_M" else Q.Q8_0 in types
    r = peer(path, *(() if name == "Q4_1" else ("--no-reference",)))
    s = r["summary"]
    assert s["max_ratio"] <= 1, s
    assert s["argmax_differences_not_near_ties"] == 0 and s["argmax_agree_fast_llama"] >= 0.8, s
    if name == "Q4_1":  # our exact function is as close to llama.cpp as our fast path is
        assert s["max_abs_ref_llama"] <= 2 * s["max_abs_fast_llama"] + 0.5
    g = r["prompts"][0]["greedy"]
    assert g["first_difference"] is None or g["first_difference"]["near_tie"], g


@needs_llamacpp
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_synthetic_qwen3_matches_llamacpp(tmp_path, qtype):
    path = syn.write_model(tmp_path / "q3.gguf", syn.Recipe("qwen3", syn.SHAPES["tiny"], qtype))
    r = peer(path, "--max-chars", "400")
    s = r["summary"]
    assert s["max_ratio"] <= 1 and s["argmax_differences_not_near_ties"] == 0, s


@needs_llamacpp
def test_the_check_sees_a_different_model(tmp_path):
    """Our logits of one seed against llama.cpp's of another: far outside the bound (what a
    wrong layout or a missing bias would look like), where the same file is well within it."""
    recipe = syn.Recipe("qwen2", syn.SHAPES["tiny"], Q.Q8_0)
    ours = syn.write_model(tmp_path / "a.gguf", recipe)
    other = syn.write_model(tmp_path / "b.gguf", syn.replace(recipe, seed=9))
    ids = list(range(10, 500, 41))
    ratios = {}
    for name, theirs in (("same", ours), ("other", other)):
        worker = pl.LogitsWorker(pl.vs.default_venv(), theirs, 1, 128)
        try:
            ratios[name] = pl.Check(ours, worker, 128, reference=False).logits(ids)["summary"]
        finally:
            worker.close()
    assert ratios["same"]["max_ratio"] <= 1
    # (argmaxes still agree often: with a tied head a random model favours its input token)
    assert ratios["other"]["median_ratio"] > 3


@needs_llamacpp
def test_requantize_names_a_bad_file_type(tmp_path, model_path):
    with pytest.raises(RuntimeError, match="could not quantise"):
        syn.requantize(model_path, tmp_path / "x.gguf", "Q9_Z")
    assert not list(tmp_path.iterdir())  # no half-written file left


def test_head_bound_follows_each_sides_rounding():
    """Pure arithmetic (no llama.cpp): a q8 head's bound is both sides' half steps times |W|;
    an F32 head leaves ours alone; the torch path adds the bf16 logit term."""
    import numpy as np

    h = np.zeros((1, 256), np.float32)
    h[0, 0], h[0, 40] = 127.0, 254.0  # 32-block maxima: steps 1 and 2, half steps 0.5 and 1
    w, zero = np.ones((3, 256), np.float32), np.zeros((1, 3), np.float32)
    grow, fl = 1 + 2**-10, 2 * 256 * 2**-24 * 381  # the bound's own rounding, float32 sums
    ours = 0.5 * 32 + 1.0 * 32
    assert np.allclose(pl.head_bound(h, w, "F32", "native-avx2", zero), (ours + fl) * grow)
    # q8_0 activations on llama.cpp's side: the same steps (these scales are fp16-exact)
    assert np.allclose(pl.head_bound(h, w, "Q8_0", "native-avx2", zero), (2 * ours + fl) * grow)
    # q8_K: one step for the whole 256-block, half of 254/127 per input
    assert np.allclose(pl.head_bound(h, w, "Q4_K", "native-avx2", zero),
                       (ours + 256 + fl) * grow)
    # the torch path: bf16 activations and weights, plus its bf16 logits
    assert np.allclose(pl.head_bound(h, w, "F32", "torch-cpu", np.full((1, 3), 512, np.float32)),
                       (381 * 2**-8 + fl + 1.0) * grow)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        pl.head_bound(h, w, "IQ2_XXS", "native-avx2", zero)
