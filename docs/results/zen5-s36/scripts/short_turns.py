"""Issue 41's work for the session's in-process scripts: the 24 short first turns (at most 500
characters) and one engine per arm on one loaded target, each from an empty store."""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
import torch

torch.set_num_threads(2)
import concurrency as cc

from adaspark.bench.conversations import load_conversations
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import load_speculator


def setup(arms):
    """(requests, target, {arm: Engine})"""
    reqs = cc.first_turns(load_conversations(cc.CONVERSATIONS), 500)[:24]
    path = resolve_model(None)
    gguf = read_gguf(path)
    target = Transformer(gguf)
    tok = Tokenizer.from_gguf(gguf)
    root = Path(tempfile.mkdtemp())
    return reqs, target, {a: Engine(target, tok, path, load_speculator(
        target, path, tok.stop_ids, ModelOptions(arm=a, store=root / a.replace(",", "+"),
                                                 fresh=True))) for a in arms}
