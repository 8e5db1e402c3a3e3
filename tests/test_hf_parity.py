"""Reference precision reproduces HF transformers' float32 greedy decoding, token for token.

tests/data/hf_greedy_reference.json holds transformers' own greedy ids for fixed chat prompts,
made once by tests/data/make_hf_reference.py (transformers is not needed here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaspark.engine import Engine
from adaspark.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

REFERENCE = json.loads((Path(__file__).parent / "data" / "hf_greedy_reference.json").read_text())


@pytest.fixture(scope="module")
def engine(reference_model, model_path):
    """Plain decoding (the `ar` arm: no speculator) on the shared float32 reference model."""
    engine = Engine(reference_model, Tokenizer.from_gguf(model_path), model_path)
    engine.reset()
    return engine


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["name"])
def test_greedy_matches_transformers(engine, case):
    engine.reset()
    gen = engine.generate(case["messages"], max_tokens=REFERENCE["new_tokens"])
    assert gen.prompt_token_ids == case["prompt_ids"]
    # transformers' ids end with the eos it stopped on; ours keep the stop token apart
    ours = gen.token_ids + ([gen.stop_token_id] if gen.stop_token_id is not None else [])
    assert ours == case["output_ids"]
    assert gen.text == case["text"].removesuffix("<|im_end|>")
