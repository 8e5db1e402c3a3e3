"""Decode speed of llama.cpp against our plain decoding (`ar`): same GGUF, prompts and threads.

llama-cpp-python is built from the PyPI sdist once, into its own virtual environment in the user
cache (never the project's), with native CPU detection off and the instruction sets chosen from
/proc/cpuinfo, AMX off (docs/llama_cpp_baseline.md says why). llama.cpp then runs in a worker
process on that environment's python, serving prompts over stdin/stdout JSON lines; our engine
runs in this process. The two take turns prompt by prompt (A B A B ...), so a machine that
speeds up or slows down during the run affects both alike.

Both engines get the same prompt token ids (the chat messages rendered once through the GGUF's
chat template by our tokenizer; with --raw, for a base model without a template, the turns' text
as it is, as `adaspark generate --raw` reads it), decode greedily, stop at the same stop tokens
or after the same number of reply tokens, and are clocked the same way:

    decode tok/s = (reply tokens after the first) / (seconds from the first reply token to the last)

so prefill is excluded and every later forward counts. On the llama.cpp side the clock reads
between the tokens `Llama.generate` yields (the low-level eval/sample loop), not streamed chat
chunks, which would add llama-cpp-python's detokenizing and response building to each token.

    .venv/bin/python benchmarks/vs_llamacpp.py --build-only         # build once (tens of minutes)
    .venv/bin/python benchmarks/vs_llamacpp.py --runs 3 --max-tokens 128 --out vs_llamacpp.json
    .venv/bin/python benchmarks/vs_llamacpp.py --model gemma-3-270m-q4_k_m.gguf --raw
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from adaspark.cpuinfo import flags as cpu_flags
from adaspark.cpuinfo import name as cpu_name
from adaspark.cpuinfo import read as read_cpuinfo

VERSION = "0.3.36"
STAMP = "adaspark-build.json"
CONVERSATIONS = Path(__file__).resolve().parents[2] / "shared/data/eval/conversations.jsonl"
FALLBACK_PROMPTS = (  # used when the evaluation file is not there
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain how a hash table works and when it is a poor choice.",
    "Write a Python function that checks whether a string is a palindrome, then explain it.",
    "Summarize the causes of the French Revolution in a few paragraphs.",
)
N_CTX = 2048

# cpuinfo flags (all required) -> ggml switch. Every switch is written ON or OFF explicitly, so
# the build does not depend on ggml's defaults and the stamp names exactly what was compiled.
ISA_SWITCHES = (
    (("sse4_2",), "GGML_SSE42"),
    (("avx",), "GGML_AVX"),
    (("avx2",), "GGML_AVX2"),
    (("fma",), "GGML_FMA"),
    (("f16c",), "GGML_F16C"),
    (("bmi2",), "GGML_BMI2"),
    (("avx_vnni",), "GGML_AVX_VNNI"),
    (("avx512f", "avx512bw", "avx512vl"), "GGML_AVX512"),
    (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), "GGML_AVX512_VNNI"),
    (("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), "GGML_AVX512_BF16"),
    (("avx512f", "avx512bw", "avx512vl", "avx512vbmi"), "GGML_AVX512_VBMI"),
)
# AMX stays off even where listed: on this VM the -march=native build dies with SIGILL on it.
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cmake_args(flags: set[str], avx512: bool = True) -> str:
    """CMAKE_ARGS for a portable build with exactly the instruction sets in `flags`.

    GGML_NATIVE=OFF comes first: while native is on, ggml compiles for the host with
    -march=native (AMX included) and ignores the per-extension switches."""
    args = ["-DGGML_NATIVE=OFF"]
    for needed, switch in ISA_SWITCHES:
        on = all(f in flags for f in needed) and (avx512 or not switch.startswith("GGML_AVX512"))
        args.append(f"-D{switch}={'ON' if on else 'OFF'}")
    args += [f"-D{switch}=OFF" for switch in ALWAYS_OFF]
    return " ".join(args)


def default_venv() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("adaspark")) / "llamacpp" / "venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def stamp_matches(venv: Path, version: str, args: str) -> bool:
    """True when `venv` holds a finished build of this version with these CMAKE_ARGS."""
    try:
        stamp = json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(stamp, dict) and stamp.get("version") == version
            and stamp.get("cmake_args") == args and venv_python(venv).exists())


def write_stamp(venv: Path, version: str, args: str, build_s: float) -> None:
    # Written last, after the import check: a build that died half-way leaves no stamp.
    (venv / STAMP).write_text(json.dumps({"version": version, "cmake_args": args,
                                          "build_s": round(build_s, 1),
                                          "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                    time.gmtime())}) + "\n")


def build(venv: Path, version: str, args: str, jobs: int) -> float:
    """Build llama-cpp-python `version` from the sdist into a fresh venv; returns seconds."""
    if venv.exists():
        if not (venv / "pyvenv.cfg").exists():
            raise SystemExit(f"{venv} exists and is not a virtual environment; not touching it")
        shutil.rmtree(venv)  # a stale or unfinished build with other switches
    venv.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # From inside the project venv, -m venv builds on the base interpreter: nothing is shared.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
    print(f"building llama-cpp-python {version} into {venv}\n  CMAKE_ARGS={args}\n"
          f"  CMAKE_BUILD_PARALLEL_LEVEL={jobs}", file=sys.stderr, flush=True)
    subprocess.run([str(venv_python(venv)), "-m", "pip", "install", "--verbose",
                    "--disable-pip-version-check", "--no-cache-dir",
                    "--no-binary", "llama-cpp-python", f"llama-cpp-python=={version}"],
                   check=True, env=env)
    subprocess.run([str(venv_python(venv)), "-c",
                    "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"],
                   check=True, env=env)
    seconds = time.perf_counter() - start
    write_stamp(venv, version, args, seconds)
    print(f"built in {seconds / 60:.1f} min", file=sys.stderr, flush=True)
    return seconds


# The llama.cpp side. First stdin line: {"model", "threads", "n_ctx"}; it answers with its
# version and ggml's system info (the instruction sets actually compiled in). Then one request
# a line: {"ids", "max_tokens", "stop_ids"} -> {"tokens", "prefill_s", "decode_s", ...}.
WORKER = r"""
import json, sys, time
import llama_cpp

init = json.loads(sys.stdin.readline())
llm = llama_cpp.Llama(model_path=init["model"], n_threads=init["threads"],
                      n_threads_batch=init["threads"], n_ctx=init["n_ctx"], verbose=False)
info = llama_cpp.llama_print_system_info()
print(json.dumps({"version": llama_cpp.__version__,
                  "system_info": info.decode() if isinstance(info, bytes) else str(info)}),
      flush=True)
for line in sys.stdin:
    req = json.loads(line)
    stops = set(req["stop_ids"])
    llm.reset()  # prefill from scratch, as our side does
    tokens, stamps = [], []
    start = time.perf_counter()
    # temp=0 is llama.cpp's greedy sampler; the clock reads as each token is yielded, before
    # the next forward runs, which is where ours reads too.
    for tok in llm.generate(req["ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                            repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        if tok in stops:
            break
        tokens.append(int(tok))
        if len(tokens) >= req["max_tokens"]:
            break
    print(json.dumps({"tokens": tokens, "prefill_s": stamps[0] - start,
                      "decode_s": stamps[-1] - stamps[0], "decode_tokens": len(stamps) - 1}),
          flush=True)
"""


class LlamaWorker:
    def __init__(self, venv: Path, model: Path, threads: int):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen([str(venv_python(venv)), "-c", WORKER], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = self._ask({"model": str(model), "threads": threads, "n_ctx": N_CTX})

    def _ask(self, message: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            hint = (" (SIGILL: an instruction set this CPU lacks; rebuild with --no-avx512)"
                    if rc == -signal.SIGILL else "")
            raise SystemExit(f"llama.cpp worker exited with {rc}{hint}")
        return json.loads(line)

    def generate(self, ids: list[int], max_tokens: int, stop_ids: list[int]) -> dict:
        return self._ask({"ids": ids, "max_tokens": max_tokens, "stop_ids": stop_ids})

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def tok_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def summarize(pairs: list[dict]) -> dict:
    """pairs: one per A/B pair, {"round", "prompt", "llamacpp_tok_s", "ar_tok_s"}.
    Ratios are ar / llama.cpp (above 1: ours decodes faster)."""
    if not pairs:
        return {}
    theirs = [p["llamacpp_tok_s"] for p in pairs]
    ours = [p["ar_tok_s"] for p in pairs]
    rounds: dict[int, list[dict]] = {}
    for p in pairs:
        rounds.setdefault(p["round"], []).append(p)

    def ratio(a: float, b: float) -> float | None:
        return a / b if b > 0 else None

    return {
        "median_llamacpp_tok_s": statistics.median(theirs),
        "median_ar_tok_s": statistics.median(ours),
        "ratio_of_medians": ratio(statistics.median(ours), statistics.median(theirs)),
        "pair_ratios": [ratio(p["ar_tok_s"], p["llamacpp_tok_s"]) for p in pairs],
        "round_ratios": [ratio(statistics.median(q["ar_tok_s"] for q in ps),
                               statistics.median(q["llamacpp_tok_s"] for q in ps))
                         for _, ps in sorted(rounds.items())],
    }


def load_prompts(path: Path, count: int, max_chars: int) -> list[list[dict]]:
    """First user turn (with its system prompt) of the first conversation of each source,
    skipping tool conversations (tool schemas would reach the two prompts differently) and
    those too long for llama.cpp's n_ctx; the fixed prompts when the file is missing."""
    if not path.is_file():
        return [[{"role": "user", "content": p}] for p in FALLBACK_PROMPTS[:count]]
    from adaspark.bench.conversations import load_conversations

    out, seen = [], set()
    for conv in load_conversations(path):
        if conv.source in seen or conv.tools or len(conv.turns[0]) > max_chars:
            continue
        seen.add(conv.source)
        system = [{"role": "system", "content": conv.system}] if conv.system else []
        out.append(system + [{"role": "user", "content": conv.turns[0]}])
        if len(out) == count:
            break
    return out


def encode(tokenizer, messages: list[dict], raw: bool) -> list[int]:
    """A prompt's token ids: the chat rendered through the model's template, or with `raw` the
    messages' text joined by blank lines, as text to continue (BOS as the model asks)."""
    if raw:
        return tokenizer.encode_prompt("\n\n".join(m["content"] for m in messages))
    return tokenizer.encode_chat(messages)


def run_benchmark(args: argparse.Namespace, venv: Path, cpuinfo: str) -> dict:
    import torch

    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path
    from adaspark.sequence import common_prefix

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else default_model_path()
    engine = Engine.load(model, arm="ar")
    assert engine.speculator is None, "arm ar must decode without a speculator"
    stop_ids = sorted(int(t) for t in engine.tokenizer.stop_ids)
    prompts = []
    for messages in load_prompts(Path(args.conversations), args.prompts, args.max_chars):
        ids = encode(engine.tokenizer, messages, args.raw)
        if len(ids) + args.max_tokens <= N_CTX:
            prompts.append(ids)
    if not prompts:
        raise SystemExit("no prompt fits llama.cpp's context")
    worker = LlamaWorker(venv, model, args.threads)
    try:
        # One untimed reply each: first-call allocations and caches are not decode speed.
        worker.generate(prompts[0], 8, stop_ids)
        engine.reset()
        engine.generate_ids(prompts[0], max_tokens=8)
        rows = []
        for rnd in range(args.runs):
            for i, ids in enumerate(prompts):
                theirs = worker.generate(ids, args.max_tokens, stop_ids)  # A
                engine.reset()  # prefill from scratch, as the worker does
                gen = engine.generate_ids(ids, max_tokens=args.max_tokens)  # B
                t = gen.timings
                rows.append({
                    "round": rnd, "prompt": i, "prompt_tokens": len(ids),
                    "llamacpp_tok_s": tok_s(theirs["decode_tokens"], theirs["decode_s"]),
                    "ar_tok_s": t.decode_tok_s,
                    "llamacpp_decode_tokens": theirs["decode_tokens"],
                    "ar_decode_tokens": t.decode_tokens,
                    "llamacpp_prefill_s": theirs["prefill_s"], "ar_prefill_s": t.prefill_s,
                    "same_tokens": common_prefix(theirs["tokens"], gen.token_ids),
                    "reply_tokens": [len(theirs["tokens"]), len(gen.token_ids)],
                })
                print(f"  round {rnd} prompt {i}: llama.cpp {rows[-1]['llamacpp_tok_s']:.1f}, "
                      f"ar {t.decode_tok_s:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        worker.close()
    return {
        "cpu": cpu_name(cpuinfo), "threads": args.threads, "torch_threads":
        torch.get_num_threads(), "max_tokens": args.max_tokens, "runs": args.runs,
        "raw": args.raw, "forward": engine.forward,
        "model": str(model), "llamacpp_version": worker.info["version"],
        "llamacpp_system_info": worker.info["system_info"],
        "cmake_args": json.loads((venv / STAMP).read_text())["cmake_args"],
        "decode_tok_s_definition": "(reply tokens after the first) / (seconds from the first "
                                   "reply token to the last); prefill excluded; the same prompt "
                                   "token ids, greedy, same stop tokens for both engines",
        "ratio_definition": "ar / llama.cpp (above 1: ar decodes faster)",
        "pairs": rows, **summarize(rows),
    }


def print_report(r: dict) -> None:
    print(f"CPU: {r['cpu']}; threads {r['threads']} (torch {r['torch_threads']}); max tokens "
          f"{r['max_tokens']}; {r['runs']} interleaved run(s) x {len(r['pairs']) // r['runs']} "
          f"{'raw ' if r['raw'] else ''}prompts; ours {r['forward']}")
    print(f"llama-cpp-python {r['llamacpp_version']}: {r['llamacpp_system_info']}")
    print(f"decode tok/s = {r['decode_tok_s_definition']}")
    print(f"{'round':>5} {'prompt':>6} {'ptoks':>5} {'llama.cpp':>9} {'ar':>7} {'ar/llama':>8} "
          f"{'prefill ms l/a':>15} {'reply l/a':>9} {'same':>4}")
    for p, ratio in zip(r["pairs"], r["pair_ratios"], strict=True):
        prefill = f"{p['llamacpp_prefill_s'] * 1e3:.0f}/{p['ar_prefill_s'] * 1e3:.0f}"
        replies = "{}/{}".format(*p["reply_tokens"])
        print(f"{p['round']:>5} {p['prompt']:>6} {p['prompt_tokens']:>5} "
              f"{p['llamacpp_tok_s']:>9.1f} {p['ar_tok_s']:>7.1f} "
              f"{ratio if ratio is not None else float('nan'):>8.3f} {prefill:>15} "
              f"{replies:>9} {p['same_tokens']:>4}")
    ratio = r["ratio_of_medians"]
    print(f"median decode tok/s: llama.cpp {r['median_llamacpp_tok_s']:.1f}, ar "
          f"{r['median_ar_tok_s']:.1f}; ratio of medians (ar/llama.cpp) "
          f"{ratio if ratio is not None else float('nan'):.3f}")
    print("per-round ratios (median ar / median llama.cpp): "
          + ", ".join(f"{x:.3f}" if x is not None else "n/a" for x in r["round_ratios"]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="interleaved repeats over the prompts")
    p.add_argument("--max-tokens", type=int, default=128, help="reply cap per prompt")
    p.add_argument("--threads", type=int, default=2, help="threads for both engines")
    p.add_argument("--prompts", type=int, default=4, help="how many prompts")
    p.add_argument("--max-chars", type=int, default=6000,
                   help="skip first turns longer than this (llama.cpp runs with n_ctx 2048)")
    p.add_argument("--conversations", default=str(CONVERSATIONS),
                   help="evaluation conversations (fixed prompts when missing)")
    p.add_argument("--model", help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--raw", action="store_true",
                   help="prompts as text to continue, no chat template (a base model)")
    p.add_argument("--venv", help="llama.cpp's venv (default: ~/.cache/adaspark/llamacpp/venv)")
    p.add_argument("--jobs", type=int, default=2, help="CMAKE_BUILD_PARALLEL_LEVEL")
    p.add_argument("--no-avx512", action="store_true",
                   help="build without AVX-512 (if the AVX-512 build dies with SIGILL)")
    p.add_argument("--build-only", action="store_true", help="build if needed, then exit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="FILE", help="also write the JSON object here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cpuinfo = read_cpuinfo()
    venv = Path(args.venv) if args.venv else default_venv()
    wanted = cmake_args(cpu_flags(cpuinfo), avx512=not args.no_avx512)
    if stamp_matches(venv, VERSION, wanted):
        print(f"llama-cpp-python {VERSION} already built in {venv}", file=sys.stderr)
    else:
        build(venv, VERSION, wanted, args.jobs)
    if args.build_only:
        return 0
    result = run_benchmark(args, venv, cpuinfo)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
