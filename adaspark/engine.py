"""The decode loop: chat messages in, a reply out (greedy or sampled), with stops, streaming and
timing.

One `Engine` owns a target `Transformer` (its KV cache holds the conversation so far) and the
model's `Tokenizer`. A request renders the messages through the chat template, reuses the cached
prefix it shares with the previous request, prefills the rest, then decodes. Every arm decodes
step by step in batch.py's `Batch`: a request alone here is a batch of one, the server runs
several in the same loop. Plain decoding (`ar`) is sequence.py's `Decode`, the 1-row case of
the target's verify path (row at depth 0, then commit it); a speculative arm is
speculative.py's `RoundDecode`, one round of the paper's Algorithm 1 a step (each slot with its
own drafter). Both push into request.py's `Reply`, which applies every stop (stop token, stop
string, max tokens) token by token, so a round that accepts several tokens at once stops at
exactly the same place. Sampling (sampling.py) replaces each row's argmax by its position-keyed
Gumbel-max pick; greedy requests never build a Sampler.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from adaspark.batch import Batch
from adaspark.cached import CachedTokens
from adaspark.errors import UserError
from adaspark.grammar import Grammar, GrammarCompiler, ResponseFormat
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.options import ModelOptions
from adaspark.request import Generation, Reply, TextCallback, Timing
from adaspark.sampling import Sampler, SamplingParams
from adaspark.sequence import Decode, StopRequest
from adaspark.speculative import RoundDecode, Speculator, load_speculator

__all__ = ["Engine"]


class Engine:
    """A target model, its tokenizer, and the conversation held in its KV cache."""

    def __init__(self, target: Any, tokenizer: Tokenizer, model_path: Path | None = None,
                 speculator: Speculator | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.speculator = speculator  # None: plain decoding (the `ar` arm)
        self._grammars: GrammarCompiler | None = None  # built on the first response_format
        # the tokens whose K/V sit in target.cache (and the drafter's): their one owner
        self.cache = CachedTokens(target, speculator.drafter if speculator else None)
        # the running requests (every arm's), the engine's own cache their first slot; the
        # server lets several run at once (max_slots), a request alone runs by itself
        self.batch = Batch(target, self.cache, self.context_length)
        if speculator is not None:  # the shared row budget; the shared call's time
            self.batch.before_plan = speculator.price_step
            self.batch.before_verify = speculator.share_rows
            self.batch.after_verify = speculator.learn_shared_verify
        if speculator is not None and speculator.drafter is not None:
            # every further slot drafts on its own drafter; every verify taps their layers
            self.batch.new_drafter = speculator.drafter.fork
            self.batch.tap_layers = speculator.tap_layers

    @classmethod
    def load(cls, model: str | Path | None = None, options: ModelOptions | None = None, *,
             max_context: int | None = None, **changes) -> Engine:
        """Engine for `model` (a GGUF path; None: options.model, else the embedded default)
        with `options` (options.py), any field of which `changes` may set (arm="ar")."""
        from adaspark.model.gguf import read_gguf
        from adaspark.model.transformer import Transformer

        options = (options or ModelOptions()).but(**changes)  # a misspelt arm fails here
        path = resolve_model(model if model is not None else options.model)
        gguf = read_gguf(path)  # parsed once, for the weights and the tokenizer
        # the tokenizer first: its build's transient peak then comes before the packed weights
        tokenizer = Tokenizer.from_gguf(gguf)
        # its vocabulary lists (tokens, merges, types, scores) are the tokenizer's own copies
        # now: let the file's go before the weights are packed (a few MiB of the load's peak)
        for key in [k for k, v in gguf.metadata.items()
                    if k.startswith("tokenizer.ggml.") and isinstance(v, list)]:
            del gguf.metadata[key]
        target = Transformer(gguf, precision=options.precision, device=options.device,
                             max_context=max_context)
        if target.native_note:  # one line: the engine runs, more slowly
            print(f"adaspark: native forward not used ({target.native_note}); "
                  "the torch path runs", file=sys.stderr)
        speculator = load_speculator(target, path, tokenizer.stop_ids, options)
        return cls(target, tokenizer, path, speculator)

    @property
    def forward(self) -> str:
        """Which forward the target runs: native-<instruction set> or torch-<device>. Benchmarks
        record it, so that arms run on different forwards are never compared by accident."""
        isa = getattr(self.target, "native_isa", None)
        device = getattr(getattr(self.target, "device", None), "type", "cpu")
        return f"native-{isa}" if isa else f"torch-{device}"

    @property
    def context_length(self) -> int:
        capacity = getattr(self.target.cache, "capacity", None)
        return int(capacity if capacity is not None else self.target.config.context_length)

    def reset(self) -> None:
        """Forget the conversation (the next request prefills from scratch)."""
        self.cache.reset()
        for slot in self.batch.slots:
            slot.reset()

    def generate(self, prompt: Sequence[Mapping[str, Any]] | Sequence[int], *,
                 tools: Sequence[Mapping[str, Any]] | None = None, max_tokens: int = 256,
                 stop: Sequence[str] = (), on_text: TextCallback | None = None,
                 should_stop: StopRequest | None = None,
                 request_id: str | None = None,
                 sampling: SamplingParams | None = None,
                 response_format: ResponseFormat | Mapping | Grammar | None = None
                 ) -> Generation:
        """Reply to chat messages (role/content dicts, rendered through the chat template with
        `tools`) or to prompt token ids already rendered. `on_text` receives the reply text as
        it is decoded; `should_stop` is polled between forwards to cancel; sampling: None or
        temperature 0 is greedy."""
        if prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            ids = self.tokenizer.encode_chat(prompt, tools=tools)
        return self.generate_ids(ids, max_tokens=max_tokens, stop=stop, on_text=on_text,
                                 should_stop=should_stop, request_id=request_id,
                                 sampling=sampling, response_format=response_format)

    def generate_ids(self, prompt: Sequence[int], *, max_tokens: int = 256,
                     stop: Sequence[str] = (), on_text: TextCallback | None = None,
                     should_stop: StopRequest | None = None,
                     request_id: str | None = None,
                     sampling: SamplingParams | None = None,
                     response_format: ResponseFormat | Mapping | Grammar | None = None
                     ) -> Generation:
        """Continuation of prompt token ids (the chat template already applied), greedy unless
        `sampling` says otherwise; response_format: the reply's structure (grammar.py). request_id
        names the request in the round log. Every arm runs as a batch of one (batch.py): not
        while a server drives the batch."""
        seq = self.new_decode(prompt, max_tokens=max_tokens, stop=stop, on_text=on_text,
                              should_stop=should_stop, request_id=request_id, sampling=sampling,
                              response_format=response_format)
        try:
            if self.batch.add(seq):
                while not seq.finished:
                    self.batch.step()
        except BaseException as err:  # e.g. Ctrl-C: the next request starts clean
            self.batch.drop(seq, err)
            raise
        if seq.error is not None:
            raise seq.error
        return self.result(seq)

    def new_decode(self, prompt: Sequence[int], *, max_tokens: int = 256,
                   stop: Sequence[str] = (), on_text: TextCallback | None = None,
                   should_stop: StopRequest | None = None, request_id: str | None = None,
                   sampling: SamplingParams | None = None,
                   response_format: ResponseFormat | Mapping | Grammar | None = None) -> Decode:
        """A request checked and ready to start (generate_ids' arguments)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise UserError("empty prompt")
        if max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {max_tokens}")
        if len(prompt) > self.context_length:
            raise UserError(f"prompt is {len(prompt)} tokens, longer than the model's context "
                            f"of {self.context_length}")
        sampler = None
        if sampling is not None and not sampling.check().greedy:
            sampler = Sampler(sampling, self.target.config.vocab_size)
        grammar = self.grammar(response_format)
        parts = (prompt, Reply(self.tokenizer, max_tokens, stop, on_text),
                 Timing(prompt_tokens=len(prompt)), sampler, should_stop, request_id)
        state = None if grammar is None else grammar.start()  # each reply its own
        if self.speculator is not None:  # a round a batch step
            return RoundDecode(self.speculator, *parts, grammar=state)
        return Decode(*parts, grammar=state)

    def grammar(self, response_format: ResponseFormat | Mapping | Grammar | None
                ) -> Grammar | None:
        """The compiled grammar of a response_format (OpenAI's object, a ResponseFormat, or
        one compiled already); None for plain text. GrammarError names what it cannot serve."""
        if response_format is None or isinstance(response_format, Grammar):
            return response_format
        if not isinstance(response_format, ResponseFormat):
            response_format = ResponseFormat.parse(response_format)
            if response_format is None:
                return None
        if self._grammars is None:  # the vocabulary's side once (~0.1 s), the logits' width
            self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer,
                                                           self.target.config.vocab_size)
        return self._grammars.compile(response_format)

    @staticmethod
    def result(seq: Decode) -> Generation:
        """The finished request's reply."""
        sampler, reply = seq.sampler, seq.reply
        logprobs = None
        if sampler is not None and sampler.params.logprobs:  # a stop token gets no entry
            logprobs = sampler.logprobs[:len(reply.token_ids)]
        return Generation(text=reply.text, token_ids=reply.token_ids,
                          prompt_token_ids=seq.prompt,
                          finish_reason=reply.finish_reason or "length",
                          stop_token_id=reply.stop_token_id, timings=seq.timing,
                          seed=sampler.seed if sampler is not None else None,
                          logprobs=logprobs)
