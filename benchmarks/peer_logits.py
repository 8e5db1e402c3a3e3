"""Our logits against llama.cpp's on the same GGUF and the same token ids: a peer check.

For each prompt (chat messages rendered once by our tokenizer) three engines give the logits of
every position: ours on the fast path (the forward Engine.load chooses: native or torch), ours
on the reference path (float32, gguf-dequantised weights: the exact function of the file), and
llama.cpp (logits_all, in a worker on llama.cpp's own python, as benchmarks/vs_llamacpp.py runs
it). Per position: max |fast - llama|, |ref - llama|, |fast - ref| over the vocabulary, and
whether the argmaxes agree. Then both engines reply greedily from the prompt; the replies are
compared to the first difference, where each engine's logit margin (its token's logit minus
the other engine's token's logit, both from the common context) is set against the bound.

The bound. Both engines multiply the same weights (the file's blocks, decoded the same way)
but round the activations differently. For a linear y = W x with x rounded to x^ where
|x^_i - x_i| <= e_i, |y^_j - y_j| <= sum_i e_i |W_ji| (worst case, every error aligned). So at
the LM head, with h the final-normed row, the two engines' logit j differ by at most

    B_j = sum_i (e_ours_i + e_llama_i + 2 n 2^-24 |h_i|) |W_ji|  (+ |l_j| 2^-9 on the torch path)

where, per input i in block b (the block's scale d_b = max_b |h| / 127):
  - ours, native: int8 per 32 inputs, float32 scale: e = d_b / 2;
  - ours, torch: bf16 activations and bf16 weights (or int4 with bf16 scales): e = |h_i| 2^-8,
    and its logits are bf16 (the |l_j| 2^-9 term) except the top few it recomputes in float32;
  - llama.cpp, by the head's type (ggml's vec_dot_type): Q4_0/Q5_0/Q8_0 -> q8_0 and Q4_1/Q5_1
    -> q8_1, per 32 inputs with the scale stored in fp16: e = d~_b / 2 + 127 |d~_b - d_b|
    (d~ the fp16 scale, the values quantised with 1/d); K-quants -> q8_K, per 256 inputs, float
    scale: e = d_b / 2; F16 / BF16 -> activations in that format: e = |h_i - round(h_i)|; F32:
    e = 0;
  - the last term covers float32 accumulation (n = inputs).
B_j bounds what the head's own rounding can put between the engines, computed on h of the
reference path. It is not an end-to-end bound: every layer below rounds its activations the same
way, and those errors reach the logits through the network (attention and SiLU are not linear),
with llama.cpp's fp16 K/V, RoPE and softmax rounding besides. The report gives, per position,
max_j |fast - llama| / max_j B_j ("ratio"): a ratio near or under 1 says the engines differ by
about what their activation rounding allows; a bug (a wrong RoPE, a missing bias) shows as
logit differences the size of the logits themselves, ratios of tens or more. Where the engines'
argmaxes part (ours t, llama.cpp s), as at the first difference of the greedy replies, our
margin l_t - l_s and llama.cpp's l'_s - l'_t sum to at most B_t + B_s if each logit stays within
its bound: a parting within that is a near tie that rounding decides ("near_tie").

    .venv/bin/python benchmarks/peer_logits.py --model FILE --prompts 4 --out peer.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vs = _sibling("vs_llamacpp")  # its venv, prompts and worker protocol

# First line: {"model", "threads", "n_ctx"}; then requests, one a line:
# {"op": "logits", "ids", "out"} -> every position's logits saved as float32 .npy at "out";
# {"op": "generate", "ids", "max_tokens", "stop_ids"} -> {"tokens"}: greedy, as vs_llamacpp's,
# up to max_tokens tokens or a stop token (kept).
WORKER = r"""
import json, sys
import numpy as np
import llama_cpp

init = json.loads(sys.stdin.readline())
llm = llama_cpp.Llama(model_path=init["model"], n_threads=init["threads"],
                      n_threads_batch=init["threads"], n_ctx=init["n_ctx"], logits_all=True,
                      verbose=False)
info = llama_cpp.llama_print_system_info()
print(json.dumps({"version": llama_cpp.__version__,
                  "system_info": info.decode() if isinstance(info, bytes) else str(info)}),
      flush=True)
for line in sys.stdin:
    req = json.loads(line)
    llm.reset()
    if req["op"] == "logits":
        llm.eval(req["ids"])
        np.save(req["out"], np.asarray(llm.scores[:len(req["ids"])], dtype=np.float32))
        print(json.dumps({"rows": len(req["ids"])}), flush=True)
        continue
    stops, tokens = set(req["stop_ids"]), []
    for tok in llm.generate(req["ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                            repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))  # a stop token included: where it comes is compared too
        if tok in stops or len(tokens) >= req["max_tokens"]:
            break
    print(json.dumps({"tokens": tokens}), flush=True)
"""


class LogitsWorker(vs.LlamaWorker):
    """vs_llamacpp's worker protocol over the script above."""

    def __init__(self, venv: Path, model: Path, threads: int, n_ctx: int):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen([str(vs.venv_python(venv)), "-c", WORKER], env=env,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = self._ask({"model": str(model), "threads": threads, "n_ctx": n_ctx})
        self._dir = tempfile.TemporaryDirectory(prefix="peer_logits_")

    def logits(self, ids: list[int]) -> np.ndarray:
        out = Path(self._dir.name) / "logits.npy"
        self._ask({"op": "logits", "ids": ids, "out": str(out)})
        return np.load(out)

    def greedy(self, ids: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
        return self._ask({"op": "generate", "ids": ids, "max_tokens": max_tokens,
                          "stop_ids": stop_ids})["tokens"]

    def close(self) -> None:
        super().close()
        self._dir.cleanup()


def llamacpp_logits(model: Path, ids: list[int], n_ctx: int, threads: int = 1) -> np.ndarray:
    """llama.cpp's logits at every position of `ids`, from a worker started for this one call."""
    worker = LogitsWorker(vs.default_venv(), model, threads, n_ctx)
    try:
        return worker.logits(ids)
    finally:
        worker.close()


# --- the bound -----------------------------------------------------------------------------------

BLOCK_Q8, BLOCK_Q8K = 32, 256
Q8_TYPES = {"Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1"}  # vec_dot_type q8_0 / q8_1: the same steps
K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}  # vec_dot_type q8_K


def _block_max(h: np.ndarray, block: int) -> np.ndarray:
    """max |h| of each input's block, per input: [rows, n]."""
    rows, n = h.shape
    m = np.abs(h).reshape(rows, n // block, block).max(-1)
    return np.repeat(m, block, axis=-1)


def ours_step(h: np.ndarray, forward: str) -> np.ndarray:
    """Bound on |x^ - x| per input of our head's activations."""
    if forward.startswith("native"):
        return _block_max(h, BLOCK_Q8) / 254
    return np.abs(h) * 2.0**-8  # bf16 activations and bf16-rounded weights


def llamacpp_step(h: np.ndarray, head_type: str) -> np.ndarray:
    """Bound on |x^ - x| per input of llama.cpp's head activations (ggml's vec_dot_type)."""
    if head_type in Q8_TYPES:
        d = _block_max(h, BLOCK_Q8).astype(np.float64) / 127
        d16 = d.astype(np.float16).astype(np.float64)
        return d16 / 2 + 127 * np.abs(d16 - d)
    if head_type in K_TYPES:
        return _block_max(h, BLOCK_Q8K) / 254
    if head_type == "F16":
        return np.abs(h - h.astype(np.float16).astype(np.float32))
    if head_type == "BF16":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(h))
        return (t - t.bfloat16().float()).abs().numpy()
    if head_type == "F32":
        return np.zeros_like(h)
    raise ValueError(f"no activation rounding known for a {head_type} head")


def head_bound(h: np.ndarray, w_abs: np.ndarray, head_type: str, forward: str,
               logits: np.ndarray) -> np.ndarray:
    """B [rows, vocab]: the module docstring's bound on |ours - llama.cpp| from the head alone.
    h [rows, dim] final-normed rows, w_abs [vocab, dim] |W|, logits [rows, vocab] ours."""
    h = h.astype(np.float32)
    e = (ours_step(h, forward) + llamacpp_step(h, head_type)
         + 2 * h.shape[1] * 2.0**-24 * np.abs(h))
    bound = e.astype(np.float32) @ w_abs.T
    if not forward.startswith("native"):
        bound += np.abs(logits) * 2.0**-9
    return bound * np.float32(1 + 2**-10)  # the bound's own float32 rounding


# --- our side ------------------------------------------------------------------------------------

def causal(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n), dtype=bool))


def all_logits(target, ids: list[int], final_norm: bool = False):
    """Every position's logits [n, vocab] (and, with final_norm, the final-normed rows)."""
    import torch

    from adaspark.model.transformer import rms_norm

    n, last = len(ids), target.config.n_layers - 1
    target.reset()
    out = target.verify(ids, list(range(n)), causal(n), [last] if final_norm else [],
                        return_logits=True)
    target.reset()
    logits = out.logits.float().numpy()
    if not final_norm:
        return logits
    with torch.no_grad():
        h = rms_norm(out.hiddens[last], target.norm, target.config.norm_eps, target.exact)
    return logits, h.float().numpy()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def top2_margin(logits: np.ndarray) -> float:
    """The top logit minus the runner-up's."""
    second, first = np.partition(logits, -2)[-2:]
    return float(first - second)


def parting(ours: np.ndarray, theirs: np.ndarray, bound: np.ndarray, t: int, s: int) -> dict:
    """Where ours picks t and llama.cpp s: both margins and whether rounding explains them. If
    every logit j differs by at most B_j, the two margins sum to at most B_t + B_s. Each side's
    top-2 margin beside (its margin over the other's token is at least that, when the token it
    picked is its argmax here: "argmaxes_picked" says whether both are)."""
    ours_margin, their_margin = float(ours[t] - ours[s]), float(theirs[s] - theirs[t])
    pair = float(bound[t] + bound[s])
    return {"ours_token": int(t), "llamacpp_token": int(s), "ours_margin": ours_margin,
            "llamacpp_margin": their_margin, "pair_head_bound": pair,
            "near_tie": ours_margin + their_margin <= pair,
            "ours_top2_margin": top2_margin(ours), "llamacpp_top2_margin": top2_margin(theirs),
            "argmaxes_picked": int(ours.argmax()) == t and int(theirs.argmax()) == s}


def position_rows(fast: np.ndarray, ref: np.ndarray | None, theirs: np.ndarray,
                  bound: np.ndarray) -> list[dict]:
    rows = []
    for p in range(len(theirs)):
        t, s = int(fast[p].argmax()), int(theirs[p].argmax())
        row = {"max_abs_fast_llama": float(np.abs(fast[p] - theirs[p]).max()),
               "head_bound": float(bound[p].max()), "argmax": [t, s]}
        row["ratio"] = row["max_abs_fast_llama"] / row["head_bound"]
        if t != s:
            row["parting"] = parting(fast[p], theirs[p], bound[p], t, s)
        if ref is not None:
            row["max_abs_ref_llama"] = float(np.abs(ref[p] - theirs[p]).max())
            row["max_abs_fast_ref"] = float(np.abs(fast[p] - ref[p]).max())
            row["argmax"].append(int(ref[p].argmax()))
        rows.append(row)
    return rows


def summarize_positions(rows: list[dict]) -> dict:
    agree = [r["argmax"][0] == r["argmax"][1] for r in rows]
    out = {"positions": len(rows), "argmax_agree_fast_llama": sum(agree) / len(rows),
           "argmax_differences_not_near_ties": sum(not r["parting"]["near_tie"]
                                                   for r in rows if "parting" in r),
           "max_abs_fast_llama": max(r["max_abs_fast_llama"] for r in rows),
           "median_ratio": statistics.median(r["ratio"] for r in rows),
           "max_ratio": max(r["ratio"] for r in rows),
           "within_head_bound": sum(r["ratio"] <= 1 for r in rows) / len(rows)}
    if "max_abs_ref_llama" in rows[0]:
        out["max_abs_ref_llama"] = max(r["max_abs_ref_llama"] for r in rows)
        out["max_abs_fast_ref"] = max(r["max_abs_fast_ref"] for r in rows)
        out["argmax_agree_ref_llama"] = sum(r["argmax"][2] == r["argmax"][1]
                                            for r in rows) / len(rows)
    return out


class Check:
    """Our engine, our reference model and llama.cpp's worker on one GGUF."""

    def __init__(self, model: Path, worker: LogitsWorker, n_ctx: int, reference: bool):
        from adaspark.engine import Engine
        from adaspark.model.gguf import read_gguf
        from adaspark.model.transformer import Transformer

        self.engine = Engine.load(model, arm="ar", max_context=n_ctx)
        f = read_gguf(model)
        self.ref = (Transformer(f, precision="reference", max_context=n_ctx)
                    if reference else None)
        head = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]
        self.head_type = head.qtype.name
        self.w_abs = np.abs(head.dequantize())
        self.worker = worker
        self.forward = self.engine.forward

    def _reference(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Logits and final-normed rows of the reference path (of the fast path without it)."""
        out = all_logits(self.ref or self.engine.target, ids, final_norm=True)
        self.engine.reset()
        return out

    def _bound(self, h: np.ndarray, fast: np.ndarray) -> np.ndarray:
        return head_bound(h, self.w_abs, self.head_type, self.forward, fast)

    def logits(self, ids: list[int]) -> dict:
        fast = all_logits(self.engine.target, ids)
        self.engine.reset()
        ref, h = self._reference(ids)
        theirs = self.worker.logits(ids)
        rows = position_rows(fast, ref if self.ref is not None else None, theirs,
                             self._bound(h, fast))
        return {"summary": summarize_positions(rows), "per_position": rows}

    def greedy(self, ids: list[int], max_tokens: int) -> dict:
        stop_ids = sorted(int(t) for t in self.engine.tokenizer.stop_ids)
        self.engine.reset()
        gen = self.engine.generate_ids(ids, max_tokens=max_tokens)
        ours = gen.token_ids + ([gen.stop_token_id] if gen.stop_token_id is not None else [])
        self.engine.reset()
        theirs = self.worker.greedy(ids, max_tokens, stop_ids)
        same = common_prefix(ours, theirs)
        out = {"same_tokens": same, "reply_tokens": [len(ours), len(theirs)],
               "ours": ours, "llamacpp": theirs, "first_difference": None}
        if same < min(len(ours), len(theirs)):
            out["first_difference"] = self._difference(ids + ours[:same], ours[same],
                                                       theirs[same])
        return out

    def _difference(self, context: list[int], t_ours: int, t_theirs: int) -> dict:
        """Both margins at the first differing reply token, from the common context."""
        last = all_logits(self.engine.target, context)[-1:]
        self.engine.reset()
        theirs = self.worker.logits(context)[-1]
        bound = self._bound(self._reference(context)[1][-1:], last)[0]
        return {"position": len(context), **parting(last[0], theirs, bound, t_ours, t_theirs),
                "max_abs_difference": float(np.abs(last[0] - theirs).max())}


# --- running it ----------------------------------------------------------------------------------

def prompt_ids(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    prompts = []
    for messages in vs.load_prompts(Path(args.conversations), args.prompts, args.max_chars):
        ids = vs.encode(tokenizer, messages, args.raw)
        if len(ids) + args.max_tokens <= args.n_ctx:
            prompts.append(ids)
    if not prompts:
        raise SystemExit(f"no prompt fits a context of {args.n_ctx}")
    return prompts


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    venv = Path(args.venv) if args.venv else vs.default_venv()
    if not vs.venv_python(venv).exists():
        raise SystemExit(f"no llama.cpp at {venv}: benchmarks/vs_llamacpp.py --build-only")
    model = Path(args.model)
    worker = LogitsWorker(venv, model, args.threads, args.n_ctx)
    try:
        check = Check(model, worker, args.n_ctx, not args.no_reference)
        results = []
        for ids in prompt_ids(check.engine.tokenizer, args):
            item = {"prompt_tokens": len(ids), **check.logits(ids)}
            if args.max_tokens > 0:
                item["greedy"] = check.greedy(ids, args.max_tokens)
            results.append(item)
            s = item["summary"]
            print(f"  {len(ids)} tokens: argmax agree {s['argmax_agree_fast_llama']:.3f}, max "
                  f"|fast-llama| {s['max_abs_fast_llama']:.4f}, ratio median "
                  f"{s['median_ratio']:.3f} max {s['max_ratio']:.3f}", file=sys.stderr,
                  flush=True)
    finally:
        worker.close()
    return {"model": str(model), "forward": check.forward, "head_type": check.head_type,
            "llamacpp_version": worker.info["version"],
            "llamacpp_system_info": worker.info["system_info"],
            "bound_definition": "head_bound: max over the vocabulary of the LM head's worst-case "
                                "difference from both engines' activation rounding (module "
                                "docstring); ratio = max |fast - llama| / head_bound",
            "prompts": results, "summary": overall(results)}


def overall(results: list[dict]) -> dict:
    rows = [r for item in results for r in item["per_position"]]
    out = summarize_positions(rows)
    greedy = [item["greedy"] for item in results if "greedy" in item]
    if greedy:
        out["greedy_identical"] = sum(g["first_difference"] is None for g in greedy)
        out["greedy_near_ties"] = sum(bool(g["first_difference"] and
                                           g["first_difference"]["near_tie"]) for g in greedy)
        out["greedy_prompts"] = len(greedy)
    return out


def add_peer_arguments(p: argparse.ArgumentParser, max_tokens: int, max_tokens_help: str
                       ) -> None:
    """The options every peer check against llama.cpp takes (this file, peer_greedy.py)."""
    p.add_argument("--model", required=True, help="a GGUF both engines load")
    p.add_argument("--prompts", type=int, default=4, help="how many prompts")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    p.add_argument("--max-chars", type=int, default=3000, help="skip longer first turns")
    p.add_argument("--n-ctx", type=int, default=1024, help="context for both engines")
    p.add_argument("--threads", type=int, default=2, help="threads for both engines")
    p.add_argument("--raw", action="store_true",
                   help="prompts as text to continue, no chat template (a base model)")
    p.add_argument("--conversations", default=str(vs.CONVERSATIONS),
                   help="evaluation conversations (fixed prompts when missing)")
    p.add_argument("--venv", help="llama.cpp's venv (default: ~/.cache/adaspark/llamacpp/venv)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON object here")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_peer_arguments(p, 32, "greedy reply cap per prompt (0: no greedy comparison)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip our float32 reference path (big models: its dense weights)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(result["summary"], indent=1) if args.out else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
