"""Make the llama.cpp reference logits that tests/test_reference_logits.py checks our engine
against in CI, where there is no llama.cpp build (by hand, on a machine that has one).

Two models, each a few token sequences, every position's logits by llama.cpp (llama-cpp-python
0.3.36 built by benchmarks/vs_llamacpp.py, `logits_all`, in a worker on its own python, as
benchmarks/peer_logits.py runs it):

- "smollm2": the embedded SmolLM2-135M-Instruct Q4_1 (the file `adaspark fetch-model` pins by
  sha256). Its vocabulary is 49152, so per position only llama.cpp's TOP_K largest logits are
  kept, and the whole row at a few positions (FULL_AT);
- "kquant": a synthetic qwen3 (adaspark/model/synthetic.py) of K-quant matrices, Q4_K with
  Q5_K and Q6_K tensors as llama.cpp's Q4_K_M mixes them, the tied head Q6_K. CI re-creates it
  from KQUANT_RECIPE (the writer is deterministic; the file's sha256 is stored and checked), so
  no model file is committed. Vocabulary 512: every position's whole row is kept.

Each sequence is a prompt and llama.cpp's own greedy continuation of it, so its positions are
what decoding visits. Written to tests/data/llamacpp_logits/ (one .npz per model, and
provenance.json: llama.cpp's version and commit, its build switches, the CPU, the command).

    .venv/bin/python benchmarks/vs_llamacpp.py --build-only
    .venv/bin/python benchmarks/make_reference_logits.py
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from adaspark.model import synthetic as syn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llamacpp_logits"
N_CTX = 512
TOP_K = 64  # llama.cpp's largest logits kept per position of the big vocabulary
FULL_AT = (1, 0.5, -1)  # positions whose whole row is kept: the second, the middle, the last
CONTINUATION = 16  # llama.cpp's greedy tokens appended to each prompt

SMOLLM2_PROMPTS = (  # (chat messages, or raw text to continue); the first long enough that
    # positions reach past 150, where a wrong RoPE moves the logits most
    [{"role": "system", "content": "You are a careful assistant who answers in plain words."},
     {"role": "user", "content": (
         "I am writing a short guide for new gardeners. Tomatoes in my raised bed grew tall "
         "and green but set very little fruit this summer; the bed gets about six hours of "
         "sun, I watered every evening, and I fed the plants a high-nitrogen fertiliser every "
         "two weeks. Nights were warm, often above 24 degrees. Explain in a few sentences "
         "what most likely went wrong, what I should change next year, and why each change "
         "helps. Keep it friendly and avoid jargon.")}],
    "The printing press, invented by Johannes Gutenberg around 1440, changed Europe because",
)
KQUANT_RECIPE = syn.Recipe(
    "qwen3", syn.SHAPES["tiny"], syn.Q.Q4_K,
    {"attn_v": syn.Q.Q5_K, "ffn_down": syn.Q.Q6_K, "token_embd": syn.Q.Q6_K}, seed=40)
KQUANT_PROMPTS = (  # ids: a fixed random draw, and a repeating pattern (attention to copies)
    [int(t) for t in np.random.default_rng(40).integers(0, 512, 160)],
    [17, 301, 88, 455, 260, 9, 123] * 12,
)


def kquant_model(path: Path) -> Path:
    return syn.write_model(path, KQUANT_RECIPE)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def full_positions(n: int) -> list[int]:
    return sorted({min(n - 1, int(p * n) if isinstance(p, float) else p % n) for p in FULL_AT})


def sequences(model: Path, prompts, worker) -> list[tuple[list[int], int]]:
    """Each prompt (ids, raw text or chat messages) with llama.cpp's greedy continuation, and
    the prompt's length."""
    from adaspark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(model)
    out = []
    for p in prompts:
        ids = (list(p) if isinstance(p, list) and isinstance(p[0], int)
               else tok.encode_prompt(p) if isinstance(p, str) else tok.encode_chat(p))
        out.append((ids + worker.greedy(ids, CONTINUATION, []), len(ids)))
    return out


def reference(model: Path, prompts, worker, top_k: int | None) -> dict[str, np.ndarray]:
    """The arrays of one model's .npz: per sequence k, ids_k (prompt_length_k of them the
    prompt), llama.cpp's top_k largest logits of every position (top_tokens_k, top_logits_k;
    all of them when top_k is None) and the whole rows at full_positions_k (full_logits_k;
    none when every row is whole already)."""
    arrays: dict[str, np.ndarray] = {"file_sha256": np.array(sha256(model))}
    for k, (ids, prompt_length) in enumerate(sequences(model, prompts, worker)):
        logits = worker.logits(ids)  # [n, vocab] float32
        order = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
        arrays[f"ids_{k}"] = np.asarray(ids, np.int32)
        arrays[f"prompt_length_{k}"] = np.array(prompt_length, np.int32)
        arrays[f"top_tokens_{k}"] = order.astype(np.int32)
        arrays[f"top_logits_{k}"] = np.take_along_axis(logits, order, 1)
        at = full_positions(len(ids)) if top_k is not None else []
        arrays[f"full_positions_{k}"] = np.asarray(at, np.int32)
        arrays[f"full_logits_{k}"] = logits[at] if at else np.zeros((0, logits.shape[1]),
                                                                      np.float32)
    return arrays


def ggml_build(venv: Path) -> dict:
    """ggml's version and commit as the built library reports them."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    code = ("import ctypes, json, os, llama_cpp\n"
            "g = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib', "
            "'libggml-base.so'))\n"
            "out = {}\n"
            "for name in ('ggml_version', 'ggml_commit'):\n"
            "    f = getattr(g, name); f.restype = ctypes.c_char_p; out[name] = f().decode()\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([str(pl.vs.venv_python(venv)), "-c", code], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _peer_logits():
    import importlib.util

    spec = importlib.util.spec_from_file_location("peer_logits",
                                                  Path(__file__).with_name("peer_logits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pl = _peer_logits()  # its llama.cpp worker (logits_all) and vs_llamacpp's venv


def git_commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    return done.stdout.strip() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", help="llama.cpp's venv (default: ~/.cache/adaspark/llamacpp/venv)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(OUT), help="folder for the .npz files")
    args = p.parse_args(argv)
    from adaspark.cpuinfo import name as cpu_name
    from adaspark.model.sources import default_model_path

    venv = Path(args.venv) if args.venv else pl.vs.default_venv()
    if not pl.vs.venv_python(venv).exists():
        raise SystemExit(f"no llama.cpp at {venv}: benchmarks/vs_llamacpp.py --build-only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="reference_logits_") as tmp:
        models = {"smollm2": (default_model_path(), SMOLLM2_PROMPTS, TOP_K),
                  "kquant": (kquant_model(Path(tmp) / "kquant.gguf"), KQUANT_PROMPTS, None)}
        info = {}
        for name, (model, prompts, top_k) in models.items():
            worker = pl.LogitsWorker(venv, model, args.threads, N_CTX)
            try:
                arrays = reference(model, prompts, worker, top_k)
                info = worker.info
            finally:
                worker.close()
            np.savez_compressed(out / f"{name}.npz", **arrays)
            print(f"{name}: {out / f'{name}.npz'}", file=sys.stderr)
    provenance = {
        "made_by": "benchmarks/make_reference_logits.py",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "project_commit": git_commit(),
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_name(), "threads": args.threads, "n_ctx": N_CTX,
        "llama_cpp_python": info["version"], **ggml_build(venv),
        "llamacpp_system_info": info["system_info"],
        "cmake_args": json.loads((venv / pl.vs.STAMP).read_text())["cmake_args"],
        "synthetic_writer": {"numpy": np.__version__, "gguf": importlib.metadata.version("gguf")},
        "models": {"smollm2": f"{default_model_path().name} (sha256 in adaspark/model/sources.py)",
                   "kquant": f"synthetic: {KQUANT_RECIPE!r}"},
    }
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
