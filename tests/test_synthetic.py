"""adaspark.model.synthetic: random GGUF models of any shape and weight type.

Every architecture and type must load through read_gguf with the recipe's shapes and types, its
blocks must decode (gguf's dequantiser) to the values they were written from, and the model must
run: the fast forward (whichever the loader picks: native or torch) against the float32
reference, and Engine.load with the tokenizer the writer puts in the metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from adaspark.model import synthetic as syn
from adaspark.model.config import ModelConfig
from adaspark.model.gguf import read_gguf
from adaspark.model.kernels import exact_linear
from adaspark.model.native import blocks
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = syn.SHAPES["tiny"]
# rms error / std of a gguf-quantised normal matrix: the types' own precision, with room
RMS_ERROR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 0.01, Q.Q5_0: 0.05, Q.Q5_1: 0.05,
             Q.Q4_0: 0.11, Q.Q4_1: 0.11}


@pytest.fixture(scope="module")
def tokenizer_meta():
    return syn.embedded_tokenizer()


@pytest.fixture(scope="module")
def written(tmp_path_factory, tokenizer_meta):
    """(arch, type) -> path of a tiny model, written once for the module."""
    root = tmp_path_factory.mktemp("synthetic")
    cache = {}

    def get(arch: str, qtype: Q):
        if (arch, qtype) not in cache:
            recipe = syn.Recipe(arch, syn.shapes_of(arch)["tiny"], qtype, seed=3)
            cache[arch, qtype] = syn.write_model(root / f"{arch}-{qtype.name}.gguf", recipe,
                                                 tokenizer_meta)
        return cache[arch, qtype]

    return get


ARCH_TYPES = [(a, t) for a in syn.ARCHITECTURES for t in syn.TYPES]


@pytest.mark.parametrize(("arch", "qtype"), ARCH_TYPES, ids=lambda x: getattr(x, "name", x))
def test_every_arch_and_type_loads_with_its_shapes(written, arch, qtype):
    f = read_gguf(written(arch, qtype))
    tiny = syn.shapes_of(arch)["tiny"]
    specs = syn.tensor_specs(syn.ARCHITECTURES[arch], tiny)
    assert f.architecture == arch and set(f.tensors) == {s.name for s in specs}
    for s in specs:
        t = f.tensors[s.name]
        assert t.shape == s.shape  # (n,), (rows, inputs) or (experts, rows, inputs)
        # conv taps and routers F32, as llama.cpp's converter keeps them
        kept = s.name.endswith(syn.F32_MATRICES)
        assert t.qtype == (qtype if len(s.shape) > 1 and not kept else Q.F32), s.name
    c = ModelConfig.from_metadata(f.metadata)
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == (
        tiny.n_layers, tiny.dim, tiny.n_heads, tiny.n_kv_heads, tiny.head_dim, tiny.ffn_dim,
        tiny.vocab_size)
    attention = tuple(range(tiny.n_layers)) if tiny.attention_layers is None else \
        tiny.attention_layers
    assert c.attention_layers == attention
    kind = syn.ARCHITECTURES[arch]
    assert c.conv_kernel == (tiny.conv_kernel if kind.shortconv else 0)
    assert ("blk.0.attn_q.bias" in f.tensors) == (arch == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in f.tensors) == (kind.qk_norm and 0 in attention)
    assert (c.experts is not None) == kind.moe
    if kind.moe:  # the expert keys as written
        assert (c.experts.count, c.experts.used, c.experts.ffn_dim, c.experts.dense_lead) == (
            tiny.experts, tiny.experts_used, tiny.expert_ffn_dim, tiny.dense_lead)


@pytest.mark.parametrize("qtype", syn.QUANTIZED_BY_GGUF, ids=lambda t: t.name)
def test_gguf_dequantiser_round_trip(written, qtype):
    """Stored blocks decode to the drawn values within the type's precision; F32 exactly."""
    f = read_gguf(written("qwen3", qtype))
    spec = next(s for s in syn.tensor_specs(syn.ARCHITECTURES["qwen3"], TINY)
                if s.name == "blk.1.ffn_down.weight")
    drawn = syn.tensor_data(spec, Q.F32, seed=3)  # the same generator: the values before encoding
    decoded = f.tensors[spec.name].dequantize()
    rms = float(np.sqrt(np.mean((decoded - drawn) ** 2))) / spec.std
    assert rms <= RMS_ERROR[qtype]
    if qtype != Q.F32:
        assert rms > 0  # it was quantised, not stored as float32


@pytest.mark.parametrize("qtype", list(syn.K_SCALE_OFFSETS), ids=lambda t: t.name)
def test_random_k_blocks_are_valid_and_scaled(written, qtype):
    f = read_gguf(written("llama", qtype))
    spec = next(s for s in syn.tensor_specs(syn.ARCHITECTURES["llama"], TINY)
                if s.name == "blk.0.attn_q.weight")
    t = f.tensors[spec.name]
    w = t.dequantize()
    assert np.isfinite(w).all()
    assert abs(w.std() / spec.std - 1) < 0.1  # d set from the block's own spread
    d_at, m_at = syn.K_SCALE_OFFSETS[qtype]
    raw = np.asarray(t.data).reshape(-1, syn.GGML_QUANT_SIZES[qtype][1])
    d = raw[:, d_at:d_at + 2].copy().view(np.float16)
    assert np.isfinite(d).all() and (d > 0).all()
    if m_at is not None:  # dmin centres each block
        assert np.abs(w.reshape(-1, 256).mean(-1)).max() < 0.05 * spec.std


def test_k_quant_needs_whole_super_blocks():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        syn.random_k_blocks(rng, Q.Q4_K, 4, 96, 0.1)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        syn.encode(np.zeros((2, 48), np.float32), Q.Q4_0)


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the native forward quantises activations (qweight.h quantize_row): per 32
    inputs, q = round(clamp(x * 127 / amax, -127, 127)), x^ = q * amax / 127."""
    b = x.float().unflatten(-1, (-1, 32))
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.clamp(b * inv, -127, 127).round() * (amax / 127)).flatten(-2)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


class FastRounding:
    """A reference Linear that rounds where the fast forward rounds, float32 otherwise.
    Native: integer-typed weights take int8 activations (dense F32/F16/BF16 ones float32), the
    bias is bf16, and K/V (the qkv's last kv_from.. columns) are stored in fp16. Torch path:
    bf16 activations, weights and outputs."""

    def __init__(self, lin, native: bool, integer: bool, kv_from: int | None = None):
        self.lin, self.native, self.integer, self.kv_from = lin, native, integer, kv_from

    def __call__(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        w, b = self.lin.fp32, self.lin.bias
        b = None if b is None else bf16(b)
        if not self.native:
            return bf16(exact_linear(bf16(x), bf16(w), b))
        y = exact_linear(int8_blocks(x) if self.integer else x, w, b)
        if self.kv_from is not None:
            y = torch.cat([y[:, :self.kv_from], y[:, self.kv_from:].half().float()], -1)
        return y


def with_fast_rounding(model: Transformer, native: bool, integer: bool) -> Transformer:
    """The reference model, its every projection rounding as the fast forward's does."""
    q_cols = model.config.n_heads * model.config.head_dim
    for block in model.layers:  # the projections are cached properties: instance attributes
        mixer = () if block.conv else ("qkv", "o")
        ffn = () if block.moe else ("gate_up", "down")
        for name in (*mixer, *ffn):
            block.__dict__[name] = FastRounding(getattr(block, name), native, integer,
                                                q_cols if name == "qkv" else None)
        if block.conv:  # a conv layer's projections (ShortConv keeps them likewise)
            for name in ("in_proj", "out_proj"):
                block.conv.__dict__[name] = FastRounding(getattr(block.conv, name), native,
                                                         integer)
        if block.moe:  # each expert's projections (MoE keeps them by expert id); the router
            for e in range(block.moe.experts.count):  # stays float32 on every forward
                block.moe._linears[e] = tuple(FastRounding(lin, native, integer)
                                              for lin in block.moe.expert(e))
    model.output = FastRounding(model.output, native, integer)
    if native:  # the native forward keeps the conv layers' B*x in fp16, as its K/V
        model.cache.conv = model.cache.conv.half()
    return model


# routed architectures choose experts by comparing scores: a rounding that moves a row by 1%
# can swap two experts whose scores sit within that, a discrete jump no rounding bound covers,
# so their forwards are compared per routed FFN on shared inputs instead (test_moe.py)
DENSE_ARCH_TYPES = [(a, t) for a, t in ARCH_TYPES if not syn.ARCHITECTURES[a].moe]


@pytest.mark.parametrize(("arch", "qtype"), DENSE_ARCH_TYPES,
                         ids=lambda x: getattr(x, "name", x))
def test_fast_forward_agrees_with_the_reference(written, arch, qtype):
    """Whatever forward the loader picks for this type, its logits are as far from the float32
    reference as its rounding puts them, and the argmax is the reference's wherever the top two
    are further apart than twice the largest difference (within that, rounding may swap them).

    The bound comes from the data, not a fixed fraction: the reference forward run again with
    the fast forward's rounding at every projection (FastRounding: the native int8 activation
    blocks, its bf16 bias and fp16 K/V; or the torch path's bf16 matmuls) moves the logits by
    `rounding`, the size of what that rounding does to this model (3% to 9% of the logits'
    spread for int8 activations here, under 0.3% for float32 ones with fp16 K/V). The fast forward
    rounds by the same rules on activations that differ from the emulation's by the rounding
    before them, so its difference is another draw of the same size (measured 0.7x to 1.4x of
    `rounding` over every architecture and type); twice `rounding` leaves room for the steps it
    does not emulate (summation order, the torch path's bf16 norms, attention and residuals). A
    wrong kernel, scale or missing part moves logits by their own spread: tens of `rounding`."""
    path = written(arch, qtype)
    ids = list(range(5, 480, 37))
    n = len(ids)
    mask = np.tril(np.ones((n, n), dtype=bool))

    def load(precision: str) -> Transformer:
        return Transformer.from_gguf(path, precision=precision, max_context=64, calibrate=False)

    fast_model = load("fast")
    native, integer = fast_model.native is not None, qtype in blocks.INTEGER
    models = [load("reference"), fast_model,
              with_fast_rounding(load("reference"), native, integer)]
    outs = [m.verify(ids, list(range(n)), mask, return_logits=True) for m in models]
    ref, fast, emulated = (o.logits.float() for o in outs)
    diff, rounding = float((fast - ref).abs().max()), float((emulated - ref).abs().max())
    assert 0 < rounding < 0.2 * float(ref.std())  # the emulation rounds, and only a little
    assert diff <= 2 * rounding, (diff, rounding)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    assert torch.equal(outs[1].argmax[clear], outs[0].argmax[clear])


def test_seeded_and_per_tensor(tmp_path, tokenizer_meta):
    """Same seed: the same bytes; another seed: other weights; a tensor's values do not depend
    on which other tensors the model has."""
    a, b, c = (syn.write_model(tmp_path / f"{i}.gguf", syn.Recipe("llama", TINY, Q.Q4_0, seed=s),
                               tokenizer_meta) for i, s in enumerate((1, 1, 2)))
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()
    deeper = syn.write_model(tmp_path / "deep.gguf", syn.Recipe(
        "llama", syn.replace(TINY, n_layers=3), Q.Q4_0, seed=1), tokenizer_meta)
    name = "blk.1.ffn_up.weight"
    assert np.array_equal(read_gguf(a).tensors[name].data, read_gguf(deeper).tensors[name].data)


def test_type_overrides_pick_the_longest_match():
    r = syn.Recipe(qtype=Q.Q4_0, overrides={"ffn": Q.Q8_0, "ffn_down": Q.Q6_K})
    spec = {s.name: s for s in syn.tensor_specs(syn.ARCHITECTURES["qwen3"], TINY)}
    assert r.type_of(spec["blk.0.ffn_down.weight"]) == Q.Q6_K
    assert r.type_of(spec["blk.0.ffn_up.weight"]) == Q.Q8_0
    assert r.type_of(spec["blk.0.attn_q.weight"]) == Q.Q4_0
    assert r.type_of(spec["blk.0.attn_norm.weight"]) == Q.F32


def test_untied_models_write_an_output_matrix(tmp_path, tokenizer_meta):
    path = syn.write_model(tmp_path / "u.gguf", syn.Recipe(
        "qwen2", syn.replace(TINY, tied=False), Q.Q8_0), tokenizer_meta)
    f = read_gguf(path)
    assert f.tensors["output.weight"].shape == (TINY.vocab_size, TINY.dim)


def test_cut_vocabulary_is_a_working_bpe(tokenizer_meta):
    """Cut to 512 tokens: every kept merge builds a kept token, and text still round-trips
    (through shorter tokens) with the chat template's control tokens intact."""
    meta = syn.fit_vocab(tokenizer_meta, 512)
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == len(meta["tokenizer.ggml.token_type"]) == 512
    assert all(m.replace(" ", "", 1) in set(tokens) for m in meta["tokenizer.ggml.merges"])
    assert len(meta["tokenizer.ggml.merges"]) == 512 - syn.SMOL_BASE
    small, full = Tokenizer(meta), Tokenizer(tokenizer_meta)
    text = "The quick brown fox, 42 times over.\nDone."
    ids = small.encode(text)
    assert small.decode(ids) == text and max(ids) < 512 and len(ids) > len(full.encode(text))
    chat = small.encode_chat([{"role": "user", "content": "hi"}])
    assert small.eot_id in chat and small.stop_ids <= set(range(512))


def test_padded_vocabulary_keeps_the_tokenizer(tokenizer_meta):
    """Beyond SmolLM2's 49152 tokens: [PADn] tokens of type UNUSED; the same encoding."""
    meta = syn.fit_vocab(tokenizer_meta, 49152 + 64)
    assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{49152 + 63}]"
    assert set(meta["tokenizer.ggml.token_type"][49152:]) == {syn.UNUSED}
    text = "Padding changes nothing the text can reach."
    assert Tokenizer(meta).encode(text) == Tokenizer(tokenizer_meta).encode(text)
    with pytest.raises(ValueError, match="byte tokens"):
        syn.fit_vocab(tokenizer_meta, 100)


def test_engine_loads_and_replies(written):
    from adaspark.engine import Engine

    engine = Engine.load(written("qwen3", Q.Q4_0), arm="ar", max_context=256)
    gen = engine.generate([{"role": "user", "content": "Say something."}], max_tokens=6)
    assert 1 <= len(gen.token_ids) + (gen.stop_token_id is not None) <= 6
    assert engine.tokenizer.vocab_size == TINY.vocab_size


def test_cli_writes_the_file(tmp_path):
    out = tmp_path / "cli.gguf"
    assert syn.main(["--arch", "qwen2", "--shape", "tiny", "--layers", "1", "--type", "q5_k",
                     "--tensor-type", "ffn_down=Q8_0", "--seed", "7", "--out", str(out)]) == 0
    f = read_gguf(out)
    assert f.architecture == "qwen2" and f.metadata["qwen2.block_count"] == 1
    assert f.tensors["blk.0.attn_q.weight"].qtype == Q.Q5_K
    assert f.tensors["blk.0.ffn_down.weight"].qtype == Q.Q8_0
    with pytest.raises(SystemExit):
        syn.parse_args(["--type", "IQ2_XXS"])
