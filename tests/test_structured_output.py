"""Structured output (response_format: json_object, json_schema) on the embedded model: replies
parse as JSON and validate against their schema; every arm's reply equals `ar`'s under the same
grammar token for token, greedy and seeded, alone and in the batch beside unconstrained
requests; the candidates a grammar forbids take no rows; schemas the server cannot compile, or
too large ones, are refused with the reason (grammar.py, constrained.py)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from adaspark.drafter.loading import load_drafter
from adaspark.engine import Engine
from adaspark.grammar import (
    MAX_SCHEMA_BYTES,
    GrammarError,
    ResponseFormat,
    json_schema_of,
    tool_call_schema,
)
from adaspark.model.tokenizer import Tokenizer
from adaspark.sampling import SamplingParams
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.tree import CandidateTree
from adaspark.speculative import RoundDecode, Speculator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Give me a JSON object describing a person named "
               "Alice, aged 30, who lives in Paris. Then describe her hobbies."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Tokyo, in celsius? Answer "
                "with the arguments for a weather lookup."}]
ASK_CITY = [{"role": "user", "content": "Return a JSON object with the keys city and country "
             "for Tokyo."}]
CASES = [
    (ASK_PERSON, {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                          "strict": True}}, PERSON),
    (ASK_WEATHER, {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
     WEATHER),
    (ASK_CITY, {"type": "json_object"}, {"type": "object"}),
]
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, frequency_penalty=0.3,
                        logprobs=True, top_logprobs=2)
ARMS = ("ngram", "adaspark,gate", "adaspark", "chain3", "chain", "tree:3", "cost")
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def drafter(fast_model, model_path):
    return load_drafter(fast_model, model_path)


@pytest.fixture(scope="module")
def make(fast_model, model_path, tokenizer, drafter):
    """A fresh engine for an arm (fresh learned state) on the shared target and drafter."""
    def make(arm: str) -> Engine:
        spec = None if arm == "ar" else Speculator(
            fast_model, None if arm == "ngram" else drafter, Scheduler(arm), tokenizer.stop_ids)
        engine = Engine(fast_model, tokenizer, model_path, spec)
        engine.reset()
        return engine
    return make


def assert_valid(reply, schema) -> None:
    """A reply that ended on its own is JSON valid under its schema."""
    assert reply.finish_reason == "stop", reply.text
    jsonschema.validate(json.loads(reply.text), schema)


# ----- the grammar on its own ----------------------------------------------------------------
def test_tool_schemas_in_a_languages_type_names_become_json_schema(make):
    """BFCL writes Python's and Java's type names ("dict", "float", "HashMap", "any"): they map
    to JSON Schema's, an unknown one leaves the type open, a property named "type" stays, null
    keywords go; the call schema of such a tool compiles and admits the call it describes."""
    params = {"type": "dict", "required": None, "properties": {
        "type": {"type": "String", "description": "a property named type"},
        "ratio": {"type": "float"}, "sizes": {"type": "tuple", "items": {"type": "int"}},
        "options": {"type": "HashMap", "additionalProperties": {"type": "any"}},
        "mode": {"type": ["str", "null"]}}}
    assert json_schema_of(params) == {"type": "object", "properties": {
        "type": {"type": "string", "description": "a property named type"},
        "ratio": {"type": "number"}, "sizes": {"type": "array", "items": {"type": "integer"}},
        "options": {"type": "object", "additionalProperties": {}},
        "mode": {"type": ["string", "null"]}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}},
             {"name": "g"}]
    schema = tool_call_schema(tools)
    assert [c["properties"]["name"] for c in schema["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    grammar = make("ar").grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    assert grammar is not None
    jsonschema.validate({"name": "f", "arguments": {"type": "x", "ratio": 0.5, "sizes": [1],
                                                    "options": {"k": [1, "v"]}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"ratio": "half"}}, schema)


def test_response_formats_parse_and_refuse_with_the_reason():
    assert ResponseFormat.parse(None) is None and ResponseFormat.parse({"type": "text"}) is None
    assert ResponseFormat.parse({"type": "json_object"}) == ResponseFormat("json_object")
    fmt = ResponseFormat.parse({"type": "json_schema",
                                "json_schema": {"name": "p", "schema": PERSON}})
    assert fmt.schema == PERSON and fmt.name == "p"
    for body, param in [({"type": "yaml"}, "response_format.type"),
                        ({"type": "json_schema"}, "response_format.json_schema"),
                        ({"type": "json_schema", "json_schema": {"schema": 3}},
                         "response_format.json_schema.schema")]:
        with pytest.raises(GrammarError) as err:
            ResponseFormat.parse(body)
        assert err.value.param == param


def test_uncompilable_and_oversized_schemas_are_refused(make):
    engine = make("ar")
    with pytest.raises(GrammarError, match="cannot be compiled.*objekt"):
        engine.grammar({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}})
    with pytest.raises(GrammarError, match="cannot be compiled.*does not exist"):
        engine.grammar({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}})
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"}
                                            for i in range(MAX_SCHEMA_BYTES // 20)}}
    with pytest.raises(GrammarError, match=f"at most {MAX_SCHEMA_BYTES}"):
        engine.grammar({"type": "json_schema", "json_schema": {"schema": big}})


def test_tree_legality_follows_each_path(make, tokenizer):
    state = make("ar").grammar(CASES[0][1]).start()
    good = tokenizer.encode('{"name": "Al')
    state.advance_all(good[:2])  # '{"', 'name'
    rest = good[2:]
    wrong = tokenizer.encode("}")[0]  # neither inside the key nor as its value
    stop = min(tokenizer.stop_ids)
    # a chain of the good tokens; a sibling and a child of a legal node that are wrong
    tokens = [*rest, wrong, wrong, stop, rest[1]]
    parents = [-1, *range(len(rest) - 1), -1, 0, 0, len(rest) + 1]
    illegal = state.illegal(np.array(tokens), np.array(parents))
    assert illegal.tolist() == [False] * len(rest) + [True, True, True, True]
    # the state is where it was: the same nodes again
    assert state.illegal(np.array(tokens), np.array(parents)).tolist() == illegal.tolist()
    assert not state.complete and not state.legal(stop)


def test_a_greedy_pick_equals_the_masked_argmax_whether_or_not_the_row_top_is_legal(
        make, tokenizer):
    """constrained.pick checks only the row's top token where it is legal: at every state of
    each case's reply, with the target's top made a legal token, an illegal one, a stop token
    and a tie below an illegal one, its pick is the fully masked row's first maximum, whether
    it takes the row's argmax itself or is given it."""
    import torch

    from adaspark import constrained

    engine = make("ar")
    rng = np.random.default_rng(0)
    seen = {"legal": 0, "illegal": 0}
    for messages, response_format, _ in CASES:
        grammar = engine.grammar(response_format)
        reply = engine.generate(messages, max_tokens=MAX_TOKENS, response_format=grammar)
        state = grammar.start()
        for token in reply.token_ids:
            allowed = state.allowed()
            legal, illegal = np.flatnonzero(allowed), np.flatnonzero(~allowed)
            base = torch.from_numpy(rng.standard_normal(allowed.size).astype(np.float32))
            tops = [int(rng.choice(legal)), int(rng.choice(illegal)), min(tokenizer.stop_ids)]
            for top in tops:
                row = base.clone()
                row[top] = 50.0
                if not allowed[top]:  # a legal token tied below it: the first legal maximum
                    row[int(legal[-1])] = row[int(legal[0])] = 10.0
                want = int(torch.where(torch.from_numpy(allowed), row, -torch.inf).argmax())
                got, _ = constrained.pick(state, None, row, 0)
                state.rollback(0 if got in state.stop_ids else 1)
                # the same with the forward's argmax given (Batch's steps pass theirs)
                given, _ = constrained.pick(state, None, row, 0, top=int(row.argmax()))
                state.rollback(0 if given in state.stop_ids else 1)
                assert got == want == given, (top, got, want, given)
                seen["legal" if allowed[top] else "illegal"] += 1
            state.advance(token)
    assert seen["legal"] > 20 and seen["illegal"] > 20


def test_forced_tokens_are_certain_and_extend_the_tree(make, tokenizer):
    grammar = make("ar").grammar(CASES[0][1])
    ids = tokenizer.encode('{"name": "Alice", "age": 30')
    assert [tokenizer.token_bytes[i] for i in ids[5:8]] == [b'",', b' "', b"age"]
    state = grammar.start()
    state.advance_all(ids[:6])  # {"name": "Alice",
    # ' "' opens the next key (whitespace could come first: not certain); then "age" is the
    # only legal token: a forced chain below the leaf
    survey = state.survey(np.array(ids[6:7]), np.array([-1]))
    assert survey.illegal.tolist() == [False] and survey.certain.tolist() == [False]
    assert survey.forced == [(0, [ids[7]])]
    state.advance(ids[6])
    assert state.survey(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)).forced == [
        (-1, [ids[7]])]  # no candidate: the chain hangs from the anchor
    survey = state.survey(np.array(ids[7:8]), np.array([-1]))
    assert survey.certain.tolist() == [True]  # a drafted "age" is certain


class CountingMatcher:
    """A matcher that counts the calls made on it (what a survey asks the grammar library)."""

    def __init__(self, matcher):
        self._m, self.calls = matcher, {}

    def __getattr__(self, name):
        attr = getattr(self._m, name)
        if not callable(attr):
            return attr

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args)
        return counted


def brute_illegal(grammar, so_far, tokens, parents) -> list[bool]:
    """Each node's path checked from a fresh state, one token at a time (nothing is legal
    below a stop token: the reply ends there)."""
    out = []
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        state = grammar.start()
        state.advance_all(so_far)
        ok = True
        for n in reversed(path):
            ok = state.legal(tokens[n]) and (n == node or tokens[n] not in state.stop_ids)
            if not ok:
                break
            state.advance(tokens[n])
        out.append(not ok)
    return out


def test_the_survey_marks_exactly_the_paths_the_grammar_forbids(make, tokenizer):
    """Random trees around a reply (chains of its next tokens, with wrong tokens and stop tokens
    among them, branching anywhere): survey's illegal nodes are the brute-force ones, and the
    state is where it was."""
    engine = make("ar")
    rng = np.random.default_rng(1)
    stop = min(tokenizer.stop_ids)
    checked = illegal_seen = 0
    for messages, fmt, _ in CASES:
        grammar = engine.grammar(fmt)
        reply = engine.generate(messages, max_tokens=MAX_TOKENS, response_format=grammar)
        ids = reply.token_ids + [reply.stop_token_id or stop]
        for at in range(0, len(ids) - 1, 2):
            tokens, parents, depth_of = [], [], {}
            for _ in range(int(rng.integers(3, 16))):
                parent = int(rng.integers(-1, len(tokens))) if tokens else -1
                depth = 0 if parent < 0 else depth_of[parent] + 1
                if parent >= 0 and tokens[parent] == stop:
                    parent, depth = -1, 0
                right = ids[min(at + depth, len(ids) - 1)]
                token = right if rng.random() < 0.6 else int(rng.choice(
                    [stop, *tokenizer.encode("} ,\n  x")]))
                depth_of[len(tokens)] = depth
                tokens.append(int(token))
                parents.append(parent)
            state = grammar.start()
            state.advance_all(ids[:at])
            survey = state.survey(np.array(tokens), np.array(parents))
            assert survey.illegal.tolist() == brute_illegal(grammar, ids[:at], tokens, parents)
            assert state.legal(ids[at])  # where it was
            checked += len(tokens)
            illegal_seen += int(survey.illegal.sum())
    assert checked > 200 and 0 < illegal_seen < checked


def test_the_survey_checks_a_chain_in_one_call(make, tokenizer):
    """An n-gram chain (each node its parent's only candidate) costs one try-consume, not a
    legality check, a consume, a rollback and a forced-token look-up per node: 12 nodes, at
    most two look-ups (the anchor's only token, the chain's end) and two rollbacks."""
    engine = make("ar")
    messages, fmt, _ = CASES[0]
    grammar = engine.grammar(fmt)
    reply = engine.generate(messages, max_tokens=MAX_TOKENS, response_format=grammar)
    state = grammar.start()
    state.advance_all(reply.token_ids[:3])
    chain = reply.token_ids[3:15]
    counting = CountingMatcher(state._m)
    state._m = counting
    survey = state.survey(np.array(chain), np.arange(-1, len(chain) - 1))
    assert not survey.illegal.any()
    assert counting.calls.get("try_consume_tokens") == 1
    assert counting.calls.get("compute_ff_tokens", 0) <= 2
    assert counting.calls.get("rollback", 0) <= 2
    assert "validate_tokens" not in counting.calls and "consume_token" not in counting.calls


def test_forced_chains_hang_below_a_parents_first_legal_candidate_only(make, tokenizer):
    """After '{"name": "Alice",' a drafted ' "' forces "age". As a sibling behind a legal pick
    (whitespace) its chain would never outrank the pick's subtree: none is appended. Behind
    an illegal pick it is the first legal candidate: the chain is appended below it."""
    grammar = make("ar").grammar(CASES[0][1])
    ids = tokenizer.encode('{"name": "Alice", "age": 30')
    state = grammar.start()
    state.advance_all(ids[:6])
    pick = next(t for text in ("\n", " \n", "  ") for t in tokenizer.encode(text)[:1]
                if state.legal(t) and t != ids[6])
    wrong = tokenizer.encode("}")[0]
    behind_legal = state.survey(np.array([pick, ids[6]]), np.array([-1, -1]))
    assert behind_legal.illegal.tolist() == [False, False]
    assert all(parent != 1 for parent, _ in behind_legal.forced)
    behind_illegal = state.survey(np.array([wrong, ids[6]]), np.array([-1, -1]))
    assert behind_illegal.illegal.tolist() == [True, False]
    assert behind_illegal.forced == [(1, [ids[7]])]


# ----- every arm equals ar ---------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_every_arm_equals_ar_under_the_same_grammar(make, sampling, monkeypatch):
    forbidden = []
    constrain = CandidateTree.constrain

    def spy(tree, illegal, certain):  # how many candidates the grammars dropped
        forbidden.append(int(np.sum(illegal)))
        constrain(tree, illegal, certain)

    monkeypatch.setattr(CandidateTree, "constrain", spy)
    ar = make("ar")
    want = [ar.generate(messages, max_tokens=MAX_TOKENS, sampling=sampling, response_format=fmt)
            for messages, fmt, _ in CASES]
    for reply, (_, _, schema) in zip(want, CASES, strict=True):
        assert_valid(reply, schema)
    free = ar.generate(ASK_PERSON, max_tokens=MAX_TOKENS, sampling=sampling)
    assert free.token_ids != want[0].token_ids  # the grammar changed the reply
    accepted = 0
    for arm in ARMS:
        engine = make(arm)
        for (messages, fmt, _), expected in zip(CASES, want, strict=True):
            got = engine.generate(messages, max_tokens=MAX_TOKENS, sampling=sampling,
                                  response_format=fmt)
            assert got.token_ids == expected.token_ids, (arm, got.text, expected.text)
            assert got.finish_reason == expected.finish_reason
            if sampling is not None:
                assert got.seed == expected.seed
                assert [e["logprob"] for e in got.logprobs] == \
                    [e["logprob"] for e in expected.logprobs]
            accepted += got.timings.accepted_tokens
    assert accepted > 0  # trees were verified and taken, or nothing was tested
    assert sum(forbidden) > 0  # some drafted or n-gram candidate was illegal and dropped


def test_every_verified_row_is_legal_on_its_path(make):
    """The rows the drafting arms verify are all legal where they stand: the grammar state after
    the reply so far, then the row's ancestors."""
    messages, fmt, schema = CASES[0]
    for arm in ("adaspark", "ngram", "chain"):
        engine = make(arm)
        grammar = engine.grammar(fmt)
        traces: list = []
        engine.speculator.round_hook = traces.append
        reply = engine.generate(messages, max_tokens=MAX_TOKENS, response_format=grammar)
        assert_valid(reply, schema)
        full = reply.token_ids + [reply.stop_token_id]  # it ended on its own: a stop token
        so_far = full[: len(full) - sum(len(t.emitted) for t in traces)]  # the first token
        wide = certain = 0
        for trace in traces:
            plan = trace.plan
            state = grammar.start()
            state.advance_all(so_far)
            assert so_far[-1] == plan.tokens[0]  # the anchor: the reply's last token
            nodes = plan.parents[1:] - 1  # row r is node r - 1; row 0 (the anchor) is -1
            assert not state.illegal(plan.tokens[1:], nodes).any(), arm
            wide += plan.rows > 1
            if plan.tree is not None and plan.tree.certain is not None:
                certain += int(plan.tree.certain[plan.layout.nodes[1:]].sum())
            so_far += trace.emitted
        assert wide > 0, arm  # some round verified a tree
        if arm != "chain":  # a chain is the drafter's picks alone
            assert certain > 0, arm  # some row was a token the grammar forces, priced certain


# ----- beside unconstrained requests in the batch ----------------------------------------------
def test_constrained_beside_unconstrained_requests_in_the_batch(make):
    messages, fmt, schema = CASES[0]
    ar = make("ar")
    want = {s: ar.generate(messages, max_tokens=MAX_TOKENS, sampling=s, response_format=fmt)
            for s in (None, SEEDED)}
    engine = make("adaspark,gate")
    free_solo = [engine.generate(m, max_tokens=MAX_TOKENS, sampling=s)
                 for m, s in [(ASK_WEATHER, None), (HAIKU, SEEDED)]]
    engine.reset()
    engine.batch.max_slots = 4
    seqs = [engine.new_decode(engine.tokenizer.encode_chat(m), max_tokens=MAX_TOKENS,
                              sampling=s, response_format=f)
            for m, s, f in [(messages, None, fmt), (ASK_WEATHER, None, None),
                            (messages, SEEDED, fmt), (HAIKU, SEEDED, None)]]
    assert all(isinstance(seq, RoundDecode) for seq in seqs)
    try:
        for seq in seqs:
            assert engine.batch.add(seq)
        while engine.batch.running:
            engine.batch.step()
    finally:
        engine.batch.max_slots = 1
    got = [engine.result(seq) for seq in seqs]
    assert got[0].token_ids == want[None].token_ids
    assert got[2].token_ids == want[SEEDED].token_ids
    assert [got[1].token_ids, got[3].token_ids] == [r.token_ids for r in free_solo]
    for reply in (got[0], got[2]):
        assert_valid(reply, schema)
