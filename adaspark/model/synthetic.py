"""Synthetic GGUF models: any shape, random weights from a seed, each tensor in a chosen type.

They exercise what a real model would (the architectures' layouts, every weight type the reader
takes, a Qwen3-0.6B-sized forward) without downloading one, and a peer (llama.cpp) loads them
as it loads a converted model. Not engine code at run time: tests, benchmarks and the peer
check (benchmarks/peer_logits.py) write them, into the user cache or a temporary directory.

    python -m adaspark.model.synthetic --arch qwen3 --shape 0.6b --type Q4_0 --out FILE
    python -m adaspark.model.synthetic --requantize SRC.gguf --ftype Q4_K_M --out FILE

Weights. Matrices are normal with std 1/sqrt(inputs), so every linear's output is the size of
its input; the embedding (also the head when tied) has std LOGIT_SCALE/sqrt(dim), so logits of
a unit-RMS final row come out with std ~LOGIT_SCALE, peaked like a real model's rather than
flat. Norm weights are 1 + N(0, 0.1^2), qwen2's q/k/v biases N(0, 0.1^2); vectors stay F32
whatever the chosen type (llama.cpp's converter keeps them so too). Each tensor draws from its
own generator seeded by (seed, tensor name): a tensor's values do not depend on the others.

Types. F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 by gguf.quants.quantize (what
convert_hf_to_gguf writes). gguf 0.19 does not quantise K-quants, so Q2_K..Q6_K blocks are
random VALID blocks: random bytes for the quants and sub-block scales, and each block's fp16
super-scale d (and dmin, where the type has one) set from the block's own decoded values so the
block has mean 0 (dmin) and the matrix's std (d). They dequantise to finite numbers by gguf's
code and llama.cpp's alike.

Tokenizer. The embedded SmolLM2's byte-level BPE (its merges are ranked in id order: merge i
makes token 252 + i), cut to the first `vocab` tokens with the merges whose result survives, or
padded beyond its 49152 tokens with [PADn] tokens of type UNUSED (what convert_hf_to_gguf does
for Qwen's padded vocabularies); its chat template comes along, so Engine.load and chat work.

Architectures: llama, qwen2 (q/k/v biases), qwen3 (per-head q/k norms), lfm2 (LFM2's short
convolution layers beside a few attention layers: shapes of their own, LFM2_SHAPES; the conv
taps stay F32 whatever the type, as llama.cpp's converter keeps them), qwen3moe and lfm2moe
(routed FFNs: a router kept F32, three 3-D expert tensors in the chosen type, lfm2moe's
selection bias; QWEN3MOE_SHAPES, LFM2MOE_SHAPES). Another is one more
ARCHITECTURES entry: its per-layer vectors, whether it has biases, and a hook for its own
metadata keys; gemma3 would add ("post_attention_norm", "post_ffw_norm") to layer_norms, the
q/k norms, and its sliding-window and embedding-scale keys in `metadata`.

Requantising runs llama.cpp's own quantiser (llama_model_quantize, allow_requantize) on
llama.cpp's python in a subprocess: `--ftype Q4_K_M`, Q5_K_M, Q6_K, Q8_0, F16, ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import platformdirs
from gguf import (
    GGML_QUANT_SIZES,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    quants,
)

Q = GGMLQuantizationType
LOGIT_SCALE = 4.0
QUANTIZED_BY_GGUF = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
# K-quants: byte offsets of the fp16 super-block scale d and of dmin (None: the type has none)
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
                   Q.Q6_K: (208, None)}
TYPES = (*QUANTIZED_BY_GGUF, *K_SCALE_OFFSETS)
# matrices kept F32 whatever the type (as llama.cpp's converter keeps them): conv taps, routers
F32_MATRICES = ("shortconv.conv.weight", "ffn_gate_inp.weight")
ROWS_PER_CHUNK = 4096  # rows drawn and quantised at a time: bounds memory on big tensors

SMOL_BASE = 252  # SmolLM2: 17 control tokens and 235 byte tokens come before the first merge
UNUSED = 5  # llama.cpp's token type for padding


@dataclass(frozen=True)
class Shape:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    context_length: int = 4096
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    tied: bool = True  # no output.weight: the head is the embedding
    attention_layers: tuple[int, ...] | None = None  # lfm2: the layers that attend (None: all)
    conv_kernel: int = 3  # lfm2: the conv layers' window (shortconv.l_cache)
    experts: int = 0  # routed FFNs (qwen3moe, lfm2moe): experts per layer ...
    experts_used: int = 0  # ... the top-k each row runs ...
    expert_ffn_dim: int = 0  # ... each expert's width ...
    dense_lead: int = 0  # ... after this many dense-FFN layers


# Qwen3's published configs (config.json of Qwen/Qwen3-0.6B and -1.7B: 28 layers, 16 query
# and 8 KV heads of 128, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6, tied embeddings,
# 40960 positions). "tiny": whole K-quant super-blocks (256) in every matrix's inputs, a head
# size the native forward takes, a vocabulary the SmolLM2 BPE can be cut to.
SHAPES = {
    "tiny": Shape(2, 256, 4, 2, 64, 512, 512, context_length=1024),
    "0.6b": Shape(28, 1024, 16, 8, 128, 3072, 151936, context_length=40960),
    "1.7b": Shape(28, 2048, 16, 8, 128, 6144, 151936, context_length=40960),
}


# LFM2's: "tiny" conv, conv, attention, conv (both kinds of layer, a conv state crossing an
# attention layer); "1.2b" LiquidAI/LFM2-1.2B's config.json (16 layers, attention at 2, 5, 8,
# 10, 12, 14, 32 heads and 8 KV heads of 64, the FFN auto-adjusted to 8192, vocab 65536,
# rope_theta 1e6, norm_eps 1e-5, L_cache 3, tied embeddings, 128000 positions).
LFM2_SHAPES = {
    "tiny": Shape(4, 256, 4, 2, 64, 512, 512, context_length=1024, attention_layers=(2,)),
    "1.2b": Shape(16, 2048, 32, 8, 64, 8192, 65536, context_length=128000, norm_eps=1e-5,
                  attention_layers=(2, 5, 8, 10, 12, 14)),
}


# Routed FFNs. "tiny": every path in a few MB (K-quant super-blocks in every matrix's inputs,
# 8 experts, enough that rows choose differently); qwen3moe "30b-a3b" Qwen/Qwen3-30B-A3B's
# config.json (48 layers, 32 query and 4 KV heads of 128, 128 experts top-8 of width 768, the
# dense width 6144 written but unused, vocab 151936, untied head, 40960 positions); lfm2moe
# "8b-a1b" LiquidAI/LFM2-8B-A1B's (24 layers, 2 dense ones of width 7168 first, 32 experts
# top-4 of width 1792, 32 heads and 8 KV heads of 64, vocab 65536, tied; attention layers
# assumed at 2, 6, 10, 14, 18, 21: six, as in the 1.2B, from the model card's layer_types).
QWEN3MOE_SHAPES = {
    "tiny": Shape(2, 256, 4, 2, 64, 512, 512, context_length=1024, experts=8, experts_used=2,
                  expert_ffn_dim=256),
    "30b-a3b": Shape(48, 2048, 32, 4, 128, 6144, 151936, context_length=40960, tied=False,
                     experts=128, experts_used=8, expert_ffn_dim=768),
}
LFM2MOE_SHAPES = {
    "tiny": Shape(4, 256, 4, 2, 64, 512, 512, context_length=1024, attention_layers=(2,),
                  experts=8, experts_used=3, expert_ffn_dim=256, dense_lead=1),
    "8b-a1b": Shape(24, 2048, 32, 8, 64, 7168, 65536, context_length=128000, norm_eps=1e-5,
                    attention_layers=(2, 6, 10, 14, 18, 21), experts=32, experts_used=4,
                    expert_ffn_dim=1792, dense_lead=2),
}


@dataclass(frozen=True)
class Arch:
    name: str
    bias: bool = False  # q/k/v biases (qwen2)
    qk_norm: bool = False  # RMSNorm per head on q and k (qwen3)
    layer_norms: tuple[str, ...] = ("attn_norm", "ffn_norm")  # per-layer vectors of dim
    metadata: Callable[[GGUFWriter, Shape], None] | None = None  # the arch's own keys
    shapes: Mapping[str, Shape] | None = None  # its own named shapes (None: SHAPES)
    final_norm: str = "output_norm"
    shortconv: bool = False  # layers outside shape.attention_layers are short convolutions
    moe: bool = False  # routed FFNs past shape.dense_lead (experts, a router)
    selection_bias: bool = False  # the router's exp_probs_b (lfm2moe)


def _lfm2_metadata(w: GGUFWriter, s: Shape) -> None:
    """Per-layer KV heads (0: a conv layer) and the conv window, as convert_hf_to_gguf writes."""
    attn = _attention_layers(s)
    w.add_head_count_kv([s.n_kv_heads if i in attn else 0 for i in range(s.n_layers)])
    w.add_shortconv_l_cache(s.conv_kernel)


def _experts_metadata(w: GGUFWriter, s: Shape) -> None:
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.experts_used)
    w.add_expert_feed_forward_length(s.expert_ffn_dim)


def _lfm2moe_metadata(w: GGUFWriter, s: Shape) -> None:
    """lfm2's keys and the experts', as convert_hf_to_gguf's LFM2MoeModel writes them."""
    _lfm2_metadata(w, s)
    _experts_metadata(w, s)
    w.add_leading_dense_block_count(s.dense_lead)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)


ARCHITECTURES = {"llama": Arch("llama"), "qwen2": Arch("qwen2", bias=True),
                 "qwen3": Arch("qwen3", qk_norm=True),
                 "lfm2": Arch("lfm2", qk_norm=True, metadata=_lfm2_metadata,
                              shapes=LFM2_SHAPES, final_norm="token_embd_norm",
                              shortconv=True),
                 "qwen3moe": Arch("qwen3moe", qk_norm=True, metadata=_experts_metadata,
                                  shapes=QWEN3MOE_SHAPES, moe=True),
                 "lfm2moe": Arch("lfm2moe", qk_norm=True, metadata=_lfm2moe_metadata,
                                 shapes=LFM2MOE_SHAPES, final_norm="token_embd_norm",
                                 shortconv=True, moe=True, selection_bias=True)}


def _attention_layers(s: Shape) -> tuple[int, ...]:
    return tuple(range(s.n_layers)) if s.attention_layers is None else s.attention_layers


def shapes_of(arch: str) -> Mapping[str, Shape]:
    """The named shapes an architecture's files come in."""
    return ARCHITECTURES[arch].shapes or SHAPES


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, inputs), (experts, rows, inputs) or (n,)
    std: float
    offset: float = 0.0  # norm weights centre on 1


def tensor_specs(arch: Arch, s: Shape) -> list[TensorSpec]:
    """Every tensor of the model, in file order."""
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim

    def mat(name: str, rows: int, cols: int) -> TensorSpec:
        return TensorSpec(name, (rows, cols), cols ** -0.5)

    def norm(name: str, n: int) -> TensorSpec:
        return TensorSpec(name, (n,), 0.1, 1.0)

    def ffn(p: str, i: int) -> list[TensorSpec]:
        if not arch.moe or i < s.dense_lead:
            return [mat(p + "ffn_gate.weight", s.ffn_dim, s.dim),
                    mat(p + "ffn_up.weight", s.ffn_dim, s.dim),
                    mat(p + "ffn_down.weight", s.dim, s.ffn_dim)]
        e, f = s.experts, s.expert_ffn_dim
        out = [mat(p + "ffn_gate_inp.weight", e, s.dim)]  # router logits of std ~1
        if arch.selection_bias:
            out.append(TensorSpec(p + "exp_probs_b.bias", (e,), 0.1))
        return out + [TensorSpec(p + "ffn_gate_exps.weight", (e, f, s.dim), s.dim ** -0.5),
                      TensorSpec(p + "ffn_up_exps.weight", (e, f, s.dim), s.dim ** -0.5),
                      TensorSpec(p + "ffn_down_exps.weight", (e, s.dim, f), f ** -0.5)]

    embed_std = LOGIT_SCALE * s.dim ** -0.5
    specs = [TensorSpec("token_embd.weight", (s.vocab_size, s.dim), embed_std)]
    attention = _attention_layers(s)
    for i in range(s.n_layers):
        p = f"blk.{i}."
        specs += [norm(p + n + ".weight", s.dim) for n in arch.layer_norms]
        if arch.shortconv and i not in attention:  # LFM2's conv layer: B|C|x, taps, out
            specs += [mat(p + "shortconv.in_proj.weight", 3 * s.dim, s.dim),
                      TensorSpec(p + "shortconv.conv.weight", (s.dim, s.conv_kernel),
                                 s.conv_kernel ** -0.5),
                      mat(p + "shortconv.out_proj.weight", s.dim, s.dim), *ffn(p, i)]
            continue
        specs += [mat(p + "attn_q.weight", q, s.dim), mat(p + "attn_k.weight", kv, s.dim),
                  mat(p + "attn_v.weight", kv, s.dim), mat(p + "attn_output.weight", s.dim, q),
                  *ffn(p, i)]
        if arch.bias:
            specs += [TensorSpec(p + f"attn_{x}.bias", (n,), 0.1)
                      for x, n in (("q", q), ("k", kv), ("v", kv))]
        if arch.qk_norm:
            specs += [norm(p + "attn_q_norm.weight", s.head_dim),
                      norm(p + "attn_k_norm.weight", s.head_dim)]
    specs.append(norm(arch.final_norm + ".weight", s.dim))
    if not s.tied:
        specs.append(TensorSpec("output.weight", (s.vocab_size, s.dim), embed_std))
    return specs


# --- values --------------------------------------------------------------------------------------

def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _values(rng: np.random.Generator, spec: TensorSpec, rows: int) -> np.ndarray:
    cols = spec.shape[-1]
    x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(spec.std)
    return x + np.float32(spec.offset) if spec.offset else x


def random_k_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int,
                    std: float) -> np.ndarray:
    """[rows, bytes] of valid `qtype` blocks: random bytes, the fp16 scales set per block so
    that it decodes with mean ~0 (dmin) and standard deviation ~std (d)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs inputs in whole blocks of {block}, not {cols}")
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d_at, m_at = K_SCALE_OFFSETS[qtype]

    def decoded(d: float, dmin: float) -> np.ndarray:
        b = blocks.copy()
        b[:, d_at:d_at + 2] = np.float16(d).reshape(1).view(np.uint8)
        if m_at is not None:
            b[:, m_at:m_at + 2] = np.float16(dmin).reshape(1).view(np.uint8)
        return quants.dequantize(b, qtype).reshape(-1, block).astype(np.float64)

    # value = d * a + dmin * b per block (the decoding is linear in its two scales)
    a = decoded(1.0, 0.0)
    ratio = np.zeros(len(blocks))
    if m_at is not None:
        b = decoded(0.0, 1.0)
        mean_b = b.mean(-1)
        ratio = np.divide(-a.mean(-1), mean_b, out=ratio, where=mean_b != 0)
        a = a + ratio[:, None] * b
    spread = a.std(-1)
    d = np.divide(std, spread, out=np.zeros_like(spread), where=spread > 0)
    blocks[:, d_at:d_at + 2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    if m_at is not None:
        blocks[:, m_at:m_at + 2] = (ratio * d).astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


def encode(x: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 rows as `qtype` by gguf's quantiser (F32 and F16 as plain arrays)."""
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16)
    if qtype not in QUANTIZED_BY_GGUF:
        raise ValueError(f"gguf does not quantise {qtype.name}")
    block = GGML_QUANT_SIZES[qtype][0]
    if x.shape[-1] % block:
        raise ValueError(f"{qtype.name} needs inputs in whole blocks of {block}, "
                         f"not {x.shape[-1]}")
    return quants.quantize(x, qtype)


def tensor_data(spec: TensorSpec, qtype: Q, seed: int) -> np.ndarray:
    """The stored array of one tensor (float32 / float16, or uint8 blocks [rows, bytes])."""
    rng = _rng(seed, spec.name)
    if len(spec.shape) == 1:
        return _values(rng, spec, 1)[0]
    *outer, cols = spec.shape
    rows = int(np.prod(outer))  # an expert tensor: its experts' rows one after another
    parts = []
    for start in range(0, rows, ROWS_PER_CHUNK):
        n = min(ROWS_PER_CHUNK, rows - start)
        if qtype in K_SCALE_OFFSETS:
            parts.append(random_k_blocks(rng, qtype, n, cols, spec.std))
        else:
            parts.append(encode(_values(rng, spec, n), qtype))
    data = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return data.reshape(*outer, -1) if len(outer) > 1 else data


def nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


# --- tokenizer -----------------------------------------------------------------------------------

def embedded_tokenizer() -> dict:
    """tokenizer.* metadata of the embedded SmolLM2."""
    from adaspark.model.gguf import read_gguf
    from adaspark.model.sources import default_model_path

    meta = read_gguf(default_model_path()).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def fit_vocab(meta: Mapping, vocab: int) -> dict:
    """SmolLM2's tokenizer metadata cut or padded to `vocab` tokens."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    merges = list(meta["tokenizer.ggml.merges"])
    if vocab < SMOL_BASE:
        raise ValueError(f"a vocabulary under {SMOL_BASE} tokens cannot hold the byte tokens")
    out = dict(meta)
    if vocab <= len(tokens):
        kept = set(tokens[:vocab])
        out["tokenizer.ggml.merges"] = [m for m in merges if m.replace(" ", "", 1) in kept
                                        and all(p in kept for p in m.split(" ", 1))]
        out["tokenizer.ggml.tokens"], out["tokenizer.ggml.token_type"] = (tokens[:vocab],
                                                                          types[:vocab])
    else:
        pad = range(len(tokens), vocab)
        out["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in pad]
        out["tokenizer.ggml.token_type"] = types + [UNUSED] * len(pad)
    for key in ("bos", "eos", "unknown", "padding"):
        if out.get(f"tokenizer.ggml.{key}_token_id", 0) >= vocab:
            del out[f"tokenizer.ggml.{key}_token_id"]
    return out


def add_tokenizer(w: GGUFWriter, meta: Mapping) -> None:
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("unknown", w.add_unk_token_id), ("padding", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            add(int(meta[f"tokenizer.ggml.{key}_token_id"]))
    w.add_add_bos_token(bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    w.add_add_space_prefix(bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
    if "tokenizer.chat_template" in meta:
        w.add_chat_template(meta["tokenizer.chat_template"])


# --- the file ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    arch: str = "qwen3"
    shape: Shape = SHAPES["tiny"]
    qtype: Q = Q.Q8_0  # every matrix's type ...
    overrides: Mapping[str, Q] = field(default_factory=dict)  # ... but where a name contains key
    seed: int = 0

    def type_of(self, spec: TensorSpec) -> Q:
        if len(spec.shape) == 1 or spec.name.endswith(F32_MATRICES):
            return Q.F32
        hits = [k for k in self.overrides if k in spec.name]
        return self.overrides[max(hits, key=len)] if hits else self.qtype


def _add_metadata(w: GGUFWriter, r: Recipe, arch: Arch) -> None:
    s = r.shape
    w.add_name(f"synthetic {r.arch} {r.qtype.name} seed {r.seed}")
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.ffn_dim)
    w.add_head_count(s.n_heads)
    if not arch.shortconv:  # lfm2 writes one count per layer (its metadata hook)
        w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.norm_eps)
    w.add_vocab_size(s.vocab_size)
    ftype = getattr(LlamaFileType, f"MOSTLY_{r.qtype.name}", None)
    if ftype is not None:
        w.add_file_type(int(ftype))
    w.add_quantization_version(2)
    if arch.metadata is not None:
        arch.metadata(w, s)


def write_model(path: str | os.PathLike, recipe: Recipe,
                tokenizer: Mapping | None = None) -> Path:
    """Write the recipe's model to `path` (through a temporary name: no half file is left
    there). tokenizer: SmolLM2-style tokenizer.* metadata (default: the embedded model's)."""
    path = Path(path)
    arch = ARCHITECTURES[recipe.arch]
    specs = tensor_specs(arch, recipe.shape)
    tmp = path.with_name(path.name + ".part")
    w = GGUFWriter(tmp, recipe.arch)
    _add_metadata(w, recipe, arch)
    add_tokenizer(w, fit_vocab(tokenizer or embedded_tokenizer(), recipe.shape.vocab_size))
    for spec in specs:  # the tensor table first, then the data streamed in the same order
        qtype = recipe.type_of(spec)
        dtype = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
        w.add_tensor_info(spec.name, spec.shape, np.dtype(dtype or np.float32),
                          nbytes(spec.shape, qtype), raw_dtype=None if dtype else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for spec in specs:
        w.write_tensor_data(tensor_data(spec, recipe.type_of(spec), recipe.seed))
    w.close()
    tmp.replace(path)
    return path


# --- llama.cpp's quantiser -----------------------------------------------------------------------

def llamacpp_python(venv: str | os.PathLike | None = None) -> Path:
    """The python of llama.cpp's venv (benchmarks/vs_llamacpp.py builds it there)."""
    cache = Path(platformdirs.user_cache_dir("adaspark"))
    return (Path(venv) if venv else cache / "llamacpp" / "venv") / "bin" / "python"


REQUANTIZE = r"""
import ctypes, json, sys
import llama_cpp

a = json.loads(sys.argv[1])
p = llama_cpp.llama_model_quantize_default_params()
name = a["ftype"]
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_" + ("ALL_F32" if name == "F32" else "MOSTLY_" + name))
p.allow_requantize = True
p.nthread = a["threads"]
sys.exit(llama_cpp.llama_model_quantize(a["src"].encode(), a["dst"].encode(), ctypes.byref(p)))
"""


def requantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, *,
               venv: str | os.PathLike | None = None, threads: int = 2) -> Path:
    """`src` re-quantised by llama.cpp to `ftype` (a LLAMA_FTYPE name: Q4_K_M, Q8_0, F16...),
    as llama-quantize --allow-requantize would, written to `dst`."""
    python = llamacpp_python(venv)
    if not python.exists():
        raise FileNotFoundError(f"no llama.cpp python at {python} (benchmarks/vs_llamacpp.py "
                                "--build-only builds it)")
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    job = {"src": str(src), "dst": str(tmp), "ftype": ftype.upper(), "threads": threads}
    done = subprocess.run([str(python), "-c", REQUANTIZE, json.dumps(job)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantise {src} to {ftype} (exit "
                           f"{done.returncode}): {done.stderr.strip()[-2000:]}")
    tmp.replace(dst)
    return dst


# --- command line --------------------------------------------------------------------------------

def default_dir() -> Path:
    return Path(platformdirs.user_cache_dir("adaspark")) / "synthetic"


def parse_type(text: str) -> Q:
    try:
        qtype = Q[text.upper()]
    except KeyError:
        qtype = None
    if qtype not in TYPES:
        raise argparse.ArgumentTypeError(f"type {text!r}: choose from "
                                         f"{', '.join(t.name for t in TYPES)}")
    return qtype


def parse_override(text: str) -> tuple[str, Q]:
    name, sep, qtype = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME=TYPE, e.g. ffn_down=Q6_K")
    return name, parse_type(qtype)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3")
    p.add_argument("--shape", default="tiny",
                   choices=sorted({n for a in ARCHITECTURES for n in shapes_of(a)}),
                   help="a named shape of the architecture (lfm2: tiny, 1.2b; qwen3moe: tiny, "
                        "30b-a3b; lfm2moe: tiny, 8b-a1b)")
    p.add_argument("--layers", type=int, help="override the shape's layer count")
    p.add_argument("--vocab", type=int, help="override the shape's vocabulary size")
    p.add_argument("--untied", action="store_true", help="write a separate output.weight")
    p.add_argument("--type", type=parse_type, default=Q.Q8_0, help="every matrix's type")
    p.add_argument("--tensor-type", type=parse_override, action="append", default=[],
                   metavar="NAME=TYPE", help="type of the matrices whose name contains NAME")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requantize", metavar="SRC", help="re-quantise SRC with llama.cpp instead")
    p.add_argument("--ftype", default="Q4_K_M", help="llama.cpp file type for --requantize")
    p.add_argument("--venv", help="llama.cpp's venv (default: ~/.cache/adaspark/llamacpp/venv)")
    p.add_argument("--out", metavar="FILE", help=f"output GGUF (default: under {default_dir()})")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.requantize:
        out = Path(args.out or default_dir() / f"{Path(args.requantize).stem}.{args.ftype}.gguf")
        out.parent.mkdir(parents=True, exist_ok=True)
        print(requantize(args.requantize, out, args.ftype, venv=args.venv))
        return 0
    shapes = shapes_of(args.arch)
    if args.shape not in shapes:
        raise SystemExit(f"--arch {args.arch} comes in shapes {', '.join(shapes)}, "
                         f"not {args.shape!r}")
    shape = shapes[args.shape]
    shape = replace(shape, n_layers=args.layers or shape.n_layers,
                    vocab_size=args.vocab or shape.vocab_size,
                    tied=shape.tied and not args.untied,
                    dense_lead=min(shape.dense_lead, args.layers or shape.n_layers))
    if args.layers and shape.attention_layers is not None:  # those within the layers kept
        shape = replace(shape, attention_layers=tuple(i for i in shape.attention_layers
                                                      if i < args.layers))
    recipe = Recipe(args.arch, shape, args.type, dict(args.tensor_type), args.seed)
    out = Path(args.out or default_dir() / f"{args.arch}-{args.shape}-{args.type.name}-"
                                          f"s{args.seed}.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    print(write_model(out, recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
