"""The `adaspark` command: a thin dispatcher.

Each subcommand lives in `adaspark/commands/<name>.py` with `configure(parser)` and
`run(args) -> int`. Only the chosen subcommand's module is imported, so `adaspark sim`
never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from adaspark.errors import UserError

# name -> (module under adaspark.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "fetch-model": ("fetch_model", "download the default model (or gemma3-270m) to the user cache"),
    "generate": ("generate", "one reply to a prompt (greedy unless --temperature)"),
    "chat": ("chat", "interactive multi-turn chat"),
    "sim": ("sim", "simulate the scheduler on a cost curve, no model"),
    "gen-data": ("gen_data", "the target's greedy replies for drafter training, batched"),
    "train-drafter": ("train_drafter", "train the DSpark drafter for a target"),
    "eval-drafter": ("eval_drafter", "evaluate a drafter on held-out prompts"),
    "export-drafter": ("export_drafter", "write a drafter in llama.cpp's dflash GGUF format"),
    "serve": ("serve", "OpenAI-compatible HTTP server"),
    "bench": ("bench", "run the paper's evaluation protocol against servers"),
    "report": ("report", "tables and figures from a bench directory"),
}


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_text) in COMMANDS.items():
        if importlib.util.find_spec(f"adaspark.commands.{module}") is not None:
            found[name] = (module, help_text)
    return found


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _available()
    parser = argparse.ArgumentParser(prog="adaspark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in commands.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in commands:
        parser.parse_args(argv)  # prints usage or the unknown-command error
        parser.print_help()
        return 2
    name = argv[0]
    module = importlib.import_module(f"adaspark.commands.{commands[name][0]}")
    cmd_parser = argparse.ArgumentParser(prog=f"adaspark {name}", description=commands[name][1])
    module.configure(cmd_parser)
    try:  # a bad option (an unknown --arm among them) is argparse's exit 2, returned
        args = cmd_parser.parse_args(argv[1:])
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"adaspark {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
