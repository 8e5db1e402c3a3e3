"""What a grammar costs per tree row, against a one-row verify: the choice of grammar library.

Each library walks the same JSON documents (valid under their schemas, tokenised by the model's
own tokenizer, as a model would write them) token by token: at every position the allowed-token
bitmask, then the token is consumed. Reported per library: the mask's time per position, a
consume, a one-token legality check with a consume-and-rollback (what pruning a tree costs per
node), a copy of a state, and the compile time of each schema; with --verify, the embedded
model's one-row verify (a plain decode step) on the same machine, the cost a mask is measured
against. llguidance is the engine's (adaspark/grammar.py); xgrammar runs where it imports.

    .venv/bin/python benchmarks/grammar_mask_cost.py --repeat 5 --verify
    .venv/bin/python benchmarks/grammar_mask_cost.py --libraries llguidance --repeat 1

Run it alone on the machine: the numbers are wall-clock medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SCHEMAS = [
    ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name", "age", "email", "tags"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
      "tags": ["mathematician", "writer", "analyst"]}),
    ({"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
      "required": ["location", "unit", "days"]},
     {"location": "Paris, France", "unit": "celsius", "days": 5}),
    ({"type": "object"},
     {"title": "Shopping list", "items": [{"name": "eggs", "count": 12},
                                          {"name": "milk", "count": 2}], "done": False}),
]


def ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):.3f}"


def run_llguidance(tok, docs, repeat: int) -> dict:
    from adaspark.grammar import GrammarCompiler, ResponseFormat

    t = time.perf_counter()
    compiler = GrammarCompiler.for_tokenizer(tok)
    out = {"tokenizer_s": time.perf_counter() - t, "compile": [], "mask": [], "consume": [],
           "check": [], "fork": [], "forced": [], "run": []}
    for schema, ids in docs:
        for _ in range(repeat):
            t = time.perf_counter()
            grammar = compiler.compile(ResponseFormat("json_schema", schema))
            out["compile"].append(time.perf_counter() - t)
            state = grammar.start()
            for at, token in enumerate(ids):
                # the tree survey's two other calls: the forced-token look-up, and a run of the
                # next (up to) 8 tokens checked in one call and rolled back
                t = time.perf_counter()
                state._m.compute_ff_tokens()
                out["forced"].append(time.perf_counter() - t)
                t = time.perf_counter()
                state.rollback(state._m.try_consume_tokens(ids[at:at + 8]))
                out["run"].append(time.perf_counter() - t)
                t = time.perf_counter()
                allowed = state.allowed()
                out["mask"].append(time.perf_counter() - t)
                assert allowed[token], "the document leaves the grammar"
                t = time.perf_counter()
                legal = state.legal(token)
                state.advance(token)
                state.rollback(1)
                out["check"].append(time.perf_counter() - t)
                assert legal
                t = time.perf_counter()
                state._m.deep_copy()
                out["fork"].append(time.perf_counter() - t)
                t = time.perf_counter()
                state.advance(token)
                out["consume"].append(time.perf_counter() - t)
            assert state.complete
    return out


def run_xgrammar(tok, docs, repeat: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError as err:
        print(f"xgrammar: not measured ({err})")
        return None
    t = time.perf_counter()
    info = xgr.TokenizerInfo([b"" if i in tok.special_ids else b
                              for i, b in enumerate(tok.token_bytes)],
                             vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                             stop_token_ids=sorted(tok.stop_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    out = {"tokenizer_s": time.perf_counter() - t, "compile": [], "mask": [], "consume": [],
           "check": [], "fork": []}
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    for schema, ids in docs:
        for _ in range(repeat):
            t = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema))
            out["compile"].append(time.perf_counter() - t)
            matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
            for token in ids:
                t = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                out["mask"].append(time.perf_counter() - t)
                word = int(bitmask[0, token // 32])
                assert (word >> (token % 32)) & 1, "the document leaves the grammar"
                t = time.perf_counter()
                assert matcher.accept_token(token)
                matcher.rollback(1)
                out["check"].append(time.perf_counter() - t)
                out["fork"].append(float("nan"))  # no copy of a matcher's state: rollback only
                t = time.perf_counter()
                matcher.accept_token(token)
                out["consume"].append(time.perf_counter() - t)
    return out


def one_row_verify_s(repeat: int) -> float:
    """The embedded model's one-row verify (a plain decode step) after a short reply."""
    from adaspark.engine import Engine
    from adaspark.sequence import ONE_ROW

    engine = Engine.load(arm="ar")
    reply = engine.generate([{"role": "user", "content": "Describe a cat."}], max_tokens=16)
    times = []
    for _ in range(max(20, 10 * repeat)):
        t = time.perf_counter()
        engine.target.verify(np.array([reply.token_ids[-1]]), *ONE_ROW)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--libraries", default="llguidance,xgrammar")
    p.add_argument("--repeat", type=int, default=3, help="walks of every document")
    p.add_argument("--verify", action="store_true", help="also time a one-row verify")
    args = p.parse_args(argv)

    from adaspark.model.sources import default_model_path
    from adaspark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    docs = [(schema, tok.encode(json.dumps(doc))) for schema, doc in SCHEMAS]
    print(f"{len(docs)} documents, {sum(len(ids) for _, ids in docs)} tokens a walk, "
          f"vocabulary {tok.vocab_size}")
    runs = {"llguidance": run_llguidance, "xgrammar": run_xgrammar}
    print(f"{'library':12} {'vocab s':>8} {'compile ms':>10} {'mask ms':>8} {'consume ms':>10} "
          f"{'check ms':>8} {'copy ms':>8}  (medians)")
    for name in args.libraries.split(","):
        out = runs[name](tok, docs, args.repeat)
        if out is None:
            continue
        copy = "n/a" if all(np.isnan(out["fork"])) else ms(out["fork"])
        print(f"{name:12} {out['tokenizer_s']:8.2f} {ms(out['compile']):>10} "
              f"{ms(out['mask']):>8} {ms(out['consume']):>10} {ms(out['check']):>8} "
              f"{copy:>8}   p90 mask {1000 * float(np.quantile(out['mask'], 0.9)):.3f} ms "
              f"over {len(out['mask'])}")
        if out.get("forced"):
            print(f"{name:12} a forced-token look-up {ms(out['forced'])} ms, an 8-token run "
                  f"checked and rolled back {ms(out['run'])} ms (medians)")
    if args.verify:
        print(f"one-row verify (embedded model, ar): {1000 * one_row_verify_s(args.repeat):.2f} ms")


if __name__ == "__main__":
    main()
