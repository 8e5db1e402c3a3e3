"""The OpenAI-compatible routes: /v1/chat/completions and /v1/completions (SSE or not),
/v1/models, /health.

Requests are parsed and tokenised on the event loop's side; generation runs on the engine's own
thread (see worker.py), several plain-decoding requests at once in one batch (`parallel`), the rest
queued in arrival order; past the queue's bound a request gets 429 with Retry-After. Any model name
is accepted in a request: the server serves exactly one model, and echoes its id in every response.
A prompt that fills the context is refused (400, context_length_exceeded); otherwise the reply may
run to max_tokens or to the end of the context, whichever comes first (finish_reason "length").
Every response, streamed or not, carries `usage` and the engine's `timings` for the request (of
its first choice when n > 1). A sampled response also carries `adaspark: {"seed": S}`: choice i
used seed S + i, so any reply can be reproduced. Logprobs, when asked for, come whole in each
choice's last chunk when streaming. /v1/completions continues raw text (or token ids) without
the chat template, through the same queue and sampling; a model without a chat template serves
only that route (its chat answers 400).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from adaspark.errors import UserError
from adaspark.model.tokenizer import StreamDecoder
from adaspark.server.auth import ApiKey, ApiKeyMiddleware, is_open
from adaspark.server.errors import (
    BodyLimitMiddleware,
    error_body,
    error_response,
    error_responses,
    install_error_handlers,
    internal_error,
    validation_message,
)
from adaspark.server.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    Message,
    RequestError,
    openapi_body,
)
from adaspark.server.toolcalls import may_be_tool_call, parse_tool_calls
from adaspark.server.watch import Watch, watch_routes
from adaspark.server.worker import Cancelled, EngineWorker, Job, QueueFull

MAX_BODY_BYTES = 32 << 20  # far above any prompt that fits the context; guards memory only
RETRY_AFTER_S = 1  # what a refused client is told to wait: about a few replies' decode time
NO_TEMPLATE = ("this model has no chat template (no tokenizer.chat_template in its GGUF), so it "
               "cannot chat: send the text to continue to /v1/completions")


class Unavailable(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages as plain dicts for the tokenizer, which renders tools and tool calls."""
    out = []
    for message in messages:
        entry = message.model_dump(exclude_none=True)
        entry["content"] = message.text()
        if message.role == "developer":  # OpenAI's newer name for the system role
            entry["role"] = "system"
        out.append(entry)
    return out


def parse_request(model: type[GenerationRequest], body: bytes) -> Any:
    """The body as `model`, checked; a RequestError (400) names the bad field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        raise RequestError(message, param) from None
    req.check_supported()
    return req


def _usage(prompt_tokens: int, results: list[Any]) -> dict[str, int]:
    completion = sum(len(result.token_ids) for result in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def create_app(load_engine: Callable[[], Any], model_id: str, api_key: str | None = None,
               public_metrics: bool = False, parallel: int | None = None,
               queue_limit: int | None = None) -> FastAPI:
    """The app; `load_engine()` runs on the engine thread at startup, so the port opens at once.
    api_key: every route but /health and the dashboard's page needs it (auth.py), /metrics too
    unless public_metrics. parallel, queue_limit: requests decoding at once and waiting at most
    (worker.py; None: chosen from the machine at load)."""
    watch = Watch(model_id)  # metrics, learned state, dashboard (watch.py)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.worker = EngineWorker(watch.loader(load_engine), parallel, queue_limit)
        watch.watch(app.state.worker)
        yield
        # SIGTERM: the engine ends its requests and saves what it learned before the exit
        await asyncio.to_thread(app.state.worker.close)

    app = FastAPI(title="adaspark", lifespan=lifespan)
    app.state.watch = watch
    install_error_handlers(app)
    app.include_router(watch_routes(watch))
    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)
    if api_key is not None:  # added last, so it runs first: no body is read before the key
        app.add_middleware(ApiKeyMiddleware, key=ApiKey(api_key), public_metrics=public_metrics)
        declare_api_key(app, public_metrics)

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, exc: Unavailable) -> JSONResponse:
        return error_response(exc.status, exc.message)

    def ready_engine() -> Any:
        worker = app.state.worker
        if worker.fault is not None:  # the engine thread stopped (the cause is in the log)
            raise Unavailable(503, "the engine stopped after an internal error; restart the "
                                   "server")
        if worker.load_error is not None:
            raise Unavailable(500, f"the model failed to load: {worker.load_error}")
        if not worker.ready:
            raise Unavailable(503, "the model is still loading; retry shortly")
        return worker.engine

    @app.get("/health", responses=error_responses(500, 503))
    async def health() -> JSONResponse:
        engine = ready_engine()
        return JSONResponse({"status": "ok", "model": model_id,
                             "forward": getattr(engine, "forward", None)})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "adaspark"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions", openapi_extra={"requestBody": openapi_body(ChatRequest)},
              responses=error_responses(400, 413, 429, 500, 503))
    async def chat_completions(request: Request):
        # BodyLimitMiddleware holds the body to MAX_BODY_BYTES
        req = parse_request(ChatRequest, await request.body())
        engine = ready_engine()
        if engine.tokenizer.chat_template is None:
            raise RequestError(NO_TEMPLATE, param="messages", code="no_chat_template")
        try:
            prompt_ids = await asyncio.to_thread(
                engine.tokenizer.encode_chat, template_messages(req.messages), req.active_tools()
            )
        except UserError as err:  # e.g. a role order the chat template refuses
            raise RequestError(str(err), param="messages") from None
        sampling = req.sampling()
        reply = Reply(model_id, len(prompt_ids), req.parses_tool_calls(), sampling.seed,
                      engine.tokenizer.token_bytes)
        return await serve(request, engine, req, prompt_ids, reply, sampling, "messages")

    @app.post("/v1/completions",
              openapi_extra={"requestBody": openapi_body(CompletionRequest)},
              responses=error_responses(400, 413, 429, 500, 503))
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await request.body())
        engine = ready_engine()
        prompt_ids, text = await asyncio.to_thread(req.prompt_ids, engine.tokenizer)
        sampling = req.sampling()
        reply = TextReply(model_id, len(prompt_ids), sampling.seed, engine.tokenizer.token_bytes,
                          echo=text if req.echo else "")
        return await serve(request, engine, req, prompt_ids, reply, sampling, "prompt")

    async def serve(request: Request, engine: Any, req: GenerationRequest,
                    prompt_ids: list[int], reply: Reply, sampling: Any, param: str) -> Any:
        """A checked request's jobs (its n choices) queued; its reply streamed or whole."""
        room = engine.context_length - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"the prompt is {len(prompt_ids)} tokens; this model's context holds "
                f"{engine.context_length}, including the reply",
                param=param,
                code="context_length_exceeded",
            )
        cap = req.token_cap()
        cancel = threading.Event()  # one client: leaving cancels every choice
        jobs = [Job(prompt_ids, min(cap, room) if cap else room, req.stop_strings(), reply.id,
                    cancel=cancel, sampling=choice_sampling(sampling, i))
                for i in range(req.n or 1)]
        if app.state.worker.full:  # checked at arrival: a stream's status goes out at once
            return busy_response()
        if req.stream:
            stream = _sse(app.state.worker, jobs, reply, req.include_usage())
            return StreamingResponse(stream, media_type="text/event-stream")
        return await _complete(request, app.state.worker, jobs, reply)

    return app


def declare_api_key(app: FastAPI, public_metrics: bool) -> None:
    """The OpenAPI document declares a 401 on exactly the routes that the key guards (auth.py's
    is_open decides both), whoever defined them."""
    document = app.openapi

    def with_401() -> dict[str, Any]:
        doc = document()  # FastAPI's, built once and cached: adding twice changes nothing
        unauthorized = error_responses(401)[401]
        schema = {"$ref": f"#/components/schemas/{unauthorized.pop('model').__name__}"}
        unauthorized["content"] = {"application/json": {"schema": schema}}
        for path, operations in doc["paths"].items():
            if not is_open(path, public_metrics):
                for operation in operations.values():
                    operation["responses"].setdefault("401", unauthorized)
        return doc

    app.openapi = with_401


def busy_body() -> dict[str, Any]:
    """OpenAI's error object for a full queue (status 429)."""
    return error_body(429, "the server is busy: too many requests are waiting; retry shortly",
                      code="rate_limit_exceeded")


def busy_response() -> JSONResponse:
    """429 with Retry-After: the queue holds as many requests as it may."""
    return JSONResponse(busy_body(), status_code=429,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def choice_sampling(sampling: Any, index: int) -> Any:
    """Choice `index` of n: its own seed, so the n samples differ and each can be reproduced."""
    return sampling if index == 0 or sampling.seed is None else \
        replace(sampling, seed=sampling.seed + index)


class Reply:
    """What every response about one chat request shares: its id, model, and the shape of
    its choices, whole or streamed (TextReply: a text completion's)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model_id: str, prompt_tokens: int, tools_active: bool,
                 seed: int | None = None, token_bytes: list[bytes] | None = None):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_id
        self.prompt_tokens = prompt_tokens
        self.tools_active = tools_active
        self.seed = seed  # the sampling seed of choice 0; None: greedy
        self.token_bytes = token_bytes

    @property
    def extra(self) -> dict[str, Any]:
        return {} if self.seed is None else {"adaspark": {"seed": self.seed}}

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def logprobs(self, result: Any) -> dict[str, Any] | None:
        """OpenAI's logprobs object for a reply's tokens, or None when not asked for."""
        if getattr(result, "logprobs", None) is None or self.token_bytes is None:
            return None

        def token(tid: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes[tid]
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                    "bytes": list(raw)}

        return {"content": [{**token(e["id"], e["logprob"]),
                             "top_logprobs": [token(i, v) for i, v in e["top"]]}
                            for e in result.logprobs]}

    def finish(self, text: str, result: Any) -> tuple[dict[str, Any], str]:
        """The final message and finish_reason of a reply."""
        calls = parse_tool_calls(text) if self.tools_active else None
        if calls:
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text}, result.finish_reason

    def choice(self, index: int, result: Any) -> dict[str, Any]:
        """A finished choice of the whole (not streamed) response."""
        message, finish_reason = self.finish(result.text, result)
        return {"index": index, "message": message, "finish_reason": finish_reason,
                "logprobs": self.logprobs(result)}

    def delta(self, index: int, content: str, first: bool) -> dict[str, Any]:
        """A streamed choice's chunk of text."""
        body = {"role": "assistant", "content": content} if first else {"content": content}
        return {"index": index, "delta": body, "finish_reason": None, "logprobs": None}

    def last(self, index: int, final: dict[str, Any], finish_reason: str,
             result: Any) -> dict[str, Any]:
        """A streamed choice's final chunk: `final` (tool calls, or nothing) and why it ended."""
        return {"index": index, "delta": final, "finish_reason": finish_reason,
                "logprobs": self.logprobs(result)}


class TextReply(Reply):
    """A text completion's response (/v1/completions): choices carry `text`; `echo`, the
    prompt's text when asked for, comes before each choice's reply."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model_id: str, prompt_tokens: int, seed: int | None,
                 token_bytes: list[bytes], echo: str = ""):
        super().__init__(model_id, prompt_tokens, False, seed, token_bytes)
        self.echo = echo

    def logprobs(self, result: Any) -> dict[str, Any] | None:
        """The legacy completions logprobs: tokens, their logprobs, the top alternatives of
        each (token text -> logprob) and where each token's text starts in the choice's text."""
        if getattr(result, "logprobs", None) is None:
            return None
        def spell(tid: int) -> str:
            return self.token_bytes[tid].decode("utf-8", errors="replace")

        entries, decoder, offsets, at = result.logprobs, StreamDecoder(self.token_bytes), [], 0
        for entry in entries:  # a character split across tokens starts where it is whole
            offsets.append(at)
            at += len(decoder.push(entry["id"]))
        return {"tokens": [spell(e["id"]) for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{spell(i): v for i, v in e["top"]} for e in entries],
                "text_offset": offsets}

    def choice(self, index: int, result: Any) -> dict[str, Any]:
        return {"index": index, "text": self.echo + result.text,
                "finish_reason": result.finish_reason, "logprobs": self.logprobs(result)}

    def delta(self, index: int, content: str, first: bool) -> dict[str, Any]:
        return {"index": index, "text": (self.echo if first else "") + content,
                "finish_reason": None, "logprobs": None}

    def last(self, index: int, final: dict[str, Any], finish_reason: str,
             result: Any) -> dict[str, Any]:
        return {"index": index, "text": "", "finish_reason": finish_reason,
                "logprobs": self.logprobs(result)}


async def _complete(request: Request, worker: EngineWorker, jobs: list[Job],
                    reply: Reply) -> Any:
    async def watch_disconnect() -> None:
        # the body has been read, so the next message can only be the client leaving
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for job in jobs:
            job.cancel.set()

    watcher = asyncio.create_task(watch_disconnect())
    try:  # the n choices one after another
        results = [await asyncio.wrap_future(worker.submit(job)) for job in jobs]
    except UserError as err:
        return error_response(400, str(err))
    except Cancelled:
        return error_response(400, "request cancelled")  # nobody is listening any more
    except QueueFull:
        return busy_response()
    finally:
        watcher.cancel()
    return JSONResponse({
        "id": reply.id,
        "object": reply.object,
        "created": reply.created,
        "model": reply.model,
        "choices": [reply.choice(index, result) for index, result in enumerate(results)],
        "usage": _usage(reply.prompt_tokens, results),
        "timings": results[0].timings.as_dict(),
        **reply.extra,
    })


_DONE = object()


async def _sse(
    worker: EngineWorker, jobs: list[Job], reply: Reply, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events for one request, its n choices one after another; leaving early (a
    disconnect) cancels the request."""
    results: list[Any] = []
    try:
        for index, job in enumerate(jobs):
            last = index == len(jobs) - 1
            async for event in _sse_choice(worker, job, reply, index, last, results):
                yield event
            if len(results) <= index:  # the choice failed and said so in the stream
                return
        usage, timings = _usage(reply.prompt_tokens, results), results[0].timings.as_dict()
        if include_usage:
            yield reply.chunk([], usage=usage, timings=timings, **reply.extra)
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            job.cancel.set()  # a no-op once finished; stops the engine if the client left


async def _sse_choice(worker: EngineWorker, job: Job, reply: Reply, index: int, last: bool,
                      results: list[Any]) -> AsyncIterator[str]:
    """One choice's chunks; appends its result to `results` when it finishes. The last
    choice's final chunk carries the request's usage and timings."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()

    def post(item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
            loop.call_soon_threadsafe(pieces.put_nowait, item)

    job.on_text = post
    try:
        future = worker.submit(job)
    except QueueFull:  # a later choice of n found the queue full: the status was sent already
        yield f"data: {json.dumps(busy_body())}\n\n"
        return
    future.add_done_callback(lambda _: post(_DONE))
    first = True
    held = ""  # text kept back while the reply may still be a bare tool call

    def delta(content: str) -> str:
        nonlocal first
        choice = reply.delta(index, content, first)
        first = False
        return reply.chunk([choice])

    while (piece := await pieces.get()) is not _DONE:
        if not piece:
            continue
        if reply.tools_active and (held or first):
            held += piece
            if may_be_tool_call(held):
                continue
            piece, held = held, ""
        yield delta(piece)
    try:
        result = future.result()
    except (UserError, Cancelled) as err:
        yield f"data: {json.dumps(error_body(400, str(err) or 'request cancelled'))}\n\n"
        return
    except Exception as err:  # a bug: say so in the stream, whose status was already sent
        yield f"data: {json.dumps(internal_error(err, f'streaming {reply.id}')[1])}\n\n"
        return
    calls = parse_tool_calls(held) if held else None
    if calls:
        final = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        if first:
            final = {"role": "assistant", "content": None, **final}
        finish_reason = "tool_calls"
    else:
        if held or first:
            yield delta(held)
        final, finish_reason = {}, result.finish_reason
    results.append(result)
    usage, timings = _usage(reply.prompt_tokens, results), results[0].timings.as_dict()
    yield reply.chunk([reply.last(index, final, finish_reason, result)],
                      **({"usage": usage, "timings": timings, **reply.extra} if last else {}))
