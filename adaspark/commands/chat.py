"""`adaspark chat`: an interactive multi-turn conversation over stdin.

Each line is a user turn; the reply streams back. The KV cache keeps the conversation, so a turn
only prefills what is new. `/reset` starts over; end of input (Ctrl-D) or `/exit` quits.
"""

from __future__ import annotations

import argparse
import sys

from adaspark.commands.generate import (
    add_generation_options,
    load_engine,
    require_chat_template,
    sampling_params,
    timing_line,
)
from adaspark.errors import UserError


def configure(parser: argparse.ArgumentParser) -> None:
    add_generation_options(parser)
    parser.add_argument("--quiet", action="store_true", help="no timing line after each reply")


def run(args: argparse.Namespace) -> int:
    sampling = sampling_params(args)
    engine = load_engine(args)
    require_chat_template(engine)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    if interactive:
        print("adaspark chat — /reset starts over, Ctrl-D or /exit quits", file=sys.stderr)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = list(system)
            engine.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})

        def stream(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        try:
            gen = engine.generate(messages, max_tokens=args.max_tokens, stop=args.stop,
                                  on_text=stream, sampling=sampling)
        except UserError as err:  # e.g. the conversation outgrew the context: keep the session
            messages.pop()
            print(f"error: {err} (try /reset)", file=sys.stderr)
            continue
        print()
        sys.stdout.flush()
        if not args.quiet:
            print(timing_line(gen), file=sys.stderr)
        messages.append({"role": "assistant", "content": gen.text})
    if interactive:
        print(file=sys.stderr)
    return 0
