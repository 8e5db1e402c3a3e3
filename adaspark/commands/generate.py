"""`adaspark generate`: one chat reply to a prompt (greedy, or sampled with --temperature),
streamed or as JSON; with --raw, the prompt's text continued as it is (no chat template)."""

from __future__ import annotations

import argparse
import json
import sys

from adaspark.engine import Engine
from adaspark.errors import UserError
from adaspark.options import ModelOptions, add_model_options
from adaspark.request import Generation
from adaspark.sampling import SamplingParams


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    """The model's options (options.py) and a reply's: system prompt, cap, stops, sampling."""
    add_model_options(parser)
    parser.add_argument("--system", metavar="TEXT", help="system prompt")
    parser.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                        help="most reply tokens (default 256)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop string (repeatable); the reply ends before it")
    sampling = parser.add_argument_group(
        "sampling", "position-keyed Gumbel-max: a seed gives the same reply on every arm")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="0 (default) is greedy; up to 2")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="sample from the likeliest tokens holding mass P (0, 1]")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K",
                          help="sample from the K likeliest tokens (0: all)")
    sampling.add_argument("--seed", type=int, metavar="N",
                          help="noise seed (default: drawn, and printed with the reply)")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                          help="subtract X per earlier use of a token in the reply [-2, 2]")
    sampling.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                          help="subtract X from every token already in the reply [-2, 2]")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling options, checked (a SamplingError, a UserError, names a bad one)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty).check()


def load_engine(args: argparse.Namespace) -> Engine:
    return Engine.load(options=ModelOptions.from_args(args))


def require_chat_template(engine: Engine) -> None:
    """A model without a chat template (a base model) cannot chat: say what it can do."""
    if engine.tokenizer.chat_template is None:
        raise UserError("this model has no chat template (no tokenizer.chat_template in its "
                        "GGUF), so it cannot chat: continue raw text with `adaspark generate "
                        "--raw --prompt TEXT` (or the server's /v1/completions)")


def timing_line(gen: Generation) -> str:
    t = gen.timings
    return (f"[{len(gen.prompt_token_ids)} prompt tokens ({t.reused_tokens} reused), prefill "
            f"{t.prefill_s * 1000:.0f} ms; {len(gen.token_ids)} reply tokens, decode "
            f"{t.decode_tok_s:.1f} tok/s; {gen.finish_reason}"
            + (f"; {t.draft_rounds} draft + {t.ngram_rounds} n-gram + {t.plain_rounds} plain "
               f"rounds, mean width {t.mean_width:.1f}, {t.accepted_tokens} drafted tokens "
               f"accepted" if t.draft_rounds + t.ngram_rounds else "")
            + (f"; seed {gen.seed}]" if gen.seed is not None else "]"))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, metavar="TEXT",
                        help="the user message (rendered through the model's chat template), or "
                             "with --raw the text to continue")
    parser.add_argument("--raw", action="store_true",
                        help="continue the prompt's text as it is: no chat template (a base "
                             "model; what the server's /v1/completions does)")
    add_generation_options(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, ids, timing) instead of streaming")


def run(args: argparse.Namespace) -> int:
    sampling = sampling_params(args)  # a bad value fails before the model loads
    if args.raw and args.system:
        raise UserError("--system is a chat message: not with --raw (put it in the prompt)")
    engine = load_engine(args)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    gen = engine.generate_ids(prompt_ids(engine, args), max_tokens=args.max_tokens,
                              stop=args.stop, on_text=None if args.json else stream,
                              sampling=sampling)
    if args.json:
        print(json.dumps({
            "text": gen.text, "token_ids": gen.token_ids,
            "prompt_token_ids": gen.prompt_token_ids, "finish_reason": gen.finish_reason,
            "stop_token_id": gen.stop_token_id, "decode_tok_s": gen.timings.decode_tok_s,
            "timings": gen.timings.as_dict(), "model": str(engine.model_path),
            "precision": args.precision,
            "arm": engine.speculator.arm if engine.speculator is not None else "ar",
            "forward": engine.forward, "raw": args.raw,
            "seed": gen.seed,
        }, ensure_ascii=False))
    else:
        print()
        print(timing_line(gen), file=sys.stderr)
    return 0


def prompt_ids(engine: Engine, args: argparse.Namespace) -> list[int]:
    """The prompt's token ids: the text as it is with --raw, else a chat turn (with --system)."""
    if args.raw:
        return engine.tokenizer.encode_prompt(args.prompt)
    require_chat_template(engine)
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    return engine.tokenizer.encode_chat(messages)
