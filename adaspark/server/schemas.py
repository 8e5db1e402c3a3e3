"""The request bodies of `/v1/chat/completions` and `/v1/completions`, validated with pydantic.

Only what the engine can honour is accepted; anything else is refused with a 400 that names the
field, rather than silently ignored, because it would change the reply the client expects.
Sampling (adaspark/sampling.py): temperature [0, 2] (0 or absent: greedy), top_p (0, 1], top_k
>= 0 (0: off), an int64 seed, penalties in [-2, 2], logprobs with top_logprobs 0-20, and n
choices (n seeded samples, choice i with seed + i, run side by side). Up to MAX_STOPS stop
strings of up to MAX_STOP_CHARS characters each. response_format: text, json_object or
json_schema (grammar.py; the server compiles the schema, a 400 where it cannot).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from adaspark.grammar import GrammarError, ResponseFormat
from adaspark.sampling import MAX_SEED, MAX_TOP_LOGPROBS, MIN_SEED, SamplingParams

MAX_CHOICES = 16  # n: a cap bounds one request's work (its choices share the batch)
# The stop list. OpenAI takes at most 4 stop strings; 16 leaves room for clients written for
# servers without a cap (a chat front-end's stop per speaker name). Each one costs the engine
# thread, which every running request shares, one state move per new character (stops.py), so
# 16 keep a token's scan at a few dozen moves; a stop string is a marker (an end tag, a
# speaker's turn), never a passage, and up to its length of text is held back from a stream
# while it may be a stop's beginning, hence 256 characters.
MAX_STOPS = 16
MAX_STOP_CHARS = 256


class RequestError(Exception):
    """A request the server understands but cannot honour: becomes a 400 with `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def parse_json(text: str) -> Any:
    """JSON text inside a request (a tool call's arguments) or a reply, through the parser
    that reads the request body: nesting past its limit is a ValueError like any malformed
    text, where json.loads would raise RecursionError (a 500)."""
    return pydantic_core.from_json(text)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that parses `model` itself, its $defs inlined (the
    models have no cycles), so the document describes the body the route validates."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        return [inline(item) for item in node] if isinstance(node, list) else node

    return {"required": True, "content": {"application/json": {"schema": inline(schema)}}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body (OpenAI's error object), as the OpenAPI document declares it."""

    error: ErrorDetail


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


def _message_schema(schema: dict[str, Any]) -> None:
    """The JSON schema says what the validator below refuses: content is null only in an
    assistant's message with tool calls."""
    props = schema["properties"]
    with_content = {**props, "content": {"anyOf": [
        part for part in props["content"]["anyOf"] if part != {"type": "null"}]}}
    calls = {**props, "role": {"const": "assistant"},
             "tool_calls": {**props["tool_calls"]["anyOf"][0], "minItems": 1}}
    variants = [{**schema, "properties": with_content, "required": ["role", "content"]},
                {**schema, "properties": calls, "required": ["role", "tool_calls"]}]
    schema.clear()
    schema.update(title="Message", anyOf=variants)


class Message(BaseModel):
    model_config = ConfigDict(json_schema_extra=_message_schema)

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


def _stop_schema(props: dict[str, Any]) -> None:
    bounded = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    props["stop"]["anyOf"][:2] = [bounded,
                                  {"type": "array", "items": bounded, "maxItems": MAX_STOPS}]


def _response_format_schema(props: dict[str, Any]) -> None:
    """OpenAI's three response formats (grammar.ResponseFormat.parse reads them)."""
    def kind(name: str, **more: Any) -> dict[str, Any]:
        return {"type": "object", "properties": {"type": {"const": name}, **more},
                "required": ["type", *more]}

    spec = {"type": "object", "properties": {"name": {"type": "string"},
                                             "schema": {"type": "object"},
                                             "strict": {"type": ["boolean", "null"]}}}
    props["response_format"]["anyOf"] = [kind("text"), kind("json_object"),
                                         kind("json_schema", json_schema=spec), {"type": "null"}]


def _request_schema(schema: dict[str, Any]) -> None:
    """The JSON schema says what check_supported refuses (pydantic sees only the types), so a
    client or a fuzzer that follows it is not refused."""
    props = schema["properties"]
    _stop_schema(props)
    _response_format_schema(props)
    props["tool_choice"]["anyOf"] = [{"enum": ["auto", "none"]}, {"type": "null"}]


class GenerationRequest(BaseModel):
    """What chat and text completions share: the reply's cap, stops, streaming, sampling."""

    # Unknown fields (user, metadata, ...) do not change the reply: ignored.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # vLLM's extension; 0: off
    # 3.0 or "3" is not an integer seed; int64 (sampling.py: each replays exactly)
    seed: int | None = Field(default=None, strict=True, ge=MIN_SEED, le=MAX_SEED)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    response_format: dict[str, Any] | None = None

    def structured(self) -> ResponseFormat | None:
        """The reply's structure (None: free text); a RequestError names a malformed one."""
        try:
            return ResponseFormat.parse(self.response_format)
        except GrammarError as err:
            raise RequestError(str(err), param=err.param) from None

    def _refusals(self) -> list[tuple[bool, str, str]]:
        """(refused, param, why) for what this kind of request cannot have."""
        return []

    def _top_logprobs(self) -> int | None:
        """None: no logprobs asked for; else how many alternatives per token."""
        return None

    def check_supported(self) -> None:
        """Refuse, with a RequestError, whatever the engine cannot honour."""
        for refused, param, message in self._refusals():
            if refused:
                raise RequestError(message, param=param)
        stops = self.stop_strings()
        if len(stops) > MAX_STOPS:
            raise RequestError(f"stop holds {len(stops)} strings; at most {MAX_STOPS} are "
                               "allowed", param="stop")
        for stop in stops:
            if not stop:
                raise RequestError("stop strings must not be empty", param="stop")
            if len(stop) > MAX_STOP_CHARS:
                raise RequestError(f"a stop string is {len(stop)} characters; at most "
                                   f"{MAX_STOP_CHARS} are allowed", param="stop")
        self.structured()

    def sampling(self) -> SamplingParams:
        """The request's sampling, with a seed drawn when sampling without one (returned to the
        client so that the reply can be reproduced)."""
        top = self._top_logprobs()
        params = SamplingParams(
            temperature=self.temperature or 0.0, top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, seed=self.seed,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0, logprobs=top is not None,
            top_logprobs=top or 0).check()
        return params.with_seed() if params.temperature > 0 else params

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_cap(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(GenerationRequest):
    model_config = ConfigDict(json_schema_extra=_request_schema)

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=None, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def _refusals(self) -> list[tuple[bool, str, str]]:
        return [
            (bool(self.top_logprobs) and not self.logprobs, "top_logprobs",
             "top_logprobs needs logprobs: true"),
            (self.tool_choice not in (None, "auto", "none"), "tool_choice",
             "tool_choice must be 'auto' or 'none': a tool call cannot be forced"),
        ]

    def check_supported(self) -> None:
        super().check_supported()
        for i, message in enumerate(self.messages):
            for call in message.tool_calls or ():
                try:
                    parse_json(call.function.arguments)
                except ValueError as err:  # the parser's reason, e.g. its nesting limit
                    raise RequestError(
                        f"tool call arguments must be a JSON object in text ({err})",
                        param=f"messages.{i}.tool_calls",
                    ) from None

    def _top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_cap(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render, as plain dicts (still shown to the model under 'none')."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def parses_tool_calls(self) -> bool:
        """Under a response_format the reply is that structure, never a tool call."""
        return bool(self.tools) and self.tool_choice != "none" and self.structured() is None


TokenIds = list[Annotated[int, Field(strict=True, ge=0)]]


def _completion_schema(schema: dict[str, Any]) -> None:
    """As _request_schema: the document leaves out the prompts that check_supported refuses
    (empty, or more than one)."""
    props = schema["properties"]
    _stop_schema(props)
    _response_format_schema(props)
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    props["prompt"] = {"anyOf": [
        {"type": "string", "minLength": 1}, ids,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
         "maxItems": 1},
        {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}],
        "title": "Prompt", "description": "text to continue (no chat template), or its "
        "token ids; a list holds one prompt"}


class CompletionRequest(GenerationRequest):
    """`/v1/completions`: text (or token ids) continued as they are, no chat template.
    max_tokens defaults to 16, as OpenAI and vLLM have it; logprobs is the legacy integer (how
    many alternatives per token)."""

    model_config = ConfigDict(json_schema_extra=_completion_schema)

    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> Any:
        """One message for a prompt of no accepted shape (pydantic's names its first try)."""
        try:
            return handler(value)
        except ValidationError:
            raise pydantic_core.PydanticCustomError(
                "prompt_type", "must be a string, a list of token ids (integers >= 0), or a "
                "list holding one of either") from None

    def _refusals(self) -> list[tuple[bool, str, str]]:
        many = isinstance(self.prompt, list) and len(self.prompt) > 1 and \
            not isinstance(self.prompt[0], int)
        return [
            (many, "prompt", "one prompt per request: send each prompt as its own request"),
            (not self.prompt or self.prompt in ([""], [[]]), "prompt", "the prompt is empty"),
            (self.suffix is not None, "suffix", "suffix (insertion) is not supported"),
            (self.best_of not in (None, 1), "best_of",
             "best_of is not supported: ask for n choices instead"),
            (self.echo and self.logprobs is not None, "logprobs",
             "logprobs with echo would need the prompt's logprobs, which are not computed"),
        ]

    def _top_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_ids(self, tokenizer: Any) -> tuple[list[int], str]:
        """The prompt's token ids and its text: a string tokenised raw (the model's BOS
        added if it asks for one), ids taken as they are, checked against the vocabulary."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a list of one prompt (check_supported refused more)
        if isinstance(prompt, str):
            return tokenizer.encode_prompt(prompt), prompt
        bad = next((t for t in prompt if t >= tokenizer.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary "
                               f"(0-{tokenizer.vocab_size - 1})", param="prompt")
        return list(prompt), tokenizer.decode(prompt)
