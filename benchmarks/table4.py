"""The paper's Table 4 on this CPU: AdaSpark against llama.cpp's DSpark with the same drafter.

One server at a time, over HTTP, on the evaluation conversations (adaspark.bench's protocol:
turn by turn with the arm's own replies as history, greedy, client-clock decode speed per
reply), the same GGUF and the same threads for every server:

- ours (`adaspark serve`, threads pinned with ADASPARK_THREADS and OMP_NUM_THREADS): `ar`, the
  default arm (`adaspark+gate`), `adaspark`, `ngram`;
- llama.cpp's `llama-server` (built by benchmarks/llama_server.py from the llama-cpp-python
  sources the project pins; `--threads N --threads-batch N`, one slot with our context):
  `llama-server` (plain), `llama-server-dspark3` / `-dspark7` (`--spec-type draft-dspark
  --spec-draft-n-max 3` / `7` with the drafter GGUF), `llama-server-ngram-mod`
  (`--spec-type ngram-mod`).

The drafter GGUF is `--draft-gguf PATH`, or else made once into OUT/drafter.gguf by
`adaspark export-drafter --format gguf OUT --model GGUF [--drafter DIR]` from the drafter our
arms run (`--drafter`, default the shipped one), so both engines draft with the same drafter.

The report (OUT/table4.md, and OUT/table4.json with every reply's raw row) gives, per arm, (a)
its speed over our `ar`, (b) over its own engine's plain decoding (the paper's right-hand
column), its accepted and drafted tokens (llama-server's per-reply `timings`, else its log; ours
from the round log) and its replies equal to our `ar`'s (ours must all be: greedy-exact); then
(c) our default arm over llama.cpp's DSpark n=3 and n=7, `ngram` over `ngram-mod` and `ar` over
llama-server plain. benchmarks/table4_report.py says how ratios and capped replies are counted.

A killed run resumes (`--out` the same folder): finished conversations are kept per arm, a
server whose arm has them all is not started again.

    .venv/bin/python benchmarks/table4.py --out runs/table4                  # every arm
    .venv/bin/python benchmarks/table4.py --out runs/t4-quick --subset short --limit 2 \\
        --cap 64 --arms ar,llama-server                                      # a quick look
    ADASPARK_NATIVE=avx2 ... --avx2   # our AVX2 build and llama-server built without AVX-512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402
import table4_report as t4  # noqa: E402

from adaspark.bench.conversations import SUBSETS, load_conversations  # noqa: E402
from adaspark.bench.rounds import load_rounds  # noqa: E402
from adaspark.bench.runner import FORWARDS, ResultsFile, machine_description, run_bench  # noqa: E402
from adaspark.bench.servers import ArmRun, file_stem  # noqa: E402
from adaspark.errors import UserError  # noqa: E402
from adaspark.scheduler.arm import Arm  # noqa: E402

CONVERSATIONS = Path(__file__).resolve().parents[2] / "shared/data/eval/conversations.jsonl"
SETTINGS = "table4-run.json"  # what must not change between a run and its resume
EXPORT_COMMAND = "export-drafter"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True,
                   help="results folder (an existing one is resumed)")
    p.add_argument("--arms", default=",".join(t4.ALL_ARMS),
                   help="comma-separated, run in this order (default: all): ours "
                        f"({', '.join(t4.OUR_ARMS)}, or any arm of ours, modifiers joined "
                        f"with '+') and llama.cpp's ({', '.join(t4.LLAMA_ARMS)})")
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF every server runs (default: the embedded SmolLM2)")
    p.add_argument("--drafter", default=None,
                   help="our arms' drafter, and what the GGUF is exported from (default: the "
                        "shipped one for the model)")
    p.add_argument("--draft-gguf", type=Path, default=None,
                   help="llama.cpp drafter GGUF (dflash) for the DSpark arms (default: export "
                        "--drafter into OUT/drafter.gguf with `adaspark export-drafter`)")
    p.add_argument("--threads", type=int, default=2, help="every server's threads")
    p.add_argument("--cap", type=int, default=1024, help="max tokens per reply")
    p.add_argument("--conversations", type=Path, default=CONVERSATIONS)
    p.add_argument("--subset", choices=sorted(SUBSETS),
                   help="short: first two turns of the first conversation of each source; "
                        "first-turns: the first turn of every conversation")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only the first N conversations (after --subset)")
    p.add_argument("--avx2", action="store_true",
                   help="force our AVX2 build (ADASPARK_NATIVE=avx2) and a llama-server "
                        "built without AVX-512 (its own folder beside the default build)")
    p.add_argument("--jobs", type=int, default=2, help="llama-server build parallelism")
    p.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.cap < 1 or args.threads < 1 or (args.limit is not None and args.limit < 1):
        p.error("--cap, --threads and --limit must be at least 1")
    return args


def parse_arms(spec: str) -> list[str]:
    """Arm labels in run order: llama.cpp's by name, ours as Arm.parse takes them ('+')."""
    labels = [a.strip() for a in spec.split(",") if a.strip()]
    if not labels:
        raise UserError("--arms names no arm")
    if len(set(labels)) != len(labels):
        raise UserError(f"an arm is listed twice in --arms {spec}")
    for label in labels:
        if t4.is_llama(label):
            continue
        try:
            Arm.parse(label)
        except UserError as err:
            raise UserError(f"--arms: {label!r} is neither llama.cpp's "
                            f"({', '.join(t4.LLAMA_ARMS)}) nor one of ours ({err})") from None
    return labels


def select(conversations: list, subset: str | None, limit: int | None) -> list:
    if subset:
        conversations = SUBSETS[subset](conversations)
    return conversations[:limit] if limit else conversations


def subset_name(subset: str | None, limit: int | None) -> str | None:
    """What run.json records as the subset, so a resume with another selection is refused."""
    if limit is None:
        return subset
    return f"{subset or 'all'}[:{limit}]"


def check_settings(out: Path, settings: dict) -> None:
    """Refuse to resume a folder whose replies came from another model, thread count, build
    or drafter: they would be compared as if alike. A setting the folder has not recorded yet
    (the drafter GGUF of DSpark arms added on a resume) is added."""
    path = out / SETTINGS
    old = json.loads(path.read_text()) if path.exists() else {}
    changed = [k for k in settings if k in old and old[k] != settings[k]]
    if changed:
        k = changed[0]
        raise UserError(f"{out} holds a run with {k}={old[k]!r}, not {settings[k]!r}; use "
                        "another --out")
    path.write_text(json.dumps({**old, **settings}, indent=1) + "\n")


def export_drafter(out: Path, model: Path | None, drafter: str | None) -> Path:
    """OUT/drafter.gguf, made by `adaspark export-drafter` unless a previous run made it."""
    target = out / "drafter.gguf"
    if target.exists():
        return target
    from adaspark.cli import COMMANDS

    if EXPORT_COMMAND not in COMMANDS:
        raise UserError(
            f"`adaspark {EXPORT_COMMAND}` does not exist in this checkout yet (issue 45's "
            "exporter), so the DSpark arms have no drafter GGUF: give one with --draft-gguf "
            f"PATH, or leave {', '.join(t4.DSPARK_N_MAX)} out of --arms")
    command = [sys.executable, "-m", "adaspark.cli", EXPORT_COMMAND, "--format", "gguf",
               str(target)]
    command += (["--model", str(model)] if model else []) + (
        ["--drafter", drafter] if drafter else [])
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not target.exists():
        target.unlink(missing_ok=True)
        raise UserError(f"exporting the drafter failed ({done.returncode}): "
                        f"{(done.stderr or done.stdout).strip()[-1500:]}")
    return target


def check_draft_gguf(path: Path) -> None:
    """A llama.cpp drafter llama-server can run as DSpark: architecture `dflash`."""
    if not path.is_file():
        raise UserError(f"--draft-gguf {path}: no such file")
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields.get("general.architecture")
    except (ValueError, OSError) as err:
        raise UserError(f"--draft-gguf {path}: not a GGUF ({err})") from None
    arch = field.contents() if field is not None else None
    if arch != "dflash":
        raise UserError(f"--draft-gguf {path}: architecture {arch!r}, not llama.cpp's "
                        "drafter architecture 'dflash'")


def slot_context(model: Path) -> int:
    """llama-server's context per slot: what our server gives a request on this model."""
    from adaspark.model.config import ModelConfig
    from adaspark.model.gguf import read_gguf
    from adaspark.model.transformer import DEFAULT_MAX_CONTEXT

    config = ModelConfig.from_metadata(read_gguf(model).metadata)
    return min(config.context_length, DEFAULT_MAX_CONTEXT)


def avx2_wanted(flag: bool, environ) -> bool:
    """--avx2, or ADASPARK_NATIVE=avx2 set for ours: then llama-server runs without AVX-512
    too, so that the side-by-side is AVX2 against AVX2."""
    return flag or environ.get("ADASPARK_NATIVE") == "avx2"


def pin_threads(threads: int, avx2: bool) -> None:
    """Our servers inherit these: a fixed thread count (no adapting to neighbours, as
    llama-server does not) and, with --avx2, the AVX2 build."""
    os.environ["OMP_NUM_THREADS"] = os.environ["ADASPARK_THREADS"] = str(threads)
    if avx2:
        os.environ["ADASPARK_NATIVE"] = "avx2"
        from adaspark.model.native import load

        module, why = load()
        if module is None:
            raise UserError(f"--avx2: our AVX2 build does not load here ({why})")


def arm_done(out: Path, label: str, conversations: list) -> bool:
    done = ResultsFile(out).done()
    return all((label, c.key) in done for c in conversations)


def run_arm(label: str, args, conversations, model: Path, draft_gguf: Path | None,
            context: int) -> None:
    common = dict(conversations=conversations, out_dir=args.out, cap=args.cap,
                  conversations_path=args.conversations,
                  subset=subset_name(args.subset, args.limit), argv=args.argv,
                  progress=not args.no_progress)
    if not t4.is_llama(label):
        serve = ["--model", str(model)] + (["--drafter", args.drafter] if args.drafter else [])
        run_bench(runs=[ArmRun(label=label, arm=label.replace("+", ","))], serve_args=serve,
                  **common)
        check_isa(args.out, label, args.avx2)
        return
    log = args.out / "logs" / f"{file_stem(label)}.log"
    server = llama_server.LlamaServer(model, log, parallel=1, threads=args.threads,
                                      slot_context=context, avx512=not args.avx2,
                                      extra=t4.llama_args(label, draft_gguf, args.threads))
    with server:
        run_bench(runs=[ArmRun(label=label, arm=None, url=server.url)], **common)


def check_isa(out: Path, label: str, avx2: bool) -> None:
    """With --avx2, our server must have run the AVX2 forward (a failed build load falls back
    to another with one log line)."""
    forward = recorded_forwards(out).get(label)
    if avx2 and forward != "native-avx2":
        raise UserError(f"--avx2: arm {label}'s server ran the {forward} forward, not "
                        f"native-avx2 (its log: {out / 'logs' / (file_stem(label) + '.log')}); "
                        f"its replies are recorded in {out}: start again with another --out")


def recorded_forwards(out: Path) -> dict[str, str]:
    """Arm label -> the forward its server ran (its /health), as the runner recorded them."""
    return json.loads((out / FORWARDS).read_text()) if (out / FORWARDS).exists() else {}


def forwards(out: Path, labels: list[str]) -> str:
    seen = recorded_forwards(out)
    ran = sorted({seen[label] for label in labels if label in seen})
    return ", ".join(ran) + " forward" if ran else "no arm of ours ran"


def write_report(args, labels: list[str], header: list[str]) -> dict:
    """OUT/table4.json (every reply's raw row and the summary) and OUT/table4.md; the
    summary."""
    records = [r for r in ResultsFile(args.out).load() if r.get("arm") in labels]
    kept = {label: {r["response_id"] for r in records if r.get("arm") == label
                    and r.get("kind") == "reply" and r.get("response_id")} for label in labels}
    ours = [label for label in labels if not t4.is_llama(label)]
    rounds = load_rounds(args.out, ours, kept)
    logs = {}
    for label in labels:
        log = args.out / "logs" / f"{file_stem(label)}.log"
        if t4.is_llama(label) and log.exists():
            logs[label] = log.read_text(errors="replace")
    summary = t4.summarise(records, labels, rounds, logs, n_boot=args.n_boot)
    errors = [r for r in records if r.get("kind") == "conversation"
              and r.get("status") == "error"]
    replies = [r for r in records if r.get("kind") == "reply"]
    (args.out / "table4.json").write_text(json.dumps(
        {"header": header, "summary": summary, "conversation_errors": errors,
         "replies": replies}, indent=1) + "\n")
    text = t4.markdown(summary, header)
    if errors:
        text += "\nConversations that failed (left out; a resume retries them): " + ", ".join(
            f"{e['arm']} {e['conversation']} ({e.get('error', '')[:80]})" for e in errors) + "\n"
    (args.out / "table4.md").write_text(text)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = ["benchmarks/table4.py", *(sys.argv[1:] if argv is None else argv)]
    try:
        return run(args)
    except UserError as err:
        print(f"table4: error: {err}", file=sys.stderr)
        return 2


def run(args) -> int:
    from adaspark.model.sources import resolve_model

    labels = parse_arms(args.arms)
    if avx2_wanted(args.avx2, os.environ) and not args.avx2:
        print("ADASPARK_NATIVE=avx2: llama-server runs its build without AVX-512 too (--avx2)",
              file=sys.stderr)
        args.avx2 = True
    conversations = select(load_conversations(args.conversations), args.subset, args.limit)
    model = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"model": str(model), "threads": args.threads, "avx2": args.avx2,
                "drafter": args.drafter, "cap": args.cap}
    check_settings(args.out, settings)  # before a build or an export: fail fast
    pin_threads(args.threads, args.avx2)
    stamp = None
    if any(t4.is_llama(label) for label in labels):
        llama_server.ensure_built(args.jobs, avx512=not args.avx2)
        stamp = json.loads((llama_server.server_dir(not args.avx2) / llama_server.STAMP
                            ).read_text())
    draft_gguf = None
    if t4.needs_draft_gguf(labels):
        draft_gguf = (args.draft_gguf or export_drafter(args.out, args.model, args.drafter)
                      ).resolve()  # llama-server may not share our working directory
        check_draft_gguf(draft_gguf)
        check_settings(args.out, {**settings, "draft_gguf": str(draft_gguf)})
    context = slot_context(model)
    for label in labels:
        if arm_done(args.out, label, conversations):
            print(f"{label}: every conversation done, not run again", file=sys.stderr)
            continue
        start = time.perf_counter()
        run_arm(label, args, conversations, model, draft_gguf, context)
        print(f"{label}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    machine = machine_description()
    header = [f"CPU: {machine['cpu']} ({machine['cpus_usable']} usable); {args.threads} "
              f"threads every server; model {model.name}; cap {args.cap}; "
              f"{len(conversations)} conversations "
              f"({subset_name(args.subset, args.limit) or 'all'} of {args.conversations.name})",
              f"ours: {forwards(args.out, labels)}"
              f"{' (ADASPARK_NATIVE=avx2)' if args.avx2 else ''}; "
              f"drafter {args.drafter or 'the shipped one'}"
              + (f"; llama.cpp drafter GGUF {draft_gguf}" if draft_gguf else ""),
              *([f"llama-server {llama_server.VERSION}: {stamp['cmake_args']}"] if stamp
                else [])]
    summary = write_report(args, labels, header)
    print((args.out / "table4.md").read_text())
    return 1 if t4.differing_greedy(summary) else 0


if __name__ == "__main__":
    sys.exit(main())
