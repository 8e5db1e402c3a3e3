"""Model hyper-parameters, read from GGUF metadata (`{arch}.*` keys, as llama.cpp names them).

An architecture is a row of ARCHITECTURES: which parts its decoder block is made of. The
forward (transformer.py) composes a block from those parts, so another architecture built from
the same parts is one more row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adaspark.errors import UserError


@dataclass(frozen=True)
class ArchTraits:
    pair_rope_rows: bool  # q/k rows stored in HF's half split: permuted to pairs at load
    qk_norm: bool = False  # RMSNorm on each head's q and k before RoPE
    attn_bias: bool = False  # biases on the q, k, v projections
    post_norms: bool = False  # RMSNorm on the attention and FFN outputs before each residual add
    ffn_act: str = "silu"  # gated FFN's activation on the gate: silu | gelu_tanh
    embed_scale: bool = False  # input embeddings times sqrt(dim)
    global_every: int = 0  # sliding-window attention except on every n-th layer (0: no window)
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers
    # layers whose head_count_kv (a per-layer array) is 0 are gated short convolutions
    # (shortconv.py: LFM2's), their window length `shortconv.l_cache`
    shortconv: bool = False
    final_norm: str = "output_norm.weight"  # the final RMSNorm's tensor
    # a routed FFN (moe.py) on the layers past `leading_dense_block_count`: the router's gate
    # (softmax | sigmoid) when the file names none (`expert_gating_func`), whether a selection
    # bias `exp_probs_b` is added before the top-k, whether the chosen weights are renormalised
    moe_gating: str | None = None
    moe_selection_bias: bool = False
    moe_norm_weights: bool = True


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(pair_rope_rows=False),
    "qwen2": ArchTraits(pair_rope_rows=True, attn_bias=True),
    "qwen3": ArchTraits(pair_rope_rows=True, qk_norm=True),
    # llama.cpp's gemma3 graph: GeGLU, four norms per block, QK-norm, 5 local : 1 global layers
    # with their own RoPE bases (local 10000), embeddings scaled by sqrt(dim), tied head
    "gemma3": ArchTraits(pair_rope_rows=True, qk_norm=True, post_norms=True,
                         ffn_act="gelu_tanh", embed_scale=True, global_every=6,
                         local_rope_theta=10000.0),
    # llama.cpp's lfm2 graph: conv layers where head_count_kv[i] == 0, attention layers with
    # QK-norm and NeoX RoPE, the final norm stored as token_embd_norm
    "lfm2": ArchTraits(pair_rope_rows=True, qk_norm=True, shortconv=True,
                       final_norm="token_embd_norm.weight"),
    # llama.cpp's qwen3moe graph: qwen3's attention, a softmax-routed FFN on every layer
    "qwen3moe": ArchTraits(pair_rope_rows=True, qk_norm=True, moe_gating="softmax"),
    # llama.cpp's lfm2moe graph: lfm2's layers, dense FFNs first, then sigmoid-routed ones
    # choosing by p + exp_probs_b and weighting by p
    "lfm2moe": ArchTraits(pair_rope_rows=True, qk_norm=True, shortconv=True,
                          final_norm="token_embd_norm.weight", moe_gating="sigmoid",
                          moe_selection_bias=True),
}

# llama.cpp's llama_expert_gating_func_type (the `{arch}.expert_gating_func` values)
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class Experts:
    """A routed FFN's hyper-parameters (the `{arch}.expert_*` keys)."""
    count: int  # experts per routed layer
    used: int  # experts each row runs (top-k)
    ffn_dim: int  # each expert's FFN width
    gating: str  # the router's gate: softmax | sigmoid
    dense_lead: int = 0  # the first layers keep a dense FFN
    selection_bias: bool = False  # choose by p + exp_probs_b (weights stay p)
    norm_weights: bool = True  # the chosen weights divided by their sum

    def routed(self, layer: int) -> bool:
        return layer >= self.dense_lead


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # a key of ARCHITECTURES
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float  # the global layers' RoPE base
    norm_eps: float
    context_length: int
    qk_norm: bool
    attn_bias: bool
    traits: ArchTraits
    # per layer: how many positions back a row sees, itself included (0: all of them)
    windows: tuple[int, ...] = ()
    attn_scale: float = 0.0  # scores = q.k * attn_scale
    rope_factor: float = 1.0  # global layers' linear RoPE scaling: positions / factor
    conv_layers: tuple[int, ...] = ()  # the short-convolution layers (traits.shortconv)
    conv_kernel: int = 0  # their window: each reads the last conv_kernel rows' B*x
    experts: Experts | None = None  # the routed FFN (traits.moe_gating), else None

    def is_moe(self, layer: int) -> bool:
        return self.experts is not None and self.experts.routed(layer)

    def is_conv(self, layer: int) -> bool:
        return layer in self.conv_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if i not in self.conv_layers)

    @property
    def sliding(self) -> bool:
        return any(self.windows)

    @property
    def plain_block(self) -> bool:
        """A llama-style block: none of Gemma's parts."""
        t = self.traits
        return not (t.post_norms or t.embed_scale or self.sliding or t.ffn_act != "silu")

    def layer_rope_theta(self, layer: int) -> float:
        local = self.windows[layer] and self.traits.local_rope_theta is not None
        return self.traits.local_rope_theta if local else self.rope_theta

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_rows: int | None = None) -> ModelConfig:
        arch = str(meta.get("general.architecture", ""))
        if arch not in ARCHITECTURES:
            raise UserError(f"unsupported model architecture {arch!r} "
                            f"(supported: {', '.join(ARCHITECTURES)})")
        traits = ARCHITECTURES[arch]

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise UserError(f"GGUF metadata lacks {arch}.{key}")
            return value

        dim = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        n_layers = int(get("block_count"))
        n_kv, conv_layers, conv_kernel = _kv_heads(traits, n_layers,
                                                   get("attention.head_count_kv", n_heads), get)
        head_dim = int(get("attention.key_length", dim // n_heads))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else vocab_rows
        if vocab is None:
            raise UserError("GGUF metadata gives no vocabulary size")
        return cls(
            arch=arch,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 2048)),
            qk_norm=traits.qk_norm,
            attn_bias=traits.attn_bias,
            traits=traits,
            windows=_windows(traits, n_layers, get, meta.get(f"{arch}.attention.sliding_window"),
                             conv_layers),
            attn_scale=_attn_scale(arch, n_layers, dim, n_heads, head_dim),
            rope_factor=_rope_factor(meta, arch),
            conv_layers=conv_layers,
            conv_kernel=conv_kernel,
            experts=_experts(traits, n_layers, get),
        )


def _experts(traits: ArchTraits, n_layers: int, get) -> Experts | None:
    """The routed FFN's keys, checked (llama.cpp refuses a file without them too)."""
    if traits.moe_gating is None:
        return None
    count, used = int(get("expert_count")), int(get("expert_used_count"))
    if not 0 < used <= count:
        raise UserError(f"expert_used_count {used} must be 1..expert_count ({count})")
    code = get("expert_gating_func", 0)
    if code and int(code) not in GATING_FUNCS:
        raise UserError(f"expert_gating_func {code} is not supported (supported: "
                        f"{', '.join(f'{k} ({v})' for k, v in GATING_FUNCS.items())})")
    ffn = get("expert_feed_forward_length")
    if isinstance(ffn, (list, tuple)):  # one per layer: only one width is supported
        if len(set(ffn)) != 1:
            raise UserError(f"experts of different widths per layer {sorted(set(ffn))} are "
                            "not supported")
        ffn = ffn[0]
    lead = int(get("leading_dense_block_count", 0))
    if not 0 <= lead <= n_layers:
        raise UserError(f"leading_dense_block_count {lead} is outside 0..{n_layers}")
    if int(get("expert_shared_count", 0)):
        raise UserError("shared experts are not supported")
    return Experts(count=count, used=used, ffn_dim=int(ffn),
                   gating=GATING_FUNCS[int(code)] if code else traits.moe_gating,
                   dense_lead=lead, selection_bias=traits.moe_selection_bias,
                   norm_weights=traits.moe_norm_weights)


def _kv_heads(traits: ArchTraits, n_layers: int, value: Any, get,
              ) -> tuple[int, tuple[int, ...], int]:
    """(KV heads of the attention layers, the conv layers, the conv window) from head_count_kv:
    one count, or (shortconv architectures) one per layer with 0 marking a conv layer."""
    counts = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
    if len(counts) == 1:
        counts *= n_layers
    if len(counts) != n_layers:
        raise UserError(f"head_count_kv lists {len(counts)} layers, the model has {n_layers}")
    conv = tuple(i for i, c in enumerate(counts) if c == 0)
    attn = {c for c in counts if c}
    if conv and not traits.shortconv:
        raise UserError("head_count_kv is 0 on some layers of an architecture without "
                        "short-convolution layers")
    if len(attn) > 1:
        raise UserError(f"attention layers with different KV head counts {sorted(attn)} are "
                        "not supported")
    kernel = int(get("shortconv.l_cache")) if conv else 0
    if conv and kernel < 2:
        raise UserError(f"shortconv.l_cache must be at least 2, not {kernel}")
    return (attn.pop() if attn else 0), conv, kernel


def _windows(traits: ArchTraits, n_layers: int, get, lfm2_window: Any = None,
             conv_layers: tuple[int, ...] = ()) -> tuple[int, ...]:
    """llama.cpp's set_swa_pattern(n): every n-th layer (the last of each n) is global. lfm2:
    with attention.sliding_window > 0, every attention layer is windowed (llama.cpp's
    is_swa = !is_recr)."""
    if traits.shortconv:
        window = int(lfm2_window or 0)
        return tuple(0 if i in conv_layers else window for i in range(n_layers))
    if not traits.global_every:
        return (0,) * n_layers
    window = int(get("attention.sliding_window"))
    every = traits.global_every
    return tuple(window if i % every < every - 1 else 0 for i in range(n_layers))


def _attn_scale(arch: str, n_layers: int, dim: int, n_heads: int, head_dim: int) -> float:
    """head_dim**-0.5; Gemma 3 27B (62 layers) scales by (dim / heads)**-0.5 instead (its
    query_pre_attn_scalar, which llama.cpp infers from the layer count: GGUF does not store it)."""
    if arch == "gemma3" and n_layers == 62:
        return (dim / n_heads) ** -0.5
    return head_dim ** -0.5


def _rope_factor(meta: Mapping[str, Any], arch: str) -> float:
    """Linear RoPE scaling (Gemma 3 4B+ global layers): positions divided by the factor. Other
    kinds stay unapplied, as before this was read (llama 3's comes as rope_freqs instead)."""
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if meta.get(f"{arch}.rope.scaling.type") != "linear" or not factor:
        return 1.0
    return float(factor)
