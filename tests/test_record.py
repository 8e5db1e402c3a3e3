"""The round log's line (RoundRecord.to_json): every field under its own name, its list a copy."""

from __future__ import annotations

from dataclasses import fields

from adaspark.scheduler.record import ChosenBy, RoundRecord


def record(**kw) -> RoundRecord:
    base = dict(ctx=40, width=4, rows=3, chosen_by=ChosenBy.CHOOSER, accepted=2, D=1e-3,
                verify=4e-3, commit=1e-4, width_offered=[2, 4], pred_S=1.5, gate_bucket=2,
                rows_drafter=1, rows_ngram=1, rows_agreed=0, arm="adaspark", request="r1")
    return RoundRecord(**{**base, **kw})


def test_every_field_and_the_derived_ones():
    r = record()
    line = r.to_json()
    assert set(line) == {f.name for f in fields(RoundRecord)} | {"cold", "plain"}
    assert line["chosen_by"] == "chooser" and not line["cold"] and not line["plain"]
    assert all(line[f.name] == getattr(r, f.name) for f in fields(RoundRecord)
               if f.name != "chosen_by")
    assert RoundRecord.from_json(line) == r


def test_a_plain_round_has_no_row_split_and_its_list_is_a_copy():
    r = record(width=1, rows=1, chosen_by=ChosenBy.PLAIN, accepted=0, width_offered=[1],
               rows_drafter=None, rows_ngram=None, rows_agreed=None)
    line = r.to_json()
    assert line["plain"] and not {"rows_drafter", "rows_ngram", "rows_agreed"} & set(line)
    line["width_offered"].append(8)  # a reader changing its row leaves the record alone
    assert r.width_offered == [1]
