"""The prompt pool for drafter data: conversations whose later user turns follow the target's own
earlier replies, as the evaluation's multi-turn chats do.

A pool is JSONL (optionally gzipped), one conversation a line, the evaluation file's shape:
    {"source", "id"?, "turns": [user message, ...], "tools"?, "system"?}
The training prompt file's single prompts ({"prompt", ...}) read as one-turn conversations.
Turn t's prompt is the chat template over the system text, turns 0..t and, between them, the
target's replies to turns 0..t-1 as text (what a client sends back: benchmarks/arms.py), so a
second-stage prompt exists only once the first-stage reply does (generate.py).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from adaspark.errors import UserError


@dataclass(frozen=True)
class Conversation:
    source: str
    turns: tuple[str, ...]
    tools: tuple | None = None  # JSON-schema tools, as the chat template takes them
    system: str | None = None
    # the replies' structure (a request's response_format: grammar.py), None for free text
    response_format: dict | None = None

    @property
    def key(self) -> str:
        """A stable name from the content: a shard's records find their conversation by it."""
        fields = [self.source, self.turns, self.tools, self.system]
        if self.response_format is not None:  # free conversations keep their keys
            fields.append(self.response_format)
        body = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict]:
        """The messages up to user turn `turn`, replies[i] answering turn i."""
        if len(replies) < turn:
            raise ValueError(f"turn {turn} needs {turn} earlier replies, got {len(replies)}")
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn + 1):
            msgs.append({"role": "user", "content": self.turns[i]})
            if i < turn:
                msgs.append({"role": "assistant", "content": replies[i]})
        return msgs

    def prompt_ids(self, tokenizer, turn: int, replies: Sequence[str]) -> list[int]:
        return tokenizer.encode_chat(self.messages(turn, replies),
                                     list(self.tools) if self.tools else None)


def conversation(item: dict) -> Conversation:
    """A pool line (or a training-prompt line) as a Conversation; a clear error otherwise."""
    turns = item.get("turns")
    if turns is None and "prompt" in item:
        turns = [item["prompt"]]
    if not turns or not all(isinstance(t, str) and t for t in turns):
        raise UserError(f"a pool item needs non-empty user turns: {str(item)[:120]}")
    tools = item.get("tools")
    return Conversation(str(item.get("source", "?")), tuple(turns),
                        tuple(tools) if tools else None, item.get("system") or None)


CALL_SUFFIX = "+call"  # a tool-call conversation's source: its free conversation's and this


def tool_calls(pool: Iterable[Conversation]) -> list[Conversation]:
    """For each conversation with tools, its first turn answered as one call of its tools under
    a JSON Schema (grammar.tool_call_schema), as a client asking for structured output gets:
    replies of the form a drafter meets under a schema."""
    from adaspark.grammar import tool_call_schema

    return [Conversation(c.source + CALL_SUFFIX, c.turns[:1], c.tools, c.system,
                         {"type": "json_schema", "json_schema": {
                             "name": "call", "schema": tool_call_schema(c.tools)}})
            for c in pool if c.tools]


def read_pool(paths: Iterable[Path]) -> list[Conversation]:
    """Every conversation of the files, in file order, each once (by key)."""
    out, seen = [], set()
    for path in paths:
        path = Path(path)
        try:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8", newline="") as f:
                text = f.read()
            # not splitlines(): U+2028 may sit inside a JSON string
            items = [json.loads(line) for line in text.split("\n") if line.strip()]
        except (OSError, ValueError) as err:
            raise UserError(f"cannot read the prompt pool {path}: {err}") from err
        for item in items:
            conv = conversation(item)
            if conv.key not in seen:
                seen.add(conv.key)
                out.append(conv)
    return out


def ordered(pool: Sequence[Conversation], seed: int,
            sources: Sequence[str] | None = None) -> list[Conversation]:
    """The pool in its seeded order, only sources starting with one of `sources` (all: None)."""
    convs = [c for c in pool if not sources or c.source.startswith(tuple(sources))]
    random.Random(seed).shuffle(convs)
    return convs


# --- deduplication against the evaluation pool (as shared/data/train was built) ------------------

def _norm(text: str) -> str:
    return " ".join(text.lower().split())


class EvalGuard:
    """Whether a text overlaps an evaluation turn: equal, the same first 200 characters, or one
    containing the other (whitespace and case folded; texts under 40 characters match only
    exactly, so "Thank you!" does not exclude every conversation that says it)."""

    def __init__(self, eval_turns: Iterable[str]):
        self.turns = [_norm(t) for t in eval_turns if t.strip()]
        self.exact = set(self.turns)
        self.heads = {t[:200] for t in self.turns if len(t) >= 40}

    def hits(self, text: str) -> bool:
        t = _norm(text)
        if t in self.exact:
            return True
        if len(t) < 40:
            return False
        if t[:200] in self.heads:
            return True
        return any((len(e) >= 40 and e in t) or t in e for e in self.turns)

    @classmethod
    def from_conversations(cls, path: Path) -> EvalGuard:
        return cls(t for c in read_pool([path]) for t in c.turns)
