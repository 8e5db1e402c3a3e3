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
    fresh: bool = False  # start from an empty learned store (saved; the old one set aside)
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


# A few words on each of Arm's names for --help; the names themselves come from Arm.BASES and
# Arm.MODIFIERS, so a new arm is listed even before it has words here.
ARM_NOTES = {
    "ar": "plain decoding",
    "chain3": "a drafter chain of at most 3, llama.cpp's default",
    "chain": "the drafter's whole block as a chain",
    "tree:N": "N rows, head-based acceptance",
    "cost": "cost-model width, head-based acceptance",
    "adaspark": "the paper's arm",
    "adaspark:N": "its width pinned to N",
    "ngram": "n-gram trees from the request's own text, no drafter",
    "ngram:N": "its width pinned to N",
}
MODIFIER_NOTES = {
    "head": "head-based acceptance",
    "no-ngram": "no n-gram fill",
    "ratio": "the per-round ratio rule",
    "no-hysteresis": "no hysteresis in the chooser",
    "plain": "width-1 plain rounds",
    "gate": "the draft gate and a paced cold start",
    "classes": "kernel-class widths",
    "ladder": "the gate without the pacing",
}


def _named(names, notes: dict[str, str]) -> str:
    return ", ".join(f"{n} ({notes[n]})" if n in notes else n for n in names)


def arm_help() -> str:
    """--arm's help: every base and modifier Arm.parse takes."""
    return (f"decoding arm: {_named(Arm.BASES, ARM_NOTES)}; modifiers after ',' or '+': "
            f"{_named(Arm.MODIFIERS, MODIFIER_NOTES)}; ngram takes only "
            f"{', '.join(Arm.NGRAM_MODIFIERS)}")


def model_help() -> str:
    """--model's help, from the tables the loader checks: the architectures it builds
    (config.ARCHITECTURES) and the tensor types it reads (gguf.SUPPORTED_TYPES), those the
    native forward packs (native.PACKABLE) apart from those it runs on the torch path."""
    from adaspark.model.config import ARCHITECTURES
    from adaspark.model.gguf import SUPPORTED_TYPES
    from adaspark.model.native import PACKABLE

    def names(types) -> str:
        return ", ".join(t.name for t in sorted(types))

    native = SUPPORTED_TYPES & set(PACKABLE)
    torch_only = SUPPORTED_TYPES - native
    text = (f"a local GGUF; architectures: {', '.join(ARCHITECTURES)}; tensor types: "
            f"{names(native)} (native)")
    if torch_only:
        text += f", {names(torch_only)} (dequantised, torch path)"
    return text + "; default: the embedded SmolLM2"


def add_model_options(parser: argparse.ArgumentParser, model_default: str | None = None) -> None:
    """The flags of ModelOptions, shared by every command that loads a model and decodes."""
    parser.add_argument("--model", metavar="PATH", default=model_default, help=model_help())
    parser.add_argument("--precision", choices=("fast", "reference"), default="fast",
                        help="fast: the packed kernels on the file's own types; reference: "
                             "float32 (validation)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--arm", metavar="ARM", type=arm_type,
                        help=arm_help() + "; default: adaspark,gate when a drafter exists for "
                             "the model, else ngram")
    parser.add_argument("--drafter", metavar="PATH",
                        help="drafter: our checkpoint folder (refused unless trained for this "
                             "model file), a llama.cpp dflash GGUF or a DeepSpec folder "
                             "(checked against the model; docs/drafter-formats.md); default: "
                             "the shipped one for the model")
    parser.add_argument("--store", metavar="DIR",
                        help="learned store directory (default: the user cache)")
    parser.add_argument("--fresh", action="store_true",
                        help="start from an empty learned store (it is still saved; the "
                             "previous one is set aside as <store>.replaced-<time>)")
    parser.add_argument("--round-log", metavar="FILE",
                        help="append one JSON line per decoding round")
