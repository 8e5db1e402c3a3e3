"""LFM2 (short-convolution layers beside a few attention layers): its metadata, its forward
against llama.cpp's on synthetic files, and the conv state under tree verify (a tree row reads
its own path's B*x; the committed state is the accepted path's).

The llama.cpp checks need llama.cpp's venv (benchmarks/vs_llamacpp.py --build-only builds it);
without it they skip with that reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from adaspark.errors import UserError
from adaspark.model import synthetic as syn
from adaspark.model.config import ModelConfig
from adaspark.model.transformer import Transformer


def benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pl = benchmark("peer_logits")

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = syn.LFM2_SHAPES["tiny"]


def _llamacpp_missing() -> str | None:
    import subprocess

    python = syn.llamacpp_python()
    if not python.exists():
        return f"llama.cpp's venv is absent ({python.parent.parent}; CI has none: " \
               "benchmarks/vs_llamacpp.py --build-only builds it)"
    if subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode:
        return f"llama_cpp does not import in {python}"
    return None


needs_llamacpp = pytest.mark.skipif(bool(_llamacpp_missing()), reason=_llamacpp_missing() or "")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm2")
    cache = {}

    def get(qtype: Q, shape: syn.Shape = TINY) -> Path:
        key = (qtype, shape)
        if key not in cache:
            cache[key] = syn.write_model(root / f"lfm2-{len(cache)}-{qtype.name}.gguf",
                                         syn.Recipe("lfm2", shape, qtype, seed=5))
        return cache[key]

    return get


# --- metadata ----------------------------------------------------------------------------------

def _meta(**over) -> dict:
    meta = {"general.architecture": "lfm2", "lfm2.embedding_length": 256,
            "lfm2.attention.head_count": 4, "lfm2.attention.head_count_kv": [0, 0, 2, 0],
            "lfm2.block_count": 4, "lfm2.feed_forward_length": 512, "lfm2.vocab_size": 512,
            "lfm2.shortconv.l_cache": 3}
    meta.update({f"lfm2.{k}": v for k, v in over.items()})
    return meta


def test_per_layer_kv_heads_mark_the_conv_layers():
    c = ModelConfig.from_metadata(_meta())
    assert c.conv_layers == (0, 1, 3) and c.attention_layers == (2,)
    assert c.n_kv_heads == 2 and c.conv_kernel == 3 and c.windows == (0, 0, 0, 0)
    assert c.traits.final_norm == "token_embd_norm.weight"
    windowed = ModelConfig.from_metadata(_meta(**{"attention.sliding_window": 64}))
    assert windowed.windows == (0, 0, 64, 0)  # llama.cpp: every attention layer, not the convs


@pytest.mark.parametrize(("over", "message"), [
    ({"attention.head_count_kv": [0, 2]}, "lists 2 layers"),
    ({"attention.head_count_kv": [0, 2, 4, 0]}, "different KV head counts"),
    ({"shortconv.l_cache": 1}, "at least 2"),
])
def test_bad_lfm2_metadata_is_named(over, message):
    with pytest.raises(UserError, match=message):
        ModelConfig.from_metadata(_meta(**over))


def test_conv_layers_need_a_shortconv_architecture():
    meta = {k.replace("lfm2", "qwen3"): v for k, v in _meta().items()}
    meta["general.architecture"] = "qwen3"
    with pytest.raises(UserError, match="without short-convolution layers"):
        ModelConfig.from_metadata(meta)


def test_shapes_of_the_writer(written):
    big = syn.LFM2_SHAPES["1.2b"]
    specs = {s.name: s for s in syn.tensor_specs(syn.ARCHITECTURES["lfm2"], big)}
    assert big.n_layers == 16 and big.dim == 2048 and len(big.attention_layers) == 6
    assert specs["blk.0.shortconv.in_proj.weight"].shape == (3 * 2048, 2048)
    assert specs["blk.0.shortconv.conv.weight"].shape == (2048, 3)
    assert "blk.2.attn_q_norm.weight" in specs and "blk.0.attn_q.weight" not in specs
    assert "token_embd_norm.weight" in specs and "output_norm.weight" not in specs
    f = Transformer.from_gguf(written(Q.Q4_K), precision="reference", max_context=32)
    assert [layer.conv is not None for layer in f.layers] == [True, True, False, True]


# --- against llama.cpp ---------------------------------------------------------------------------

IDS = list(range(10, 500, 23))


def _reference_ratios(path: Path) -> np.ndarray:
    """Per position: max |ours (reference) - llama.cpp| over the vocabulary, over the head's
    rounding bound (peer_logits.head_bound, with our side's int8 step: the reference rounds
    less than that)."""
    from adaspark.model.gguf import read_gguf

    ref = Transformer.from_gguf(path, precision="reference", max_context=128)
    logits, h = pl.all_logits(ref, IDS, final_norm=True)
    theirs = pl.llamacpp_logits(path, IDS, 128)
    f = read_gguf(path)
    head = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]
    bound = pl.head_bound(h, np.abs(head.dequantize()), head.qtype.name, "native", logits)
    return np.abs(logits - theirs).max(-1) / bound.max(-1)


@needs_llamacpp
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
def test_reference_forward_matches_llamacpp(written, qtype):
    """Measured max ratio 0.56 (Q8_0), 0.26 (Q4_K); the taps read newest-first (a wrong conv
    order) measured ~30."""
    ratios = _reference_ratios(written(qtype))
    assert ratios.max() <= 1, ratios


# --- the conv state under tree verify ------------------------------------------------------------

# a depth-first tree with siblings (rows 1 and 4 under the root; 2, 6 under 1), so its depths
# come out of order: a row's conv must read its own ancestors, not the rows before it
PARENTS = [-1, 0, 1, 2, 0, 4, 1]
TOKENS = [41, 7, 300, 12, 99, 250, 3]


def tree(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(depths, ancestor mask, itself included) of a parent list."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    depths = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
            depths[i] = depths[p] + 1
    return depths, mask


def path_to(row: int) -> list[int]:
    out = []
    while row >= 0:
        out.append(row)
        row = PARENTS[row]
    return out[::-1]


def chain(model: Transformer, tokens: list[int]):
    n = len(tokens)
    return model.verify(tokens, np.arange(n), np.tri(n, dtype=bool), return_logits=True)


@pytest.fixture(scope="module")
def reference(written):
    return Transformer.from_gguf(written(Q.Q4_K), precision="reference", max_context=64)


def check_tree_rows_equal_their_chains(model: Transformer, prompt: list[int]) -> None:
    depths, mask = tree(PARENTS)
    model.reset()
    model.prefill(prompt)
    out = model.verify(TOKENS, depths, mask, return_logits=True)
    for row in range(len(PARENTS)):
        model.truncate(len(prompt))
        alone = chain(model, [TOKENS[r] for r in path_to(row)])
        assert torch.equal(out.logits[row], alone.logits[-1]), row
        assert int(out.argmax[row]) == int(alone.argmax[-1])


@pytest.mark.parametrize("prompt", [[5], [5, 260, 17], list(range(30, 45))],
                         ids=["one-token", "three", "fifteen"])
def test_tree_rows_equal_the_chain_decode_exactly(reference, prompt):
    """Each row of a tree with siblings and out-of-order depths, bit for bit the last row of
    its own path verified as a chain: its conv read its ancestors (and, within L-1 of the root,
    the committed slots; before the first token, zeros)."""
    check_tree_rows_equal_their_chains(reference, prompt)


@pytest.mark.parametrize("forward", ["reference", "native_model"])
def test_the_tree_check_sees_a_conv_that_reads_the_rows_before_it(request, forward,
                                                                   monkeypatch):
    """Conv sources taken by row order (what a plain causal conv over the batch would read):
    the rows whose path is not the rows before them leave their chains."""
    reference = request.getfixturevalue(forward)
    from adaspark.model import transformer

    def by_row_order(depths, ancestors, start, kernel):
        from adaspark.model.shortconv import chain_sources

        return chain_sources(torch.arange(len(depths)) + start, kernel)

    monkeypatch.setattr(transformer, "tree_sources", by_row_order)
    with pytest.raises(AssertionError):
        check_tree_rows_equal_their_chains(reference, [5, 260, 17])


def test_commit_keeps_the_accepted_paths_conv_state(reference):
    """After a tree round accepting a path that is not the first rows (0, 4, 5), the next rows
    equal those after the path verified as a chain and committed: the conv state is the last
    L-1 B*x of the accepted path."""
    prompt, after = [5, 260, 17, 88], [61, 62, 63]
    depths, mask = tree(PARENTS)
    reference.reset()
    reference.prefill(prompt)
    reference.verify(TOKENS, depths, mask)
    reference.commit([0, 4, 5])
    got = chain(reference, after)
    reference.reset()
    reference.prefill(prompt)
    chain(reference, [TOKENS[r] for r in (0, 4, 5)])
    reference.commit([0, 1, 2])
    want = chain(reference, after)
    assert torch.equal(got.logits, want.logits)


def test_a_rejected_round_leaves_the_conv_state(reference):
    """Rows verified and not committed (a round that accepts nothing, or one that failed)
    leave the committed state as it was: the next verify equals one on a fresh prefill."""
    prompt = [5, 260, 17, 88]
    depths, mask = tree(PARENTS)
    reference.reset()
    reference.prefill(prompt)
    reference.verify(TOKENS, depths, mask)  # nothing committed
    got = chain(reference, [70, 71])
    reference.reset()
    reference.prefill(prompt)
    assert torch.equal(got.logits, chain(reference, [70, 71]).logits)


def test_truncate_keeps_the_conv_state_of_the_kept_prefix(reference):
    """Prefix reuse (`keep`): truncated to k tokens, the cache's conv state is the first k
    tokens' own, whatever followed them."""
    reference.reset()
    reference.prefill([5, 260, 17, 88, 9, 10, 11])
    reference.truncate(4)
    got = chain(reference, [70, 71, 72])
    reference.reset()
    reference.prefill([5, 260, 17, 88])
    assert torch.equal(got.logits, chain(reference, [70, 71, 72]).logits)


def test_a_prefill_across_chunks_equals_one_chunk(written, prefill_in_chunks_equals_whole):
    """Chunks of 3 rows: each chunk's first rows read the previous chunk's B*x from the
    committed slots, so every row equals the single-chunk prefill's (argmax and taps)."""
    model = Transformer.from_gguf(written(Q.Q4_K), precision="reference", max_context=64)
    prefill_in_chunks_equals_whole(model, list(range(40, 51)), [0, 3])


# --- every arm emits ar's tokens ------------------------------------------------------------------

def arm_replies(model: Transformer, path: Path, arm: str | None, store: Path) -> list:
    """Greedy replies of `arm` (None: the default arm, which for a model without a drafter is
    ngram) to prompts whose replies repeat (so the n-gram arm proposes trees), a second turn
    reusing the first's cache (keep), and a one-token prompt."""
    from adaspark.engine import Engine
    from adaspark.model.tokenizer import Tokenizer
    from adaspark.options import ModelOptions
    from adaspark.speculative import load_speculator

    tok = Tokenizer.from_gguf(path)
    options = ModelOptions(arm=arm, store=store)
    spec = None if arm == "ar" else load_speculator(model, path, tok.stop_ids, options)
    engine = Engine(model, tok, path, spec)
    engine.reset()
    prompts = [[5, 260, 17, 88, 5, 260, 17], [5, 260, 17, 88, 5, 260, 17, 88, 9], [300]]
    out, accepted = [], 0
    for prompt in prompts:  # the second extends the first: its prefix is reused
        gen = engine.generate_ids(prompt, max_tokens=120)
        out.append((gen.token_ids, gen.finish_reason))
        accepted += gen.timings.accepted_tokens
    return out, spec, accepted


@pytest.mark.parametrize("arm", ["ngram", None], ids=["ngram", "default"])
def test_every_arm_emits_the_ar_tokens(written, tmp_path, arm):
    """The default arm of a model without a drafter is ngram (speculative.NO_DRAFTER_ARM): its
    trees go through verify and commit like every drafting arm's."""
    path = written(Q.Q4_K)
    model = Transformer.from_gguf(path, precision="reference", max_context=256)
    want, _, _ = arm_replies(model, path, "ar", tmp_path)
    got, spec, accepted = arm_replies(model, path, arm, tmp_path)
    assert got == want
    assert spec.arm == "ngram" and accepted > 0  # trees were verified and paths taken


# --- the native forward ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def native_model(written):
    model = Transformer.from_gguf(written(Q.Q4_K), precision="fast", max_context=256,
                                  calibrate=False)
    if model.native is None:
        pytest.skip(f"no native forward here: {model.native_note}")
    return model


@needs_llamacpp
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q4_0], ids=lambda t: t.name)
def test_native_forward_matches_llamacpp(written, qtype):
    """Every position within the head's rounding bound (measured max ratio 0.46 for Q8_0, 0.27
    for Q4_K), argmaxes parting only at near ties, greedy replies equal or parting at one.
    (Q6_K, whose weights round least, sits at the bound itself: 0.98 here, one position of 93
    at 1.11 on the chat prompt, our float32 reference 0.84: the rounding below the head, which
    the bound leaves out, passes through LFM2's products B*x and C*conv.)"""
    path = written(qtype)
    if Transformer.from_gguf(path, max_context=32, calibrate=False).native is None:
        pytest.skip("no native forward here")
    r = pl.run(pl.parse_args(["--model", str(path), "--prompts", "1", "--max-tokens", "16",
                              "--threads", "1", "--n-ctx", "256", "--max-chars", "400",
                              "--conversations", "/nonexistent"]))
    s = r["summary"]
    assert s["max_ratio"] <= 1 and s["argmax_differences_not_near_ties"] == 0, s
    g = r["prompts"][0]["greedy"]
    assert g["first_difference"] is None or g["first_difference"]["near_tie"], g


@pytest.mark.parametrize("prompt", [[5], list(range(30, 45))], ids=["one-token", "fifteen"])
def test_native_tree_rows_equal_the_chain_decode_exactly(native_model, prompt):
    check_tree_rows_equal_their_chains(native_model, prompt)


def test_native_commit_keeps_the_accepted_paths_conv_state(native_model):
    test_commit_keeps_the_accepted_paths_conv_state(native_model)


def test_native_chunked_prefill_equals_one_chunk(native_model, prefill_in_chunks_equals_whole):
    """The first rows of each chunk read the previous chunk's B*x from the cache: bit for bit
    the rows of one whole prefill."""
    prefill_in_chunks_equals_whole(native_model, list(range(40, 51)), [0, 3], exact=True)


def test_native_batched_sequences_equal_each_alone(native_model):
    """verify_many / prefill_many of two sequences in one native call: each row, and each
    cache's B*x slots, as that sequence's own call gives them."""
    depths, mask = tree(PARENTS)
    prompts = [[5, 260, 17, 88], [300, 301]]
    caches = [native_model.new_cache() for _ in prompts]
    outs = native_model.prefill_many(caches, prompts, return_logits=True)
    both = native_model.verify_many(caches, [(TOKENS, depths, mask), (TOKENS[:3], depths[:3],
                                                                       mask[:3, :3])],
                                    return_logits=True)
    for s, prompt in enumerate(prompts):
        alone = native_model.new_cache()
        with native_model.using(alone):
            first = native_model.prefill(prompt, return_logits=True)
            rows = TOKENS if s == 0 else TOKENS[:3]
            mine = native_model.verify(rows, depths[:len(rows)], mask[:len(rows), :len(rows)],
                                       return_logits=True)
        assert torch.equal(outs[s].logits, first.logits)
        at = 0 if s == 0 else len(TOKENS)
        assert torch.equal(both.logits[at:at + len(rows)], mine.logits)
        end = len(prompt) + len(rows)
        assert torch.equal(caches[s].conv[:, :, :end], alone.conv[:, :, :end])


@pytest.mark.parametrize("arm", ["ngram", None], ids=["ngram", "default"])
def test_every_arm_emits_the_ar_tokens_on_the_native_forward(native_model, written, tmp_path,
                                                              arm):
    path = written(Q.Q4_K)
    want, _, _ = arm_replies(native_model, path, "ar", tmp_path)
    got, spec, accepted = arm_replies(native_model, path, arm, tmp_path)
    assert got == want and accepted > 0


def test_batched_causal_paths_carry_each_sequences_conv_state(reference):
    """The drafter-data paths (right-padded sequences in one batch, one row per sequence at
    slots of their own): each sequence's greedy tokens and taps are its own alone."""
    prompts = [[5, 260, 17, 88, 9], [300, 301]]
    both = reference.generate_greedy_batch(prompts, 6, set())
    assert both == [reference.generate_greedy_batch([p], 6, set())[0] for p in prompts]
    reference.reset()
    taps = reference.hidden_states_batch(prompts, [1, 3])
    for prompt, got in zip(prompts, taps, strict=True):
        reference.reset()
        want = reference.prefill(prompt, [1, 3]).hiddens
        for layer in (1, 3):
            torch.testing.assert_close(got[layer], want[layer], rtol=1e-5, atol=1e-5)


def test_the_cache_holds_kv_for_attention_layers_and_bx_for_conv_layers(native_model):
    """K/V only for the attention layer, fp16 B*x slots for the three conv layers; a server
    slot's size (worker.slot_bytes) counts both."""
    from types import SimpleNamespace

    from adaspark.server.worker import slot_bytes

    cache, c = native_model.cache, native_model.config
    assert cache.k.shape == (1, 1, c.n_kv_heads, cache.capacity, c.head_dim)
    assert cache.conv.shape == (3, 1, cache.capacity, c.dim)
    assert cache.conv.dtype == torch.float16
    kv = 2 * cache.k.numel() * 2
    engine = SimpleNamespace(target=native_model)
    assert slot_bytes(engine) == kv + cache.conv.numel() * 2


def test_requests_batched_in_the_server_loop_equal_each_alone(native_model, written):
    """Continuous batching (batch.py): requests joining at different steps, each over its own
    slot (its own B*x), a second turn reusing a slot's prefix: every reply as alone."""
    from test_batch import alone, together

    from adaspark.engine import Engine
    from adaspark.model.tokenizer import Tokenizer

    path = written(Q.Q4_K)
    engine = Engine(native_model, Tokenizer.from_gguf(path), path)
    engine.reset()
    prompts = [[5, 260, 17, 88], [300, 301, 7], [9]]
    solo = [alone(engine, p, max_tokens=n).token_ids for p, n in zip(prompts, (20, 8, 14),
                                                                       strict=True)]
    seqs, widths = together(engine, [{"prompt": p, "max_tokens": n} for p, n
                                     in zip(prompts, (20, 8, 14), strict=True)], joins=[0, 2, 4])
    assert [engine.result(seq).token_ids for seq in seqs] == solo
    assert max(widths) == 3
    # the next turn of the first conversation reuses its slot's prefix (and conv state)
    turn = prompts[0] + solo[0] + [61, 62]
    again, _ = together(engine, [{"prompt": turn, "max_tokens": 10}])
    assert engine.result(again[0]).timings.reused_tokens > 0
    engine.reset()
    assert engine.result(again[0]).token_ids == alone(engine, turn, max_tokens=10).token_ids


def test_a_tree_whose_depths_skip_an_ancestor_is_refused(reference):
    """A row at depth 2 whose mask names no depth-1 ancestor: its conv would read a slot no
    row wrote, so the verify is refused, naming the disagreement."""
    reference.reset()
    reference.prefill([5, 260, 17])
    mask = np.array([[True, False], [True, True]])
    with pytest.raises(ValueError, match="ancestor mask and depths disagree"):
        reference.verify([7, 8], [0, 2], mask)


@needs_llamacpp
def test_float32_weights_leave_only_llamacpps_fp16_cache_between_the_engines(written):
    """With F32 weights llama.cpp multiplies float32 activations: what is left between it and
    our reference is its fp16 K/V and summation order. Measured max |difference| 0.004 on
    logits of std ~4 (the native forward, int8 activations: 0.009); conv taps read newest-first
    move them by ~24. The limit, 0.05, is ten times the measured and far below any wrong part."""
    path = written(Q.F32)
    ref = Transformer.from_gguf(path, precision="reference", max_context=128)
    ours = pl.all_logits(ref, IDS)
    theirs = pl.llamacpp_logits(path, IDS, 128)
    assert np.abs(ours - theirs).max() <= 0.05
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_verify_cost_times_the_native_calls_of_a_hybrid(native_model):
    """benchmarks/verify_cost.py's host-overhead probe calls the native forward directly; on a
    hybrid it must hand over the conv state and each row's sources as verify does (without
    them the native forward refuses the call)."""
    vc = benchmark("verify_cost")
    native_model.reset()
    native_model.prefill(list(range(30, 45)))
    out = vc.host_overhead_ms(native_model, reps=3)
    assert out["verify_ms"] > 0 and out["native_calls_ms"] > 0


def native_ab_and_dense(tmp_path, seed):
    """benchmarks/native_ab.py, the native build and a tiny dense Qwen3 file (skips without a
    native build)."""
    from adaspark.model import native

    ab = benchmark("native_ab")
    module, why = native.load()
    if module is None:
        pytest.skip(f"no native forward here: {why}")
    dense = syn.write_model(tmp_path / "qwen3.gguf",
                            syn.Recipe("qwen3", syn.SHAPES["tiny"], Q.Q4_K, seed=seed))
    return ab, module, dense


def test_native_ab_times_a_dense_file_and_refuses_a_hybrid(written, tmp_path):
    """benchmarks/native_ab.py --model: a dense file is prefilled without a drafter; a hybrid
    is refused by name (its conv layers need the state verify_cost.py hands over)."""
    from adaspark.model.gguf import read_gguf

    ab, module, dense = native_ab_and_dense(tmp_path, 3)
    target, drafter, hiddens = ab.with_module(module, dense, read_gguf(dense), None,
                                              list(range(100, 140)))
    assert drafter is None and hiddens is None and target.native is not None
    hybrid = written(Q.Q4_K)
    with pytest.raises(SystemExit, match="hybrid"):
        ab.with_module(module, hybrid, read_gguf(hybrid), None, list(range(100, 140)))


def test_native_ab_many_step_equals_each_sequence_alone(tmp_path):
    """benchmarks/native_ab.py --many: its caches hold contexts of half to one and a half
    `context`, and its step (one row at the end of each cache, one native call) picks what
    each sequence's own verify alone picks there."""
    from adaspark.model.gguf import read_gguf

    ab, module, dense = native_ab_and_dense(tmp_path, 5)
    ids = [(7 * i) % 200 + 30 for i in range(120)]
    target, _, _ = ab.with_module(module, dense, read_gguf(dense), None, ids[:40], 256)
    caches = ab.many_caches(target, ids, 4, 40)
    assert [c.length for c in caches] == [20, 33, 46, 60]
    picks = ab.step_many(target, caches, 99)
    alone = []
    for cache in caches:
        with target.using(cache):
            out = target.verify([99], np.array([0]), np.array([[True]]))
        alone.append(int(out.argmax[0]))
    assert picks == alone and [c.length for c in caches] == [20, 33, 46, 60]
