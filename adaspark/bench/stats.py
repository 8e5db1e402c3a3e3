"""The paper's statistics over bench results (§4.1, Tables 3, 4, 6, 8, 10).

A comparison of arm A over arm B is the geometric mean, over the replies both served, of the
per-reply ratio of their client-clock decode speeds, with a 95% bootstrap interval that
resamples conversations (replies of one conversation share a history, so they are not
independent). A reply that reached the cap (a repetition loop under greedy decoding) in either
arm is left out of that ratio and counted; so is a reply streamed as a single delta, which has no
decode interval. AdaSpark's two runs combine into one arm whose speed on a reply is the mean of
the two (§3.4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

BAND_EDGE = 2048  # tokens of prompt plus half the reply (Table 3)
BANDS = ("under 2,048", "2,048 and over")
N_BOOT = 2000
SEED = 0

Key = tuple[str, int, int]  # (conversation, turn, reply)


@dataclass(frozen=True)
class Reply:
    arm: str
    conversation: str
    source: str
    turn: int
    reply: int
    tokens: int
    prompt_tokens: int | None
    deltas: int
    decode_s: float | None
    looped: bool
    text: str = ""

    @property
    def key(self) -> Key:
        return (self.conversation, self.turn, self.reply)

    @property
    def timed(self) -> bool:
        return self.deltas >= 2 and bool(self.decode_s)

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.decode_s if self.timed else None

    @property
    def context(self) -> float | None:
        """The context the reply was decoded at: prompt plus half the reply."""
        return None if self.prompt_tokens is None else self.prompt_tokens + self.tokens / 2


def band(context: float | None) -> str | None:
    if context is None:
        return None
    return BANDS[0] if context < BAND_EDGE else BANDS[1]


def replies_by_arm(
    records: Iterable[dict], include_capped: bool = False
) -> dict[str, dict[Key, Reply]]:
    """Reply records per arm. `include_capped` treats a reply that reached the cap as cut off
    rather than looped (for runs whose cap is below normal reply lengths)."""
    out: dict[str, dict[Key, Reply]] = {}
    for r in records:
        if r.get("kind") != "reply":
            continue
        reply = Reply(
            arm=r["arm"],
            conversation=r["conversation"],
            source=r.get("source", r["conversation"].split("/")[0]),
            turn=int(r["turn"]),
            reply=int(r.get("reply", 0)),
            tokens=int(r.get("completion_tokens") or 0),
            prompt_tokens=r.get("prompt_tokens"),
            deltas=int(r.get("deltas") or 0),
            decode_s=r.get("decode_s"),
            looped=bool(r.get("reached_cap")) and not include_capped,
            text=(r.get("reasoning") or "") + (r.get("text") or ""),
        )
        out.setdefault(reply.arm, {})[reply.key] = reply
    return out


@dataclass(frozen=True)
class MeanRun(Reply):
    """A reply's speed as the mean of two runs' speeds (AdaSpark before and after the pins)."""

    mean_tok_s: float | None = None

    @property
    def tok_s(self) -> float | None:
        return self.mean_tok_s


def mean_of_runs(first: dict[Key, Reply], second: dict[Key, Reply]) -> dict[Key, Reply]:
    """Combine two runs of one arm: mean speed where both timed it; looped if either looped."""
    out: dict[Key, Reply] = {}
    for key, a in first.items():
        b = second.get(key)
        if b is None:
            out[key] = a
            continue
        speeds = [r.tok_s for r in (a, b) if r.tok_s is not None]
        mean = float(np.mean(speeds)) if len(speeds) == 2 else None
        out[key] = MeanRun(
            arm=a.arm, conversation=a.conversation, source=a.source, turn=a.turn, reply=a.reply,
            tokens=a.tokens, prompt_tokens=a.prompt_tokens, deltas=min(a.deltas, b.deltas),
            # the decode time at the mean speed, so pooled tok/s agrees with the per-reply mean
            decode_s=a.tokens / mean if mean else None,
            looped=a.looped or b.looped, text=a.text, mean_tok_s=mean,
        )
    for key, b in second.items():
        out.setdefault(key, b)
    return out


def geomean(values: Iterable[float]) -> float:
    values = np.asarray(list(values), dtype=float)
    if values.size == 0:
        raise ValueError("geometric mean of nothing")
    if np.any(values <= 0):
        raise ValueError("geometric mean needs positive values")
    return float(np.exp(np.mean(np.log(values))))


def bootstrap_interval(
    log_values: Iterable[float],
    groups: Iterable[str],
    n_boot: int = N_BOOT,
    seed: int = SEED,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval of exp(mean log value), resampling whole groups (conversations)."""
    log_values = np.asarray(list(log_values), dtype=float)
    groups = list(groups)
    names = sorted(set(groups))
    index = {g: i for i, g in enumerate(names)}
    sums = np.zeros(len(names))
    counts = np.zeros(len(names))
    for value, group in zip(log_values, groups, strict=True):
        sums[index[group]] += value
        counts[index[group]] += 1
    draws = np.random.default_rng(seed).integers(0, len(names), size=(n_boot, len(names)))
    means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(np.exp(low)), float(np.exp(high))


@dataclass(frozen=True)
class Ratio:
    value: float | None  # None when no reply pair is left
    low: float | None
    high: float | None
    n: int  # replies the ratio rests on
    looped: int  # pairs left out because either arm reached the cap
    single_delta: int  # pairs left out because either arm streamed one delta
    conversations: int


Where = Callable[[Reply, Reply], bool]


def compare(
    numerator: dict[Key, Reply],
    denominator: dict[Key, Reply],
    where: Where | None = None,
    n_boot: int = N_BOOT,
    seed: int = SEED,
) -> Ratio:
    """Numerator arm over denominator arm, as the paper compares arms."""
    logs, groups = [], []
    looped = single = 0
    for key in sorted(numerator.keys() & denominator.keys()):
        a, b = numerator[key], denominator[key]
        if where is not None and not where(a, b):
            continue
        if a.looped or b.looped:
            looped += 1
            continue
        if a.tok_s is None or b.tok_s is None:
            single += 1
            continue
        logs.append(np.log(a.tok_s / b.tok_s))
        groups.append(key[0])
    if not logs:
        return Ratio(None, None, None, 0, looped, single, 0)
    low, high = bootstrap_interval(logs, groups, n_boot=n_boot, seed=seed)
    value = float(np.exp(np.mean(logs)))
    return Ratio(value, low, high, len(logs), looped, single, len(set(groups)))


def in_band(name: str) -> Where:
    """Both replies' mean context falls in the band (their lengths differ between arms)."""

    def where(a: Reply, b: Reply) -> bool:
        contexts = [r.context for r in (a, b) if r.context is not None]
        return bool(contexts) and band(float(np.mean(contexts))) == name

    return where


def from_source(source: str) -> Where:
    return lambda a, b: a.source == source


@dataclass(frozen=True)
class Speed:
    geomean: float | None  # geometric mean of per-reply tok/s
    pooled: float | None  # generated tokens over decode time, summed over replies (Table 4)
    n: int
    looped: int
    single_delta: int


def arm_speed(replies: dict[Key, Reply], where: Callable[[Reply], bool] | None = None) -> Speed:
    """An arm's tok/s over its own replies, leaving out its own looped and single-delta ones."""
    chosen = [r for r in replies.values() if where is None or where(r)]
    looped = sum(r.looped for r in chosen)
    kept = [r for r in chosen if not r.looped]
    timed = [r for r in kept if r.tok_s is not None]
    single = len(kept) - len(timed)
    if not timed:
        return Speed(None, None, 0, looped, single)
    pooled_pairs = [(r.tokens, r.decode_s) for r in timed if r.decode_s]
    pooled = (sum(t for t, _ in pooled_pairs) / sum(d for _, d in pooled_pairs)
              if pooled_pairs else None)
    return Speed(geomean(r.tok_s for r in timed), pooled, len(timed), looped, single)


@dataclass(frozen=True)
class Identical:
    same: int
    total: int
    same_first: int  # first reply of each conversation: shared history, isolates the verify
    total_first: int


def identical_replies(a: dict[Key, Reply], b: dict[Key, Reply]) -> Identical:
    """Replies whose text, reasoning included, is byte-identical between two arms (Table 10)."""
    keys = a.keys() & b.keys()
    same = [k for k in keys if a[k].text.encode() == b[k].text.encode()]
    first = [k for k in keys if k[1] == 0 and k[2] == 0]
    same_first = [k for k in first if k in set(same)]
    return Identical(len(same), len(keys), len(same_first), len(first))
