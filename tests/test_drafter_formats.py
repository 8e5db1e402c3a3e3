"""Drafters in the peers' formats (drafter/peers.py, drafter/export.py): a DeepSpec folder and a
llama.cpp dflash GGUF load, check against the target, draft the peer's published forward (a
plain numpy float64 transcription of llama.cpp's src/models/dflash.cpp and common/
speculative.cpp's DSpark chain, below), and our export runs in llama-server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from adaspark.drafter import peers
from adaspark.drafter.export import export_gguf, identity_norm_scale
from adaspark.drafter.loading import DEFAULT_DRAFTER, load_model, target_info
from adaspark.drafter.model import DraftModel, neox_to_pairs
from adaspark.drafter.runtime import Drafter
from adaspark.errors import UserError
from adaspark.model import synthetic as syn
from adaspark.model.transformer import Transformer

pytestmark = pytest.mark.slow

# --- the peer's forward in numpy (llama.cpp dflash.cpp + speculative.cpp, greedy DSpark) ------


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_neox(x, pos, theta):
    """x [n, heads, hd] at positions pos [n]: ggml's NeoX rotation (x_i, x_{i+hd/2})."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None, None] * inv  # [n, 1, hd/2]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def peer_draft(t: dict, meta: dict, target_embd: np.ndarray, target_head: np.ndarray,
               taps: np.ndarray, anchor: int):
    """The DSpark drafter llama.cpp runs, from GGUF-named float64 tensors `t` (numpy order:
    rows = outputs) and metadata; taps [n, n_taps * dim] of the n committed tokens (layer
    inputs of meta['target_layers']), the anchor at position n. Returns the base logits over
    the target vocabulary [B, V] (-inf off d2t), the chain's biased rows [B, V], picks [B]
    and confidences [B]."""
    eps, theta, B = meta["eps"], meta["theta"], meta["block_size"]
    H, KH, hd = meta["heads"], meta["kv_heads"], meta["head_dim"]
    n = len(taps)
    L = meta["layers"]
    emb = t.get("token_embd.weight", target_embd)
    # encoder: fc, hidden norm, then each layer's K (k norm, rope) and V into the cache
    g = _rms(taps @ t["fc.weight"].T, t["enc.output_norm.weight"], eps)
    cache = []
    for i in range(L):
        k = (g @ t[f"blk.{i}.attn_k.weight"].T).reshape(n, KH, hd)
        k = _rope_neox(_rms(k, t[f"blk.{i}.attn_k_norm.weight"], eps), np.arange(n), theta)
        v = (g @ t[f"blk.{i}.attn_v.weight"].T).reshape(n, KH, hd)
        cache.append((k, v))
    # decoder: [anchor, mask, ...] at n.., non-causal over the cache and the block
    x = emb[[anchor] + [meta["mask"]] * (B - 1)].astype(np.float64)
    pos = np.arange(n, n + B)
    for i in range(L):
        h = _rms(x, t[f"blk.{i}.attn_norm.weight"], eps)
        q = (h @ t[f"blk.{i}.attn_q.weight"].T).reshape(B, H, hd)
        k = (h @ t[f"blk.{i}.attn_k.weight"].T).reshape(B, KH, hd)
        v = (h @ t[f"blk.{i}.attn_v.weight"].T).reshape(B, KH, hd)
        q = _rope_neox(_rms(q, t[f"blk.{i}.attn_q_norm.weight"], eps), pos, theta)
        k = _rope_neox(_rms(k, t[f"blk.{i}.attn_k_norm.weight"], eps), pos, theta)
        K = np.concatenate([cache[i][0], k]).transpose(1, 0, 2)  # [KH, n+B, hd]
        V = np.concatenate([cache[i][1], v]).transpose(1, 0, 2)
        out = np.empty((B, H, hd))
        for head in range(H):
            kv = head // (H // KH)
            s = q[:, head] @ K[kv].T / np.sqrt(hd)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ V[kv]
        x = x + out.reshape(B, -1) @ t[f"blk.{i}.attn_output.weight"].T
        h = _rms(x, t[f"blk.{i}.ffn_norm.weight"], eps)
        gate = h @ t[f"blk.{i}.ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ t[f"blk.{i}.ffn_up.weight"].T)) @ \
            t[f"blk.{i}.ffn_down.weight"].T
    hidden = _rms(x, t["output_norm.weight"], eps)
    head = t.get("output.weight", target_head)
    V = len(target_embd)
    d2t = t.get("d2t", np.arange(V)).astype(np.int64)
    base = np.full((B, V), -np.inf)
    base[:, d2t] = hidden @ head.T
    rows, picks, conf = np.empty((B, V)), [], []
    prev = anchor
    for i in range(B):
        e = t["markov_w1.weight"][prev]
        bias = np.zeros(V)
        bias[d2t] = t["markov_w2.weight"] @ e
        rows[i] = base[i] + bias
        if "conf_proj.weight" in t:
            z = t["conf_proj.weight"][0] @ np.concatenate([hidden[i], e]) + t["conf_proj.bias"][0]
            conf.append(1 / (1 + np.exp(-z)))
        prev = int(np.argmax(rows[i]))  # ggml_argmax: the first of equal maxima
        picks.append(prev)
    return base, rows, np.array(picks), np.array(conf)


def read_peer_gguf(path: Path) -> tuple[dict, dict]:
    """A dflash GGUF's tensors (float64, int64 d2t) and metadata, read with gguf-py alone."""
    r = gguf.GGUFReader(str(path))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.t")}
    t = {}
    for x in r.tensors:
        if x.name == "d2t":
            t[x.name] = np.array(x.data, dtype=np.int64)
        else:
            shape = tuple(reversed([int(s) for s in x.shape]))
            t[x.name] = gguf.quants.dequantize(x.data, x.tensor_type).reshape(shape).astype(
                np.float64)
    meta = {"eps": f["dflash.attention.layer_norm_rms_epsilon"],
            "theta": f["dflash.rope.freq_base"], "block_size": f["dflash.block_size"],
            "heads": f["dflash.attention.head_count"],
            "kv_heads": f["dflash.attention.head_count_kv"],
            "head_dim": f["dflash.attention.key_length"], "layers": f["dflash.block_count"],
            "mask": f["tokenizer.ggml.mask_token_id"], "target_layers": f["dflash.target_layers"]}
    return t, meta


# --- our side ---------------------------------------------------------------------------------


def our_draft(model: DraftModel, embed, taps: torch.Tensor, anchor: int):
    """Our torch float32 runtime's draft (the Markov chain with its exact shortlist) and the
    base logits of the same block, over the draft vocabulary."""
    d = Drafter(model, embed, dtype=torch.float32)
    d.observe_taps(taps)
    block = d.draft(anchor)
    n = d.cache.length
    with torch.inference_mode():
        x = model.block_rows(embed(torch.tensor([anchor]))[0].float())
        pos = torch.arange(n, n + model.c.block_size)
        for layer, k, v in zip(model.layers, d.cache.k, d.cache.v, strict=True):
            x = layer.forward_cached(x, pos, k, v, n)
        base = model.logits(model.norm(x)).double().numpy()
    return block, base


def tolerance(reference: np.ndarray) -> float:
    """float32 against float64: each of the forward's stages (norms, projections of at most
    1728 inputs, a softmax over at most a few hundred slots, the head) rounds relative to the
    size of its terms, and the RMS norms keep every stage's terms within a few units of its
    result; a sum of n terms carries at most n * 2^-24 of their absolute sum (Higham's gamma_n),
    which for these lengths (<= 2^11) and some ten stages stays under 2^-9 of the largest
    logit in the worst case, and in practice (random signs: sqrt(n)) some 2^-16."""
    finite = np.abs(reference[np.isfinite(reference)])
    return 2.0**-9 * float(finite.max())


def assert_parity(model, embed, taps, anchor, t, meta, target_embd, target_head):
    block, base = our_draft(model, embed, taps, anchor)
    p_base, p_rows, p_picks, p_conf = peer_draft(t, meta, target_embd, target_head,
                                                 taps.reshape(len(taps), -1).double().numpy(),
                                                 anchor)
    ids = model.draft_ids.numpy()
    tol = tolerance(p_base)
    assert np.abs(base - p_base[:, ids]).max() <= tol
    assert np.array_equal(block.picks, p_picks)  # the greedy chain, pick by pick
    got = np.take_along_axis(p_rows, block.topk_ids, 1)
    assert np.abs(block.topk_logits - got).max() <= tol
    if len(p_conf):
        assert np.allclose(block.head, p_conf, atol=1e-4)
    return block


# --- a synthetic qwen3 target and a DeepSpec checkpoint for it --------------------------------

TAPS = [0, 1]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = syn.write_model(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf",
                           syn.Recipe("qwen3", syn.SHAPES["tiny"], syn.Q.Q8_0, seed=4))
    return path, Transformer.from_gguf(path, precision="reference", max_context=256)


def deepspec_tensors(s: syn.Shape, n_layers=2, rank=16, draft_vocab=None, seed=7, conf=True):
    g = torch.Generator().manual_seed(seed)

    def mat(rows, cols, scale=1.0):
        return torch.randn(rows, cols, generator=g) * scale / cols**0.5

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    H, KH, hd, d, f = 4, 2, 64, s.dim, 512
    t = {"fc.weight": mat(d, len(TAPS) * d), "hidden_norm.weight": norm(d),
         "norm.weight": norm(d),
         "markov_head.markov_w1.weight": torch.randn(s.vocab_size, rank, generator=g),
         "markov_head.markov_w2.weight": mat(draft_vocab or s.vocab_size, rank, 8.0)}
    if conf:
        t["confidence_head.proj.weight"] = mat(1, d + rank)
        t["confidence_head.proj.bias"] = torch.tensor([0.3])
    for i in range(n_layers):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight":
                  norm(d), p + "self_attn.q_proj.weight": mat(H * hd, d, 4.0),
                  p + "self_attn.k_proj.weight": mat(KH * hd, d, 4.0),
                  p + "self_attn.v_proj.weight": mat(KH * hd, d),
                  p + "self_attn.o_proj.weight": mat(d, H * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "mlp.gate_proj.weight": mat(f, d), p + "mlp.up_proj.weight": mat(f, d),
                  p + "mlp.down_proj.weight": mat(d, f)})
    config = {"architectures": ["Qwen3DSparkModel"], "hidden_size": d, "num_hidden_layers":
              n_layers, "num_attention_heads": H, "num_key_value_heads": KH, "head_dim": hd,
              "intermediate_size": f, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "vocab_size": s.vocab_size, "target_layer_ids": TAPS, "block_size": 4,
              "mask_token_id": s.vocab_size - 3, "markov_rank": rank, "hidden_act": "silu",
              "tie_word_embeddings": True}
    return config, t


def write_deepspec(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({f"model.{k}": v.contiguous() for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    return folder


def as_gguf_names(config: dict, tensors: dict) -> tuple[dict, dict]:
    """DeepSpec's tensors as llama.cpp's converter names them (the reference reads those)."""
    names = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight",
             "markov_head.markov_w1.weight": "markov_w1.weight",
             "markov_head.markov_w2.weight": "markov_w2.weight",
             "confidence_head.proj.weight": "conf_proj.weight",
             "confidence_head.proj.bias": "conf_proj.bias", "d2t": "d2t",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    t = {}
    for k, v in tensors.items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            part, _, kind = rest.rpartition(".")
            t[f"blk.{i}.{layer[part]}.{kind}"] = v.double().numpy()
        elif k == "d2t":
            t["d2t"] = (v.long() + torch.arange(len(v))).numpy()  # speculators' offsets
        else:
            t[names[k]] = v.double().numpy()
    meta = {"eps": config["rms_norm_eps"], "theta": config["rope_theta"],
            "block_size": config["block_size"], "heads": config["num_attention_heads"],
            "kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"],
            "layers": config["num_hidden_layers"], "mask": config["mask_token_id"],
            "target_layers": [x + 1 for x in config["target_layer_ids"]]}
    return t, meta


def target_taps(target: Transformer, tokens: list[int], layers: list[int]) -> torch.Tensor:
    target.reset()
    out = target.prefill(tokens, tap_layers=layers)
    target.reset()
    return torch.stack([out.hiddens[i] for i in layers], -2).float()


def target_tables(target: Transformer) -> tuple[np.ndarray, np.ndarray]:
    embd = target.embed(torch.arange(target.config.vocab_size)).double().numpy()
    return embd, embd  # the synthetic and embedded targets tie their head


@pytest.mark.parametrize("draft_vocab", [None, 200])
def test_a_deepspec_checkpoint_drafts_the_peers_forward(qwen3, tmp_path, draft_vocab):
    """A DeepSpec folder (full vocabulary, or a draft vocabulary through speculators' d2t with
    its own lm_head) for a synthetic qwen3 target: our base logits are the numpy transcription
    of llama.cpp's forward within float32's error, and the greedy Markov chain is its chain."""
    path, target = qwen3
    s = syn.SHAPES["tiny"]
    config, tensors = deepspec_tensors(s, draft_vocab=draft_vocab)
    if draft_vocab:
        g = torch.Generator().manual_seed(2)
        ids = torch.sort(torch.randperm(s.vocab_size, generator=g)[:draft_vocab]).values
        tensors["d2t"] = ids - torch.arange(draft_vocab)  # speculators store offsets
        tensors["lm_head.weight"] = torch.randn(draft_vocab, s.dim, generator=g) / 16
        config["draft_vocab_size"] = draft_vocab
    folder = write_deepspec(tmp_path / "ds", config, tensors)
    model = load_model(target, target_info(target, path), folder)
    assert model.c.qk_norm and model.c.rope_style == "neox" and model.c.markov_keys == "target"
    t, meta = as_gguf_names(config, tensors)
    embd, head = target_tables(target)
    tokens = list(range(40, 100))
    taps = target_taps(target, tokens, TAPS)
    for anchor in (7, 300, 45):
        assert_parity(model, target.embed, taps, anchor, t, meta, embd, head)


def test_the_markov_chain_is_exact_where_the_old_shortlist_was_not(qwen3, tmp_path):
    """A Markov bias strong enough to lift a candidate from outside a row's 64 best backbone
    logits: the pick is still the argmax over every candidate (the old top-64 shortlist kept
    the best of the 64 and missed it)."""
    path, target = qwen3
    config, tensors = deepspec_tensors(syn.SHAPES["tiny"], seed=11)
    tensors["markov_head.markov_w2.weight"] *= 40.0
    folder = write_deepspec(tmp_path / "ds", config, tensors)
    model = load_model(target, target_info(target, path), folder)
    taps = target_taps(target, list(range(40, 100)), TAPS)
    t, meta = as_gguf_names(config, tensors)
    embd, head = target_tables(target)
    block = assert_parity(model, target.embed, taps, 7, t, meta, embd, head)
    _, base = our_draft(model, target.embed, taps, 7)
    ranks = [(base[i] > base[i, block.picks[i]]).sum() for i in range(len(base))]
    assert max(ranks) >= 64  # some pick lies outside its row's 64 best backbone logits


def test_the_checks_name_what_does_not_fit(qwen3, tmp_path):
    path, target = qwen3
    info = target_info(target, path)
    s = syn.SHAPES["tiny"]
    cases = [({"target_layer_ids": [0, 5]}, "taps the outputs of layers [5]"),
             ({"markov_head_type": "gated"}, "another Markov head type"),
             ({"final_logit_softcapping": 30.0}, "logit softcapping"),
             ({"use_sliding_window": True}, "sliding-window attention"),
             ({"vocab_size": 1000}, "vocabulary of 1000")]
    for change, words in cases:
        config, tensors = deepspec_tensors(s)
        config.update(change)
        folder = write_deepspec(tmp_path / str(len(words)), config, tensors)
        with pytest.raises(UserError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_model(target, info, folder)
    config, tensors = deepspec_tensors(s)
    tensors["layers.0.self_attn.sinks"] = torch.zeros(4)
    with pytest.raises(UserError, match="attention sinks"):
        load_model(target, info, write_deepspec(tmp_path / "sinks", config, tensors))
    config, tensors = deepspec_tensors(replace_dim(s, 128))
    with pytest.raises(UserError, match="hidden size 128"):
        load_model(target, info, write_deepspec(tmp_path / "dim", config, tensors))


def replace_dim(s: syn.Shape, dim: int) -> syn.Shape:
    return syn.replace(s, dim=dim)


def test_a_deepspec_drafter_round_trips_through_llamacpps_format(qwen3, tmp_path):
    """Exported to a dflash GGUF and read back, a peer-form drafter drafts what it did: the
    same tensors, names and taps (id + 1), so the same chain and logits."""
    path, target = qwen3
    config, tensors = deepspec_tensors(syn.SHAPES["tiny"], seed=5)
    model = load_model(target, target_info(target, path),
                       write_deepspec(tmp_path / "ds", config, tensors))
    out = export_gguf(model, path, tmp_path / "d.gguf")
    again = load_model(target, target_info(target, path), out)
    t, meta = read_peer_gguf(out)
    assert meta["target_layers"] == [x + 1 for x in TAPS] and "token_embd.weight" not in t
    taps = target_taps(target, list(range(40, 90)), TAPS)
    embd, head = target_tables(target)
    a = assert_parity(again, target.embed, taps, 9, t, meta, embd, head)
    b, _ = our_draft(model, target.embed, taps, 9)
    assert np.array_equal(a.picks, b.picks) and np.allclose(a.topk_logits, b.topk_logits,
                                                            atol=1e-4)


# --- the shipped drafter through llama.cpp's format ---------------------------------------------


# the shipped drafter (q/k norms, NeoX RoPE) and the one it replaced (interleaved RoPE, no q/k
# norms: the export's pair-to-NeoX rows and identity norms), both loadable
OLD_DRAFTER = Path(__file__).resolve().parents[1] / "data" / "drafter" / "stages" / "shipped-v1"


@pytest.fixture(scope="module", params=[DEFAULT_DRAFTER, OLD_DRAFTER], ids=["shipped", "old"])
def shipped_export(request, reference_model, model_path, tmp_path_factory):
    info = target_info(reference_model, model_path)
    model = load_model(reference_model, info, request.param)
    out = export_gguf(model, model_path, tmp_path_factory.mktemp("export") / "drafter.gguf")
    return model, out


def test_the_exported_shipped_drafter_drafts_as_the_shipped_one(shipped_export, reference_model,
                                                                model_path):
    """Our shipped drafter (q/k norms, NeoX RoPE) and the one it replaced (interleaved RoPE, no
    q/k norms), each with a learned mask vector and W1 by draft index, written as llama.cpp's
    and read back: the numpy transcription of llama.cpp's forward
    over the file's tensors and our runtime over the read-back model both give the shipped
    drafter's chain, and their logits agree within float32's error."""
    model, out = shipped_export
    again = load_model(reference_model, target_info(reference_model, model_path), out)
    assert again.c.qk_norm and again.c.rope_style == "neox" and again.c.markov_keys == "target"
    t, meta = read_peer_gguf(out)
    layers = [x - 1 for x in meta["target_layers"]]
    assert layers == model.c.target_layers
    embd, head = target_tables(reference_model)
    tokens = list(range(1000, 1060))
    taps = target_taps(reference_model, tokens, layers)
    for anchor in (tokens[-1], 28, 355):
        a = assert_parity(again, reference_model.embed, taps, anchor, t, meta, embd, head)
        b, base = our_draft(model, reference_model.embed, taps, anchor)
        assert np.array_equal(a.picks, b.picks)
        assert np.abs(a.topk_logits - b.topk_logits).max() <= tolerance(base)


def test_the_identity_norm_moves_q_by_under_its_bound():
    """The export's stand-in for a missing q/k norm: scaled rows and weights sqrt(eps)/s give
    RMSNorm(s q) = q to within 2^-40 relative, for inputs at the bound's extreme."""
    g = torch.Generator().manual_seed(0)
    w, norm, eps = torch.randn(64, 96, generator=g) * 3, torch.rand(96, generator=g) * 4, 1e-5
    s = identity_norm_scale(w, [norm], eps)
    x = torch.randn(8, 96, generator=g, dtype=torch.float64)
    h = x / x.pow(2).mean(-1, keepdim=True).sqrt() * norm.double()
    q = h @ w.double().T
    y = s * q
    normed = y / (y.pow(2).mean(-1, keepdim=True) + eps).sqrt() * (eps**0.5 / s)
    assert float(((normed - q).abs() / q.abs().max()).max()) < 2.0**-40
    assert s < 1.0


def test_neox_and_pair_layouts_give_one_rotation():
    """neox_to_pairs: a NeoX drafter's q/k rows reordered so that RoPE on pairs rotates as
    NeoX RoPE does (the native build's layout), and the export's reorder undoes it."""
    from adaspark.drafter.export import pairs_to_neox
    from adaspark.drafter.model import rope

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=g)
    w = torch.randn(32, 8, generator=g)
    assert torch.equal(pairs_to_neox(neox_to_pairs(w, 16), 16), w)
    pos = torch.arange(5) + 11
    neox = rope(x, pos, 1e4, neox=True)
    perm = neox_to_pairs(torch.arange(16)[:, None].float(), 16).long().flatten()
    assert torch.allclose(rope(x[..., perm], pos, 1e4)[..., :], neox[..., perm], atol=1e-6)


def native_module():
    from adaspark.model import native

    module, why = native.load_isa(native.runnable_isas()[0]) if native.runnable_isas() else (
        None, "no native build runs here")
    if module is None:
        pytest.skip(f"native build not usable here: {why}")
    return module


def native_backbone_error(module, model, embed, taps, anchor: int) -> float:
    """The native backbone's largest row error relative to the float32 model's."""
    nat = Drafter(model, embed, native=module, positions=256)
    assert nat.native is not None
    nat.observe_taps(taps)
    ref = Drafter(model, embed, dtype=torch.float32)
    ref.observe_taps(taps)
    n, a = nat.cache.length, torch.tensor([anchor])
    hidden, _ = nat.native.backbone(nat.cache.k, nat.cache.v, embed(a)[0], n, torch.empty(0))
    with torch.inference_mode():
        ref.cache._grow(n + model.c.block_size)
        x = model.block_rows(embed(a)[0])
        pos = torch.arange(n, n + model.c.block_size)
        for layer, k, v in zip(model.layers, ref.cache.k, ref.cache.v, strict=True):
            x = layer.forward_cached(x, pos, k, v, n)
        want = model.norm(x)
    return float(((hidden - want).norm(dim=-1) / want.norm(dim=-1)).max())


def test_the_exported_shipped_drafter_runs_natively(shipped_export, reference_model, model_path):
    """Read back, the export's shrunken q/k rows (its identity norms) are rescaled by a power of
    two for Q8_0 at load, the norms' epsilon with them: the native backbone stays within
    Q8_0's ~1% of the float32 model, as the shipped drafter's does."""
    _, out = shipped_export
    again = load_model(reference_model, target_info(reference_model, model_path), out)
    tokens = list(range(1000, 1060))
    taps = target_taps(reference_model, tokens, again.c.target_layers)
    assert native_backbone_error(native_module(), again, reference_model.embed, taps,
                                 tokens[-1]) < 2**-4


def test_a_peer_drafter_runs_on_the_native_build_near_its_float32_self(qwen3, tmp_path):
    """Every option on (q/k norms, NeoX, a token-row mask, W1 by target id): the native draft
    (Q8_0 weights) stays within Q8_0's ~1% of the float32 one, the rows as the torch path's."""
    module = native_module()
    path, target = qwen3
    config, tensors = deepspec_tensors(syn.SHAPES["tiny"], seed=3, conf=False)
    model = load_model(target, target_info(target, path),
                       write_deepspec(tmp_path / "ds", config, tensors))
    assert model.confidence is None
    taps = target_taps(target, list(range(40, 100)), TAPS)
    assert native_backbone_error(module, model, target.embed, taps, 7) < 2**-4
    nat = Drafter(model, target.embed, native=module, positions=256)
    assert nat.native is not None
    nat.observe_taps(taps)
    ref = Drafter(model, target.embed, dtype=torch.float32)
    ref.observe_taps(taps)
    a, b = nat.draft(7), ref.draft(7)
    assert np.allclose(a.head, 0.5) and np.allclose(b.head, 0.5)  # no confidence head: 1/2
    assert a.picks.shape == b.picks.shape == (model.c.block_size,)


# --- llama-server runs the export ---------------------------------------------------------------


def _server_binary() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import llama_server

    return llama_server.binary()


@pytest.mark.skipif(not _server_binary().is_file(),
                    reason="llama-server not built (benchmarks/llama_server.py --build-only)")
def test_llama_server_loads_the_export_and_drafts_with_it(shipped_export, model_path, tmp_path):
    import llama_server

    from adaspark.bench.client import ChatClient
    from adaspark.bench.servers import ServerProcess, free_port

    _, out = shipped_export
    port = free_port()
    cmd = llama_server.command(model_path, port, parallel=1, threads=1) + [
        "--spec-draft-model", str(out), "--spec-type", "draft-dspark", "--spec-draft-n-max", "3"]
    with ServerProcess(cmd, port, tmp_path / "log") as srv, ChatClient(srv.url) as chat:
        reply = chat.stream_chat([{"role": "user", "content": "Count from 1 to 20."}],
                                 max_tokens=48)
    log = (tmp_path / "log").read_text(errors="replace")
    assert reply.completion_tokens > 0 and reply.text, log[-2000:]
    assert "draft-dspark" in log
    timings = reply.timings or {}
    assert timings.get("draft_n", 0) > 0, (timings, log[-2000:])
    assert timings.get("draft_n_accepted", 0) > 0, timings


def test_export_drafter_cli_help():
    out = subprocess.run([sys.executable, "-m", "adaspark.cli", "export-drafter", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--format" in out and "--drafter" in out and "--model" in out and "OUT" in out


def test_generate_runs_the_exported_drafter_and_emits_the_targets_tokens(shipped_export,
                                                                         tmp_path, capsys):
    """`adaspark generate --drafter OUT.gguf` drafts with the llama.cpp-format file and emits
    exactly plain decoding's greedy tokens."""
    from adaspark import cli

    _, out = shipped_export
    argv = ["generate", "--prompt", "Name three colours.", "--max-tokens", "24", "--json",
            "--store", str(tmp_path / "store")]
    assert cli.main([*argv, "--arm", "ar"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--drafter", str(out)]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["token_ids"] == plain["token_ids"]


def rewrite_gguf(src: Path, dst: Path, extra_keys: dict | None = None,
                 extra_tensors: dict | None = None) -> Path:
    """src's metadata and tensors again at dst, plus keys / float32 tensors."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "dflash")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, value in (extra_keys or {}).items():
        w.add_uint32(key, value)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=np.array(t.data).shape,
                     raw_dtype=t.tensor_type)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_gguf_drafter_with_what_the_engine_does_not_run_is_refused_by_name(qwen3, tmp_path):
    path, target = qwen3
    info = target_info(target, path)
    config, tensors = deepspec_tensors(syn.SHAPES["tiny"], seed=5)
    model = load_model(target, info, write_deepspec(tmp_path / "ds", config, tensors))
    out = export_gguf(model, path, tmp_path / "d.gguf")
    same = load_model(target, info, rewrite_gguf(out, tmp_path / "same.gguf"))
    # the rewrite alone changes nothing (eps is float32 in a GGUF)
    assert {**same.c.to_dict(), "norm_eps": 0} == {**model.c.to_dict(), "norm_eps": 0}
    cases = [({"dflash.attention.sliding_window": 64}, None, "sliding-window attention"),
             ({"dflash.hyper_connection.count": 4}, None, "hyper-connections"),
             (None, {"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}, "attention sinks")]
    for i, (keys, extra, words) in enumerate(cases):
        bad = rewrite_gguf(out, tmp_path / f"bad{i}.gguf", keys, extra)
        with pytest.raises(UserError, match=words):
            load_model(target, info, bad)


def test_a_speculators_checkpoint_is_read_as_llamacpps_converter_reads_it(qwen3, tmp_path):
    """speculators' layout: the layer shape under transformer_layer_config, taps as
    aux_hidden_state_layer_ids (layer inputs), d2t offsets; without sample_from_anchor it is a
    bonus-anchor drafter, refused by name, and with it it drafts as the DeepSpec form."""
    path, target = qwen3
    info = target_info(target, path)
    config, tensors = deepspec_tensors(syn.SHAPES["tiny"], seed=6)
    inner = {k: config.pop(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "intermediate_size",
                                        "rms_norm_eps", "rope_theta", "vocab_size")}
    config.update(architectures=["DSparkSpeculator"], transformer_layer_config=inner,
                  aux_hidden_state_layer_ids=[x + 1 for x in config.pop("target_layer_ids")])
    with pytest.raises(UserError, match="bonus-anchor"):
        load_model(target, info, write_deepspec(tmp_path / "a", config, tensors))
    config["sample_from_anchor"] = True
    model = load_model(target, info, write_deepspec(tmp_path / "b", config, tensors))
    assert model.c.target_layers == TAPS and model.c.n_layers == inner["num_hidden_layers"]


def test_a_peer_drafter_keeps_in_our_checkpoint_format(qwen3, tmp_path):
    """A DeepSpec drafter with a draft vocabulary and its own head, saved as our checkpoint and
    loaded again: every option, the stored head and the token-row mask come back, and it drafts
    the same (its weights are fp16 values, which our checkpoints store)."""
    from adaspark.drafter.checkpoint import load_checkpoint, save_checkpoint

    path, target = qwen3
    info = target_info(target, path)
    s = syn.SHAPES["tiny"]
    config, tensors = deepspec_tensors(s, draft_vocab=150, seed=8)
    g = torch.Generator().manual_seed(9)
    tensors["d2t"] = torch.sort(torch.randperm(s.vocab_size, generator=g)[:150]).values - \
        torch.arange(150)
    tensors["lm_head.weight"] = torch.randn(150, s.dim, generator=g) / 16
    tensors = {k: v if k == "d2t" else v.half().float() for k, v in tensors.items()}
    model = load_model(target, info, write_deepspec(tmp_path / "ds", config, tensors))
    save_checkpoint(tmp_path / "ours", model, info)
    again = load_checkpoint(tmp_path / "ours", info, target.embed)
    assert again.c == model.c and again.c.lm_head == "stored"
    assert torch.equal(again.head, model.head) and torch.equal(again.mask_embedding,
                                                               model.mask_embedding)
    taps = target_taps(target, list(range(40, 90)), TAPS)
    a, _ = our_draft(model, target.embed, taps, 11)
    b, _ = our_draft(again, target.embed, taps, 11)
    assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.topk_logits,
                                                                      b.topk_logits)


def test_an_untied_targets_head_is_shared_not_copied(tmp_path):
    """A target whose head is not its embedding (Qwen3-8B's kind): a full-vocabulary DeepSpec
    drafter drafts with the target's head rows, and its export carries no head (llama.cpp
    shares the target's) yet reads back to the same drafter."""
    s = syn.replace(syn.SHAPES["tiny"], tied=False)
    path = syn.write_model(tmp_path / "untied.gguf", syn.Recipe("qwen3", s, syn.Q.Q8_0, seed=2))
    target = Transformer.from_gguf(path, precision="reference", max_context=256)
    assert not target.tied
    info = target_info(target, path)
    config, tensors = deepspec_tensors(s, seed=12)
    model = load_model(target, info, write_deepspec(tmp_path / "ds", config, tensors))
    head = peers.target_of(target).head_rows(torch.arange(s.vocab_size)).double().numpy()
    embd = target.embed(torch.arange(s.vocab_size)).double().numpy()
    assert not np.array_equal(head, embd)
    t, meta = as_gguf_names(config, tensors)
    taps = target_taps(target, list(range(40, 90)), TAPS)
    assert_parity(model, target.embed, taps, 5, t, meta, embd, head)
    out = export_gguf(model, path, tmp_path / "d.gguf")
    t2, _ = read_peer_gguf(out)
    assert "output.weight" not in t2 and "d2t" not in t2
    again = load_model(target, info, out)
    assert_parity(again, target.embed, taps, 5, t2, meta, embd, head)
