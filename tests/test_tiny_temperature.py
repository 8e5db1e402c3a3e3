"""Temperatures far below 1 (issue 40): logits over a tiny T overflow float32 (and T itself rounds
to 0 below ~1.4e-45); the pick must still be the argmax, a draw from softmax(logits / T), and
the logprobs finite or -inf, never NaN. Ordinary temperatures keep their exact bits."""

from __future__ import annotations

import math

import pytest
import torch

from adaspark.sampling import Sampler, SamplingParams, over_temperature

LOGITS = torch.tensor([[2.0, 1.5, 2.5, 0.3, -40.0, 25.0, -1.0, 24.999998]])


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 1e-46, 5e-324])
def test_a_tiny_temperature_picks_the_argmax_with_logprobs_not_nan(temperature):
    for seed in range(50):
        params = SamplingParams(temperature=temperature, seed=seed, logprobs=True,
                                top_logprobs=4, top_p=0.9, top_k=5)
        sampler = Sampler(params, LOGITS.shape[1])
        picks, x = sampler.sample(LOGITS, [3])
        assert int(picks[0]) == 5
        assert not torch.isnan(x).any() and not torch.isposinf(x).any()
        sampler.record(x[0], int(picks[0]))
        entry = sampler.logprobs[0]
        assert entry["logprob"] == 0.0  # certain at this temperature
        assert all(not math.isnan(v) and v <= 0.0 for _, v in entry["top"])


def test_ordinary_temperatures_keep_the_plain_divisions_bits():
    for temperature in (0.7, 1.0, 1e-3, 2.0):
        assert torch.equal(over_temperature(LOGITS, temperature), LOGITS / temperature)


def test_only_the_row_that_overflows_is_shifted():
    rows = torch.cat([LOGITS, torch.zeros(1, LOGITS.shape[1])])
    y = over_temperature(rows, 1e-40)
    assert torch.equal(y[1], torch.zeros(LOGITS.shape[1]))  # 0 / T: finite, kept
    assert y[0, 5] == 0.0 and torch.isneginf(y[0, [0, 1, 2, 3, 4, 6]]).all()
    # the runner-up, 2e-6 below the top, is at -2e34, finite in float32: still no chance
    assert -1e35 < y[0, 7] < -1e33
