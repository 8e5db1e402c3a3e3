"""The picks of a reply under a grammar (grammar.py), exact under tree speculation.

Plain decoding under a grammar takes, at each position, the target's argmax (or its seeded
Gumbel-max sample, sampling.py) over the tokens the grammar allows after the reply so far. A
verified tree row stands at the end of its own path (the committed tokens, then its ancestors'),
so its pick is taken under the grammar state of that path: path_picks walks the rows the accept
walk will take, one at a time as sample_path does, advancing one state over each pick; the walk
reads no other row (they stay -1). So every row the walk reads is picked as plain decoding would
pick it there, and the reply equals `ar`'s under the same grammar token for token, on every arm.

The state advances over every pick, the last one (the bonus) included, except a stop token,
which ends the reply: after a step the state stands where the reply's next pick is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from adaspark.grammar import GrammarState
from adaspark.sampling import Sampler


def masked(logits_row: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """A float32 copy of one row of logits [vocab] with the tokens the grammar forbids at -inf."""
    return torch.where(torch.from_numpy(allowed), logits_row.float(), -torch.inf)


def pick(state: GrammarState, sampler: Sampler | None, logits_row: torch.Tensor,
         position: int, path: Sequence[int] = (), top: int | None = None) -> tuple[int, Any]:
    """The token at absolute `position` under `state` (which then advances over it): the masked
    row's argmax, or its sample; path: the tokens before it not yet in the reply (a tree row's
    ancestors), which the penalties count; top: the row's argmax where the forward already took
    it (the head's, lowest id among equal maxima as torch's: a torch argmax over the vocabulary
    costs ~30 us, about a matcher step). Returns (token, the row for Sampler.record: the
    adjusted target distribution before the mask, as logprobs report it; None when greedy)."""
    if sampler is None:
        top = int(logits_row.argmax()) if top is None else int(top)
        # the row's first maximum is legal, so it is also the masked row's first maximum:
        # one token's step instead of the vocabulary's mask (greedy replies in a grammar
        # mostly follow it; a stop token's legality is the mask's to say)
        if top not in state.stop_ids and state.take(top):
            return top, None
        x = np.where(state.allowed(), logits_row.float().cpu().numpy(), -np.inf)
        token = int(x.argmax())  # numpy's first maximum, as torch's
        state.advance(token)
        return token, None
    paths = [list(path)] if sampler.params.penalised else None
    picks, _ = sampler.sample(masked(logits_row, state.allowed())[None], [position], paths)
    token = int(picks[0])
    adjusted = sampler.adjusted(logits_row[None], paths)[0] if sampler.params.logprobs else None
    state.advance(token)
    return token, adjusted


def path_picks(state: GrammarState, sampler: Sampler | None, logits: torch.Tensor, plan: Any,
               start: int, argmax: np.ndarray | None = None) -> tuple[np.ndarray, dict[int, Any]]:
    """Each row's pick along the path the accept walk takes (Plan.walk, as
    speculative.sample_path, under the grammar): a row at depth d picks position start + d + 1
    under the state after its ancestors' tokens. Returns the picks [rows] (-1 off the path)
    and the rows for Sampler.record by row; `state` ends after the last pick. argmax: each
    row's argmax [rows] as the forward took it (None: taken here)."""
    return plan.walk(lambda row, path: pick(state, sampler, logits[row],
                                            start + int(plan.depths[row]) + 1, path,
                                            None if argmax is None else argmax[row]))
