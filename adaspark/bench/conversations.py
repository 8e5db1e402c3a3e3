"""The evaluation conversations: loading, validating and selecting them.

One conversation a JSON line (see /work/shared/data/README.md):

    {"source", "id", "category", "turns": [user message, ...], "tools"?: [tool schema, ...],
     "system"?, "sha256"?, "tool_results"?: [recorded result or null, one per turn]}

`tools` may be ToolACE-style ({"name", "description", "parameters"}) or already in the OpenAI
form ({"type": "function", "function": {...}}); requests always carry the OpenAI form.
`tool_results` is optional: when a turn has a recorded tool result the harness returns it after a
tool call; otherwise it returns `neutral_tool_result` (the shipped subset records none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from adaspark.errors import UserError


@dataclass(frozen=True)
class Conversation:
    source: str
    id: str
    category: str
    turns: tuple[str, ...]
    tools: tuple[dict, ...] = ()
    system: str | None = None
    tool_results: tuple[object, ...] = ()

    @property
    def key(self) -> str:
        """Unique across sources (ids repeat between sources, e.g. ToolACE 0 and LongBench)."""
        return f"{self.source}/{self.id}"

    def openai_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        out = []
        for tool in self.tools:
            if tool.get("type") == "function" and "function" in tool:
                out.append(tool)
                continue
            function = {"name": tool["name"], "description": tool.get("description", "")}
            function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
            out.append({"type": "function", "function": function})
        return out

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.openai_tools() or []]

    def recorded_tool_result(self, turn: int) -> object | None:
        return self.tool_results[turn] if turn < len(self.tool_results) else None


def neutral_tool_result(name: str) -> dict:
    """What a called tool returns when the dataset recorded no result.

    Shaped like ToolACE's own results ({"name", "results"}) but empty, so it tells the model that
    the call ran and gives it nothing to copy: the reply after it is the model's own text.
    """
    return {"name": name, "results": {}}


def _tool_name(tool: object) -> str | None:
    if not isinstance(tool, dict):
        return None
    if tool.get("type") == "function" and isinstance(tool.get("function"), dict):
        tool = tool["function"]
    name = tool.get("name")
    return name if isinstance(name, str) and name else None


def _parse(record: object, where: str) -> Conversation:
    if not isinstance(record, dict):
        raise UserError(f"{where}: a conversation must be a JSON object")
    for field in ("source", "id", "turns"):
        if field not in record:
            raise UserError(f"{where}: missing field {field!r}")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'turns' must be a non-empty list of user messages")
    if not all(isinstance(t, str) and t.strip() for t in turns):
        raise UserError(f"{where}: every turn must be a non-empty string")
    tools = record.get("tools") or []
    if not isinstance(tools, list) or any(_tool_name(t) is None for t in tools):
        raise UserError(f"{where}: 'tools' must be a list of tool schemas, each with a name")
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise UserError(f"{where}: 'system' must be a string")
    results = record.get("tool_results") or []
    if not isinstance(results, list):
        raise UserError(f"{where}: 'tool_results' must be a list, one entry per turn")
    return Conversation(
        source=str(record["source"]),
        id=str(record["id"]),
        category=str(record.get("category", "")),
        turns=tuple(turns),
        tools=tuple(tools),
        system=system,
        tool_results=tuple(results),
    )


def load_conversations(path: str | Path) -> list[Conversation]:
    """Read and validate a conversations JSONL file; a bad line is a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"conversations file not found: {path}")
    conversations: list[Conversation] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{number}: not JSON ({err.msg})") from None
            conversations.append(_parse(record, f"{path}:{number}"))
    if not conversations:
        raise UserError(f"{path}: no conversations")
    keys = [c.key for c in conversations]
    duplicate = next((k for k in keys if keys.count(k) > 1), None)
    if duplicate:
        raise UserError(f"{path}: conversation {duplicate} appears twice")
    return conversations


def _first(conv: Conversation, turns: int) -> Conversation:
    return Conversation(source=conv.source, id=conv.id, category=conv.category,
                        turns=conv.turns[:turns], tools=conv.tools, system=conv.system,
                        tool_results=conv.tool_results[:turns])


def short_subset(conversations: list[Conversation]) -> list[Conversation]:
    """The paper's short subset: the first two turns of the first conversation of each source."""
    seen: set[str] = set()
    out = []
    for conv in conversations:
        if conv.source in seen:
            continue
        seen.add(conv.source)
        out.append(_first(conv, 2))
    return out


def first_turns(conversations: list[Conversation]) -> list[Conversation]:
    """The first turn of every conversation: what a server meets from an empty store (no
    cached history, each request the first of its conversation)."""
    return [_first(conv, 1) for conv in conversations]


SUBSETS = {"short": short_subset, "first-turns": first_turns}
