"""Regenerate the HF transformers reference data in this folder (by hand, never in CI).

    python3 -m venv /tmp/hfref
    /tmp/hfref/bin/pip install torch==2.13.0 transformers gguf accelerate
    /tmp/hfref/bin/python tests/data/make_hf_reference.py [MODEL.gguf]

Writes, for the embedded default model (SmolLM2-135M-Instruct Q4_1):
- tokenizer_reference.json: HF's ids for varied texts, and its chat-template renderings;
- hf_greedy_reference.json: HF's float32 greedy continuation (64 tokens) of fixed chat prompts,
  with the top-1/top-2 logit gap of every step (a tiny gap marks a near-tie a float32
  rounding difference may flip).

Transformers builds its tokenizer and float32 weights from the same GGUF (dequantised), so the
tests compare against an independent implementation without needing transformers at run time.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = Path.home() / ".cache/adaspark/models/SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 64

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've done it, you'd agree. DON'T SHOUT",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i);\n}",
    "Numbers: 0 7 42 2024 3.14159 -1e-9 1,000,000 0x1F 12345678901234567890",
    "whitespace:  two   three    four\n\n\nthree newlines\t\ttabs \r\n crlf   ",
    "   leading spaces and trailing spaces   ",
    "Ünïcödé: café naïve façade — “quotes” ‘single’ … ∑ ∞ → ©",
    "中文字符和日本語のテキスト、한국어 텍스트",
    "Emoji: 🙂🚀👍🏽 👨‍👩‍👧 flags 🇫🇷",
    "Arabic العربية and Hebrew עברית and Devanagari हिन्दी",
    "e\u0301 combining accent, zero\u200bwidth space, nbsp\u00a0here",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after an end token<|im_end|>",
    "URL: https://example.com/path?q=a&b=c#frag email a.b@c.org",
    "JSON: {\"key\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "Markdown **bold** _it_ `code` # Heading\n- item\n1. first",
    "",
    " ",
    "\n",
    "a",
]

PROMPTS = {
    "haiku": [{"role": "user", "content": "Write a haiku about the sea."}],
    "system": [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "What is the capital of France, and why is it famous?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "12 times 7 is 84."},
        {"role": "user", "content": "Now divide that by 4 and explain each step."},
    ],
    "code": [{"role": "user", "content": "Write a Python function that checks whether a "
                                         "string is a palindrome."}],
}


def qwen2_split_encodings(model_path: Path) -> list[dict]:
    """The same vocabulary cut by the qwen2 pre-tokenizer, as transformers builds it for a GGUF
    whose tokenizer.ggml.pre is "qwen2" (checks our qwen2 split without a Qwen file)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(model_path))
    qwen2 = dict(tokenizer_dict, pre_tokenizer_type="qwen2")
    backend, _ = convert_gguf_tokenizer(architecture, qwen2)
    return [{"text": t, "ids": backend.encode(t, add_special_tokens=False).ids} for t in TEXTS]


def main() -> None:
    model_path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MODEL
    folder, name = str(model_path.parent), model_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    encodings = [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TEXTS]
    renders = {k: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
               for k, m in PROMPTS.items()}
    (HERE / "tokenizer_reference.json").write_text(json.dumps(
        {"model": name, "encodings": encodings, "chat_renders": renders,
         "qwen2_split_encodings": qwen2_split_encodings(model_path)},
        ensure_ascii=False, indent=1) + "\n")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    cases = []
    for key, messages in PROMPTS.items():
        prompt = tok(renders[key], add_special_tokens=False)["input_ids"]
        ids, gaps = list(prompt), []
        past = None
        with torch.no_grad():
            step_input = torch.tensor([ids])
            for _ in range(NEW_TOKENS):
                out = model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float()
                top = torch.topk(logits, 2)
                nxt = int(top.indices[0])
                gaps.append(round(float(top.values[0] - top.values[1]), 5))
                ids.append(nxt)
                if nxt == tok.eos_token_id:
                    break
                step_input = torch.tensor([[nxt]])
        output = ids[len(prompt):]
        cases.append({"name": key, "messages": messages, "prompt_ids": prompt,
                      "output_ids": output, "text": tok.decode(output), "top2_gaps": gaps})
        print(key, len(output), "min gap", min(gaps), repr(tok.decode(output))[:100])
    (HERE / "hf_greedy_reference.json").write_text(json.dumps(
        {"model": name, "new_tokens": NEW_TOKENS, "eos_id": tok.eos_token_id,
         "transformers": __import__("transformers").__version__, "cases": cases},
        ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
