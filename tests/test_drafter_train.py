"""Drafter training: shards round-trip, the draft vocabulary, and a tiny run lowers the loss."""

import dataclasses

import numpy as np
import pytest
import torch
from test_drafter_model import DIM, V_TARGET, tiny

from adaspark.drafter.loss import dspark_loss, forward_batch, make_batch
from adaspark.drafter.shards import Sequence, read_shards, shard_path, write_shard
from adaspark.drafter.train import TrainSettings, train
from adaspark.drafter.vocab import build_draft_vocab, coverage, reply_token_counts
from adaspark.errors import UserError


def synthetic(n_seqs=6, length=60, prompt=10, seed=0):
    """Text that counts up by 2 (mod 80): each token's successor is fixed, the features carry
    the current token, and the 'target' puts its mass on the true next token."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((V_TARGET, 2, DIM)).astype(np.float16)
    seqs = []
    for _ in range(n_seqs):
        start = 2 * int(rng.integers(0, 40))
        toks = ((start + 2 * np.arange(length)) % 80).astype(np.int32)
        nxt = toks[prompt + 1 :]  # the target's next token at positions prompt..T-2
        top_ids = np.stack([nxt, (nxt + 1) % V_TARGET, (nxt + 3) % V_TARGET], 1).astype(np.int32)
        top_logits = np.tile(np.array([8.0, 1.0, 0.0], np.float16), (len(nxt), 1))
        seqs.append(Sequence(toks, prompt, table[toks[:-1]], top_ids, top_logits))
    return seqs


def test_shards_round_trip(tmp_path):
    seqs = synthetic(3)
    write_shard(shard_path(tmp_path, 0), seqs[:2], [0, 2])
    write_shard(shard_path(tmp_path, 1), seqs[2:], [0, 2])
    back, taps = read_shards(tmp_path)
    assert taps == [0, 2] and len(back) == 3
    for a, b in zip(seqs, back, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.hidden, b.hidden)
        np.testing.assert_array_equal(a.top_ids, b.top_ids)
        assert a.prompt_len == b.prompt_len
    # shards with different stored layers read as one when the wanted layers are named
    write_shard(shard_path(tmp_path, 1), [seqs[2]], [2, 5])
    with pytest.raises(UserError, match="taps layers"):
        read_shards(tmp_path)
    mixed, taps = read_shards(tmp_path, [2])
    assert taps == [2]
    np.testing.assert_array_equal(mixed[0].hidden[:, 0], seqs[0].hidden[:, 1])
    np.testing.assert_array_equal(mixed[2].hidden[:, 0], seqs[2].hidden[:, 0])
    with pytest.raises(UserError, match="lacks target layers"):
        read_shards(tmp_path, [0])
    shard_path(tmp_path, 1).write_bytes(b"junk")
    with pytest.raises(UserError, match="unreadable"):
        read_shards(tmp_path)


def test_draft_vocab_keeps_stops_and_frequent_tokens():
    seqs = synthetic(4)
    counts = reply_token_counts(seqs, V_TARGET)
    vocab = build_draft_vocab(counts, 20, always=[99, 98])
    assert len(vocab) == 20 and {98, 99} <= set(vocab.tolist())
    assert np.all(np.diff(vocab) > 0)
    top = np.argsort(-counts, kind="stable")[:18]
    assert set(top.tolist()) <= set(vocab.tolist())
    assert coverage(seqs, np.arange(0, 80, 2)) == 1.0
    assert coverage(seqs, np.array([98, 99])) == 0.0
    with pytest.raises(UserError, match="draft vocabulary size"):
        build_draft_vocab(counts, 2, always=[98, 99])


def test_batch_labels_are_shifted_block_targets():
    seq = synthetic(1)[0]
    b = make_batch(seq, [0, 1], 4, 5, np.random.default_rng(0))
    for n, a in enumerate(b.anchors.tolist()):
        for k in range(4):
            if b.valid[n, k]:
                assert b.labels[n, k] == seq.tokens[a + k + 1]
                assert b.block_prev[n, k] == seq.tokens[a + k]
                assert b.top_ids[n, k, 0] == seq.tokens[a + k + 1]
    assert b.taps.shape[0] == int(b.anchors.max())


def test_tiny_training_run_lowers_loss(tmp_path):
    model, embed = tiny()
    seqs = synthetic()
    taps = [0, 1]
    rng = np.random.default_rng(5)
    held = [make_batch(s, taps, 4, 16, rng) for s in seqs]

    def held_loss():
        with torch.no_grad():
            return float(np.mean([float(dspark_loss(model, embed, b)[0]) for b in held]))

    before = held_loss()
    s = TrainSettings(steps=30, seqs_per_step=1, anchors_per_seq=16, lr=2e-2, warmup=3,
                      bf16=False, save_every=20)
    train(model, embed, seqs, taps, s, state_path=tmp_path / "state.pt", progress=False,
          held_out=lambda m: held_loss())
    after = held_loss()
    assert after < 0.6 * before, (before, after)
    best = torch.load(tmp_path / "state.pt", weights_only=False)["best"]
    assert best["loss"] == pytest.approx(after)  # the model ends on its best held-out weights


def test_resume_continues_where_it_stopped(tmp_path):
    seqs, taps = synthetic(), [0, 1]
    s = TrainSettings(steps=6, seqs_per_step=1, anchors_per_seq=8, lr=1e-2, warmup=2, bf16=False,
                      save_every=3)
    straight, embed = tiny()
    train(straight, embed, seqs, taps, s, progress=False)
    resumed, _ = tiny()
    train(resumed, embed, seqs, taps, s, state_path=tmp_path / "st.pt", progress=False,
          stop_after=3)  # as if the session were killed after step 3
    resumed2, _ = tiny()  # a fresh process: the state file carries every trained weight
    with torch.no_grad():
        for p in resumed2.parameters():
            p.zero_()
    train(resumed2, embed, seqs, taps, s, state_path=tmp_path / "st.pt", progress=False)
    for a, b in zip(straight.parameters(), resumed2.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_heldout_shards_are_kept_out_of_training(tmp_path):
    from adaspark.drafter.pipeline import load_data

    seqs = synthetic(6)
    for i, seq in enumerate(seqs):
        seq.tokens[0] = 90 + i  # six distinct sequences
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    for i in range(3):
        write_shard(shard_path(data, i), seqs[2 * i : 2 * i + 2], [0, 2])
    train_seqs, groups, tap_index = load_data(tmp_path, [0, 2], heldout=[0, 2])
    key = [s.tokens.tobytes() for s in seqs]
    assert [[s.tokens.tobytes() for s in g] for g in groups] == [key[0:2], key[4:6]]
    assert [s.tokens.tobytes() for s in train_seqs] == key[2:4] and tap_index == [0, 1]
    with pytest.raises(UserError, match="held-out shard 7"):
        load_data(tmp_path, [0, 2], heldout=[0, 7])
    with pytest.raises(UserError, match="besides the held-out"):
        load_data(tmp_path, [0, 2], heldout=[0, 1, 2])


def test_a_new_heldout_set_forgets_the_best_weights(tmp_path):
    model, embed = tiny()
    seqs, taps = synthetic(), [0, 1]
    losses = iter([1.0, 0.5, 2.0, 3.0])
    s = TrainSettings(steps=2, seqs_per_step=1, anchors_per_seq=8, lr=1e-2, warmup=1,
                      bf16=False, val_every=1)
    state = tmp_path / "st.pt"
    train(model, embed, seqs, taps, s, state_path=state, progress=False,
          held_out=lambda m: next(losses), val_key="heldout shards 0")
    assert torch.load(state, weights_only=False)["best"]["step"] == 2
    s.steps = 4  # go on, now judged on another held-out set
    train(model, embed, seqs, taps, s, state_path=state, progress=False,
          held_out=lambda m: next(losses), val_key="heldout shards 0,34")
    st = torch.load(state, weights_only=False)
    assert st["best"]["step"] == 3 and st["val_key"] == "heldout shards 0,34"


def test_weight_decay_spares_gains_and_the_mask_vector():
    from adaspark.drafter.train import param_groups

    model, _ = tiny()
    decay, spared = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and spared["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in spared["params"]} >= {
        "mask_embedding", "norm.weight", "ctx_norm.weight"}
    assert all(p.dim() >= 2 for p in decay["params"])


def test_resume_from_a_state_with_one_parameter_group(tmp_path):
    """States saved before the decay/no-decay split still resume: weights kept, moments anew."""
    seqs, taps = synthetic(), [0, 1]
    s = TrainSettings(steps=4, seqs_per_step=1, anchors_per_seq=8, lr=1e-2, warmup=1, bf16=False)
    model, embed = tiny()
    old_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.no_grad():
        model.mask_embedding.fill_(0.5)
    torch.save({"model": model.state_dict(), "opt": old_opt.state_dict(), "step": 2,
                "settings": {}, "best": None}, tmp_path / "st.pt")
    fresh, _ = tiny()
    losses = train(fresh, embed, seqs, taps, s, state_path=tmp_path / "st.pt", progress=False)
    assert len(losses) == 2  # resumed at step 2 of 4
    assert abs(fresh.mask_embedding.detach().mean().item() - 0.5) < 0.1


def hand_batch():
    """Three anchors of four rows with every case the loss tells apart: top-k ids inside the
    draft vocabulary (even ids below 80) and outside it, a row with none inside (no target
    distribution), a label outside the vocabulary (no CE) and a row past the reply's end."""
    b = make_batch(synthetic()[0], [0, 1], 4, 3, np.random.default_rng(0))
    top_ids = torch.tensor([[[4, 6, 9], [10, 11, 12], [13, 15, 17], [20, 22, 24]],
                            [[30, 31, 32], [34, 36, 38], [41, 40, 42], [50, 51, 53]],
                            [[60, 62, 64], [66, 68, 70], [72, 74, 76], [78, 3, 5]]])
    top_logits = torch.tensor([[[3.0, 1.0, 0.5], [2.0, 1.5, -1.0], [1.0, 0.0, -1.0],
                                [0.2, 0.1, 0.0]],
                               [[4.0, 3.0, 2.5], [1.0, 1.0, 1.0], [2.0, 1.0, 0.0],
                                [5.0, 2.0, 1.0]],
                               [[0.0, -0.5, -3.0], [6.0, 0.0, -1.0], [1.5, 1.4, 1.3],
                                [2.0, 0.0, -2.0]]])
    labels = torch.tensor([[4, 10, 13, 20], [31, 34, 40, 50], [60, 66, 72, -1]])
    valid = labels >= 0
    return dataclasses.replace(b, top_ids=top_ids, top_logits=top_logits, labels=labels,
                               valid=valid)


def loss_by_hand(logits: np.ndarray, conf: np.ndarray, b, weights: dict) -> dict[str, float]:
    """loss.py's docstring in float64: the target's top-k renormalised over the ids inside the
    draft vocabulary; CE of the label, TV = half the L1 distance, BCE of the confidence logit
    against 1 - TV; each a mean over its usable rows weighted by exp(-k/4) at block row k."""
    vocab = list(range(0, 80, 2))  # tiny()'s draft vocabulary
    n_anchors, block, _ = logits.shape
    sums = {part: [0.0, 0.0] for part in ("ce", "tv", "conf")}
    for n in range(n_anchors):
        for k in range(block):
            z = logits[n, k] - logits[n, k].max()
            p_draft = np.exp(z) / np.exp(z).sum()
            w = np.exp(-k / 4)
            label = int(b.labels[n, k])
            if b.valid[n, k] and label in vocab:
                sums["ce"][0] += w * -np.log(p_draft[vocab.index(label)])
                sums["ce"][1] += w
            inside = [(vocab.index(int(t)), float(v))
                      for t, v in zip(b.top_ids[n, k], b.top_logits[n, k], strict=True)
                      if int(t) in vocab]
            if not b.valid[n, k] or not inside:
                continue
            p_target = np.zeros(len(vocab))
            for j, v in inside:
                p_target[j] = np.exp(v)
            p_target /= p_target.sum()
            tv = 0.5 * np.abs(p_draft - p_target).sum()
            c, y = min(max(1 - tv, 0), 1), 1 / (1 + np.exp(-conf[n, k]))
            sums["tv"][0] += w * tv
            sums["conf"][0] += w * -(c * np.log(y) + (1 - c) * np.log(1 - y))
            sums["tv"][1] += w
            sums["conf"][1] += w
    parts = {part: total / weight for part, (total, weight) in sums.items()}
    parts["loss"] = sum(weights[part] * parts[part] for part in ("ce", "tv", "conf"))
    return parts


def test_the_loss_is_the_documented_formula_worked_by_hand():
    model, embed = tiny()
    b = hand_batch()
    with torch.no_grad():
        logits, conf = forward_batch(model, embed, b)  # the drafter's outputs: the loss's input
        for weights in (None, {"ce": 1.0, "tv": 0.0, "conf": 0.0},
                        {"ce": 0.5, "tv": 0.5, "conf": 1.0}):
            got, parts = dspark_loss(model, embed, b, weights)
            want = loss_by_hand(logits.double().numpy(), conf.double().numpy(), b,
                                weights or {"ce": 0.1, "tv": 0.9, "conf": 1.0})
            assert float(got) == pytest.approx(want["loss"], rel=1e-5), weights
            for part in ("ce", "tv", "conf"):
                assert parts[part] == pytest.approx(want[part], rel=1e-5), part


def test_training_follows_the_settings_loss_weights():
    """All-zero loss weights (and no decay) leave the weights where they were; a CE-only loss
    moves them."""
    seqs, taps = synthetic(), [0, 1]
    still, embed = tiny()
    s = TrainSettings(steps=3, seqs_per_step=1, anchors_per_seq=8, lr=1e-2, warmup=1, bf16=False,
                      weight_decay=0.0, ce_weight=0.0, tv_weight=0.0)
    # the confidence BCE keeps weight 1: a frozen zero head passes it no gradient, so only
    # CE/TV could move anything
    for m in (still, moved := tiny()[0]):
        with torch.no_grad():
            m.confidence.weight.zero_()
        m.confidence.requires_grad_(False)
    before = [p.detach().clone() for p in still.parameters()]
    train(still, embed, seqs, taps, s, progress=False)
    for a, b in zip(before, still.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    s.ce_weight = 1.0
    train(moved, embed, seqs, taps, s, progress=False)
    assert not torch.equal(moved.fc.weight, before[0])
