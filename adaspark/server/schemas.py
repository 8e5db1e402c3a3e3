"""The request body of `/v1/chat/completions`, validated with pydantic.

Only what the engine can honour is accepted: greedy decoding (temperature 0 or absent, top_p 1,
n 1), no penalties, no logprobs. Anything else is refused with a 400 that names the field,
rather than silently ignored, because it would change the reply the client expects.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RequestError(Exception):
    """A request the server understands but cannot honour: becomes a 400 with `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire form)


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    # Unknown fields (user, seed, metadata, ...) do not change a greedy reply: ignored.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Refuse, with a RequestError, whatever greedy decoding cannot honour."""
        refusals = [
            (self.temperature not in (None, 0), "temperature",
             "only greedy decoding is implemented: temperature must be 0 or absent"),
            (self.top_p not in (None, 1), "top_p",
             "only greedy decoding is implemented: top_p must be 1 or absent"),
            (self.n not in (None, 1), "n", "only one choice per request (n = 1) is supported"),
            (self.frequency_penalty not in (None, 0), "frequency_penalty",
             "frequency_penalty is not supported"),
            (self.presence_penalty not in (None, 0), "presence_penalty",
             "presence_penalty is not supported"),
            (bool(self.logprobs), "logprobs", "logprobs are not supported"),
            (self.response_format not in (None, {"type": "text"}), "response_format",
             "only the text response_format is supported"),
            (self.tool_choice not in (None, "auto", "none"), "tool_choice",
             "tool_choice must be 'auto' or 'none': a tool call cannot be forced"),
        ]
        for refused, param, message in refusals:
            if refused:
                raise RequestError(message, param=param)
        for stop in self.stop_strings():
            if not stop:
                raise RequestError("stop strings must not be empty", param="stop")
        for i, message in enumerate(self.messages):
            for call in message.tool_calls or ():
                try:
                    json.loads(call.function.arguments)
                except ValueError:
                    raise RequestError(
                        "tool call arguments must be a JSON object in text",
                        param=f"messages.{i}.tool_calls",
                    ) from None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_cap(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render, as plain dicts (still shown to the model under 'none')."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
