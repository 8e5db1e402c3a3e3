"""`adaspark export-drafter`: a drafter this engine holds (ours, a llama.cpp GGUF, a DeepSpec
folder) written in another engine's format; today llama.cpp's `dflash` drafter GGUF, which
`llama-server --spec-draft-model OUT --spec-type draft-dspark` runs beside the same target
GGUF (docs/drafter-formats.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

FORMATS = ("gguf",)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT", help="the file to write")
    p.add_argument("--format", choices=FORMATS, default="gguf",
                   help="gguf: llama.cpp's dflash drafter with a DSpark Markov head")
    p.add_argument("--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="drafter to export: our checkpoint folder, a DeepSpec "
                   "folder or a dflash GGUF (default: the shipped one)")
    p.add_argument("--mask-token-id", type=int, help="the token whose row of the drafter's "
                   "own table holds a learned mask vector (default: the last control or unused "
                   "token no reply writes)")


def run(args) -> int:
    from adaspark.drafter.export import export_gguf
    from adaspark.drafter.loading import default_drafter_for, load_model, target_info
    from adaspark.errors import UserError
    from adaspark.model.gguf import read_gguf
    from adaspark.model.sources import resolve_model
    from adaspark.model.transformer import Transformer

    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"{out} is a directory; OUT names the GGUF file to write")
    model_path = resolve_model(args.model)
    target = Transformer(read_gguf(model_path), precision="reference")
    info = target_info(target, model_path)
    drafter = Path(args.drafter) if args.drafter else default_drafter_for(info)
    model = load_model(target, info, drafter)
    if args.mask_token_id is not None and not 0 <= args.mask_token_id < target.config.vocab_size:
        raise UserError(f"--mask-token-id {args.mask_token_id} is outside the vocabulary")
    export_gguf(model, model_path, out, args.mask_token_id)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): llama-server -m {model_path} "
          f"--spec-draft-model {out} --spec-type draft-dspark")
    return 0
