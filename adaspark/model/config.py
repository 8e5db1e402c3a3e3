"""Model hyper-parameters, read from GGUF metadata (`{arch}.*` keys, as llama.cpp names them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adaspark.errors import UserError


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # llama | qwen2 | qwen3
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float
    norm_eps: float
    context_length: int
    qk_norm: bool  # qwen3: RMSNorm on each head's q and k before RoPE
    attn_bias: bool  # qwen2: biases on the q, k, v projections

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_rows: int | None = None) -> ModelConfig:
        arch = str(meta.get("general.architecture", ""))

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise UserError(f"GGUF metadata lacks {arch}.{key}")
            return value

        dim = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        n_kv = int(get("attention.head_count_kv", n_heads))
        head_dim = int(get("attention.key_length", dim // n_heads))
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else vocab_rows
        if vocab is None:
            raise UserError("GGUF metadata gives no vocabulary size")
        return cls(
            arch=arch,
            n_layers=int(get("block_count")),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            ffn_dim=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(get("context_length", 2048)),
            qk_norm=arch == "qwen3",
            attn_bias=arch == "qwen2",
        )
