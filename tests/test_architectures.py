"""llama / qwen2 / qwen3 layouts on tiny random models written as GGUF files.

Each model is built in Hugging Face's layout, written the way convert_hf_to_gguf writes it
(llama's q/k rows permuted for pairwise RoPE; qwen's left as they are), and the reference
forward must reproduce a plain HF-style forward written out below (half-split RoPE)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from adaspark.model.transformer import Transformer

DIM, HEADS, KV_HEADS, FFN, VOCAB, LAYERS, THETA, EPS = 64, 4, 2, 96, 40, 2, 10000.0, 1e-6
HD = DIM // HEADS


def random_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows, cols, scale=0.15):
        return (rng.normal(size=(rows, cols)) * scale).astype(np.float32)

    w = {"token_embd.weight": mat(VOCAB, DIM, 1.0), "output_norm.weight": 1 + mat(1, DIM)[0],
         "output.weight": mat(VOCAB, DIM)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        w |= {p + "attn_norm.weight": 1 + mat(1, DIM)[0],
              p + "ffn_norm.weight": 1 + mat(1, DIM)[0],
              p + "attn_q.weight": mat(HEADS * HD, DIM),
              p + "attn_k.weight": mat(KV_HEADS * HD, DIM),
              p + "attn_v.weight": mat(KV_HEADS * HD, DIM),
              p + "attn_output.weight": mat(DIM, DIM),
              p + "ffn_gate.weight": mat(FFN, DIM), p + "ffn_up.weight": mat(FFN, DIM),
              p + "ffn_down.weight": mat(DIM, FFN)}
        if arch == "qwen2":
            w |= {p + "attn_q.bias": mat(1, HEADS * HD)[0],
                  p + "attn_k.bias": mat(1, KV_HEADS * HD)[0],
                  p + "attn_v.bias": mat(1, KV_HEADS * HD)[0]}
        if arch == "qwen3":
            w |= {p + "attn_q_norm.weight": 1 + mat(1, HD)[0],
                  p + "attn_k_norm.weight": 1 + mat(1, HD)[0]}
    return w


def to_gguf_layout(name: str, t: np.ndarray, arch: str) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute for llama's q/k weights."""
    if arch != "llama" or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return t
    heads = HEADS if "attn_q" in name else KV_HEADS
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2) \
        .reshape(t.shape)


def write_gguf(path, arch: str, weights: dict[str, np.ndarray]):
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_vocab_size(VOCAB)
    for name, t in weights.items():
        writer.add_tensor(name, to_gguf_layout(name, t, arch))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_forward(w: dict[str, np.ndarray], tokens: list[int]) -> torch.Tensor:
    """Logits of every position, in the shape of transformers' Llama/Qwen2/Qwen3 modules."""
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

    def rotate_half(x):
        return torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)

    n = len(tokens)
    inv_freq = 1.0 / THETA ** (torch.arange(0, HD, 2).double() / HD)
    angles = torch.arange(n).double()[:, None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x = t["token_embd.weight"][tokens]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(LAYERS):
        p = f"blk.{i}."
        h = norm(x, t[p + "attn_norm.weight"])
        q, k, v = (h @ t[p + f"attn_{s}.weight"].T + t.get(p + f"attn_{s}.bias", 0) for s in "qkv")
        q, k, v = q.view(n, HEADS, HD), k.view(n, KV_HEADS, HD), v.view(n, KV_HEADS, HD)
        if p + "attn_q_norm.weight" in t:
            q, k = norm(q, t[p + "attn_q_norm.weight"]), norm(k, t[p + "attn_k_norm.weight"])
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        k = k.repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / HD**0.5
        probs = scores.masked_fill(~causal, -torch.inf).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, DIM)
        x = x + attn @ t[p + "attn_output.weight"].T
        h = norm(x, t[p + "ffn_norm.weight"])
        gate, up = h @ t[p + "ffn_gate.weight"].T, h @ t[p + "ffn_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ t[p + "ffn_down.weight"].T
    return (norm(x, t["output_norm.weight"]) @ t["output.weight"].T).float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_reference_forward_matches_the_hf_layout(tmp_path, arch):
    weights = random_weights(arch)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, weights)
    tokens = [3, 17, 5, 29, 11, 2, 38, 7]
    expected = hf_forward(weights, tokens)
    model = Transformer.from_gguf(path, precision="reference")
    assert model.config.qk_norm == (arch == "qwen3")
    model.prefill(tokens[:5])  # then a tree: rows 5, 6, 7 as one chain
    out = model.verify(tokens[5:], [0, 1, 2], np.tril(np.ones((3, 3), dtype=bool)),
                       return_logits=True)
    torch.testing.assert_close(out.logits, expected[5:], rtol=1e-4, atol=1e-4)
    fast = Transformer.from_gguf(path, precision="fast", calibrate=False)
    fast.prefill(tokens[:5])
    fast_out = fast.verify(tokens[5:], [0, 1, 2], np.tril(np.ones((3, 3), dtype=bool)),
                           return_logits=True)
    torch.testing.assert_close(fast_out.logits, expected[5:], rtol=0.05, atol=0.05)
