"""The generative world the simulator decodes in: text, a drafter, and a noisy machine.

Text: each request is a token stream (prompt, then reply ending in EOS) built from fresh
passages and copies of earlier passages of the same request, so the n-gram index finds repeats.
The target's argmax after any prefix that follows the stream is the stream's next token.

Drafter: for each block position it draws a latent ease; the pick's top-K share and the
acceptance of the pick both grow with it, acceptance falls with depth and rises inside copied
text, and the confidence head reports a compressed, noisy, depth-overconfident version of it
(a head calibrated elsewhere). A rejected pick's true token is among the siblings with a
probability that grows with the siblings' mass, likelier at the larger shares.

Machine: interference is one-sided (Proposition 3's premise): most rounds run at machine time
with a small two-sided jitter, some pay an exponential delay, and rare bursts slow a run of
rounds. Every random draw is keyed by (seed, request, position or round), so arms that decode
the same requests see the same text, the same blocks and the same noise (common random numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaspark.scheduler.tree import Block

EOS = 2
JUNK = 1  # the target's argmax on rows off the stream: no candidate ever proposes it
FIRST_TOKEN = 3


@dataclass(frozen=True)
class WorldParams:
    vocab: int = 8192
    block: int = 7  # B
    topk: int = 8  # K
    requests_long_share: float = 0.3
    short_prompt: tuple[int, int] = (64, 700)
    long_prompt: tuple[int, int] = (2500, 7000)
    reply: tuple[int, int] = (300, 2500)  # reasoning replies average about 2,000 tokens
    repeat_rate: tuple[float, float] = (0.05, 0.5)  # per request: share of copied passages
    copy_length: tuple[int, int] = (6, 64)
    fresh_mean: float = 30.0
    # drafter: acceptance logit = accept_bias + accept_share * logit(share) + depth and copy terms
    ease_mean: float = 0.3
    ease_copy: float = 1.6
    ease_sd: float = 1.1
    accept_bias: float = -0.2
    accept_share: float = 1.3
    accept_depth: float = -0.25
    accept_copy: float = 0.8
    head_scale: float = 0.45  # the head sees a compressed ...
    head_bias: float = 0.8  # ... overconfident ...
    head_depth: float = 0.15  # ... increasingly so at depth ...
    head_sd: float = 0.8  # ... and noisy version of the acceptance logit
    sibling_bias: float = -0.3
    # machine
    jitter_sd: float = 0.003
    delay_share: float = 0.25
    delay_mean: float = 0.10
    burst_start: float = 0.01
    burst_mean_rounds: float = 10.0
    burst_factor: tuple[float, float] = (1.2, 1.6)
    first_round_factor: float = 1.08  # a request's first round runs cold (§3.2)


@dataclass
class Request:
    index: int
    stream: np.ndarray  # prompt + reply (ending in EOS) + random padding past the end
    prompt_length: int
    reply_length: int  # tokens to decode, EOS included
    in_copy: np.ndarray  # bool per stream position: the token continues a copied passage
    blocks: dict[str, np.ndarray]  # the drafter's block at every anchor (World.block)


def _logit(p: np.ndarray | float) -> np.ndarray | float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray | float) -> np.ndarray | float:
    return 1.0 / (1.0 + np.exp(-x))


class World:
    """Requests, drafter blocks and machine noise, all reproducible from one seed."""

    def __init__(self, seed: int = 0, params: WorldParams | None = None):
        self.seed = int(seed)
        self.p = params or WorldParams()
        ranks = np.arange(self.p.vocab - FIRST_TOKEN, dtype=float)
        weights = 1.0 / (ranks + 20.0) ** 1.1  # Zipf-like: common tokens recur, as in text
        self._token_cdf = np.cumsum(weights) / weights.sum()
        self._requests: dict[int, Request] = {}  # arms decoding the same requests share them

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, *key))

    def _fresh(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return FIRST_TOKEN + np.searchsorted(self._token_cdf, rng.random(n))

    def request(self, index: int) -> Request:
        if index not in self._requests:
            self._requests[index] = self._make_request(index)
        return self._requests[index]

    def _make_request(self, index: int) -> Request:
        p = self.p
        rng = self._rng(index, 0)
        long = rng.random() < p.requests_long_share
        prompt_length = int(rng.integers(*(p.long_prompt if long else p.short_prompt)))
        reply_length = int(rng.integers(*p.reply))
        total = prompt_length + reply_length
        repeat = rng.uniform(*p.repeat_rate)
        tokens: list[np.ndarray] = []
        copied: list[np.ndarray] = []
        length = 0
        while length < total:
            if length > 2 * p.copy_length[1] and rng.random() < repeat:
                n = int(rng.integers(*p.copy_length))
                start = int(rng.integers(0, length - n))
                flat = np.concatenate(tokens)
                seg = flat[start : start + n].copy()
                mark = np.arange(n) >= 2  # the drafter sees a copy once it has begun
            else:
                n = max(1, int(rng.geometric(1.0 / p.fresh_mean)))
                seg = self._fresh(rng, n)
                mark = np.zeros(n, dtype=bool)
            tokens.append(seg)
            copied.append(mark)
            length += n
        stream = np.concatenate(tokens)[:total]
        in_copy = np.concatenate(copied)[:total]
        stream[stream == EOS] = FIRST_TOKEN
        stream[-1] = EOS
        pad = self._fresh(rng, 2 * 64)  # past the end: rows there are never accepted
        stream = np.concatenate([stream, pad]).astype(np.int64)
        in_copy = np.concatenate([in_copy, np.zeros(len(pad), dtype=bool)])
        return Request(index=index, stream=stream, prompt_length=prompt_length,
                       reply_length=reply_length, in_copy=in_copy,
                       blocks=self._blocks(index, stream, in_copy, prompt_length - 1, total))

    def _blocks(self, index: int, stream: np.ndarray, in_copy: np.ndarray, first: int,
                last: int) -> dict[str, np.ndarray]:
        """The drafter's block at every anchor of the reply, drawn at once: a block depends only
        on (seed, request, anchor), whatever the arm decoding the request."""
        p = self.p
        B, K = p.block, p.topk
        n = last - first
        rng = self._rng(index, 1)
        at = first + 1 + np.arange(n)[:, None] + np.arange(B)  # [n, B] positions drafted
        truth = stream[at]
        copy = in_copy[at].astype(float)
        depth = np.arange(B, dtype=float)  # depth - 1
        ease = p.ease_mean + p.ease_copy * copy + p.ease_sd * rng.normal(0.0, 1.0, (n, B))
        # logits: the pick at 0, siblings below it by a gap that widens with ease
        gaps = np.logaddexp(0.0, ease)[..., None] + rng.exponential(0.7, (n, B, K - 1)).cumsum(2)
        logits = np.concatenate([np.zeros((n, B, 1)), -gaps], axis=2)
        probs = np.exp(logits)
        probs /= probs.sum(axis=2, keepdims=True)
        share = probs[..., 0]
        accept_logit = (
            p.accept_bias + p.accept_share * _logit(share) + p.accept_depth * depth
            + p.accept_copy * copy
        )
        pick_right = rng.random((n, B)) < _sigmoid(accept_logit)
        head_logit = (
            p.head_scale * accept_logit + p.head_bias + p.head_depth * depth
            + p.head_sd * rng.normal(0.0, 1.0, (n, B))
        )
        # siblings: where the pick is wrong the truth may sit among them, likelier at the
        # larger shares
        sib_odds = _sigmoid(p.sibling_bias + _logit(1.0 - share))
        sib_hit = ~pick_right & (rng.random((n, B)) < sib_odds)
        sib_share = probs[..., 1:] ** 1.5
        cdf = np.cumsum(sib_share, axis=2) / sib_share.sum(axis=2, keepdims=True)
        hit_rank = 1 + np.minimum((rng.random((n, B))[..., None] > cdf).sum(axis=2), K - 2)
        # wrong candidates: K distinct tokens, none of them the truth
        span = p.vocab - FIRST_TOKEN
        offset = rng.integers(1, span - K, (n, B))[..., None] + np.arange(K)
        topk_ids = FIRST_TOKEN + (truth[..., None] - FIRST_TOKEN + offset) % span
        topk_ids[..., 0] = np.where(pick_right, truth, topk_ids[..., 0])
        hit = np.zeros((n, B, K), dtype=bool)
        np.put_along_axis(hit, hit_rank[..., None], sib_hit[..., None], axis=2)
        topk_ids = np.where(hit, truth[..., None], topk_ids)
        return {
            "first": np.array(first),
            "topk_ids": topk_ids.astype(np.int64),
            "topk_logits": logits.astype(np.float32),
            "head": _sigmoid(head_logit).astype(np.float32),
        }

    def block(self, req: Request, anchor: int) -> Block:
        """The drafter's block after stream position `anchor` (the last committed token):
        picks[B], topk_ids[B,K] (column 0 = pick), topk_logits[B,K] (descending), head[B]."""
        blocks = req.blocks
        a = anchor - int(blocks["first"])
        if not 0 <= a < len(blocks["head"]):
            raise ValueError(f"anchor {anchor} lies outside request {req.index}'s reply")
        ids = blocks["topk_ids"][a]
        return Block(ids[:, 0], ids, blocks["topk_logits"][a], blocks["head"][a])

    def noise(self, req: Request, rounds: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-round multiplicative factors (verify, fixed cost D), one-sided above jitter."""
        p = self.p
        rng = self._rng(req.index, 2)
        jitter = 1.0 + rng.normal(0.0, p.jitter_sd, rounds)
        delay = np.where(
            rng.random(rounds) < p.delay_share, rng.exponential(p.delay_mean, rounds), 0.0
        )
        burst = np.ones(rounds)
        k = 0
        while k < rounds:
            if rng.random() < p.burst_start:
                n = int(rng.geometric(1.0 / p.burst_mean_rounds))
                burst[k : k + n] = rng.uniform(*p.burst_factor)
                k += n
            else:
                k += 1
        verify = jitter * (1.0 + delay) * burst
        fixed = (1.0 + rng.normal(0.0, p.jitter_sd, rounds)) * burst
        fixed *= 1.0 + np.where(rng.random(rounds) < p.delay_share,
                                rng.exponential(p.delay_mean, rounds), 0.0)
        verify[0] *= p.first_round_factor
        fixed[0] *= p.first_round_factor
        return verify, fixed


def target_argmax(req: Request, anchor: int, tokens: np.ndarray, depths: np.ndarray,
                  mask: np.ndarray) -> np.ndarray:
    """The target's argmax at each verified row: the stream's next token where the row's path
    (the row and its ancestors, `mask`) follows the stream, JUNK elsewhere."""
    depths = np.asarray(depths)
    follows = np.asarray(tokens) == req.stream[anchor + depths]
    follows[0] = True  # the anchor is committed text
    on_stream = ~np.any(np.asarray(mask) & ~follows[None, :], axis=1)
    return np.where(on_stream, req.stream[anchor + depths + 1], JUNK)
