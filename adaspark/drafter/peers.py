"""Published DSpark drafters: llama.cpp's `dflash` GGUF and DeepSpec's checkpoint folder, read
into the one DraftModel (docs/drafter-formats.md).

Both peers run the same block drafter as ours with the options DrafterConfig names: per-head
q/k RMSNorm, NeoX RoPE, the mask as a token's embedding row, W1 keyed by target id, a draft
vocabulary through `d2t` (llama.cpp) or the full target vocabulary. Their tensors map one to
one onto ours; what the engine does not run (attention sinks, sliding windows, softcapping,
another Markov head, DFlash2's selector, hyper-connections, scaled logits or embeddings) is
refused by name, and the drafter is checked against the target (hidden size, vocabulary, taps).

Taps: DeepSpec's `target_layer_ids` name a layer's output, as ours do; llama.cpp's
`dflash.target_layers` name a layer's input (the converter writes id + 1), so ours = id - 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adaspark.drafter.model import DrafterConfig, DraftModel
from adaspark.errors import UserError

_log = logging.getLogger(__name__)
ARCH = "dflash"


@dataclass
class Target:
    """What a drafter is checked against and rebuilt from: the loaded target's shape, its
    input embedding (float32 rows as gguf decodes them) and its LM head rows."""
    dim: int
    vocab_size: int
    n_layers: int
    embed: object  # token ids -> [..., dim]
    head_rows: object  # token ids -> [..., dim]: the target's LM head rows (tied: embed)
    tied: bool = True  # the head is the input embedding


def target_of(transformer) -> Target:
    """The Target of a loaded Transformer."""
    c = transformer.config

    def head_rows(ids: torch.Tensor) -> torch.Tensor:
        if transformer.tied:
            return transformer.embed(ids)
        rows = transformer._weights.raw("output.weight").dequantize()
        return torch.from_numpy(np.ascontiguousarray(rows[ids.numpy()])).float()

    return Target(c.dim, c.vocab_size, c.n_layers, transformer.embed, head_rows,
                  transformer.tied)


def kind_of(path: Path) -> str:
    """"adaspark", "deepspec" or "gguf": which format a --drafter path holds."""
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise UserError(f"drafter {path}: a file that is not a GGUF (a drafter is a llama.cpp "
                        "dflash GGUF, a DeepSpec folder or an adaspark checkpoint folder)")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise UserError(f"no drafter checkpoint at {path} (need a folder with config.json, "
                        "ours or DeepSpec's, or a llama.cpp dflash GGUF file)")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"drafter {path}: config.json is not valid JSON ({err})") from err
    if isinstance(config, dict) and "format" in config:
        return "adaspark"
    return "deepspec"


# --- the common part: a peer's tensors, named as ours, into a DraftModel ---------------------

@dataclass
class PeerDrafter:
    """A peer's drafter read into our names: its shape and float32 tensors."""
    source: str  # the path, for messages
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    block_size: int
    norm_eps: float
    rope_theta: float
    taps: list[int]  # our convention: a layer's output
    mask_token_id: int
    vocab_size: int  # the target vocabulary it was made for
    tensors: dict[str, torch.Tensor]  # our state-dict names; plus "head", "d2t", "token_embd"
    rope_style: str = "neox"


def build(p: PeerDrafter, target: Target) -> DraftModel:
    """The DraftModel of a peer drafter, checked against the target."""
    t = p.tensors
    misfits = []
    if p.dim != target.dim:
        misfits.append(f"hidden size {p.dim} (the target's is {target.dim})")
    if p.vocab_size != target.vocab_size:
        misfits.append(f"vocabulary of {p.vocab_size} (the target's is {target.vocab_size})")
    bad = [x for x in p.taps if not 0 <= x < target.n_layers]
    if bad:
        misfits.append(f"taps the outputs of layers {bad} (the target has layers 0.."
                       f"{target.n_layers - 1})")
    fc_in = t["fc.weight"].shape[1] if "fc.weight" in t else None
    if fc_in is not None and fc_in != len(p.taps) * target.dim:
        misfits.append(f"fc reads {fc_in} inputs, not {len(p.taps)} taps x {target.dim}")
    if not 0 <= p.mask_token_id < target.vocab_size:
        misfits.append(f"mask token {p.mask_token_id} outside the vocabulary")
    if misfits:
        raise UserError(f"drafter {p.source} does not fit this target: " + "; ".join(misfits))
    if p.n_heads % p.n_kv_heads or p.head_dim % 2:
        raise UserError(f"drafter {p.source}: {p.n_heads} heads over {p.n_kv_heads} KV heads "
                        f"of size {p.head_dim} is not a shape it can run")
    w1 = t.get("markov_w1.weight")
    if w1 is None or "markov_w2.weight" not in t:
        raise UserError(f"drafter {p.source} has no DSpark Markov head (markov_w1/markov_w2): "
                        "a plain DFlash drafter, which this engine does not run")
    if w1.shape[0] != target.vocab_size:
        raise UserError(f"drafter {p.source}: markov_w1 has {w1.shape[0]} rows, not one per "
                        f"target token ({target.vocab_size})")
    d2t = t.pop("d2t", None)
    draft_ids = (torch.arange(target.vocab_size) if d2t is None else d2t.long())
    if len(draft_ids) != t["markov_w2.weight"].shape[0]:
        raise UserError(f"drafter {p.source}: markov_w2 has {t['markov_w2.weight'].shape[0]} "
                        f"rows but the draft vocabulary {len(draft_ids)}")
    if d2t is not None and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= target.vocab_size
                            or len(torch.unique(draft_ids)) != len(draft_ids)):
        raise UserError(f"drafter {p.source}: d2t maps outside the target vocabulary or twice")
    head = t.pop("head", None)
    own_embd = t.pop("token_embd", None)
    mask_row = target.embed(torch.tensor([p.mask_token_id]))[0].float()
    learned_mask = None
    if own_embd is not None:  # its own input table: the target's, but perhaps for the mask row
        learned_mask = _own_embedding_mask(p, own_embd, target, mask_row)
    target_rows = target.head_rows(draft_ids).float()
    # a head of the target's own rows (our export writes them) is the target's: rebuilt at load
    # from its embedding where the target ties them (else kept, as a head of its own)
    stored = (head is not None and not torch.equal(head.float(), target_rows)) or not target.tied
    head = target_rows if head is None or not stored else head
    c = DrafterConfig(
        target_layers=list(p.taps), draft_vocab_size=len(draft_ids), dim=p.dim,
        block_size=p.block_size, n_layers=p.n_layers, n_heads=p.n_heads,
        n_kv_heads=p.n_kv_heads, head_dim=p.head_dim, ffn_dim=p.ffn_dim, norm_eps=p.norm_eps,
        rope_theta=p.rope_theta, markov_rank=w1.shape[1],
        confidence_head="confidence.weight" in t,
        mask_token="learned_embedding" if learned_mask is not None else "target_token",
        mask_token_id=p.mask_token_id, lm_head="stored" if stored else "target_embedding_rows",
        qk_norm="layers.0.q_norm.weight" in t, rope_style=p.rope_style, markov_keys="target",
        target_vocab_size=target.vocab_size)
    sorted_ids, order = torch.sort(draft_ids)
    if not torch.equal(sorted_ids, draft_ids):  # our draft vocabulary is ascending
        head, t["markov_w2.weight"] = head[order], t["markov_w2.weight"][order]
        draft_ids = sorted_ids
    model = DraftModel(c, draft_ids, head.float(),
                       mask_row=None if learned_mask is not None else mask_row)
    if learned_mask is not None:
        t["mask_embedding"] = learned_mask
    state = {k: v.float() for k, v in t.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "temperature"]
    if missing or unexpected:
        raise UserError(f"drafter {p.source}: tensors missing {missing[:4]}, not understood "
                        f"{unexpected[:4]}")
    return model.eval()


def _own_embedding_mask(p: PeerDrafter, table: torch.Tensor, target: Target,
                        mask_row: torch.Tensor) -> torch.Tensor | None:
    """A drafter's own token table (llama.cpp embeds the anchor and masks with it) must be the
    target's on every row the anchor can take; its mask row may be a vector of its own
    (llama.cpp's converter writes DFlash's mask_embedding.pt there, our export our learned
    mask). Returns that vector, or None where the mask row is the target's."""
    if table.shape != (target.vocab_size, target.dim):
        raise UserError(f"drafter {p.source}: its token embeddings are {tuple(table.shape)}, "
                        f"not the target's [{target.vocab_size}, {target.dim}]")
    step = 4096
    for lo in range(0, target.vocab_size, step):
        ids = torch.arange(lo, min(lo + step, target.vocab_size))
        want = target.embed(ids).float()
        got = table[lo : lo + len(ids)].float()
        keep = ids != p.mask_token_id
        err = (got[keep] - want[keep]).abs().max() if keep.any() else torch.tensor(0.0)
        # the target's rows to within fp16 rounding (a converter may store them as F16)
        if float(err) > 2.0**-10 * float(want.abs().max()) + 1e-12:
            raise UserError(f"drafter {p.source}: its token embeddings differ from the "
                            f"target's (by {float(err):.3g}): it was made for another target")
    own = table[p.mask_token_id].float()
    return None if torch.equal(own, mask_row) else own.clone()


# --- llama.cpp's dflash GGUF -----------------------------------------------------------------

# metadata the engine does not run, by what it is (a key present and not at its neutral value)
_REFUSED_KEYS = {
    "attention.sliding_window": "sliding-window attention",
    "attention.sliding_window_pattern": "sliding-window attention",
    "final_logit_softcapping": "logit softcapping",
    "logit_scale": "scaled logits",
    "embedding_scale": "scaled input embeddings",
    "attention.scale": "a custom attention scale",
    "attention.value_scale": "scaled attention values",
    "hyper_connection.count": "hyper-connections (DeepSeek-V4 DSpark)",
    "selector_rank": "DFlash2's candidate selector",
    "conv_kernel_size": "DFlash2's block convolutions",
    "rope.dimension_sections": "M-RoPE sections",
    "rope.scaling.type": "scaled RoPE",
}
_NEUTRAL = {"logit_scale": 1.0, "embedding_scale": 1.0, "final_logit_softcapping": 0.0,
            "attention.sliding_window": 0, "hyper_connection.count": 0, "selector_rank": 0,
            "rope.scaling.type": "none"}
_REFUSED_TENSORS = {
    "attn_sinks": "attention sinks", "post_attention_norm": "post-attention norms",
    "post_ffw_norm": "post-FFN norms", "layer_output_scale": "layer output scales",
    "rope_freqs": "RoPE frequency factors", "selector_": "DFlash2's candidate selector",
    "conv_": "DFlash2's block convolutions", ".scale": "scaled (quantisation) weights",
    "hc_": "hyper-connections (DeepSeek-V4 DSpark)",
}
_GGUF_NAMES = {  # llama.cpp's tensor names -> ours
    "fc.weight": "fc.weight", "enc.output_norm.weight": "ctx_norm.weight",
    "output_norm.weight": "norm.weight", "markov_w1.weight": "markov_w1.weight",
    "markov_w2.weight": "markov_w2.weight", "conf_proj.weight": "confidence.weight",
    "conf_proj.bias": "confidence.bias", "output.weight": "head", "d2t": "d2t",
    "token_embd.weight": "token_embd",
}
_GGUF_LAYER = {"attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
               "attn_output": "o", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
               "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    if len(f.types) > 1 or (f.types and f.types[0].name == "ARRAY"):
        return [v.item() if hasattr(v, "item") else v for v in
                (f.parts[i][0] for i in f.data)]
    v = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(v).decode("utf-8", "replace")
    return v[0].item()


def read_gguf(path: Path, target: Target) -> DraftModel:
    """A llama.cpp `dflash` drafter GGUF with a DSpark Markov head, as a DraftModel."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # a damaged file is the file's fault
        raise UserError(f"drafter {path}: not a readable GGUF ({err})") from err
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise UserError(f"drafter {path}: a GGUF of architecture {arch!r}, not llama.cpp's "
                        f"drafter architecture {ARCH!r}")

    def key(name, default=None):
        v = _field(reader, f"{ARCH}.{name}")
        return default if v is None else v

    for name, what in _REFUSED_KEYS.items():
        v = key(name)
        if v is not None and v != _NEUTRAL.get(name, object()) and not (
                name == "rope.dimension_sections" and not any(v[1:])):
            raise UserError(f"drafter {path} uses {what} ({ARCH}.{name} = {v!r}), which this "
                            "engine does not run")
    if key("attention.causal", False):
        raise UserError(f"drafter {path} uses causal block attention, which this engine does "
                        "not run (its blocks attend both ways)")
    if str(key("sample_from_anchor", True)).lower() not in ("true", "1"):
        raise UserError(f"drafter {path} uses a bonus-anchor block (sample_from_anchor false), "
                        "which this engine does not run")
    act = key("hidden_activation", "silu")
    if act != "silu":
        raise UserError(f"drafter {path} uses the activation {act!r}; this engine runs silu")
    taps = key("target_layers")
    if not taps:
        raise UserError(f"drafter {path} names no target layers ({ARCH}.target_layers)")
    if 0 in taps:
        raise UserError(f"drafter {path} taps the target's input embeddings (layer input 0), "
                        "which this engine does not tap")
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        for bad, what in _REFUSED_TENSORS.items():
            if bad in t.name:
                raise UserError(f"drafter {path} has {what} ({t.name}), which this engine "
                                "does not run")
        if t.name.startswith("blk."):
            _, i, part, kind = t.name.split(".", 3)
            if part not in _GGUF_LAYER:
                raise UserError(f"drafter {path}: tensor {t.name} is not understood")
            name = f"layers.{i}.{_GGUF_LAYER[part]}.{kind}"
        elif t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            raise UserError(f"drafter {path}: tensor {t.name} is not understood")
        tensors[name] = _gguf_tensor(t)
    n_heads, dim = key("attention.head_count"), key("embedding_length")
    p = PeerDrafter(
        source=str(path), dim=dim, n_layers=key("block_count"), n_heads=n_heads,
        n_kv_heads=key("attention.head_count_kv", n_heads),
        head_dim=key("attention.key_length", dim // n_heads), ffn_dim=key("feed_forward_length"),
        block_size=key("block_size", 16), norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0), taps=[x - 1 for x in taps],
        mask_token_id=_field(reader, "tokenizer.ggml.mask_token_id"),
        vocab_size=target.vocab_size if "markov_w1.weight" not in tensors
        else tensors["markov_w1.weight"].shape[0], tensors=tensors)
    if p.mask_token_id is None:
        raise UserError(f"drafter {path} names no mask token (tokenizer.ggml.mask_token_id)")
    if "layers.0.q_norm.weight" not in tensors:
        raise UserError(f"drafter {path}: llama.cpp's dflash needs q/k norms; this file has none")
    return build(p, target)


def _gguf_tensor(t) -> torch.Tensor:
    """A GGUF tensor as float32 (int64 for d2t), numpy's order (rows = outputs)."""
    import gguf

    if t.tensor_type == gguf.GGMLQuantizationType.I64:
        return torch.from_numpy(np.array(t.data, dtype=np.int64).reshape(-1))
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))


# --- DeepSpec's checkpoint folder --------------------------------------------------------------

_DEEPSPEC_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator")
_HF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "q", "self_attn.k_proj": "k",
             "self_attn.v_proj": "v", "self_attn.o_proj": "o", "self_attn.q_norm": "q_norm",
             "self_attn.k_norm": "k_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down"}
_HF_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "ctx_norm.weight",
             "norm.weight": "norm.weight", "markov_head.markov_w1.weight": "markov_w1.weight",
             "markov_head.markov_w2.weight": "markov_w2.weight",
             "confidence_head.proj.weight": "confidence.weight",
             "confidence_head.proj.bias": "confidence.bias", "lm_head.weight": "head",
             "d2t": "d2t", "embed_tokens.weight": "token_embd"}


def read_deepspec(path: Path, target: Target) -> DraftModel:
    """A DeepSpec DSpark checkpoint folder (config.json + *.safetensors) as a DraftModel."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not any(a in _DEEPSPEC_ARCHS for a in archs):
        raise UserError(f"drafter {path}: config.json names {archs}, not a DSpark drafter "
                        f"({', '.join(_DEEPSPEC_ARCHS)})")
    # speculators' (SpecForge's) layout, as llama.cpp's converter normalises it: the layer
    # shape nested, taps as aux_hidden_state_layer_ids (layer inputs: id - 1), and a bonus
    # anchor unless sample_from_anchor says otherwise
    eagle = "transformer_layer_config" in cfg or "aux_hidden_state_layer_ids" in cfg
    cfg = {**cfg, **cfg.get("transformer_layer_config", {})}
    dcfg = {**cfg, **cfg.get("dflash_config", {})}
    if "aux_hidden_state_layer_ids" in dcfg and "target_layer_ids" not in dcfg:
        dcfg["target_layer_ids"] = [i - 1 for i in dcfg["aux_hidden_state_layer_ids"]]
    dcfg.setdefault("sample_from_anchor", not eagle)
    checks = {
        "markov_head_type": ("vanilla", "another Markov head type"),
        "hidden_act": ("silu", "another activation"),
        "attention_bias": (False, "attention biases"),
        "use_sliding_window": (False, "sliding-window attention"),
        "is_causal": (False, "causal block attention"),
        "sample_from_anchor": (True, "a bonus-anchor block"),
    }
    for name, (ok, what) in checks.items():
        if name in dcfg and dcfg[name] is not None and dcfg[name] != ok:
            raise UserError(f"drafter {path} uses {what} ({name} = {dcfg[name]!r}), which this "
                            "engine does not run")
    for name, what in (("final_logit_softcapping", "logit softcapping"),
                       ("attention_sinks", "attention sinks"), ("use_swa", "sliding windows"),
                       ("rope_scaling", "scaled RoPE"), ("output_multiplier", "scaled logits"),
                       ("input_embedding_scale", "scaled input embeddings")):
        if dcfg.get(name):
            raise UserError(f"drafter {path} uses {what} ({name} = {dcfg[name]!r}), which this "
                            "engine does not run")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"drafter {path}: no *.safetensors beside config.json")
    raw: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            raw.update(load_file(str(f)))
    except Exception as err:
        raise UserError(f"drafter {path}: a damaged safetensors file ({err})") from err
    tensors: dict[str, torch.Tensor] = {}
    for name, value in raw.items():
        short = name.removeprefix("model.")
        if short == "t2d":
            continue
        if "sink" in short:
            raise UserError(f"drafter {path} has attention sinks ({name}), which this engine "
                            "does not run")
        if short.startswith("layers."):
            _, i, rest = short.split(".", 2)
            part, _, kind = rest.rpartition(".")
            if part not in _HF_LAYER:
                raise UserError(f"drafter {path}: tensor {name} is not understood")
            tensors[f"layers.{i}.{_HF_LAYER[part]}.{kind}"] = value.float()
        elif short in _HF_NAMES:
            tensors[_HF_NAMES[short]] = value if short == "d2t" else value.float()
        else:
            raise UserError(f"drafter {path}: tensor {name} is not understood")
    if "d2t" in tensors:  # speculators' d2t holds offsets: target id = d2t[i] + i
        d2t = tensors["d2t"].long().reshape(-1)
        tensors["d2t"] = d2t + torch.arange(len(d2t))
    n_heads = cfg["num_attention_heads"]
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    if dcfg.get("mask_token_id") is None or not dcfg.get("target_layer_ids"):
        raise UserError(f"drafter {path}: config.json needs mask_token_id and target_layer_ids")
    p = PeerDrafter(
        source=str(path), dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn_dim=cfg["intermediate_size"], block_size=int(dcfg.get("block_size", 16)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta or 10000.0),
        taps=list(dcfg["target_layer_ids"]), mask_token_id=int(dcfg["mask_token_id"]),
        vocab_size=cfg["vocab_size"], tensors=tensors,
        rope_style="neox" if dcfg.get("rope_is_neox_style", True) else "interleaved")
    return build(p, target)
