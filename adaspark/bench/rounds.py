"""Reading the engine's round log (`adaspark serve --round-log FILE`).

One JSON object per line, one line per decode round. The reader tolerates any missing field (a
figure or table that needs it is skipped and says so) and ignores fields it does not know.
Times are in seconds; token counts exclude the round's bonus token unless said otherwise.

| field            | type        | meaning                                                         |
|------------------|-------------|-----------------------------------------------------------------|
| arm              | str         | the server's --arm                                              |
| request          | str         | the chat completion's id (`id` of its response / SSE chunks)    |
| ctx              | int         | committed context length in tokens when the round starts        |
| width_offered    | int or list | widths the cost model offered (list), or the widest one (int)   |
| width            | int         | the width chosen for the verify (rows it may take)              |
| rows             | int         | rows actually verified, anchor included (1 = a plain round)     |
| accepted         | int         | draft tokens accepted (committed tokens = accepted + 1)         |
| accepted_drafter | int         | of those, from nodes only the drafter proposed                  |
| accepted_ngram   | int         | of those, from nodes only the n-gram index proposed             |
| agreed           | int         | of those, from nodes both proposed                              |
| D                | float       | fixed per-round cost: drafter forward + tree build              |
| verify           | float       | the target's verify forward                                     |
| commit           | float       | accept walk + cache commits                                     |
| pred_S           | float       | expected accepted nodes at the chosen width (null: unpriced)    |
| pred_T           | float       | cost model's verify time for the chosen width (null: none)      |

Optional fields the report uses when present (Table 7, Figures 8-10):

| field            | type  | meaning                                                              |
|------------------|-------|----------------------------------------------------------------------|
| rows_drafter     | int   | verified rows held by drafter-only nodes                             |
| rows_ngram       | int   | verified rows held by n-gram-only nodes                              |
| rows_agreed      | int   | verified rows held by nodes both sources proposed                    |
| ngram_widened    | bool  | the n-gram candidates moved the chooser to a wider width             |
| cold             | bool  | a cold-start round at a width chosen for measurement, not by price   |
| plain            | bool  | a 1-row round without drafting (width 1)                             |
| drafted          | bool  | the drafter ran (false: a plain round or a draft-gated n-gram round) |
| gate_bucket      | int   | the draft gate's bucket (n-gram evidence at the anchor; -1: none)    |
"""

from __future__ import annotations

import json
from pathlib import Path

from adaspark.bench.servers import file_stem

NUMERIC = ("ctx", "width", "rows", "accepted", "accepted_drafter", "accepted_ngram", "agreed",
           "D", "verify", "commit", "pred_S", "pred_T", "rows_drafter", "rows_ngram",
           "rows_agreed")


def _clean(record: dict) -> dict | None:
    if not isinstance(record, dict):
        return None
    out = dict(record)
    for name in NUMERIC:
        value = out.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out[name] = None
    return out


def read_round_log(path: Path) -> list[dict]:
    rounds = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = _clean(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a killed server
            if record is not None:
                rounds.append(record)
    return rounds


def load_rounds(
    out_dir: Path, labels: list[str], request_ids: dict[str, set[str]] | None = None
) -> dict[str, list[dict]]:
    """Round logs per arm label, from `out_dir/rounds/<label's file stem>/part-*.jsonl`.

    With `request_ids` (per label, the response ids the results kept) rounds of requests whose
    replies were dropped on resume are left out; a log without matching ids is kept whole.
    """
    out: dict[str, list[dict]] = {}
    for label in labels:
        folder = out_dir / "rounds" / file_stem(label)
        parts = sorted(folder.glob("part-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
        rounds = [r for part in parts for r in read_round_log(part)]
        kept = (request_ids or {}).get(label)
        if kept and any(r.get("request") in kept for r in rounds):
            rounds = [r for r in rounds if r.get("request") in kept]
        if rounds:
            out[label] = rounds
    return out


def has(rounds: list[dict], *fields: str) -> list[dict]:
    """The rounds that carry every named field (not null)."""
    return [r for r in rounds if all(r.get(f) is not None for f in fields)]
