"""Tool calls as the model writes them, and as the OpenAI API carries them.

Small chat models write a tool call as text: one JSON object per `<tool_call>` block, as the
Hermes-style tools prompt asks (adaspark.model.tokenizer renders it for templates without tool
support, SmolLM2's among them), or a list of them in one block, as SmolLM2 was trained to. A reply
that consists of nothing but such blocks becomes OpenAI `tool_calls`; any other reply stays text
exactly as generated, so streamed and non-streamed replies agree (a reply is held back from the
stream only while it still could be a bare call).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from adaspark.server.schemas import parse_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def _call_from(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = parse_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments)},
    }


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The OpenAI tool_calls of a reply made only of well-formed call blocks; else None.

    The last block may lack its closing tag: generation stops on the end-of-turn token, which
    some models emit straight after the JSON.
    """
    stripped = text.strip()
    if not stripped.startswith(OPEN):
        return None
    calls, end = [], 0
    for match in _BLOCK.finditer(stripped):
        if stripped[end : match.start()].strip():
            return None  # prose between blocks: not a bare call
        end = match.end()
        try:
            body = parse_json(match.group(1))
        except ValueError:  # malformed, or nested past the parser's limit
            return None
        for obj in body if isinstance(body, list) else [body]:
            call = _call_from(obj)
            if call is None:
                return None
            calls.append(call)
    if stripped[end:].strip() or not calls:
        return None
    return calls


def may_be_tool_call(text: str) -> bool:
    """While streaming with tools: must `text` (the reply so far) be held back a while longer?

    True while it could still turn out to be a bare tool call, i.e. it starts with the opening
    tag or is still a prefix of it.
    """
    head = text.lstrip()
    return head.startswith(OPEN) or OPEN.startswith(head)
