"""The model's own tokenizer and chat template, rebuilt from GGUF metadata.

A GGUF carries no tokenizer.json, only llama.cpp's keys: the vocabulary, the BPE merges, the
token types and a name for the pre-tokenizer (`tokenizer.ggml.pre`). We rebuild a byte-level BPE
with the `tokenizers` library and pick the split regex the way llama.cpp does for that name, so the
ids match what the model was trained on. SentencePiece-style vocabularies (`tokenizer.ggml.model`
"llama": Gemma, Llama 2: pieces with scores, no merges) are built in spm.py. The chat template
(`tokenizer.chat_template`) is rendered with a sandboxed jinja2, the same globals and filters
transformers gives templates.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from jinja2.ext import loopcontrols
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from adaspark.errors import UserError
from adaspark.model import spm

# llama.cpp token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4

# Split regexes, as llama.cpp's llama-vocab.cpp uses them per `tokenizer.ggml.pre`.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                 r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# name -> (split regexes applied in order, ignore_merges); DIGITS = each digit alone, which
# SmolLM's (and StarCoder's) tokenizer.json does before GPT-2's regex. Llama 3 looks whole words
# up in the vocabulary before merging (ignore_merges).
DIGITS = "digits"
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt2": ((_GPT2_SPLIT,), False),
    "gpt-2": ((_GPT2_SPLIT,), False),
    "smollm": ((DIGITS, _GPT2_SPLIT), False),
    "starcoder": ((DIGITS, _GPT2_SPLIT), False),
    "refact": ((DIGITS, _GPT2_SPLIT), False),
    "qwen2": ((_QWEN2_SPLIT,), False),
    "deepseek-r1-qwen": ((_QWEN2_SPLIT,), False),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "smaug-bpe": ((_LLAMA3_SPLIT,), False),
}

# Control tokens that end generation wherever a vocabulary has them (llama.cpp's EOG list).
_END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>",
                      "<end_of_turn>", "<|end|>", "<EOT>")
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")

# A template that ignores `tools` (SmolLM2's does) still gets them, in the system message, in the
# shape SmolLM2 was tuned on for function calling: the tools as JSON inside <tools></tools>, calls
# answered as a JSON list inside <tool_call></tool_call> (adaspark.server.toolcalls parses them),
# and results sent back as a user turn inside <tool_response></tool_response>.
TOOLS_SYSTEM_PROMPT = (
    "You can call functions to answer the user's question. You have access to the following "
    "tools:\n<tools>{tools}</tools>\n\nTo call one or more of them, reply with nothing but the "
    "list of calls, in this format:\n<tool_call>[\n"
    '{{"name": "function_name", "arguments": {{"argument": "value"}}}}'
    "\n]</tool_call>\nIf no function fits the question, answer it normally."
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: the alphabet byte-level vocabularies use."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _read_tokenizer_metadata(source: Any) -> Mapping[str, Any]:
    """Metadata from a path, a mapping, or an object with `.metadata` (adaspark.model.gguf)."""
    if isinstance(source, Mapping):
        return source
    if hasattr(source, "metadata"):
        return source.metadata
    from gguf import GGUFReader

    from adaspark.model.sources import check_gguf_file

    path = check_gguf_file(source)
    try:
        reader = GGUFReader(path)
    except Exception as err:  # gguf raises bare ValueError/struct errors on damaged files
        raise UserError(f"cannot read GGUF metadata from {path}: {err}") from err
    wanted = ("tokenizer.", "general.architecture")
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(wanted)}


class StreamDecoder:
    """Incremental detokenisation: push ids, get the text they complete.

    Bytes of a character split across tokens are held back until the character is whole, so
    the concatenation of all pushes (plus flush) equals Tokenizer.decode of the same ids.
    """

    def __init__(self, token_bytes: Sequence[bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], types: list[int],
                    pre: str) -> tuple[_HFTokenizer, list[bytes]]:
    """GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and each token's bytes."""
    if pre not in _PRE_TOKENIZERS:
        raise UserError(f"unsupported pre-tokenizer {pre!r}; known: {sorted(_PRE_TOKENIZERS)}")
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
    splits, ignore_merges = _PRE_TOKENIZERS[pre]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=ignore_merges)
    hf = _HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True) if r == DIGITS
         else pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>…) must match whole in text, never be cut into bytes.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types, strict=True) if k == CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
    # Each token's bytes, by the ByteLevel decoder's own rule: spelled in the byte alphabet
    # -> those bytes, otherwise the token's UTF-8 as is.
    spelled = {c: b for b, c in _bytes_to_unicode().items()}
    return hf, [bytes(spelled[c] for c in t) if set(t) <= spelled.keys() else t.encode()
                for t in tokens]


class Tokenizer:
    """Tokenizer (byte-level BPE or SentencePiece-style) + chat template of one GGUF model."""

    def __init__(self, metadata: Mapping[str, Any]):
        model = metadata.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UserError(f"unsupported tokenizer type {model!r} (byte-level BPE 'gpt2' or "
                            f"SentencePiece-style 'llama')")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise UserError("GGUF tokenizer has token types for a different vocabulary size")
        self.tokens = tokens
        self.vocab_size = len(tokens)
        if model == "llama":  # Gemma, Llama 2: pieces + scores, byte fallback (spm.py)
            self.pre_tokenizer = "spm"
            self._hf = spm.build(metadata, tokens, types)
            self.token_bytes: list[bytes] = spm.token_bytes(tokens, types)
        else:
            self.pre_tokenizer = metadata.get("tokenizer.ggml.pre", "default")
            self._hf, self.token_bytes = _byte_level_bpe(metadata, tokens, types,
                                                         self.pre_tokenizer)
        self.special_ids = frozenset(i for i, k in enumerate(types) if k == CONTROL)

        self.bos_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        by_name = {t: i for i, t in enumerate(tokens) if i in self.special_ids}
        eot = metadata.get("tokenizer.ggml.eot_token_id")
        if eot is None:
            eot = next((by_name[n] for n in _END_OF_TURN if n in by_name), self.eos_id)
        if eot is None:
            raise UserError("GGUF tokenizer names no end-of-turn or end-of-sequence token")
        self.eot_id: int = int(eot)
        stops = {self.eot_id} | {by_name[n] for n in _END_OF_GENERATION if n in by_name}
        if self.eos_id is not None:
            stops.add(int(self.eos_id))
        self.stop_ids: frozenset[int] = frozenset(stops)
        # None for a model without one (a base model): chat is refused, raw text still works
        self.chat_template: str | None = metadata.get("tokenizer.chat_template") or None

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | Any) -> Tokenizer:
        """From a GGUF path, a parsed GGUF (with `.metadata`) or a metadata mapping."""
        return cls(_read_tokenizer_metadata(source))

    # --- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of text; control tokens written in the text become their ids."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids, control tokens spelled out (nothing is skipped)."""
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.token_bytes)

    # --- chat ---------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        """Whether the GGUF carried tokenizer.chat_template (a base model has none)."""
        return self.chat_template is not None

    @cached_property
    def _template(self) -> tuple[jinja2.Template, set[str]]:
        if self.chat_template is None:  # guessing a format (ChatML) would feed it foreign text
            raise UserError("this model has no chat template (no tokenizer.chat_template in "
                            "its GGUF): give it raw text to continue instead")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def raise_exception(message: str):
            raise UserError(f"chat template: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:  # Llama 3 templates date their system prompt
            return datetime.now().strftime(fmt)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            names = jinja2.meta.find_undeclared_variables(env.parse(self.chat_template))
            return env.from_string(self.chat_template), names
        except jinja2.TemplateError as err:
            raise UserError(f"the model's chat template does not parse: {err}") from err

    @property
    def template_handles_tools(self) -> bool:
        return "tools" in self._template[1]

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The prompt text for messages (role/content dicts), through the model's template."""
        template, _ = self._template
        msgs = [_normalise_message(m) for m in messages]
        if not self.template_handles_tools:
            msgs = _inline_tools(msgs, tools or ())
        special = {"bos_token": self._name(self.bos_id), "eos_token": self._name(self.eos_id)}
        try:
            return template.render(messages=msgs, tools=list(tools) if tools else None,
                                   add_generation_prompt=add_generation_prompt,
                                   **special, **template_kwargs)
        except jinja2.TemplateError as err:
            raise UserError(f"chat template failed: {err}") from err
        except TypeError as err:  # e.g. a message whose fields the template cannot join
            raise UserError(f"chat template failed on these messages: {err}") from err

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt (BOS prepended if the model asks and it is missing)."""
        return self.encode_prompt(
            self.render_chat(messages, tools, add_generation_prompt, **template_kwargs))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt as the model reads it (a rendered chat, or raw text): BOS
        prepended if the model asks and it is missing."""
        ids = self.encode(text)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, int(self.bos_id))
        return ids

    def _name(self, token_id: int | None) -> str:
        return self.tokens[token_id] if token_id is not None else ""


def _normalise_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI-style message -> what templates expect: a role and string content."""
    if "role" not in message:
        raise UserError(f"chat message without a role: {dict(message)!r}"[:200])
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    elif not isinstance(content, str):
        raise UserError(f"message content must be a string or a list of text parts, not "
                        f"{type(content).__name__}")
    return out


def _inline_tools(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]):
    """Tools, tool calls and tool results written as text for a template that knows none of them.

    The tool list (if any) goes at the end of the system message (a new one if there is none);
    an assistant's tool_calls become a <tool_call>[...]</tool_call> list after its content; a
    tool result becomes a user turn holding <tool_response>...</tool_response>.
    """
    out = [dict(m) for m in messages]
    if tools:
        block = TOOLS_SYSTEM_PROMPT.format(tools=json.dumps(list(tools), ensure_ascii=False))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = ",\n".join(json.dumps(_call_json(c), ensure_ascii=False)
                               for c in m["tool_calls"])
            m["content"] = (f"{m['content']}\n" if m["content"] else "") + \
                f"<tool_call>[\n{calls}\n]</tool_call>"
        elif m["role"] == "tool":
            m["role"] = "user"
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
    return out


def _call_json(call: Mapping[str, Any]) -> dict[str, Any]:
    """{"name", "arguments"} of an OpenAI tool call (arguments arrive as a JSON string)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass  # keep the model's own (malformed) text rather than lose it
    return {"name": fn.get("name"), "arguments": args}
