"""Host time of sampling per round, without the model: Gumbel noise per new position, and the
pick (penalties, temperature, masks, noise, max) over rows of full-vocabulary logits.

    .venv/bin/python benchmarks/sampling_overhead.py --threads 2

The engine samples one row at a time, only the rows on the accepted path, and draws each
position's noise once per request (cached while the tree returns to it), so a round costs about
(tokens it commits) x (noise per position + pick per row), as plain decoding does per token.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaspark.sampling import Sampler, SamplingParams, gumbel_noise

VOCAB = 49152


def per_call_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    counter = iter(range(10**9))
    print(f"noise per new position: "
          f"{per_call_ms(lambda: gumbel_noise(1, next(counter), VOCAB), args.repeats):.3f} ms")
    torch.manual_seed(0)
    settings = {"T 0.7": SamplingParams(temperature=0.7, seed=1),
                "T 0.7, top-p 0.9, top-k 50": SamplingParams(temperature=0.7, seed=1, top_p=0.9,
                                                            top_k=50),
                "T 0.7, penalties": SamplingParams(temperature=0.7, seed=1,
                                                   frequency_penalty=0.5, presence_penalty=0.5)}
    logits = torch.randn(1, VOCAB) * 3
    for name, params in settings.items():
        s = Sampler(params, VOCAB)
        for t in range(200):
            s.observe(t)
        s.sample(logits, [100], [[5, 6]])  # the noise is cached from here on
        ms = per_call_ms(lambda s=s: s.sample(logits, [100], [[5, 6]]), args.repeats)
        print(f"pick per row, {name}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
