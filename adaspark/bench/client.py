"""A streaming client for any OpenAI-compatible /v1/chat/completions server.

Speed is measured on the client's clock, as the paper does (§4.1): every streamed delta that
carries text or a tool call is timestamped with `time.perf_counter()` (monotonic) the moment its
SSE line is parsed; decode speed is the server's generated-token count over the time from the
first to the last such delta. SSE is parsed here rather than through the `openai` package so
that nothing sits between the socket and the timestamp.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


class ServerReplyError(Exception):
    """The server refused a request or broke off a stream."""


@dataclass
class StreamedReply:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    response_id: str | None = None
    t_request: float = 0.0
    delta_times: list[float] = field(default_factory=list)

    @property
    def deltas(self) -> int:
        return len(self.delta_times)

    @property
    def completion_tokens(self) -> int:
        """The server's count; without usage, one token per delta (documented fallback)."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return self.deltas

    @property
    def tokens_source(self) -> str:
        has_usage = self.usage and self.usage.get("completion_tokens") is not None
        return "usage" if has_usage else "deltas"

    @property
    def prompt_tokens(self) -> int | None:
        value = (self.usage or {}).get("prompt_tokens")
        return int(value) if value is not None else None

    @property
    def decode_s(self) -> float | None:
        """First to last streamed delta; None when a single delta leaves no interval."""
        if self.deltas < 2:
            return None
        return self.delta_times[-1] - self.delta_times[0]

    @property
    def tok_s(self) -> float | None:
        decode = self.decode_s
        return self.completion_tokens / decode if decode else None

    @property
    def ttft_s(self) -> float | None:
        return self.delta_times[0] - self.t_request if self.delta_times else None


def _merge_tool_call(calls: list[dict], piece: dict) -> None:
    """Streamed tool calls arrive in fragments keyed by index; concatenate their arguments."""
    index = piece.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[index]
    if piece.get("id"):
        call["id"] = piece["id"]
    function = piece.get("function") or {}
    call["function"]["name"] += function.get("name") or ""
    call["function"]["arguments"] += function.get("arguments") or ""


class ChatClient:
    def __init__(self, base_url: str, timeout_s: float = 3600.0):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        # connect/pool timeouts short, read timeout long: a reply may run to the cap
        timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self._model: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def health(self) -> tuple[int | None, str]:
        """/health's status code and body; (None, why) while nothing answers."""
        try:
            response = self._http.get("/health", timeout=5.0)
        except httpx.HTTPError as err:
            return None, str(err)
        return response.status_code, response.text[:300]

    def healthy(self) -> bool:
        return self.health()[0] == 200

    def reachable(self) -> bool:
        """/health 200, or /v1/models 200 for servers without /health (llama-cpp-python)."""
        if self.healthy():
            return True
        try:
            return self._http.get("/v1/models", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    def model(self) -> str:
        """The server's first listed model id (strict servers need it); 'default' otherwise."""
        if self._model is None:
            self._model = "default"
            try:
                response = self._http.get("/v1/models", timeout=10.0)
                data = response.json().get("data") or []
                if response.status_code == 200 and data and data[0].get("id"):
                    self._model = str(data[0]["id"])
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        return self._model

    def stream_chat(
        self, messages: list[dict], max_tokens: int, tools: list[dict] | None = None,
        sampling: dict | None = None,
    ) -> StreamedReply:
        """sampling: request fields such as temperature and seed (default: greedy)."""
        body: dict = {
            "model": self.model(),
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(sampling or {}),
        }
        if tools:
            body["tools"] = tools
        reply = StreamedReply(t_request=time.perf_counter())
        try:
            with self._http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise ServerReplyError(f"HTTP {response.status_code}: {response.text[:300]}")
                for line in response.iter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        break
                    try:
                        chunk = json.loads(payload)
                    except json.JSONDecodeError:
                        raise ServerReplyError(f"not JSON in the stream: {payload[:200]}") from None
                    self._absorb(reply, chunk, now)
        except httpx.HTTPError as err:
            raise ServerReplyError(f"{type(err).__name__}: {err}") from err
        return reply

    @staticmethod
    def _absorb(reply: StreamedReply, chunk: dict, now: float) -> None:
        if "error" in chunk:
            raise ServerReplyError(f"error in stream: {json.dumps(chunk['error'])[:300]}")
        reply.response_id = reply.response_id or chunk.get("id")
        if chunk.get("usage"):
            reply.usage = chunk["usage"]
        if chunk.get("timings"):
            reply.timings = chunk["timings"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content = delta.get("content") or ""
            reasoning = delta.get("reasoning_content") or ""
            calls = delta.get("tool_calls") or []
            if content or reasoning or calls:
                reply.delta_times.append(now)
            reply.text += content
            reply.reasoning += reasoning
            for piece in calls:
                _merge_tool_call(reply.tool_calls, piece)
            if choice.get("finish_reason"):
                reply.finish_reason = choice["finish_reason"]
