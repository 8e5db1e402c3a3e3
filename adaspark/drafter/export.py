"""Any drafter the engine holds, written as llama.cpp's `dflash` drafter GGUF with a DSpark
Markov head (`llama-server --spec-draft-model OUT --spec-type draft-dspark`).

What llama.cpp's graph (src/models/dflash.cpp) cannot hold is re-expressed, exactly or within
a bound far under float32's rounding:
- taps: llama.cpp names a layer's input, so ours (a layer's output) are written as id + 1;
- RoPE on interleaved pairs: q/k rows reordered to NeoX halves (the same rotation);
- W1 keyed by draft index: written keyed by target id (row of every id = its draft row, or the
  row for outside), with the draft vocabulary as `d2t` and the head as `output` over it;
- a learned mask vector: written into the drafter's own token table (the target's rows, F32 so
  every value is the target's) at a token that no reply writes (`mask_token_id`);
- no q/k RMSNorm (llama.cpp's dflash requires it): q/k rows are scaled by s = 2^-k and the
  norm weights set to sqrt(eps)/s, so RMSNorm(s q) = q / sqrt(1 + s^2 mean(q^2) / eps); s is
  chosen from a bound on mean(q^2) (|W row|^2 |h|^2, |h|^2 <= dim max(norm weight)^2 for the
  RMS-normed inputs) so that s^2 mean(q^2) / eps <= 2^-40: a relative change under 2^-41.
- per-row confidence temperatures have no place in llama.cpp (it reads the confidence only
  with --spec-draft-p-min > 0): the head is written uncalibrated.
Weights are written F16 where every value is one (our checkpoints' are), else F32; rows of the
target's own table are copied as its blocks (the same values).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from adaspark.drafter.model import DraftModel
from adaspark.errors import UserError

ARCH = "dflash"
QK_NORM_MARGIN = 2.0**-40  # s^2 mean(q^2) / eps at most this: the identity norm's error


def pairs_to_neox(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k rows of interleaved-pair heads reordered to NeoX halves (model.neox_to_pairs undone):
    row i <- row 2i, row i + hd/2 <- row 2i + 1 of each head."""
    shape = rows.shape
    return rows.reshape(-1, head_dim // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def identity_norm_scale(w: torch.Tensor, input_norms: list[torch.Tensor], eps: float) -> float:
    """The power of two s for q/k rows w [out, dim] whose per-head RMSNorm (weights sqrt(eps)/s)
    must act as the identity: mean(q^2) <= max_i |w_i|^2 |h|^2 and an RMS-normed input h has
    |h|^2 <= dim max(weight)^2, so s^2 that bound / eps <= QK_NORM_MARGIN."""
    dim = w.shape[1]
    h2 = dim * max(float(n.double().abs().max()) ** 2 for n in input_norms)
    m = float(w.double().norm(dim=1).max()) ** 2 * h2
    if m == 0.0:
        return 1.0
    k = math.ceil(0.5 * math.log2(m / (eps * QK_NORM_MARGIN)))
    return 2.0 ** -max(k, 0)


def _array(t: torch.Tensor, force_f32: bool = False) -> np.ndarray:
    """float16 where every value is one (1-D tensors, norms, stay float32), else float32."""
    x = t.detach().float().contiguous()
    if not force_f32 and x.dim() > 1 and torch.equal(x.half().float(), x):
        return x.half().numpy()
    return x.numpy()


def default_mask_token(reader) -> int:
    """A token no reply writes, for the learned mask vector's row: the last control or unused
    token that is not bos / eos / unk / pad and not in the chat template. Only the drafter's
    input table holds the vector (its head is the target's rows), so an anchor that is this
    token (a prompt that holds it) is embedded as the mask: acceptance drops, nothing else."""
    f = reader.fields
    types = f["tokenizer.ggml.token_type"].contents()
    tokens = f["tokenizer.ggml.tokens"].contents()
    template = f["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in f else ""
    named = {int(f[k].contents()) for k in f if k.startswith("tokenizer.ggml.")
             and k.endswith("_token_id")}
    for i in range(len(types) - 1, -1, -1):
        if types[i] in (3, 5) and i not in named and tokens[i] not in template:
            return i
    raise UserError("no control or unused token to hold the drafter's mask vector; pass one "
                    "with --mask-token-id")


def export_gguf(model: DraftModel, target_gguf: Path, out: Path,
                mask_token_id: int | None = None) -> Path:
    """Write `model` (made for the target at target_gguf) as a llama.cpp dflash GGUF at out."""
    import gguf

    c = model.c
    reader = gguf.GGUFReader(str(target_gguf))
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    vocab = int(embd.shape[1])
    if embd.shape[0] != c.dim:
        raise UserError(f"the drafter is {c.dim} wide but {target_gguf} is {embd.shape[0]}")
    draft_ids = model.draft_ids.long()
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_name(f"{target_gguf.stem} DSpark drafter (adaspark)")
    arch_keys = {
        "context_length": int(reader.fields[f"{_field(reader, 'general.architecture')}"
                                            ".context_length"].contents()),
        "embedding_length": c.dim, "feed_forward_length": c.ffn_dim, "block_count": c.n_layers,
        "attention.head_count": c.n_heads, "attention.head_count_kv": c.n_kv_heads,
        "attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
        "block_size": c.block_size}
    for k, v in arch_keys.items():
        w.add_uint32(f"{ARCH}.{k}", v)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.norm_eps)
    w.add_float32(f"{ARCH}.rope.freq_base", c.rope_theta)
    w.add_array(f"{ARCH}.target_layers", [t + 1 for t in c.target_layers])
    w.add_bool(f"{ARCH}.sample_from_anchor", True)
    w.add_bool(f"{ARCH}.has_confidence_head", model.confidence is not None)
    for key, field in reader.fields.items():  # the target's tokenizer: the vocabularies match
        if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)

    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    # the mask: a target token's row, or our learned vector in a row of the drafter's own table
    if c.mask_token == "target_token":
        mask_id = c.mask_token_id
    else:
        mask_id = mask_token_id if mask_token_id is not None else (
            c.mask_token_id if c.mask_token_id is not None
            else default_mask_token(reader))
        table = gguf.quants.dequantize(embd.data, embd.tensor_type).reshape(vocab, c.dim).copy()
        table[mask_id] = sd["mask_embedding"].numpy()
        w.add_tensor("token_embd.weight", table.astype(np.float32))
    w.add_uint32("tokenizer.ggml.mask_token_id", mask_id)
    # the head over the draft vocabulary: none where it is the whole target head (llama.cpp
    # then shares the target's), the target's own rows where it is them, else its own
    full = len(draft_ids) == vocab and torch.equal(draft_ids, torch.arange(vocab))
    target_rows = c.lm_head == "target_embedding_rows" and "output.weight" not in tensors
    if full and c.mask_token == "target_token" and "output.weight" in tensors:
        target_rows = _is_target_head(model.head, tensors["output.weight"])
    if target_rows and not (full and c.mask_token == "target_token"):
        rows = np.ascontiguousarray(np.asarray(embd.data)[draft_ids.numpy()])
        w.add_tensor("output.weight", rows, raw_shape=rows.shape, raw_dtype=embd.tensor_type)
    elif not target_rows:
        w.add_tensor("output.weight", _array(model.head, force_f32=True))
    if not full:
        w.add_tensor("d2t", draft_ids.numpy().astype(np.int64),
                     raw_dtype=gguf.GGMLQuantizationType.I64)
    w1 = sd["markov_w1.weight"]
    if c.markov_keys == "draft":  # keyed by target id: each id's draft row (or outside's)
        w1 = w1[model.to_draft(torch.arange(vocab))]
    w.add_tensor("markov_w1.weight", _array(w1))
    w.add_tensor("markov_w2.weight", _array(sd["markov_w2.weight"]))
    if model.confidence is not None:
        w.add_tensor("conf_proj.weight", _array(sd["confidence.weight"], force_f32=True))
        w.add_tensor("conf_proj.bias", sd["confidence.bias"].numpy())
    w.add_tensor("fc.weight", _array(sd["fc.weight"]))
    w.add_tensor("enc.output_norm.weight", sd["ctx_norm.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["norm.weight"].numpy())
    to_neox = (lambda t: pairs_to_neox(t, c.head_dim)) if c.rope_style == "interleaved" else (
        lambda t: t)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        q, k = to_neox(sd[p + "q.weight"]), to_neox(sd[p + "k.weight"])
        if c.qk_norm:
            qn, kn = to_neox(sd[p + "q_norm.weight"]), to_neox(sd[p + "k_norm.weight"])
            q_arr, k_arr = _array(q), _array(k)
        else:  # an identity norm: rows scaled down until eps dominates it (module docstring)
            s_q = identity_norm_scale(q, [sd[p + "attn_norm.weight"]], c.norm_eps)
            s_k = identity_norm_scale(k, [sd[p + "attn_norm.weight"], sd["ctx_norm.weight"]],
                                      c.norm_eps)
            qn = torch.full((c.head_dim,), math.sqrt(c.norm_eps) / s_q)
            kn = torch.full((c.head_dim,), math.sqrt(c.norm_eps) / s_k)
            q_arr, k_arr = _array(q * s_q, force_f32=True), _array(k * s_k, force_f32=True)
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "attn_norm.weight"].numpy())
        w.add_tensor(b + "attn_q.weight", q_arr)
        w.add_tensor(b + "attn_k.weight", k_arr)
        w.add_tensor(b + "attn_v.weight", _array(sd[p + "v.weight"]))
        w.add_tensor(b + "attn_output.weight", _array(sd[p + "o.weight"]))
        w.add_tensor(b + "attn_q_norm.weight", qn.float().numpy())
        w.add_tensor(b + "attn_k_norm.weight", kn.float().numpy())
        w.add_tensor(b + "ffn_norm.weight", sd[p + "ffn_norm.weight"].numpy())
        w.add_tensor(b + "ffn_gate.weight", _array(sd[p + "gate.weight"]))
        w.add_tensor(b + "ffn_up.weight", _array(sd[p + "up.weight"]))
        w.add_tensor(b + "ffn_down.weight", _array(sd[p + "down.weight"]))
    tmp = Path(str(out) + ".tmp")
    w.path = tmp  # written whole, then moved into place: no half-written drafter at OUT
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return Path(out)


def _is_target_head(head: torch.Tensor, output, chunk: int = 8192) -> bool:
    """Whether head [V, dim] is the target's untied output matrix, row for row."""
    import gguf

    data = np.asarray(output.data)
    if len(data) != len(head):
        return False
    for i in range(0, len(head), chunk):
        rows = gguf.quants.dequantize(data[i:i + chunk], output.tensor_type)
        if not np.array_equal(rows.reshape(head[i:i + chunk].shape), head[i:i + chunk].numpy()):
            return False
    return True


def _field(reader, key: str):
    return reader.fields[key].contents()
