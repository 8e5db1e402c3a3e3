"""Reading the engine's round log (`adaspark serve --round-log FILE`).

One JSON object per line, one line per decode round, in the schema scheduler/record.py defines
(RoundRecord.to_json; that module's table names every field). The reader tolerates any missing
field (a figure or table that needs it is skipped and says so), ignores fields it does not know,
and nulls a numeric field that is not a number. Times are in seconds; token counts exclude the
round's bonus token unless said otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from adaspark.bench.servers import file_stem

NUMERIC = ("ctx", "width", "rows", "accepted", "accepted_drafter", "accepted_ngram", "agreed",
           "D", "verify", "commit", "pred_S", "pred_T", "rows_drafter", "rows_ngram",
           "rows_agreed", "labels", "logloss_fitted", "logloss_head")


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
