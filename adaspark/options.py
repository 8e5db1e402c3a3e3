"""The options that say which model an engine loads and how it decodes, parsed once.

`add_model_options` gives `generate`, `chat`, `serve` and the benchmarks one set of flags;
`ModelOptions.from_args` turns them into one value that Engine.load, load_speculator and the
learned store read. `--arm` is parsed by its type (a misspelt arm fails before anything loads).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from pathlib import Path

from adaspark.errors import UserError
from adaspark.scheduler.arm import Arm


def arm_type(text: str) -> Arm:
    """argparse type for --arm: `adaspark,gate` and `adaspark+gate` are the same arm."""
    try:
        return Arm.parse(text)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


@dataclass(frozen=True)
class ModelOptions:
    model: str | Path | None = None  # a GGUF path (None: the embedded default)
    precision: str = "fast"  # fast: packed kernels; reference: float32 (validation)
    device: str = "cpu"
    arm: Arm | None = None  # None: speculative.DEFAULT_ARM when a drafter exists, else
    # speculative.NO_DRAFTER_ARM (ngram)
    drafter: str | Path | None = None  # a checkpoint directory (None: the shipped one)
    store: str | Path | None = None  # the learned store's directory (None: the user cache)
    fresh: bool = False  # start from an empty learned store (it is still saved)
    round_log: str | Path | None = None  # a JSONL file, one line per round (record.py)

    def __post_init__(self) -> None:
        if isinstance(self.arm, str):
            object.__setattr__(self, "arm", Arm.parse(self.arm))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes) -> ModelOptions:
        """The options add_model_options() added, from parsed arguments."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **changes})

    def but(self, **changes) -> ModelOptions:
        return replace(self, **changes)


def add_model_options(parser: argparse.ArgumentParser, model_default: str | None = None) -> None:
    """The flags of ModelOptions, shared by every command that loads a model and decodes."""
    parser.add_argument("--model", metavar="PATH", default=model_default,
                        help="a local GGUF (llama, qwen2, qwen3); default: the embedded SmolLM2")
    parser.add_argument("--precision", choices=("fast", "reference"), default="fast",
                        help="fast: packed 4/8-bit kernels; reference: float32 (validation)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--arm", metavar="ARM", type=arm_type,
                        help="decoding arm: ar, chain3, chain, tree:N, cost, adaspark, "
                             "adaspark:N, ngram (n-gram trees from the request's own text, "
                             "no drafter), with modifiers after ',' or '+' (plain: width-1 plain "
                             "rounds, gate: the draft gate and a paced cold start, ladder: "
                             "the gate without the pacing, classes: kernel-class widths; "
                             "default: adaspark,gate when a drafter exists for the model, "
                             "else ngram)")
    parser.add_argument("--drafter", metavar="DIR",
                        help="drafter checkpoint, refused unless trained for this model "
                             "file (default: the shipped one for the model)")
    parser.add_argument("--store", metavar="DIR",
                        help="learned store directory (default: the user cache)")
    parser.add_argument("--fresh", action="store_true",
                        help="start from an empty learned store (it is still saved)")
    parser.add_argument("--round-log", metavar="FILE",
                        help="append one JSON line per decoding round")
