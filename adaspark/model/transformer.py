"""The target model: llama / qwen2 / qwen3 / gemma3 / lfm2 blocks over a static KV cache,
verifying trees. LFM2's short-convolution layers (shortconv.py) keep each slot's B*x in the
cache beside the attention layers' K/V, and a tree row's conv reads its own path's
(docs/hybrid-targets.md). qwen3moe / lfm2moe layers route each row to a few experts in place
of the dense FFN (moe.py; docs/moe-targets.md), a row's result independent of its neighbours.

Read it top to bottom: `Block` is one decoder layer, `Transformer._forward` runs the rows of a
call through all layers, and the public verbs are prefill / verify / commit (plus two batched
causal paths used to make drafter training data). A block is composed from its architecture's
parts (config.ARCHITECTURES): optional biases, QK-norm, post-norms, the gate's activation, a
sliding window and its RoPE base; the forward runs whatever parts a layer has.

Sliding-window layers (Gemma 3's local ones) keep the whole context in the cache like the others
and mask by position: a row at position p sees keys at positions p-window+1 .. p (a tree row:
its ancestors and the committed slots within that distance), and slots no row of the call can
see are cut off the attention's keys.

Layout choices:
- RoPE rotates adjacent pairs (2i, 2i+1) of each head ("GPT-J" order). That is how llama GGUFs
  store q/k (convert_hf_to_gguf permutes HF's half-split rows into pairs); qwen2/qwen3 GGUFs keep
  HF's half split, so their q/k rows are permuted the same way at load. Attention scores are
  unchanged: q and k share the permutation.
- Precision "fast" on a CPU with the native build (native/: target.h): one native call per
  forward, quantised weights times int8-quantised activations, an fp16 KV cache, every row's
  arithmetic independent of the other rows (a tree row is bit-identical to the same row
  decoded alone). Every row count runs it, prefill chunks too, so a prompt over a cached prefix
  equals its whole prefill.
- Precision "fast" otherwise (CUDA, no compiler, or an explicit `kernel`): float32 residual
  stream and norms; matmuls in bf16 activations with the kernel chosen by row count
  (kernels.py); float32 KV cache and SDPA attention (rounding there follows the tree layout:
  a row moves ~1% with the tree's width).
- Precision "reference": float32 throughout with gguf-dequantised weights, arithmetic laid out
  so that a row's result does not depend on the other rows of the call (exact_linear,
  exact_attention), which makes tree and chain verifies comparable bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from adaspark.errors import UserError
from adaspark.model import native
from adaspark.model.cache import KVCache
from adaspark.model.config import ModelConfig
from adaspark.model.gguf import GGUFFile, GGUFTensor, read_gguf
from adaspark.model.kernels import KernelTable, Linear, calibrated_table
from adaspark.model.moe import PARTS, MoE
from adaspark.model.shortconv import ShortConv, chain_sources, tree_sources

PRECISIONS = ("fast", "reference")
DEFAULT_MAX_CONTEXT = 8192
PREFILL_CHUNK = 512  # rows per forward when prefilling: bounds activation and mask memory


@dataclass
class ForwardOut:
    argmax: torch.Tensor  # [n] int64: the target's greedy next token after each row
    logits: torch.Tensor | None = None  # [n, vocab] float32, when asked for
    hiddens: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, dim] float32
    # the same taps as one [n, taps, dim] view, layers ascending, where the forward made them
    # in one tensor (the native forward): a batch's step reads it without stacking them again
    tap_rows: torch.Tensor | None = None


@dataclass
class _View:
    """What one kind of layer (by attention window) attends to in a forward: cache slots
    [lo, span) where mask allows, or in a reference verify the tree's (seen, seen_ok) and the
    committed slots [lo, start) each row sees (prefix_ok; None: all)."""
    lo: int
    mask: torch.Tensor | None
    tree: tuple[torch.Tensor, torch.Tensor] | None
    prefix_ok: torch.Tensor | None


# --- weights -----------------------------------------------------------------------------------

def _pair_rope_rows(t: GGUFTensor, n_heads: int) -> GGUFTensor:
    """Reorder each head's output rows from HF's half split to adjacent pairs (as llama GGUFs
    already are): row a*hd/2 + b goes to 2b + a. Rows are whole blocks, so this works on raw
    quantised data too."""
    rows = t.shape[0]
    half = rows // n_heads // 2
    order = np.arange(rows).reshape(n_heads, 2, half).transpose(0, 2, 1).reshape(-1)
    return GGUFTensor(t.name, t.qtype, t.shape, t.data.reshape(rows, -1)[order])


class Weights:
    """Looks up GGUF tensors of one model, dequantised or as stored."""

    def __init__(self, f: GGUFFile, config: ModelConfig, device: torch.device):
        # the tensors and the mapping only: the metadata (a vocabulary's strings) is the
        # tokenizer's to keep, and the lazy torch-path weights keep this
        self.f = dataclasses.replace(f, metadata={})
        self.config, self.device = config, device
        self.pair_rows = config.traits.pair_rope_rows

    def raw(self, name: str, heads: int | None = None) -> GGUFTensor:
        if name not in self.f.tensors:
            raise UserError(f"GGUF lacks tensor {name}: not a complete "
                            f"{self.config.arch} model")
        t = self.f.tensors[name]
        return _pair_rope_rows(t, heads) if heads and self.pair_rows else t

    def dense(self, name: str, heads: int | None = None) -> torch.Tensor:
        t = self.raw(name)
        if heads and self.pair_rows:  # a bias or a per-head norm vector in rotary order
            t = GGUFTensor(t.name, t.qtype, (t.shape[-1], 1), t.data)
            t = _pair_rope_rows(t, heads)
        return torch.from_numpy(t.dequantize().reshape(-1)).to(self.device)

    def optional(self, name: str, heads: int | None = None) -> torch.Tensor | None:
        return self.dense(name, heads) if name in self.f.tensors else None


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class Block:
    """One decoder layer's weights and parts: what its architecture has (None where not), its
    attention window (0: global) and which RoPE table it rotates by. Its projections (qkv, o,
    gate_up, down) are made when first used: the native forward packs the GGUF tensors itself,
    and qwen's rotary row order is a copy of q and k that it should not keep."""

    def __init__(self, w: Weights, i: int, precision: str, rope_index: int):
        c = w.config
        p = f"blk.{i}."
        self._w, self._p, self._precision = w, p, precision
        self.window, self.rope = c.windows[i], rope_index
        self.act = ACTIVATIONS[c.traits.ffn_act]
        self.attn_norm = w.dense(p + "attn_norm.weight")
        self.ffn_norm = w.dense(p + "ffn_norm.weight")
        # a routed FFN (moe.py) in place of the dense one, on the layers the config routes
        self.moe: MoE | None = None
        if c.is_moe(i):
            bias = w.dense(p + "exp_probs_b.bias") if c.experts.selection_bias else None
            self.moe = MoE({part: w.raw(p + f"ffn_{part}_exps.weight") for part in PARTS},
                           w.dense(p + "ffn_gate_inp.weight"), bias, c.experts, precision,
                           w.device)
        # a short-convolution layer (LFM2) mixes with `conv` instead of attention: its index
        # among the conv layers (its B*x slots in the cache), else its index among the
        # attention layers (its K/V)
        self.conv: ShortConv | None = None
        if c.is_conv(i):
            self.cache_index = c.conv_layers.index(i)
            self.conv = ShortConv({part: w.raw(p + f"shortconv.{part}.weight")
                                   for part in ("in_proj", "out_proj")}, precision, w.device,
                                  torch.from_numpy(w.raw(p + "shortconv.conv.weight").dequantize()))
            self.post_attn_norm = self.post_ffn_norm = None
            self.qkv_bias = self.q_norm = self.k_norm = None
            return
        self.cache_index = c.attention_layers.index(i)
        # Gemma: GGUF stores its norms as 1 + w already (convert_hf_to_gguf adds the 1)
        post = c.traits.post_norms
        self.post_attn_norm = w.dense(p + "post_attention_norm.weight") if post else None
        self.post_ffn_norm = w.dense(p + "post_ffw_norm.weight") if post else None
        biases = [w.optional(p + "attn_q.bias", c.n_heads),
                  w.optional(p + "attn_k.bias", c.n_kv_heads), w.optional(p + "attn_v.bias")]
        self.qkv_bias = torch.cat(biases) if all(b is not None for b in biases) else None
        norm = w.dense if c.qk_norm else w.optional  # per head_dim, in rotary order
        self.q_norm = norm(p + "attn_q_norm.weight", 1)
        self.k_norm = norm(p + "attn_k_norm.weight", 1)

    def _linear(self, names: Sequence[str], heads: Sequence[int | None],
                bias: torch.Tensor | None = None) -> Linear:
        w = self._w
        return Linear([w.raw(self._p + n, h) for n, h in zip(names, heads, strict=True)],
                      self._precision, w.device, bias)

    @cached_property
    def qkv(self) -> Linear:
        c = self._w.config
        return self._linear(["attn_q.weight", "attn_k.weight", "attn_v.weight"],
                            [c.n_heads, c.n_kv_heads, None], self.qkv_bias)

    @cached_property
    def o(self) -> Linear:
        return self._linear(["attn_output.weight"], [None])

    @cached_property
    def gate_up(self) -> Linear:
        return self._linear(["ffn_gate.weight", "ffn_up.weight"], [None, None])

    @cached_property
    def down(self) -> Linear:
        return self._linear(["ffn_down.weight"], [None])

    def linears(self) -> list[Linear]:
        mixer = self.conv.linears() if self.conv is not None else [self.qkv, self.o]
        ffn = self.moe.linears() if self.moe is not None else [self.gate_up, self.down]
        return [*mixer, *ffn]


# --- arithmetic that differs by precision --------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, exact: bool) -> torch.Tensor:
    if exact:  # HF's LlamaRMSNorm, operation for operation
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rotation(cos: torch.Tensor, sin: torch.Tensor, exact: bool):
    """What `rope` multiplies by: (cos, sin) for exact arithmetic, else one complex tensor."""
    return (cos, sin) if exact else torch.complex(cos, sin)


def rope(x: torch.Tensor, rot, exact: bool) -> torch.Tensor:
    """Rotate adjacent pairs of x [..., rows, heads, hd] by angles [..., rows, 1, hd/2]."""
    pairs = x.unflatten(-1, (-1, 2))
    if exact:  # the products and sums HF forms (q*cos + rotate_half(q)*sin), pair-ordered
        cos, sin = rot
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * rot).flatten(-2)


def _pad_rows(q: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pad q [B, H, n, hd] with zero rows to a multiple of 4 (see kernels.exact_linear)."""
    pad = -q.shape[2] % 4
    return (F.pad(q, (0, 0, 0, pad)) if pad else q).contiguous(), q.shape[2] + pad


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention in float32 over slots [0, S): prefill and the batched paths.

    q [B, H, n, hd]; k, v [B, KVH, S, hd]; mask [B, 1, n, S] bool. Query heads sharing a KV
    head are stacked as the rows of one matmul."""
    b, h, n, hd = q.shape
    kvh, s = k.shape[1], k.shape[2]
    q, rows = _pad_rows(q)
    mask = F.pad(mask, (0, 0, 0, rows - n), value=True)
    scores = (q.reshape(b, kvh, -1, hd) @ k.transpose(-1, -2)) * scale
    scores = scores.view(b, kvh, h // kvh, rows, s).masked_fill(~mask.unsqueeze(1), -math.inf)
    probs = torch.softmax(scores, dim=-1).view(b, kvh, -1, s)
    return (probs @ v).view(b, h, rows, hd)[:, :, :n]


def exact_tree_attention(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                         k_rows: torch.Tensor, v_rows: torch.Tensor,
                         seen: torch.Tensor, seen_ok: torch.Tensor, scale: float,
                         prefix_ok: torch.Tensor | None = None) -> torch.Tensor:
    """Verify attention in float32 whose every row is computed the same whatever other rows
    share the call: the tree part is summed term by term in ancestor order, so a chain's row
    adds the same numbers in the same order inside any tree (a masked matmul would put its
    ancestors in other vector lanes and round differently).

    q [B, H, n, hd]; committed K/V [B, KVH, L, hd]; the rows' own K/V [B, KVH, n, hd];
    seen [n, D] the rows each row attends to, ascending (itself last), valid where seen_ok;
    prefix_ok [n, L] the committed slots each row sees (None: all: a sliding window masks some)."""
    b, h, n, hd = q.shape
    kvh, group = k_prefix.shape[1], h // k_prefix.shape[1]
    q, rows = _pad_rows(q)
    seen = F.pad(seen, (0, 0, 0, rows - n))
    seen_ok = F.pad(seen_ok, (0, 0, 0, rows - n), value=True)  # pad rows see row 0: no NaN
    qg = q.view(b, kvh, group, rows, 1, hd)
    tree_scores = (qg * k_rows[:, :, None, seen]).sum(-1) * scale  # [B, KVH, G, rows, D]
    tree_scores = tree_scores.masked_fill(~seen_ok, -math.inf)
    top = tree_scores.amax(-1)
    prefix = k_prefix.shape[2] > 0
    if prefix:
        prefix_scores = _row_matmul(qg[..., 0, :], k_prefix.transpose(-1, -2)) * scale
        if prefix_ok is not None:  # pad rows see every slot: no NaN
            prefix_ok = F.pad(prefix_ok, (0, 0, 0, rows - n), value=True)
            prefix_scores = prefix_scores.masked_fill(~prefix_ok, -math.inf)
        top = torch.maximum(top, prefix_scores.amax(-1))
    weights = torch.exp(tree_scores - top[..., None])
    values = v_rows[:, :, None, seen]  # [B, KVH, 1, rows, D, hd]
    total = torch.zeros_like(top)
    out = torch.zeros_like(qg[..., 0, :])
    if prefix:
        prefix_weights = torch.exp(prefix_scores - top[..., None])
        total = prefix_weights.sum(-1)
        out = _row_matmul(prefix_weights, v_prefix)
    for d in range(seen.shape[1]):
        total = total + weights[..., d]
        out = out + weights[..., d, None] * values[..., d, :]
    return (out / total[..., None]).view(b, h, rows, hd)[:, :, :n]


def _row_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, KVH, G, rows, k] @ b [B, KVH, k, m], one GEMM of G rows per row: a GEMM over all
    rows picks its kernel (and which rows go through a tile's tail) by the row count, so a
    tree row would round unlike the same row in its chain."""
    return torch.stack([a[:, :, :, i] @ b for i in range(a.shape[3])], 3)


def _seen_rows(ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the rows it sees in ascending order, as indices [n, D] and validity [n, D]."""
    counts = ancestors.sum(1)
    depth = int(counts.max())
    order = torch.sort(ancestors.to(torch.int8), dim=1, descending=True, stable=True).indices
    seen = order[:, :depth]
    return seen, torch.arange(depth, device=seen.device)[None, :] < counts[:, None]


# --- the model -----------------------------------------------------------------------------------

class Transformer:
    def __init__(self, f: GGUFFile, precision: str = "fast", device: str = "cpu",
                 max_context: int | None = None, calibrate: bool = True):
        if precision not in PRECISIONS:
            raise UserError(f"unknown precision {precision!r} (choose from {PRECISIONS})")
        self.precision = precision
        self.exact = precision == "reference"
        self.device = torch.device(device)
        embd = f.tensors.get("token_embd.weight")
        self.config = c = ModelConfig.from_metadata(f.metadata, embd.shape[0] if embd else None)
        self._weights = w = Weights(f, c, self.device)
        self.act_dtype = torch.float32 if self.exact else torch.bfloat16
        # RoPE (base, linear factor) per layer: Gemma's local layers have their own base
        rope_keys = [(c.layer_rope_theta(i), 1.0 if c.windows[i] else c.rope_factor)
                     for i in range(c.n_layers)]
        rope_kinds = list(dict.fromkeys(rope_keys))
        self.layers = [Block(w, i, precision, rope_kinds.index(rope_keys[i]))
                       for i in range(c.n_layers)]
        self.embed_scale = math.sqrt(c.dim) if c.traits.embed_scale else 1.0
        self.norm = w.dense(c.traits.final_norm)
        head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"  # tied
        self.output = Linear([w.raw(head)], precision, self.device)
        self.tied = head == "token_embd.weight"
        self._embedding_rows = None  # the native embedding lookup, when the native forward runs
        self.packed_embeddings = None  # the native token embeddings (a QWeight), likewise

        capacity = max_context or min(c.context_length, DEFAULT_MAX_CONTEXT)
        self._rope_tables(w.optional("rope_freqs.weight"), capacity, rope_kinds)
        self.native_isa: str | None = None
        self.native_module = None  # the build's module, when the native forward runs
        self.native, self.native_note = self._native_model(w, head)
        if self.native is not None:  # packed: the file's pages are read again only if the
            f.release_pages()  # torch path is ever built
        # the native forward keeps K/V in fp16 (half the bytes to read at long contexts)
        self.cache = self._kv_cache(capacity,
                                    torch.float32 if self.native is None else torch.float16)
        if self.native is None:  # the torch path serves every forward: its weights now
            for lin in self.linears():
                lin.build()
        # torch kernels by row count: every forward without the native build, and the batched
        # paths (drafter data) with it
        self.torch_kernels = self._kernel_table(f, calibrate and self.native is None)
        self.kernels = (KernelTable.only(f"native-{self.native_isa}") if self.native is not None
                        else self.torch_kernels)

    def _kv_cache(self, capacity: int, dtype: torch.dtype, batch: int = 1) -> KVCache:
        """A cache for this model: K/V of its attention layers, B*x of its conv layers."""
        c = self.config
        return KVCache(len(c.attention_layers), c.n_kv_heads, c.head_dim, capacity, dtype,
                       self.device, batch=batch, conv_layers=len(c.conv_layers),
                       conv_dim=c.dim if c.conv_layers else 0)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, precision: str = "fast", device: str = "cpu",
                  max_context: int | None = None, calibrate: bool = True) -> Transformer:
        return cls(read_gguf(path), precision, device, max_context, calibrate)

    def _rope_tables(self, freq_factors: torch.Tensor | None, capacity: int,
                     kinds: list[tuple[float, float]]) -> None:
        """cos/sin [capacity, hd/2] per (base, factor) in kinds; rope_cos/sin: the global one."""
        c = self.config
        self.rope_tables = []
        for theta, factor in kinds:
            # HF's inv_freq expression, so reference cos/sin match transformers' float32 values
            inv_freq = 1.0 / (theta ** (
                torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim))
            if freq_factors is not None:  # llama-3 style long-context scaling, per frequency
                inv_freq = inv_freq / freq_factors.cpu()
            if factor != 1.0:  # linear scaling, as HF applies it
                inv_freq = inv_freq / factor
            angles = torch.arange(capacity, dtype=torch.float32)[:, None] * inv_freq[None, :]
            self.rope_tables.append((angles.cos().to(self.device), angles.sin().to(self.device)))
        glob = (c.rope_theta, c.rope_factor)
        self.rope_cos, self.rope_sin = self.rope_tables[kinds.index(glob) if glob in kinds else 0]

    def _native_model(self, w: Weights, head: str):
        """The whole forward as one native Model, where the build, the device and every weight's
        type allow; else None and why not."""
        c = self.config
        if self.exact or self.device.type != "cpu":
            return None, ""
        module, why = native.load()
        mixers = {False: ("attn_q", "attn_k", "attn_v", "attn_output"),
                  True: ("shortconv.in_proj", "shortconv.out_proj")}
        ffns = {False: ("ffn_gate", "ffn_up", "ffn_down"),
                True: tuple(f"ffn_{part}_exps" for part in PARTS)}
        names = [f"blk.{i}.{part}.weight" for i in range(c.n_layers)
                 for part in (*mixers[c.is_conv(i)], *ffns[c.is_moe(i)])] + [head]
        if module is None:
            return None, why
        why = native.unpackable([native.as_rows(w.raw(n)) for n in names])
        if why:
            return None, why
        if c.head_dim not in (32, 64, 128, 256) or c.dim % 16:  # attention's register blocking
            return None, ("the native forward needs head_dim 32, 64, 128 or 256 and dim a "
                          "multiple of 16")
        if c.experts is not None and c.experts.ffn_dim % 32:  # an expert: whole row groups
            return None, "the native forward needs an expert width that is a multiple of 32"
        packed_head = native.pack(module, [w.raw(head)])
        embeddings = packed_head if head == "token_embd.weight" else \
            native.pack_embeddings(module, w.raw("token_embd.weight"))
        bounds, norms = native.error_scales(w.raw(head)), native.packed_row_norms(packed_head)
        w.f.release_pages({head, "token_embd.weight"})  # packed: the mapped pages are copies
        dense_ffn = c.ffn_dim if any(not c.is_moe(i) for i in range(c.n_layers)) else 0
        model = module.Model(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, dense_ffn, c.norm_eps,
                             self.rope_cos, self.rope_sin, embeddings, self.norm, packed_head,
                             bounds, norms, self.embed_scale, c.attn_scale)
        empty = torch.empty(0)
        for i, layer in enumerate(self.layers):
            p = f"blk.{i}."
            # a routed layer: no dense FFN here, its experts below (route_layer)
            gate_up = None if layer.moe else native.pack(
                module, [w.raw(p + "ffn_gate.weight"), w.raw(p + "ffn_up.weight")])
            down = None if layer.moe else native.pack(module, [w.raw(p + "ffn_down.weight")])
            if layer.conv is not None:  # in_proj and out_proj where q|k|v and o would be
                model.add_layer(
                    layer.attn_norm, layer.ffn_norm, empty, empty, empty,
                    native.pack(module, [w.raw(p + "shortconv.in_proj.weight")]),
                    native.pack(module, [w.raw(p + "shortconv.out_proj.weight")]),
                    gate_up, down, **self._native_parts(layer), conv_taps=layer.conv.taps)
                self._native_experts(module, model, i, layer)
                w.f.release_pages(n for n in names if n.startswith(p))
                continue
            bias = layer.qkv_bias  # rounded to bf16 as the torch path's Linear keeps it
            model.add_layer(
                layer.attn_norm, layer.ffn_norm,
                empty if layer.q_norm is None else layer.q_norm,
                empty if layer.k_norm is None else layer.k_norm,
                empty if bias is None else bias.to(torch.bfloat16).float(),
                native.pack(module, [w.raw(p + "attn_q.weight", c.n_heads),
                                     w.raw(p + "attn_k.weight", c.n_kv_heads),
                                     w.raw(p + "attn_v.weight")]),
                native.pack(module, [w.raw(p + "attn_output.weight")]),
                gate_up, down, **self._native_parts(layer))
            self._native_experts(module, model, i, layer)
            w.f.release_pages(n for n in names if n.startswith(p))
        self.native_isa, self.native_module = module.ISA, module
        self.packed_embeddings = embeddings  # the drafter's native draft looks anchors up in it
        self._embedding_rows, self._head_rows = embeddings.rows, packed_head.rows
        return model, ""

    def _native_experts(self, module, model, i: int, layer: Block) -> None:
        """A routed layer's router, selection bias and expert tensors, each 3-D tensor packed
        whole (its experts' rows one after another; moe.h takes each expert as a slice)."""
        if layer.moe is None:
            return
        moe, e = layer.moe, layer.moe.experts
        packed = [native.pack(module, [native.as_rows(moe.tensors[part])]) for part in PARTS]
        model.route_layer(i, moe.router, torch.empty(0) if moe.bias is None else moe.bias,
                          *packed, used=e.used, gating=e.gating, norm=e.norm_weights)

    def _native_parts(self, layer: Block) -> dict:
        """A layer's parts beyond llama's, as the native Model.add_layer takes them: the
        native block runs what these say, so an architecture made of known parts needs no
        native change."""
        empty = torch.empty(0)
        cos, sin = self.rope_tables[layer.rope]
        return {"post_attn_norm": empty if layer.post_attn_norm is None else layer.post_attn_norm,
                "post_ffn_norm": empty if layer.post_ffn_norm is None else layer.post_ffn_norm,
                "act": self.config.traits.ffn_act, "window": layer.window,
                "rope_cos": cos, "rope_sin": sin}

    def _kernel_table(self, f: GGUFFile, calibrate: bool) -> KernelTable:
        if self.exact or self.device.type != "cpu":
            return KernelTable.only("bf16")  # reference ignores it; int4 packing is CPU-only
        if not calibrate:
            return KernelTable.default()
        st = f.path.stat()
        return calibrated_table(self.linears(), f"{f.path.name}|{st.st_size}|{st.st_mtime_ns}")

    def linears(self) -> list[Linear]:
        return [lin for block in self.layers for lin in block.linears()] + [self.output]

    # --- forward -----------------------------------------------------------------------------

    @cached_property
    def tok_embeddings(self) -> torch.Tensor:
        """float32 [vocab, dim], gguf's dequantised table: made when the torch path first needs
        it (the native forward looks rows up in the packed table instead)."""
        return torch.from_numpy(self._weights.raw("token_embd.weight").dequantize()).to(
            self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings, float32 [..., dim] (the drafter reads them): with the native
        forward, rows decoded from the packed table, the same values as tok_embeddings'."""
        if self._embedding_rows is not None:
            rows = self._embedding_rows(self._tokens(tokens.reshape(-1)))
            return rows.view(*tokens.shape, self.config.dim)
        return self.tok_embeddings[tokens.to(self.device)]

    @torch.no_grad()  # not inference_mode: taps may later feed a drafter being trained
    def _forward(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                 slots: int | torch.Tensor, mask: torch.Tensor | None, span: int, kernel: str,
                 tap_layers: Iterable[int], tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                 conv_sources: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run rows through every layer. tokens, positions [B, n]; K/V go to slots start..+n-1
        (an int) or, for one row per sequence, to per-sequence slots (a [B] tensor); rows attend
        to cache slots [0, span) where mask [B, 1, n, span] allows (None: all of them).
        Reference verifies pass `tree` (exact_tree_attention's seen, seen_ok) instead.
        Conv layers read B*x at conv_sources [n, L] (shortconv.tree_sources; None: each row's
        predecessors by position, shortconv.chain_sources).
        Returns the final-normed rows [B, n, dim] and the tapped residuals."""
        c, exact, act = self.config, self.exact, self.act_dtype
        b, n = tokens.shape
        taps = set(tap_layers)
        rots = [rotation(cos[positions].unsqueeze(-2),  # [B, n, 1, hd/2]
                         sin[positions].unsqueeze(-2), exact) for cos, sin in self.rope_tables]
        views = {w: self._view(w, positions, slots, mask, span, tree)
                 for w in {layer.window for layer in self.layers}}
        x = self.embed(tokens).view(b * n, c.dim)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if c.conv_layers and conv_sources is None:
            conv_sources = chain_sources(positions, c.conv_kernel)
        hiddens = {}
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.norm_eps, exact).to(act)
            if layer.conv is not None:
                out = layer.conv(h, kernel, cache.conv[layer.cache_index], slots, conv_sources,
                                 act)
            else:
                attn = self._attention(layer, h, cache, slots, span, rots[layer.rope],
                                       views[layer.window], kernel, (b, n))
                out = layer.o(attn, kernel)
            if layer.post_attn_norm is not None:
                out = rms_norm(out.float(), layer.post_attn_norm, c.norm_eps, exact)
            x += out  # a bf16 output added into the float32 stream
            h = rms_norm(x, layer.ffn_norm, c.norm_eps, exact)
            if layer.moe is not None:  # routed by the float32 row
                out = layer.moe(h, kernel, act)
            else:
                gate, up = layer.gate_up(h.to(act), kernel).chunk(2, dim=-1)
                out = layer.down(layer.act(gate) * up, kernel)
            if layer.post_ffn_norm is not None:
                out = rms_norm(out.float(), layer.post_ffn_norm, c.norm_eps, exact)
            x += out
            if i in taps:
                hiddens[i] = x.view(b, n, c.dim).clone()
        return rms_norm(x, self.norm, c.norm_eps, exact).view(b, n, c.dim), hiddens

    def _view(self, window: int, positions: torch.Tensor, slots: int | torch.Tensor,
              mask: torch.Tensor | None, span: int, tree) -> _View:
        """What layers with this window attend to: slots [lo, span) under a mask (or, in a
        reference verify, the tree rows and committed slots each row sees)."""
        if not window:
            return _View(0, mask, tree, None)
        # key positions of slots [0, span): committed slots sit at their own position, the
        # call's rows (from slot `slots` on) at theirs; per-sequence slots are positions too
        if isinstance(slots, int):
            key_pos = torch.cat([torch.arange(slots, device=self.device), positions[0]])
        else:
            key_pos = torch.arange(span, device=self.device)
        first = positions.min() - window + 1  # the earliest position any row sees
        lo = int(torch.cumprod((key_pos < first).to(torch.int32), 0).sum())
        if tree is not None:  # rows see tree rows and committed slots within the window
            seen, seen_ok = tree
            rows = positions[0]
            seen_ok = seen_ok & (rows[:, None] - rows[seen] < window)
            lo = min(lo, int(slots))
            committed = torch.arange(lo, int(slots), device=self.device)
            return _View(lo, None, (seen, seen_ok), rows[:, None] - committed[None, :] < window)
        if lo == 0 and int(positions.max()) - int(key_pos.min()) < window:
            return _View(0, mask, None, None)  # the window hides nothing here
        near = (positions[:, None, :, None] - key_pos[lo:][None, None, None, :]) < window
        return _View(lo, near if mask is None else mask[..., lo:] & near, None, None)

    def _attention(self, layer: Block, h: torch.Tensor, cache: KVCache,
                   slots: int | torch.Tensor, span: int, rot, view: _View, kernel: str,
                   shape: tuple[int, int]) -> torch.Tensor:
        """A layer's attention over rows h [B*n, dim] (before the output projection): q, k, v;
        QK-norm and RoPE; this call's K/V into the cache; attention over the view's slots."""
        c, exact = self.config, self.exact
        b, n = shape
        q_width, kv_width = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        qkv = layer.qkv(h, kernel).view(b, n, -1)
        qk = qkv[..., :q_width + kv_width].float().unflatten(-1, (-1, c.head_dim))
        if layer.q_norm is not None:
            qk = torch.cat([rms_norm(qk[..., :c.n_heads, :], layer.q_norm, c.norm_eps, exact),
                            rms_norm(qk[..., c.n_heads:, :], layer.k_norm, c.norm_eps, exact)],
                           dim=-2)
        qk = rope(qk, rot, exact).transpose(1, 2)  # [B, H+KVH, n, hd]
        q, k = qk[:, :c.n_heads], qk[:, c.n_heads:]
        v = qkv[..., q_width + kv_width:].float().unflatten(-1, (c.n_kv_heads, -1))
        v = v.transpose(1, 2)
        i = layer.cache_index
        if isinstance(slots, int):
            cache.write(i, slots, k, v)
        else:
            rows = torch.arange(b, device=slots.device)
            cache.k[i, rows, :, slots] = k[:, :, 0]
            cache.v[i, rows, :, slots] = v[:, :, 0]
        keys, values = cache.k[i, :, :, view.lo:span], cache.v[i, :, :, view.lo:span]
        if keys.dtype != q.dtype:  # an fp16 cache made for the native forward
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if view.tree is not None:
            start = span - n - view.lo
            attn = exact_tree_attention(q, keys[:, :, :start], values[:, :, :start], k, v,
                                        *view.tree, c.attn_scale, view.prefix_ok)
        elif exact:
            attn = exact_attention(q, keys, values, view.mask, c.attn_scale)
        else:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=view.mask,
                                                  enable_gqa=True, scale=c.attn_scale)
        return attn.transpose(1, 2).reshape(b * n, q_width).to(self.act_dtype)

    def _head(self, rows: torch.Tensor, kernel: str, return_logits: bool) -> ForwardOut:
        """LM head over final-normed rows [m, dim]."""
        if kernel.startswith("native"):  # no autograd in a native call: no context to enter
            logits, argmax = self.native.head(rows.float())
            return ForwardOut(argmax, logits if return_logits else None)
        with torch.no_grad():
            logits = self.output(rows.to(self.act_dtype), kernel).float()
            if not self.exact:
                logits = self._refine_top(rows, logits)
            return ForwardOut(logits.argmax(-1), logits if return_logits else None)

    def _refine_top(self, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Fast kernels round logits to bf16 (8 significant bits): near the top, ties and swaps
        would decide the argmax. Recompute in float32 every logit within 2^-6 of the row's max
        (at least two bf16 steps), so the argmax is a float32 one."""
        top = logits.max(-1, keepdim=True).values
        row, col = (logits >= top - top.abs() * 2**-6).nonzero().unbind(1)
        if not self.tied:
            weights = self.output.bf16[col].float()
        elif self._embedding_rows is not None:  # the packed head's rows: tok_embeddings' values
            weights = self._head_rows(col)
        else:
            weights = self.tok_embeddings[col]
        logits[row, col] = (rows[row] * weights).sum(-1)
        return logits

    @cached_property
    def _vocab_rows(self) -> int:
        return self._weights.raw("token_embd.weight").shape[0]

    def _tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token ids as a long tensor, each checked against the vocabulary (a step's few ids
        are checked as Python ints: two tensor reductions cost more than the check)."""
        vocab = self._vocab_rows
        if isinstance(tokens, torch.Tensor):
            t = tokens.to(dtype=torch.long, device=self.device)
            bad = t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab)
        else:
            ids = tokens if isinstance(tokens, list) else list(tokens)
            bad = ids and (min(ids) < 0 or max(ids) >= vocab)
            t = torch.tensor(ids, dtype=torch.long, device=self.device)
        if bad:
            raise UserError(f"token id out of range for a vocabulary of {vocab}")
        return t

    def _rows(self, tokens: Sequence[int], depths: torch.Tensor, ancestors: torch.Tensor,
              tap_layers: Iterable[int], kernel: str | None, exact_tree: bool = False):
        """Forward rows at slots cache.length.. with the committed prefix fully visible: the
        final-normed rows, each tap layer's rows, the kernel run, and the taps as one [n,
        taps, dim] view where the forward made them in one tensor (else None)."""
        start, n = self.cache.length, len(depths)
        self.cache.check_room(n)
        kernel = kernel or self.kernels.choose(n)
        sources = None
        if self.config.conv_layers:  # each row's conv reads its own path's B*x
            sources = tree_sources(depths, ancestors, start, self.config.conv_kernel)
        if kernel.startswith("native"):
            taps = sorted(set(tap_layers))
            x, hiddens = self.native.forward(
                self.cache.k, self.cache.v, self._tokens(tokens), start + depths, start,
                ancestors, taps,
                **({} if sources is None else {"conv": self.cache.conv, "conv_src": sources}))
            return (x, {layer: hiddens[i] for i, layer in enumerate(taps)}, kernel,
                    hiddens.transpose(0, 1) if taps else None)
        span = start + n
        mask = tree = None
        if exact_tree:
            tree = _seen_rows(ancestors)
        elif n > 1 or self.exact:
            mask = torch.zeros(n, span, dtype=torch.bool, device=self.device)
            mask[:, :start] = True
            mask[:, start:] = ancestors
            mask = mask[None, None]
        positions = (start + depths).to(self.device)[None]
        x, hiddens = self._forward(self.cache, self._tokens(tokens)[None], positions, start,
                                   mask, span, kernel, tap_layers, tree, sources)
        return x[0], {i: h[0] for i, h in hiddens.items()}, kernel, None

    def prefill(self, tokens: Sequence[int], tap_layers: Iterable[int] = (), *,
                return_logits: bool = False, kernel: str | None = None) -> ForwardOut:
        """Append committed tokens; the last row's argmax (and logits), every row's taps."""
        tokens = list(tokens)
        if not tokens:
            raise UserError("nothing to prefill: empty token list")
        self.cache.check_room(len(tokens))
        taps: dict[int, list[torch.Tensor]] = {}
        for at in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[at:at + PREFILL_CHUNK]
            n = len(chunk)
            causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            x, hiddens, used, _ = self._rows(chunk, torch.arange(n), causal, tap_layers, kernel)
            self.cache.length += n
            for i, h in hiddens.items():
                taps.setdefault(i, []).append(h)
        out = self._head(x[-1:], used, return_logits)
        out.hiddens = {i: torch.cat(parts) for i, parts in taps.items()}
        return out

    def verify(self, tokens: Sequence[int], depths: Sequence[int],
               ancestor_mask: np.ndarray | torch.Tensor, tap_layers: Iterable[int] = (), *,
               return_logits: bool = False, kernel: str | None = None) -> ForwardOut:
        """Rows of a tree at slots cache.length+i, positions cache.length+depths[i]; row i sees
        the committed context and rows j with ancestor_mask[i, j] (itself and its ancestors).
        The cache length does not move: commit() keeps the accepted path."""
        n = len(tokens)
        depths_t = torch.as_tensor(np.asarray(depths), dtype=torch.long)
        ancestors = torch.as_tensor(np.asarray(ancestor_mask), dtype=torch.bool,
                                    device=self.device)
        if n == 0 or depths_t.shape != (n,) or ancestors.shape != (n, n):
            raise ValueError(f"verify needs n >= 1 tokens, n depths and an n x n mask; got "
                             f"{n}, {tuple(depths_t.shape)}, {tuple(ancestors.shape)}")
        x, hiddens, used, tap_rows = self._rows(tokens, depths_t, ancestors, tap_layers, kernel,
                                                exact_tree=self.exact)
        out = self._head(x, used, return_logits)
        out.hiddens, out.tap_rows = hiddens, tap_rows
        return out

    def commit(self, rows: Sequence[int]) -> None:
        self.cache.commit(rows)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def reset(self) -> None:
        self.cache.reset()

    # --- several sequences, each over its own cache (continuous batching, batch.py) ------------

    def new_cache(self) -> KVCache:
        """An empty cache shaped like the model's own: another sequence's slot."""
        return self._kv_cache(self.cache.capacity, self.cache.k.dtype)

    @contextlib.contextmanager
    def using(self, cache: KVCache) -> Iterator[None]:
        """Run the single-sequence verbs (prefill, verify, commit) on `cache` meanwhile."""
        own, self.cache = self.cache, cache
        try:
            yield
        finally:
            self.cache = own

    def verify_many(self, caches: Sequence[KVCache], rows: Sequence[tuple], *,
                    tap_layers: Iterable[int] = (), return_logits: bool = False) -> ForwardOut:
        """verify() for several sequences at once: rows[s] = (tokens, depths, ancestor_mask) at
        the end of caches[s]. The output rows (and each tap layer's hiddens) follow in sequence
        order, each bit-identical to its sequence's verify alone: the native forward runs them
        in one call, with the native head (its rows do not depend on their neighbours), where
        each sequence's verify alone would run native; else one sequence after another."""
        taps = sorted(set(tap_layers))
        if len(caches) == 1:  # the sequence's own verify, with nothing to join
            (tokens, depths, mask), = rows
            with self.using(caches[0]):
                return self.verify(tokens, depths, mask, taps, return_logits=return_logits)
        alone_native = all(self.kernels.choose(len(r[0])).startswith("native") for r in rows)
        if self.native is None or not alone_native:
            outs = []
            for cache, (tokens, depths, mask) in zip(caches, rows, strict=True):
                with self.using(cache):
                    outs.append(self.verify(tokens, depths, mask, taps,
                                            return_logits=return_logits))
            logits = [o.logits for o in outs] if return_logits else None
            return ForwardOut(torch.cat([o.argmax for o in outs]),
                              None if logits is None else torch.cat(logits),
                              {i: torch.cat([o.hiddens[i] for o in outs]) for i in taps})
        x, hiddens = self._native_many(caches, rows, taps)
        out = self._head(x, "native", return_logits)  # what each verify alone runs
        out.hiddens = dict(zip(taps, hiddens, strict=True))
        if taps and isinstance(hiddens, torch.Tensor):  # [taps, rows, dim]
            out.tap_rows = hiddens.transpose(0, 1)
        return out

    def _native_many(self, caches: Sequence[KVCache], rows: Sequence[tuple],
                     taps: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One native forward_batch over rows[s] = (tokens, depths, ancestor_mask) at the end
        of caches[s] (K/V written, lengths unmoved): the final-normed rows and each tap's."""
        for cache, (tokens, _, _) in zip(caches, rows, strict=True):
            cache.check_room(len(tokens))
        tokens = [int(t) for r in rows for t in r[0]]
        positions = torch.cat([c.length + torch.as_tensor(np.asarray(r[1]), dtype=torch.long)
                               for c, r in zip(caches, rows, strict=True)])
        masks = [torch.as_tensor(np.asarray(r[2]), dtype=torch.bool) for r in rows]
        anc = torch.block_diag(*masks)
        conv = {}
        if self.config.conv_layers:  # each sequence's B*x slots; its rows' taps in them
            conv = {"caches_conv": [c.conv for c in caches], "conv_src": torch.cat([
                tree_sources(torch.as_tensor(np.asarray(r[1]), dtype=torch.long), m, c.length,
                             self.config.conv_kernel)
                for c, r, m in zip(caches, rows, masks, strict=True)])}
        return self.native.forward_batch(
            [c.k for c in caches], [c.v for c in caches], [c.length for c in caches],
            [len(r[0]) for r in rows], self._tokens(tokens), positions, anc, taps, **conv)

    def prefill_many(self, caches: Sequence[KVCache], chunks: Sequence[Sequence[int]], *,
                     tap_layers: Iterable[int] = (), return_logits: bool = False,
                     ) -> list[ForwardOut]:
        """prefill() of several sequences' next chunks (at most PREFILL_CHUNK tokens each),
        chunks[s] appended to caches[s]: one native call where each prefill alone would run
        native (a joining request's first token then waits for one forward, not for the
        prefills of those that joined before it), else one after another. Each output, K/V and
        tap is bit-identical to that sequence's prefill alone; a failure leaves every cache at
        its length before the call."""
        taps = sorted(set(tap_layers))
        chunks = [[int(t) for t in chunk] for chunk in chunks]
        if len(caches) != len(chunks) or any(not c or len(c) > PREFILL_CHUNK for c in chunks):
            raise ValueError(f"prefill_many takes one chunk of 1-{PREFILL_CHUNK} tokens per "
                             f"cache; got {[len(c) for c in chunks]} for {len(caches)} caches")
        lengths = [cache.length for cache in caches]
        alone_native = all(self.kernels.choose(len(c)).startswith("native") for c in chunks)
        if self.native is None or len(caches) == 1 or not alone_native:
            outs = []
            try:
                for cache, chunk in zip(caches, chunks, strict=True):
                    with self.using(cache):
                        outs.append(self.prefill(chunk, taps, return_logits=return_logits))
            except BaseException:
                for cache, length in zip(caches, lengths, strict=True):
                    cache.truncate(length)
                raise
            return outs
        counts = [len(c) for c in chunks]
        x, hiddens = self._native_many(  # each chunk a causal chain
            caches, [(c, np.arange(n), np.tri(n, dtype=bool)) for c, n in
                     zip(chunks, counts, strict=True)], taps)
        ends = np.cumsum(counts)
        head = self._head(x[torch.as_tensor(ends - 1)], "native", return_logits)  # last rows
        outs = []
        for s, (cache, n) in enumerate(zip(caches, counts, strict=True)):
            cache.length += n
            outs.append(ForwardOut(head.argmax[s:s + 1],
                                   None if head.logits is None else head.logits[s:s + 1],
                                   {i: h[ends[s] - n:ends[s]] for i, h in zip(taps, hiddens,
                                                                              strict=True)}))
        return outs

    def prefill_rows_many(self, caches: Sequence[KVCache], chunks: Sequence[Sequence[int]], *,
                          logits_from: Sequence[int], tap_layers: Iterable[int] = (),
                          ) -> list[ForwardOut]:
        """prefill_many() with the logits of chunk s's rows from row logits_from[s] on, not only
        its last row's (the target's distribution over a reply: drafter training data, taps.py).
        The forward is prefill_many's (one native call where the native forward runs), so the
        taps are those a drafter sees at inference; out.argmax/logits hold the chosen rows."""
        taps = sorted(set(tap_layers))
        chunks = [[int(t) for t in chunk] for chunk in chunks]
        counts = [len(c) for c in chunks]
        if (len(caches) != len(chunks) or len(logits_from) != len(chunks)
                or any(not 0 < n <= PREFILL_CHUNK for n in counts)
                or any(not 0 <= f <= n for f, n in zip(logits_from, counts, strict=True))):
            raise ValueError(f"prefill_rows_many takes one chunk of 1-{PREFILL_CHUNK} tokens and "
                             f"a first logits row within it per cache; got {counts}, "
                             f"{list(logits_from)} for {len(caches)} caches")
        if self.native is None:
            outs = []
            for cache, chunk, first in zip(caches, chunks, logits_from, strict=True):
                with self.using(cache):
                    self.cache.check_room(len(chunk))
                    n = len(chunk)
                    causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
                    x, hiddens, used, _ = self._rows(chunk, torch.arange(n), causal, taps, None)
                    self.cache.length += n
                    out = self._head(x[first:], used, True)
                out.hiddens = hiddens
                outs.append(out)
            return outs
        x, hiddens = self._native_many(
            caches, [(c, np.arange(n), np.tri(n, dtype=bool)) for c, n in
                     zip(chunks, counts, strict=True)], taps)
        ends = np.cumsum(counts)
        starts = ends - np.asarray(counts)
        picked = np.concatenate([np.arange(s + f, e) for s, f, e in
                                 zip(starts, logits_from, ends, strict=True)])
        if len(picked):
            head = self._head(x[torch.as_tensor(picked, dtype=torch.long)], "native", True)
        else:  # no row asked for: nothing to run the head on
            head = ForwardOut(torch.zeros(0, dtype=torch.long),
                              torch.zeros(0, self.config.vocab_size))
        outs, at = [], 0
        for cache, s, e, first in zip(caches, starts, ends, logits_from, strict=True):
            cache.length += int(e - s)
            m = int(e - s - first)
            outs.append(ForwardOut(head.argmax[at:at + m], head.logits[at:at + m],
                                   {i: h[s:e] for i, h in zip(taps, hiddens, strict=True)}))
            at += m
        return outs

    # --- batched causal paths (drafter training data) --------------------------------------------

    def _batch_cache(self, batch: int, capacity: int) -> KVCache:
        return self._kv_cache(capacity, torch.float32, batch)

    def _padded(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=self.device)
        for row, s in enumerate(seqs):
            tokens[row, :len(s)] = self._tokens(s)
        lengths = torch.tensor([len(s) for s in seqs], device=self.device)
        return tokens, lengths

    def _causal_batch(self, cache: KVCache, tokens: torch.Tensor, tap_layers: Iterable[int]):
        """Right-padded sequences from slot 0: padding sits after each sequence's real tokens,
        so causal attention keeps it out of them."""
        b, t = tokens.shape
        mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()[None, None]
        positions = torch.arange(t, device=self.device).expand(b, t)
        return self._forward(cache, tokens, positions, 0, mask, t,
                             self.torch_kernels.choose(b * t), tap_layers)

    def generate_greedy_batch(self, prompts: list[list[int]], max_new_tokens: int,
                              stop_ids: set[int]) -> list[list[int]]:
        """Greedy continuations of several prompts at once (own batched cache, the model's
        cache untouched); each stops after its first stop token (kept) or max_new_tokens."""
        if not prompts or any(not p for p in prompts):
            raise UserError("generate_greedy_batch needs non-empty prompts")
        tokens, lengths = self._padded(prompts)
        cache = self._batch_cache(len(prompts), tokens.shape[1] + max_new_tokens)
        x, _ = self._causal_batch(cache, tokens, ())
        last = x[torch.arange(len(prompts)), lengths - 1]
        outputs: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        kernel = self.torch_kernels.choose(len(prompts))
        for _ in range(max_new_tokens):
            nxt = self._head(last, kernel, False).argmax
            for row, tok in enumerate(nxt.tolist()):
                if not done[row]:
                    outputs[row].append(tok)
                    done[row] = tok in stop_ids or len(outputs[row]) >= max_new_tokens
            if all(done):
                break
            span = int(lengths.max()) + 1
            slot_ids = torch.arange(span, device=self.device)
            mask = (slot_ids[None, :] <= lengths[:, None])[:, None, None]  # [B, 1, 1, span]
            x, _ = self._forward(cache, nxt[:, None], lengths[:, None], lengths, mask, span,
                                 kernel, ())
            last = x[:, 0]
            lengths = lengths + 1
        return outputs

    def hidden_states_batch(self, sequences: list[list[int]], tap_layers: Iterable[int], *,
                            return_logits: bool = False,
                            max_rows: int = 4096) -> list[dict]:
        """Causal forward over whole sequences: per sequence {layer: [len, dim]} float32
        residuals after that layer; with return_logits also "logits" [len, vocab] float32 and
        "argmax" [len] (the target's next token after each position)."""
        tap_layers = list(tap_layers)
        results: list[dict] = []
        group: list[list[int]] = []
        for seq in [*sequences, None]:  # None flushes the last group
            if seq is not None and (not group or
                                    (len(group) + 1) * max(map(len, [*group, seq])) <= max_rows):
                group.append(seq)
                continue
            if group:
                results.extend(self._hidden_group(group, tap_layers, return_logits))
            group = [seq] if seq is not None else []
        return results

    def _hidden_group(self, seqs: list[list[int]], tap_layers: list[int],
                      return_logits: bool) -> list[dict]:
        if any(not s for s in seqs):
            raise UserError("hidden_states_batch needs non-empty sequences")
        tokens, lengths = self._padded(seqs)
        if tokens.shape[1] > self.cache.capacity:
            raise UserError(f"sequence of {tokens.shape[1]} tokens exceeds the context of "
                            f"{self.cache.capacity}")
        cache = self._batch_cache(len(seqs), tokens.shape[1])
        x, hiddens = self._causal_batch(cache, tokens, tap_layers)
        out = []
        for row, n in enumerate(lengths.tolist()):
            item: dict = {i: h[row, :n] for i, h in hiddens.items()}
            if return_logits:
                head = self._head(x[row, :n], self.torch_kernels.choose(n), True)
                item["logits"], item["argmax"] = head.logits, head.argmax
            out.append(item)
        return out
