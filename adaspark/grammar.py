"""Structured output: OpenAI's `response_format` (JSON mode, JSON Schema) as a grammar whose state
follows a reply token by token, on llguidance's LLMatcher (docs/structured-output.md says why
this library: fast masks, rollback and cheap copies of a state).

    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab_size)   # once per engine (~0.1 s)
    grammar = compiler.compile(ResponseFormat.parse(body))             # per request; 400s here
    state = grammar.start()                                            # per reply (n: one each)
    state.allowed()            # bool[vocab]: the tokens legal next (a stop token only where the
                               # grammar is complete)
    state.advance(token)       # the reply took `token`
    state.survey(tokens, parents)    # a candidate tree's illegal nodes, its certain ones (the
                                     # only legal token at their place), the forced chains

Nothing here touches torch or the model: constrained.py takes the picks under a state, the
scheduler prunes its trees through `illegal` (scheduler/plan.py's TreeConstraint).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np

from adaspark.errors import UserError

# The largest schema a request may carry, as compact JSON text: compiling is fast (~1 ms for a
# tool's parameters) but grows with the schema, and it runs while the client waits.
MAX_SCHEMA_BYTES = 64 * 1024
# Whitespace between JSON tokens: JSON's own, at most 20 characters in a gap (llama.cpp's bound),
# so that a model cannot fill its reply with blank lines inside a value's gaps.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"
# Grammar size bounds below llguidance's defaults (500k symbols, 250k lexer states): a schema
# that needs more is refused at compile time, not slow at every token.
LIMITS = dict(max_grammar_size=200_000, max_lexer_states=100_000)
MAX_FORCED = 16  # tokens of one forced chain appended below a tree's leaf


class GrammarError(UserError):
    """A response_format the server cannot serve; the server's 400 names `param`."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ResponseFormat:
    """What the reply must be: "json_object" (any JSON object) or "json_schema" (a JSON value
    valid under `schema`)."""

    kind: str
    schema: Mapping[str, Any] | None = None
    name: str | None = None

    @classmethod
    def parse(cls, body: Mapping[str, Any] | None) -> ResponseFormat | None:
        """OpenAI's response_format object; None for plain text (absent or {"type": "text"})."""
        if body is None:
            return None
        if not isinstance(body, Mapping):
            raise GrammarError("response_format must be an object")
        kind = body.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind != "json_schema":
            raise GrammarError(f"response_format type must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r}", "response_format.type")
        spec = body.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format json_schema needs a 'json_schema' object with "
                               "the schema under 'schema'", "response_format.json_schema")
        schema = spec.get("schema", {})  # OpenAI: absent means any JSON value
        if not isinstance(schema, Mapping) and not isinstance(schema, bool):
            raise GrammarError("response_format json_schema.schema must be a JSON Schema "
                               "object", "response_format.json_schema.schema")
        name = spec.get("name")
        return cls("json_schema", {} if schema is True else schema,
                   name if isinstance(name, str) else None)

    def schema_text(self) -> str:
        """The schema as compact JSON text (json_object: any object)."""
        if self.kind == "json_object":
            return '{"type": "object"}'
        if self.schema is False:
            raise GrammarError("response_format schema false admits no reply",
                               "response_format.json_schema.schema")
        return json.dumps(self.schema, separators=(",", ":"))


# Type names tool schemas write in their languages' words (BFCL's Python, Java and JavaScript
# tools: "dict", "float", "HashMap", ...) -> JSON Schema's; a name not here and not JSON
# Schema's ("any") leaves the value's type open.
TYPE_ALIASES = {"dict": "object", "hashmap": "object", "map": "object", "float": "number",
                "double": "number", "int": "integer", "long": "integer", "tuple": "array",
                "list": "array", "arraylist": "array", "char": "string", "str": "string",
                "bool": "boolean"}
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames")
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _json_type(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    t = name.strip().lower()
    t = TYPE_ALIASES.get(t, t)
    return t if t in JSON_TYPES else None


def json_schema_of(node: Any) -> Any:
    """A tool's parameter schema as JSON Schema: null-valued keywords dropped (ToolACE writes
    "required": null) and type names in a language's words mapped to JSON's (TYPE_ALIASES)."""
    if not isinstance(node, Mapping):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if v is None:
            continue
        if k == "type":
            names = [_json_type(t) for t in (v if isinstance(v, list) else [v])]
            if all(names):
                out[k] = names if isinstance(v, list) else names[0]
        elif k in ("properties", "$defs", "definitions") and isinstance(v, Mapping):
            out[k] = {name: json_schema_of(sub) for name, sub in v.items()}
        elif k in _SUBSCHEMA:
            out[k] = [json_schema_of(x) for x in v] if isinstance(v, list) else json_schema_of(v)
        elif k in _SUBSCHEMAS and isinstance(v, list):
            out[k] = [json_schema_of(x) for x in v]
        else:
            out[k] = v
    return out


def tool_call_schema(tools: Sequence[Mapping[str, Any]]) -> dict:
    """One call of one of `tools` (OpenAI's {"type": "function", "function": ...} or the function
    itself): {"name": its name, "arguments": its parameters}."""
    calls = []
    for tool in tools:
        fn = tool.get("function", tool)
        calls.append({"type": "object", "properties": {
            "name": {"const": fn["name"]},
            "arguments": json_schema_of(fn.get("parameters") or {"type": "object"})},
            "required": ["name", "arguments"], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


class _Vocabulary:
    """The model's tokens as llguidance reads them: each token's bytes (control tokens marked
    with a leading 0xFF, so that no grammar spells them as text), an encoder, the end tokens."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids: set[int], eos: int,
                 bos: int | None, encode: Callable[[str], list[int]], vocab_size: int):
        tokens = [b"\xff" + b if i in special_ids else b for i, b in enumerate(token_bytes)]
        self.tokens = tokens + [b""] * (vocab_size - len(tokens))  # a padded output layer
        self.eos_token_id, self.bos_token_id = eos, bos
        self.special_token_ids = sorted(special_ids)
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class GrammarCompiler:
    """Compiles response formats for one tokenizer and output vocabulary."""

    def __init__(self, token_bytes: Sequence[bytes], special_ids, stop_ids, eos: int,
                 bos: int | None, encode: Callable[[str], list[int]], vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        vocab = _Vocabulary(token_bytes, set(special_ids), eos, bos, encode, self.vocab_size)
        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab),
                                                n_vocab=self.vocab_size,
                                                eos_token=sorted(self.stop_ids))

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> GrammarCompiler:
        """From model.tokenizer.Tokenizer; vocab_size: the model's output width (the logits')."""
        return cls(tokenizer.token_bytes, tokenizer.special_ids, tokenizer.stop_ids,
                   tokenizer.eot_id, tokenizer.bos_id, tokenizer.encode,
                   vocab_size or tokenizer.vocab_size)

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The grammar of `fmt`; GrammarError (naming why) for a schema beyond MAX_SCHEMA_BYTES
        or one the library cannot compile."""
        text = fmt.schema_text()
        param = "response_format" if fmt.kind == "json_object" else \
            "response_format.json_schema.schema"
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the schema is {len(text.encode())} bytes as compact JSON; this "
                               f"server compiles schemas of at most {MAX_SCHEMA_BYTES}", param)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text, overrides={"whitespace_pattern": WHITESPACE})
        except ValueError as err:
            raise GrammarError(f"the schema cannot be compiled: {err}", param) from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise GrammarError(f"the schema cannot be compiled: {_first_line(matcher)}", param)
        return Grammar(matcher, self)


def _first_line(matcher: Any) -> str:
    return matcher.get_error().strip().splitlines()[0] if matcher.get_error() else "unknown"


class Grammar:
    """A compiled response format; start() gives each reply its own state."""

    def __init__(self, matcher: Any, compiler: GrammarCompiler):
        self._initial = matcher
        self.compiler = compiler

    def start(self) -> GrammarState:
        return GrammarState(self._initial.deep_copy(), self.compiler)


@dataclass
class Survey:
    """A candidate tree under a grammar state (GrammarState.survey)."""

    illegal: np.ndarray  # bool[n]: the grammar forbids the node's path
    certain: np.ndarray  # bool[n]: a legal node that is the only legal token at its place
    # (parent node, -1 the state itself; tokens): below a legal node none of whose candidates is
    # legal (a leaf, most often), the tokens the grammar forces, each the only legal one there
    forced: list[tuple[int, list[int]]] = field(default_factory=list)


class GrammarState:
    """Where a reply stands in its grammar: after every token the reply has taken (its picks);
    a stop token is never advanced over (it ends the reply)."""

    def __init__(self, matcher: Any, compiler: GrammarCompiler):
        self._m = matcher
        self.vocab_size = compiler.vocab_size
        self.stop_ids = compiler.stop_ids
        self._stops = np.array(sorted(self.stop_ids), dtype=np.int64)

    def allowed(self) -> np.ndarray:
        """bool[vocab_size]: the tokens the grammar allows next; the stop tokens only where the
        grammar is complete. Never empty: a state with nothing legal is a bug (RuntimeError)."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(bool)
        if self._m.is_error() or not mask.any():
            raise RuntimeError(f"grammar state has no legal token: {_first_line(self._m)}")
        return mask

    def advance(self, token: int) -> None:
        """The reply took `token` (legal here: the picks are masked)."""
        if int(token) in self.stop_ids:
            return
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"token {token} is illegal in the grammar: {_first_line(self._m)}")

    def take(self, token: int) -> bool:
        """Advance over `token` where the grammar allows it (True); else stay (False). One
        matcher call where legal() then advance() make two. Not for a stop token."""
        return self._m.try_consume_tokens([int(token)]) == 1

    def advance_all(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.advance(token)

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(int(n)):
            raise RuntimeError(f"grammar rollback of {n} failed: {_first_line(self._m)}")

    def legal(self, token: int) -> bool:
        """Whether the grammar allows `token` next (cheaper than allowed() for one token)."""
        if int(token) in self.stop_ids:
            return self._m.is_accepting()
        return self._m.validate_tokens([int(token)]) == 1

    def sole(self) -> int | None:
        """The only legal token here, or None. llguidance's forced tokens (cheap) propose it; a
        mask confirms that nothing else is legal (a forced byte string may also be spelled by
        shorter tokens, which the target could pick)."""
        forced = self._m.compute_ff_tokens()
        if not forced:
            return None
        allowed = self.allowed()
        return int(forced[0]) if allowed[forced[0]] and np.count_nonzero(allowed) == 1 else None

    def forced(self, limit: int = MAX_FORCED) -> list[int]:
        """The tokens the grammar forces from here, each the only legal one at its place (at
        most `limit`). The state is as it was after."""
        chain: list[int] = []
        while len(chain) < limit and (token := self.sole()) is not None:
            chain.append(token)
            self._m.consume_token(token)
        self.rollback(len(chain))
        return chain

    @property
    def complete(self) -> bool:
        """Nothing but a stop token is legal next."""
        return self._m.is_stopped()

    def illegal(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """bool[n]: survey()'s illegal nodes alone."""
        return self.survey(tokens, parents, forced=False).illegal

    def survey(self, tokens: np.ndarray, parents: np.ndarray, forced: bool = True) -> Survey:
        """A candidate tree below this state (node i: tokens[i] under parents[i], -1 the state
        itself, every parent before its children; a parent's candidates likeliest first, as
        CandidateTree orders them): the nodes whose path the grammar forbids (below an illegal
        node, everything), the legal nodes it makes certain, and (forced) the chains it forces
        below the legal nodes none of whose candidates is legal. The state is as it was after.

        What it asks the matcher is bounded by what can take a row (docs/structured-output.md,
        "What the survey costs"): a run of nodes each its parent's only candidate (an n-gram
        chain) is checked in one call, and its nodes below the first are not marked certain;
        a parent is asked for its only legal token only where exactly one of its candidates is
        legal; and a forced chain hangs only below the anchor and a parent's first legal
        candidate (a drafter's sibling behind a legal pick is a leaf whose chain would never
        outrank the pick's subtree)."""
        tokens, parents = np.asarray(tokens).tolist(), np.asarray(parents).tolist()
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        out = Survey(np.ones(len(tokens), dtype=bool), np.zeros(len(tokens), dtype=bool))
        matcher, stops = self._m, self.stop_ids

        def run_of(node: int) -> list[int]:
            """`node` and its descendants while each is its parent's only candidate (a stop
            token ends a run: it is checked, never consumed)."""
            run = [node]
            while len(kids := children.get(run[-1], ())) == 1 and tokens[kids[0]] not in stops:
                run.append(kids[0])
            return run

        def visit(parent: int, lead: bool) -> None:  # the matcher stands at `parent`'s path
            legal: list[int] = []
            for node in children.get(parent, ()):
                if tokens[node] in stops:
                    if matcher.is_accepting():
                        out.illegal[node] = False
                        legal.append(node)
                    continue
                run = run_of(node)
                if len(run) == 1 and node not in children and not (forced and not legal):
                    # a leaf below which no chain can hang (a sibling behind a legal one):
                    # its check alone, nothing to consume and roll back
                    if matcher.validate_tokens([tokens[node]]):
                        out.illegal[node] = False
                        legal.append(node)
                    continue
                taken = matcher.try_consume_tokens([tokens[n] for n in run])
                if not taken:
                    continue
                out.illegal[run[:taken]] = False
                end = run[taken - 1]
                if taken == len(run) and end in children:
                    visit(end, lead=not legal or taken > 1)
                elif forced and (not legal or taken > 1) and (chain := self.forced()):
                    out.forced.append((end, chain))
                legal.append(node)
                self.rollback(taken)
            if forced and len(legal) == 1 and tokens[legal[0]] == self.sole():
                out.certain[legal[0]] = True
            if forced and not legal and lead and (chain := self.forced()):
                out.forced.append((parent, chain))

        visit(-1, lead=True)
        return out
