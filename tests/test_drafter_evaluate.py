"""Drafter evaluation: the chain replay commits every reply token once, per-group figures are
those of the group evaluated alone, and held-out sequences are labelled by their prompts."""

import numpy as np
import pytest
from test_drafter_model import tiny
from test_drafter_train import synthetic

from adaspark.commands.eval_drafter import prompt_sources
from adaspark.drafter.data import encode_item
from adaspark.drafter.evaluate import evaluate, replay_chain
from adaspark.drafter.runtime import Drafter
from adaspark.drafter.shards import Sequence


def test_replay_commits_each_reply_token_once():
    model, embed = tiny(block=4)
    drafter = Drafter(model, embed)
    for seq in synthetic(3, length=40, prompt=8):
        r = replay_chain(drafter, seq, [0, 1])
        assert r["committed"] == len(seq.tokens) - 1 - seq.prompt_len
        assert r["rounds"] == r["reached"][0] == len(r["times"])
        assert r["committed"] == r["rounds"] + r["accepted"].sum()  # one bonus per round
        assert (r["accepted"] <= r["reached"]).all()


def test_groups_report_what_each_group_gets_alone():
    model, embed = tiny(block=4)
    seqs = synthetic(4, length=40, prompt=8, seed=3)
    whole = evaluate(model, embed, seqs, [0, 1], groups=["a", "b", "a", "b"])
    alone = evaluate(model, embed, [seqs[0], seqs[2]], [0, 1])
    assert whole["chain_by_group"]["a"]["prompts"] == 2
    got = whole["chain_by_group"]["a"]["chain_tokens_per_round"]
    assert got == pytest.approx(alone["chain_tokens_per_round"], abs=1e-4)
    assert "chain_by_group" not in alone


def test_sequences_are_labelled_by_their_prompt(model_path):
    from adaspark.model.gguf import read_gguf
    from adaspark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(read_gguf(model_path))
    items = [{"prompt": "What is 2+2?", "source": "math"},
             {"prompt": "Name a colour.", "system": "Be brief.", "source": "chat"}]
    seqs = [Sequence(np.asarray(encode_item(tok, it) + [5, 6]), len(encode_item(tok, it)),
                     None, None, None) for it in reversed(items)]
    seqs.append(Sequence(np.asarray([1, 2, 3, 4]), 2, None, None, None))
    assert prompt_sources(seqs, items, tok) == ["chat", "math", "?"]
