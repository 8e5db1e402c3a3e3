"""Taps and top-k logits recomputed from ids-only reply shards (drafter/taps.py,
Transformer.prefill_rows_many) on the embedded target: the same rows a sequence's own forward
gives, many sequences a call, chunked like a prefill; written as tap shards the trainer reads,
resumably and by index range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspark.drafter import taps as taps_module
from adaspark.drafter.generate import GenSettings, ReplyGenerator
from adaspark.drafter.loss import make_batch
from adaspark.drafter.pool import Conversation
from adaspark.drafter.replies import read_records, target_fingerprint
from adaspark.drafter.shards import read_shards, shard_path
from adaspark.drafter.taps import sequences_from_records, write_tap_shards
from adaspark.engine import Engine
from adaspark.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TAPS = [27, 1, 14]  # any order: the sequences keep it
POOL = [Conversation("a", ("Name three colours.", "And three animals?")),
        Conversation("b", ("Write a haiku about the sea.",)),
        Conversation("c", ("What is 2 + 2?",))]


@pytest.fixture(scope="module")
def fingerprint(model_path):
    return target_fingerprint(model_path)


@pytest.fixture(scope="module")
def replies(fast_model, model_path, fingerprint, tmp_path_factory):
    out = tmp_path_factory.mktemp("replies")
    engine = Engine(fast_model, Tokenizer.from_gguf(model_path), model_path)
    ReplyGenerator(engine, POOL, out, fingerprint,
                   GenSettings(max_new=12, max_prompt_tokens=120, concurrency=3,
                               shard_size=3)).run()
    return out


def own_forward(target, tokens):
    """One sequence's rows 0..T-2 alone: a causal verify on a fresh cache (logits of every
    row, every tap)."""
    n = len(tokens) - 1
    with target.using(target.new_cache()):
        return target.verify(tokens[:n].tolist(), np.arange(n), np.tri(n, dtype=bool), TAPS,
                             return_logits=True)


def test_taps_and_topk_are_the_sequences_own_rows(fast_model, replies, fingerprint):
    records = read_records(replies, fingerprint)
    seqs = sequences_from_records(fast_model, records, TAPS, topk=8, max_rows=256)
    assert len(seqs) == len(records) == 4
    for r, s in zip(records, seqs, strict=True):
        T, P = len(r.tokens), r.prompt_len
        assert s.tokens.tolist() == r.tokens.tolist() and s.prompt_len == P
        own = own_forward(fast_model, r.tokens)
        want = torch.stack([own.hiddens[t] for t in TAPS], 1).to(torch.float16).numpy()
        assert s.hidden.shape == (T - 1, 3, fast_model.config.dim)
        np.testing.assert_array_equal(s.hidden, want)
        vals, ids = own.logits[P:].topk(8, -1)
        np.testing.assert_array_equal(s.top_ids, ids.numpy())
        np.testing.assert_array_equal(s.top_logits, vals.to(torch.float16).numpy())
        # the greedy reply is the argmax at every reply position
        assert s.top_ids[:, 0].tolist() == r.tokens[P + 1:].tolist()
    assert len(taps_module._groups(records, 256)) < len(records)  # shared calls were made


def test_long_sequences_run_in_chunks(fast_model, replies, fingerprint, monkeypatch):
    records = read_records(replies, fingerprint)
    whole = sequences_from_records(fast_model, records, TAPS, topk=4)
    monkeypatch.setattr(taps_module, "PREFILL_CHUNK", 16)  # every prompt spans chunks
    assert all(len(r.tokens) > 40 for r in records)
    chunked = sequences_from_records(fast_model, records, TAPS, topk=4, max_rows=40)
    for a, b in zip(whole, chunked, strict=True):
        assert a.hidden.shape == b.hidden.shape and a.top_ids.shape == b.top_ids.shape
        np.testing.assert_allclose(a.hidden.astype(np.float32), b.hidden.astype(np.float32),
                                   rtol=0.05, atol=0.05)
        assert (a.top_ids[:, 0] == b.top_ids[:, 0]).mean() >= 0.9


def test_tap_shards_by_range_resume_and_train(fast_model, replies, fingerprint, tmp_path):
    work = tmp_path / "train"
    first = write_tap_shards(fast_model, replies, work, TAPS, fingerprint, per_shard=3, topk=4,
                             shards=[1])
    assert first == [shard_path(work, 1)]  # only the asked-for shard
    rest = write_tap_shards(fast_model, replies, work, TAPS, fingerprint, per_shard=3, topk=4)
    assert rest == [shard_path(work, 0)]  # shard 1 was there already
    seqs, stored = read_shards(work, TAPS)
    assert stored == TAPS and len(seqs) == 4
    batch = make_batch(seqs[0], [0, 1, 2], 4, 8, np.random.default_rng(0))
    assert batch is not None and batch.taps.shape[1:] == (3, fast_model.config.dim)


def test_torch_path_gives_its_own_rows_too(torch_model, replies, fingerprint):
    """Without the native build (or on CUDA) each sequence runs alone on the torch path."""
    record = read_records(replies, fingerprint)[0]
    s, = sequences_from_records(torch_model, [record], TAPS, topk=4)
    own = own_forward(torch_model, record.tokens)
    want = torch.stack([own.hiddens[t] for t in TAPS], 1).to(torch.float16).numpy()
    np.testing.assert_array_equal(s.hidden, want)
    np.testing.assert_array_equal(s.top_ids, own.logits[record.prompt_len:].topk(4, -1)[1])


def test_prefill_rows_many_refuses_bad_rows(fast_model):
    caches = [fast_model.new_cache(), fast_model.new_cache()]
    with pytest.raises(ValueError, match="first logits row"):
        fast_model.prefill_rows_many(caches, [[1, 2], [3]], logits_from=[0, 2])
    with pytest.raises(ValueError, match="first logits row"):
        fast_model.prefill_rows_many(caches, [[1, 2], []], logits_from=[0, 0])
    assert [c.length for c in caches] == [0, 0]
    out = fast_model.prefill_rows_many(caches, [[1, 2], [3]], logits_from=[2, 0])
    assert [len(o.argmax) for o in out] == [0, 1] and [c.length for c in caches] == [2, 1]


def test_train_drafter_data_stage_from_reply_shards(replies, tmp_path):
    from adaspark import cli

    work = tmp_path / "work"
    assert cli.main(["train-drafter", "--work", str(work), "--replies", str(replies),
                     "--tap-shards", "0", "--data-only", "--taps", "1,14,27"]) == 0
    data = work / "data" / "train"
    assert sorted(p.name for p in data.iterdir()) == [shard_path(data, 0).name]
    seqs, stored = read_shards(data)
    assert stored == [1, 14, 27] and len(seqs) == 4  # fewer than 128: one shard holds them


def test_a_stage_trains_the_peers_form_on_a_vocabulary_of_every_unheld_reply(
        fast_model, replies, model_path, fingerprint, tmp_path):
    """A training stage on reply shards: the draft vocabulary counts the replies of every tap
    shard but the held-out ones, the stage's window or not (here the window is the held-out
    shard and one more; the records of a third shard count too), and the flags' q/k RMSNorm
    and NeoX RoPE reach the exported drafter."""
    import json

    from adaspark.drafter import pipeline, vocab
    from adaspark.drafter.data import target_embedding
    from adaspark.model.gguf import read_gguf

    tokenizer = Tokenizer.from_gguf(model_path)
    s = pipeline.PipelineSettings(
        work=tmp_path / "work", prompts=tmp_path / "unused.jsonl", per_shard=1, heldout=[0],
        vocab_size=8, taps=[1, 14, 27], replies=replies, tap_shards=[0, 1], qk_norm=True,
        rope_style="neox", train=pipeline.TrainSettings(steps=2, seqs_per_step=1,
                                                        anchors_per_seq=2, val_every=1))
    pipeline.make_data(s, fast_model, tokenizer, model_path)
    gguf = read_gguf(model_path)
    out = pipeline.run_pipeline(s, gguf, target_embedding(gguf), tokenizer.stop_ids,
                                {**fingerprint, "vocab_size": fast_model.config.vocab_size})
    config = json.loads((out / "config.json").read_text())["drafter"]
    assert config["qk_norm"] is True and config["rope_style"] == "neox"
    records = read_records(replies, fingerprint)
    assert len(records) == 4  # tap shards 0-3 of one record each; 2 and 3 not in the window
    counts = np.zeros(fast_model.config.vocab_size, dtype=np.int64)
    for r in records[1:]:
        np.add.at(counts, r.reply.astype(np.int64), 1)
    want = vocab.build_draft_vocab(counts, 8, tokenizer.stop_ids)
    np.testing.assert_array_equal(np.load(s.work / "vocab.npy"), want)


def test_a_stage_starts_from_a_committed_checkpoint(fast_model, replies, model_path,
                                                    fingerprint, tmp_path, caplog):
    """--init-from: a fresh work directory takes the checkpoint's weights, vocabulary and step
    (training goes on from there: the schedule's step, not 0); a run of another shape is
    refused by name."""
    import json

    from adaspark.drafter import pipeline
    from adaspark.drafter.data import target_embedding
    from adaspark.errors import UserError
    from adaspark.model.gguf import read_gguf

    tokenizer = Tokenizer.from_gguf(model_path)
    gguf = read_gguf(model_path)
    c = fast_model.config  # the target's fingerprint as the command makes it
    fp = {**fingerprint, "arch": c.arch, "n_layers": c.n_layers, "dim": c.dim,
          "vocab_size": c.vocab_size}

    def stage(work, steps, init_from=None, layers=1):
        s = pipeline.PipelineSettings(
            work=tmp_path / work, prompts=tmp_path / "unused.jsonl", per_shard=1, heldout=[0],
            vocab_size=8, taps=[1, 14, 27], replies=replies, tap_shards=[0, 1],
            n_layers=layers, init_from=init_from,
            train=pipeline.TrainSettings(steps=steps, seqs_per_step=1, anchors_per_seq=2,
                                         val_every=1))
        pipeline.make_data(s, fast_model, tokenizer, model_path)
        return s, pipeline.run_pipeline(s, gguf, target_embedding(gguf), tokenizer.stop_ids, fp)

    caplog.set_level("INFO", logger="adaspark.drafter")
    first, out = stage("first", 2)
    with pytest.raises(UserError, match="another drafter shape.*n_layers"):
        stage("wider", 4, init_from=out, layers=2)
    second, out2 = stage("second", 3, init_from=out)
    np.testing.assert_array_equal(np.load(second.work / "vocab.npy"),
                                  np.load(first.work / "vocab.npy"))
    log = caplog.text[caplog.text.index("seeded from"):]
    assert "at step 2" in log and "resumed from" in log
    # one step (2 -> 3) trained on the seeded weights: the state and the export say 3
    assert torch.load(second.work / "train_state.pt", weights_only=False)["step"] == 3
    assert json.loads((out2 / "config.json").read_text())["info"]["steps"] == 3
