"""The target's greedy replies for drafter data, many at once through continuous batching.

The engine's own step loop does the work (batch.py's Batch with `ar` Decodes: every running
reply's row in one native call a step, a finished reply's slot refilled with the next prompt at
once), so every reply is exactly the one `ar` gives that prompt alone (sequence.py: a row does
not depend on its neighbours). Replies go to reply shards (replies.py), a shard per
`shard_size` finished replies, written as they fill.

Conversations (pool.py) run turn by turn: when turn t's reply ends, turn t+1's prompt is built
from it (the reply's text, as a client would send it back) and runs next, usually in the slot
that still holds turn t, so only the new turn prefills. A conversation with a response_format
(pool.tool_calls: a call of its tools under a JSON Schema) decodes under that grammar, and its
reply is another reply than the free one to the same prompt (prompt_digest).

Resumable: the replies already in the output directory are done. A run continues each
conversation at its first missing turn (earlier turns' replies read back from the shards) and
then takes the pool's seeded order on. Stopping (the time budget, Ctrl-C) writes every finished
reply; the replies still running are dropped and run again next time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaspark.drafter.pool import Conversation
from adaspark.drafter.replies import Record, next_shard_path, read_records, write_shard
from adaspark.errors import UserError

log = logging.getLogger("adaspark.drafter")


@dataclass
class GenSettings:
    max_new: int = 256  # reply length cap
    max_prompt_tokens: int = 2048  # a turn whose prompt is longer ends its conversation there
    concurrency: int = 16  # replies decoding at once (KV slots)
    shard_size: int = 256  # replies per shard


@dataclass
class GenReport:
    records: int = 0  # replies written by this run
    reply_tokens: int = 0  # their tokens
    dropped_tokens: int = 0  # tokens of replies still running at the stop (not written)
    skipped: int = 0  # conversations ended early: a prompt over max_prompt_tokens
    failed: int = 0  # replies that failed (logged)
    seconds: float = 0.0
    stopped: str = "done"  # "done": the pool is used up; "budget": stop_now said so
    shards: list[Path] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.reply_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Job:
    conv: Conversation
    turn: int
    prompt: list[int]
    earlier: list[Record]  # the conversation's records of turns 0..turn-1
    digest: bytes  # prompt_digest(prompt)


def prompt_digest(prompt: Sequence[int], response_format: dict | None = None) -> bytes:
    """A reply's identity: its prompt, and its structure where it has one (a tool call under a
    schema and the free reply to the same prompt are two replies)."""
    h = hashlib.blake2b(np.asarray(prompt, np.int64).tobytes(), digest_size=16)
    if response_format is not None:
        h.update(json.dumps(response_format, sort_keys=True).encode())
    return h.digest()


def reply_text(tokenizer, record: Record) -> str:
    """A record's reply as the text a client sends back (the stop token is not text)."""
    ids = record.reply.tolist()
    if record.finish == "stop" and ids:
        ids = ids[:-1]
    return tokenizer.decode(ids)


class ReplyGenerator:
    """Greedy replies of `pool` (in that order) by `engine` (an `ar` Engine) into `out_dir`."""

    def __init__(self, engine, pool: Sequence[Conversation], out_dir: Path, target: dict,
                 settings: GenSettings | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.pool = list(pool)
        self.out_dir = Path(out_dir)
        self.target = target  # the fingerprint every shard carries
        self.s = settings or GenSettings()
        if engine.speculator is not None:
            raise UserError("drafter data needs plain greedy decoding: load the engine with "
                            "arm='ar'")
        need = self.s.max_prompt_tokens + self.s.max_new + 1
        if need > engine.context_length:
            raise UserError(f"max prompt tokens + max new tokens ({need}) exceed the engine's "
                            f"context of {engine.context_length}")
        done = read_records(self.out_dir, target)
        self.by_conv: dict[str, dict[int, Record]] = {}
        # every reply of this pool's conversations by its prompt (and structure): a record
        # of a conversation not in the pool has no known structure and is not reused
        self.by_prompt: dict[bytes, Record] = {}
        formats = {c.key: c.response_format for c in self.pool}
        for r in done:
            self.by_conv.setdefault(r.key, {})[r.turn] = r
            if r.key in formats:
                self.by_prompt[prompt_digest(r.tokens[:r.prompt_len], formats[r.key])] = r
        self.waiting: dict[bytes, list[Conversation]] = {}  # running prompt -> conversations
        self.stop_ids = set(self.tokenizer.stop_ids)

    # --- what runs next ----------------------------------------------------------------------

    def _next_turn(self, conv: Conversation) -> int | None:
        """The conversation's first turn without a reply, once every earlier one has one."""
        have = self.by_conv.get(conv.key, {})
        t = 0
        while t in have:
            t += 1
        return t if t < len(conv.turns) else None

    def _job(self, conv: Conversation, report: GenReport) -> _Job | None:
        """The conversation's next reply to run. A prompt answered already (the same opening
        turn in several conversations) is not run again: its reply is taken and the
        conversation goes on; one running now makes the conversation wait for it."""
        while (turn := self._next_turn(conv)) is not None:
            earlier = [self.by_conv[conv.key][t] for t in range(turn)]
            prompt = conv.prompt_ids(self.tokenizer, turn,
                                     [reply_text(self.tokenizer, r) for r in earlier])
            if len(prompt) > self.s.max_prompt_tokens:
                report.skipped += 1
                return None
            digest = prompt_digest(prompt, conv.response_format)
            answered = self.by_prompt.get(digest)
            if answered is None:
                if digest in self.waiting:  # running: this conversation goes on after it
                    self.waiting[digest].append(conv)
                    return None
                self.waiting[digest] = []
                return _Job(conv, turn, prompt, earlier, digest)
            self.by_conv.setdefault(conv.key, {})[turn] = answered
        return None

    def _take(self, report: GenReport) -> _Job | None:
        """The next reply to run: a conversation's next turn as soon as its last reply ended
        (`self.follow`), else the pool's next conversation (those begun in an earlier run
        first); None when neither has one."""
        while self.follow:
            job = self._job(self.follow.popleft(), report)
            if job is not None:
                return job
        while self.order:
            job = self._job(self.order.popleft(), report)
            if job is not None:
                return job
        return None

    # --- the loop ----------------------------------------------------------------------------

    def run(self, stop_now: Callable[[], bool] = lambda: False,
            on_shard: Callable[[GenReport], None] | None = None) -> GenReport:
        """Generate until the pool is used up or stop_now() (polled before every step) says
        stop; write every finished reply. Returns what this run added."""
        report = GenReport()
        engine, batch = self.engine, self.engine.batch
        batch.max_slots = self.s.concurrency
        self.follow: deque[Conversation] = deque()
        self.waiting = {}  # a stopped run's running prompts are not running now
        self.order = deque([c for c in self.pool if c.key in self.by_conv]
                           + [c for c in self.pool if c.key not in self.by_conv])
        running: dict[int, tuple] = {}  # id(Decode) -> (Decode, _Job)
        buffer: list[Record] = []
        start = time.perf_counter()

        def flush() -> None:
            if not buffer:
                return
            path = next_shard_path(self.out_dir)
            write_shard(path, buffer, self.target)
            report.shards.append(path)
            report.seconds = time.perf_counter() - start
            log.info("%s: %d replies, %d reply tokens; this run %d replies, %.1f tok/s",
                     path.name, len(buffer), sum(r.reply_len for r in buffer), report.records,
                     report.tok_s)
            buffer.clear()
            if on_shard is not None:
                on_shard(report)

        try:
            while True:
                if stop_now():
                    report.stopped = "budget"
                    break
                while not batch.full and (job := self._take(report)) is not None:
                    try:
                        seq = engine.new_decode(job.prompt, max_tokens=self.s.max_new,
                                                response_format=job.conv.response_format)
                    except UserError as err:  # a tool schema the grammar library refuses
                        self._failed(job, err, report)
                        continue
                    if batch.join(seq):
                        running[id(seq)] = (seq, job)
                    else:
                        self._failed(job, seq.error, report)
                if not running:  # nothing runs and nothing is left to run
                    break
                for seq in batch.step():
                    _, job = running.pop(id(seq))
                    if seq.error is not None:
                        self._failed(job, seq.error, report)
                        continue
                    record = self._record(job, seq)
                    self.by_conv.setdefault(job.conv.key, {})[job.turn] = record
                    self.by_prompt[job.digest] = record
                    self.follow.extend(self.waiting.pop(job.digest))
                    buffer.append(record)
                    report.records += 1
                    report.reply_tokens += record.reply_len
                    if job.turn + 1 < len(job.conv.turns):
                        self.follow.append(job.conv)
                    if len(buffer) >= self.s.shard_size:
                        flush()
        finally:  # a stop or Ctrl-C: what finished is written, what runs is dropped
            for seq, _job in running.values():
                report.dropped_tokens += len(seq.reply.token_ids)
                batch.drop(seq, RuntimeError("data generation stopped"))
            report.seconds = time.perf_counter() - start
            flush()
        return report

    def _record(self, job: _Job, seq) -> Record:
        reply = list(seq.reply.token_ids)
        finish = "length"
        if seq.reply.stop_token_id is not None:
            reply.append(seq.reply.stop_token_id)
            finish = "stop"
        return Record(job.conv.key, job.turn, job.conv.source,
                      np.asarray(job.prompt + reply, dtype=np.int64), len(job.prompt), finish)

    def _failed(self, job: _Job, error, report: GenReport) -> None:
        waiting = self.waiting.pop(job.digest, [])
        report.failed += 1 + len(waiting)
        log.warning("reply to %s turn %d failed (%s); its conversation ends there (and %d "
                    "more that share the prompt)", job.conv.key, job.turn, error,
                    len(waiting))
