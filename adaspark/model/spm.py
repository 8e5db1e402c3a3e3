"""SentencePiece-style vocabularies (`tokenizer.ggml.model == "llama"`: Gemma, Llama 2) as a
`tokenizers` BPE.

The GGUF holds pieces, scores and token types but no merges. SentencePiece BPE merges, at each
step, the adjacent pair whose concatenation is the highest-scoring piece (llama.cpp's
llm_tokenizer_spm); a BPE whose merges are ranked by the merged piece's score does the same.
The merges are derived the way transformers' SentencePieceExtractor derives them: every split
of a piece into two pieces of the vocabulary, ranked by the whole piece's score. Spaces are
written as U+2581, characters outside the vocabulary fall back to their UTF-8 bytes (<0xNN>
pieces), and `tokenizer.ggml.add_space_prefix` puts a space before each piece of text (llama.cpp
adds it at the start and after every special token, hence prepend "always").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from adaspark.errors import UserError

SPACE = "\u2581"
# SentencePiece / llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def merges_by_score(tokens: Sequence[str], scores: Sequence[float],
                    types: Sequence[int]) -> list[tuple[str, str]]:
    """(left, right) pairs whose join is a normal piece, the best-scoring join first; splits of
    one piece in vocabulary order of (left, right), as transformers orders them."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (piece, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != NORMAL:
            continue
        splits = [(ids[piece[:k]], ids[piece[k:]]) for k in range(1, len(piece))
                  if piece[:k] in ids and piece[k:] in ids]
        ranked.extend((-scores[i], left, right) for left, right in sorted(splits))
    ranked.sort(key=lambda m: m[0])  # stable: ties keep vocabulary order
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def _byte_of(piece: str) -> int | None:
    """The byte a <0xNN> fallback piece stands for."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """What each piece decodes to: its byte for byte pieces, else its text with U+2581 as space
    (control pieces spelled out, as Tokenizer.decode spells them)."""
    out = []
    for piece, kind in zip(tokens, types, strict=True):
        byte = _byte_of(piece) if kind == BYTE else None
        out.append(bytes([byte]) if byte is not None else piece.replace(SPACE, " ").encode())
    return out


def build(metadata: Mapping[str, Any], tokens: Sequence[str],
          types: Sequence[int]) -> HFTokenizer:
    """The BPE tokenizer of a SentencePiece-style GGUF vocabulary."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise UserError("GGUF SentencePiece tokenizer lacks one score per token")
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=merges_by_score(tokens, scores, types),
                     unk_token=tokens[int(unk)] if unk is not None else None,
                     byte_fallback=True, fuse_unk=True)
    hf = HFTokenizer(bpe)
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default
    # split=False: SentencePiece merges across spaces ("▁▁" pieces), so the text stays one piece
    hf.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="always" if prefix else "never", split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    hf.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    # Control and user-defined pieces ("<start_of_turn>", "\n\n", tab runs) match whole in the
    # raw text before anything else, as llama.cpp partitions them out first.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types, strict=True) if k == CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED])
    return hf
