"""The OpenAI-compatible routes: /v1/chat/completions and /v1/completions (SSE or not),
/v1/models, /health.

Requests are parsed and tokenised on the event loop's side; generation runs on the engine's own
thread (see worker.py), several requests at once in one batch (`parallel`, every arm), the rest
queued in arrival order; past the queue's bound a request gets 429 with Retry-After, before its
body is parsed or tokenised (checked on arrival, and again when its turn to parse comes: at most
one request per core parses, renders and tokenises at once). A request takes its place in the
queue before its prompt is tokenised and before a stream's 200 goes out, and keeps it across its n
choices, so no choice of an admitted request is ever refused; the n choices run side by side in
the batch (worker.py), a stream interleaving their chunks by index, and one that fails fails the
request (the others are cancelled). Every stream ends in `data: [DONE]`,
after an OpenAI error object when a choice failed; NaN never appears in JSON, and logprobs are
floored at LOGPROB_FLOOR (a -inf beside a tiny temperature's certain pick). Any model name
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
import os
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
from adaspark.grammar import GrammarError
from adaspark.model.tokenizer import StreamDecoder
from adaspark.sampling import shifted_seed
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
from adaspark.server.worker import Cancelled, EngineStopped, EngineWorker, Job, Place, QueueFull

MAX_BODY_BYTES = 32 << 20  # far above any prompt that fits the context; guards memory only
LOAD_FAILED = "the model failed to load; the server's log says why"
ENGINE_STOPPED = "the engine stopped after an internal error; restart the server"
LOGPROB_FLOOR = -9999.0  # the least logprob reported (vLLM's floor, which it reports for -inf)
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
            raise Unavailable(503, ENGINE_STOPPED)
        if worker.load_error is not None:  # the reason is in the server's log, not for anyone
            raise Unavailable(500, LOAD_FAILED)  # who can reach the port (/health is open)
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

    turns = app.state.turns = Turns(work_slots())

    async def admit(request: Request, model: type[GenerationRequest], prepare: Callable) -> Any:
        """A request refused while the server is full before its body is parsed or tokenised;
        else checked, prepared (`prepare(req, engine)`: prompt ids, Reply, sampling, param), and
        served under the place it took."""
        worker = app.state.worker
        if worker.full:  # nothing read yet: a saturated server spends nothing on a refusal
            return busy_response()
        # read outside the turns: a client that sends slowly would hold one; the body's bytes
        # cost no CPU to receive, and BodyLimitMiddleware holds them to MAX_BODY_BYTES
        body = await request.body()
        async with turns.turn():
            if worker.full:  # filled while this one waited for its turn
                return busy_response()
            req = parse_request(model, body)
            del body
            engine = ready_engine()
            try:
                place = worker.reserve(threading.Event())
            except QueueFull:
                return busy_response()
            try:
                prompt_ids, reply, sampling, param = await prepare(req, engine)
                grammar = await compiled_grammar(engine, req)
                jobs = choice_jobs(engine, req, prompt_ids, reply, sampling, param, place,
                                   grammar)
            except BaseException:
                place.release()
                raise
        if req.stream:  # the place is taken: nothing after the 200 can be a 429
            return PlacedStream(_sse(place, jobs, reply, req.include_usage()), place)
        with place:
            return await _complete(request, place, jobs, reply)

    @app.post("/v1/chat/completions", openapi_extra={"requestBody": openapi_body(ChatRequest)},
              responses=error_responses(400, 413, 429, 500, 503))
    async def chat_completions(request: Request):
        async def prepare(req: ChatRequest, engine: Any) -> tuple:
            if engine.tokenizer.chat_template is None:
                raise RequestError(NO_TEMPLATE, param="messages", code="no_chat_template")
            try:
                prompt_ids = await asyncio.to_thread(
                    engine.tokenizer.encode_chat, template_messages(req.messages),
                    req.active_tools())
            except UserError as err:  # e.g. a role order the chat template refuses
                raise RequestError(str(err), param="messages") from None
            sampling = req.sampling()
            reply = Reply(model_id, len(prompt_ids), req.parses_tool_calls(), sampling.seed,
                          engine.tokenizer.token_bytes)
            return prompt_ids, reply, sampling, "messages"

        return await admit(request, ChatRequest, prepare)

    @app.post("/v1/completions",
              openapi_extra={"requestBody": openapi_body(CompletionRequest)},
              responses=error_responses(400, 413, 429, 500, 503))
    async def completions(request: Request):
        async def prepare(req: CompletionRequest, engine: Any) -> tuple:
            prompt_ids, text = await asyncio.to_thread(req.prompt_ids, engine.tokenizer)
            sampling = req.sampling()
            reply = TextReply(model_id, len(prompt_ids), sampling.seed,
                              engine.tokenizer.token_bytes, echo=text if req.echo else "")
            return prompt_ids, reply, sampling, "prompt"

        return await admit(request, CompletionRequest, prepare)

    return app


def work_slots() -> int:
    """Requests parsed, rendered and tokenised at once: one per core (more would only share
    the cores, each taking longer, beside the engine thread's decoding)."""
    return len(os.sched_getaffinity(0))


class Turns:
    """At most `slots` requests at once through the CPU work before the queue (parsing,
    rendering, tokenising a body of up to MAX_BODY_BYTES); the rest wait their turn, and are
    checked against the queue again when it comes. `waiting` and `working` count them."""

    def __init__(self, slots: int):
        self._slots = asyncio.Semaphore(slots)
        self.waiting = self.working = 0

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.working += 1
        try:
            yield
        finally:
            self.working -= 1
            self._slots.release()


async def compiled_grammar(engine: Any, req: GenerationRequest) -> Any:
    """The request's response_format compiled once for its n choices (None: free text); a
    schema the library cannot compile is the client's 400."""
    if (structure := req.structured()) is None:
        return None
    try:
        return await asyncio.to_thread(engine.grammar, structure)
    except GrammarError as err:
        raise RequestError(str(err), param=err.param) from None


def choice_jobs(engine: Any, req: GenerationRequest, prompt_ids: list[int], reply: Reply,
                sampling: Any, param: str, place: Place, grammar: Any = None) -> list[Job]:
    """A checked request's jobs: its n choices, all under the request's cancel flag (one
    client: leaving cancels every choice)."""
    room = engine.context_length - len(prompt_ids)
    if room < 1:
        raise RequestError(
            f"the prompt is {len(prompt_ids)} tokens; this model's context holds "
            f"{engine.context_length}, including the reply",
            param=param,
            code="context_length_exceeded",
        )
    cap = req.token_cap()
    return [Job(prompt_ids, min(cap, room) if cap else room, req.stop_strings(), reply.id,
                cancel=place.cancel, sampling=choice_sampling(sampling, i),
                response_format=grammar)
            for i in range(req.n or 1)]


class PlacedStream(StreamingResponse):
    """A stream whose request gives its place back however the response ends, even when the
    client left before its first chunk was asked for (the generator's own cleanup never ran)."""

    def __init__(self, content: AsyncIterator[str], place: Place):
        super().__init__(content, media_type="text/event-stream")
        self.place = place

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.place.cancel.set()  # a no-op once its jobs finished; else the client left
            self.place.release()


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


def floored(logprob: float) -> float:
    """A logprob as JSON carries it, at least LOGPROB_FLOOR (vLLM's rule): -inf (no
    probability at all, e.g. beside a tiny temperature's top token) as the floor; NaN stays,
    and fails loudly as the bug it is."""
    return max(logprob, LOGPROB_FLOOR) if logprob == logprob else logprob


def busy_response() -> JSONResponse:
    """429 with Retry-After: the queue holds as many requests as it may (the only answer a
    full server gives: an admitted request's choices never find it full)."""
    body = error_body(429, "the server is busy: too many requests are waiting; retry shortly",
                      code="rate_limit_exceeded")
    return JSONResponse(body, status_code=429, headers={"Retry-After": str(RETRY_AFTER_S)})


def choice_sampling(sampling: Any, index: int) -> Any:
    """Choice `index` of n: its own seed, so the n samples differ and each can be reproduced."""
    return sampling if index == 0 or sampling.seed is None else \
        replace(sampling, seed=shifted_seed(sampling.seed, index))


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
        return _event({"id": self.id, "object": self.chunk_object, "created": self.created,
                       "model": self.model, "choices": choices, **extra})

    def logprobs(self, result: Any) -> dict[str, Any] | None:
        """OpenAI's logprobs object for a reply's tokens, or None when not asked for."""
        if getattr(result, "logprobs", None) is None or self.token_bytes is None:
            return None

        def token(tid: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes[tid]
            return {"token": raw.decode("utf-8", errors="replace"),
                    "logprob": floored(logprob), "bytes": list(raw)}

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
                "token_logprobs": [floored(e["logprob"]) for e in entries],
                "top_logprobs": [{spell(i): floored(v) for i, v in e["top"]} for e in entries],
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


async def _complete(request: Request, place: Place, jobs: list[Job], reply: Reply) -> Any:
    async def watch_disconnect() -> None:
        # the body has been read, so the next message can only be the client leaving
        while (await request.receive())["type"] != "http.disconnect":
            pass
        place.cancel.set()

    watcher = asyncio.create_task(watch_disconnect())
    try:  # the n choices side by side in the batch, under the request's one place
        results = await _choices(place, jobs)
    except UserError as err:
        return error_response(400, str(err))
    except Cancelled:
        return error_response(400, "request cancelled")  # nobody is listening any more
    except EngineStopped:  # the cause is in the log, not for the client
        return error_response(503, ENGINE_STOPPED)
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


async def _choices(place: Place, jobs: list[Job]) -> list[Any]:
    """Every choice's result, all submitted at once; the first choice to fail fails the
    request: the others are cancelled (their slots free at the next step) and its error
    raised."""
    futures = [asyncio.wrap_future(place.submit(job)) for job in jobs]
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        if not all(_succeeded(f) for f in futures):
            place.cancel.set()  # failed, or the wait itself was cancelled (the client left)
    errors = [f.exception() for f in futures
              if f.done() and not f.cancelled() and f.exception() is not None]
    if errors:  # a choice's own error rather than the cancellation it caused in the others
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
    return [f.result() for f in futures]


def _succeeded(future: asyncio.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


_DONE = object()


def _event(body: dict[str, Any]) -> str:
    """One server-sent event; NaN or infinity is an error here, never bare in the JSON."""
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


async def _sse(place: Place, jobs: list[Job], reply: Reply,
               include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events for one request, its n choices side by side in the batch, their
    chunks interleaved as the engine makes them (each with its choice's `index`); every stream
    ends in `data: [DONE]`, after an OpenAI error object when a choice failed (the others are
    then cancelled: the request fails whole). Leaving early (a disconnect) cancels the request
    (PlacedStream)."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()

    def poster(index: int) -> Callable[[Any], None]:
        def post(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: shutting down
                loop.call_soon_threadsafe(pieces.put_nowait, (index, item))
        return post

    choices = [_StreamedChoice(reply, index) for index in range(len(jobs))]
    futures = []
    for index, job in enumerate(jobs):
        job.on_text = poster(index)
        futures.append(place.submit(job))
        futures[-1].add_done_callback(lambda _, post=job.on_text: post(_DONE))
    results: dict[int, Any] = {}
    try:
        while len(results) < len(jobs):
            index, piece = await pieces.get()
            choice = choices[index]
            if piece is not _DONE:
                if (event := choice.text(piece)) is not None:
                    yield event
                continue
            try:
                result = futures[index].result()
            except (UserError, Cancelled) as err:
                place.cancel.set()  # the request fails whole: its other choices end
                yield _event(error_body(400, str(err) or "request cancelled"))
                break
            except EngineStopped:
                place.cancel.set()
                yield _event(error_body(503, ENGINE_STOPPED))
                break
            results[index] = result
            extra = {}
            if len(results) == len(jobs):  # the last choice to end: the request's usage
                usage = _usage(reply.prompt_tokens, [results[i] for i in sorted(results)])
                extra = {"usage": usage, "timings": results[0].timings.as_dict(),
                         **reply.extra}
            for event in choice.finish(result, **extra):
                yield event
        else:
            if include_usage:
                yield reply.chunk([], **extra)
    except Exception as err:  # a bug: say so in the stream, whose status was already sent
        place.cancel.set()
        yield _event(internal_error(err, f"streaming {reply.id}")[1])
    yield "data: [DONE]\n\n"


class _StreamedChoice:
    """One choice's chunks in a stream: its first delta says the role (chat), and while its
    reply may still be a bare tool call (tools active) its text is held back."""

    def __init__(self, reply: Reply, index: int):
        self.reply, self.index = reply, index
        self.first, self.held = True, ""

    def _delta(self, content: str) -> str:
        choice = self.reply.delta(self.index, content, self.first)
        self.first = False
        return self.reply.chunk([choice])

    def text(self, piece: str) -> str | None:
        """The chunk for a piece of new text, or None while nothing may go out yet."""
        if not piece:
            return None
        if self.reply.tools_active and (self.held or self.first):
            self.held += piece
            if may_be_tool_call(self.held):
                return None
            piece, self.held = self.held, ""
        return self._delta(piece)

    def finish(self, result: Any, **extra: Any) -> list[str]:
        """The choice's last chunks: what was held back (its tool calls, or its text), then
        why it ended (with `extra`: the request's usage, on the last choice to end)."""
        events = []
        calls = parse_tool_calls(self.held) if self.held else None
        if calls:
            final = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
            if self.first:
                final = {"role": "assistant", "content": None, **final}
            finish_reason = "tool_calls"
        else:
            if self.held or self.first:
                events.append(self._delta(self.held))
            final, finish_reason = {}, result.finish_reason
        events.append(self.reply.chunk(
            [self.reply.last(self.index, final, finish_reason, result)], **extra))
        return events
