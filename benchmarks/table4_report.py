"""Table 4's numbers from the replies a table4.py run recorded: pure, no servers or clocks.

Every ratio is adaspark.bench.stats' (the paper's): the geometric mean of per-reply ratios of
client-clock decode speed over the replies both arms gave (same conversation, turn and reply),
with a 95% bootstrap interval resampling conversations. A pair where either reply reached the
cap is left out of the main ratio and counted apart: its own ratio over just those pairs is a
column of its own (a capped reply is a loop under greedy decoding, or a reply cut off by a cap
below its length; either way not the same work as a reply that ended). A reply streamed as a
single delta has no decode interval and is left out.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from adaspark.bench.stats import (
    Ratio,
    Reply,
    arm_speed,
    compare,
    identical_replies,
    replies_by_arm,
)
from adaspark.speculative import DEFAULT_ARM

OUR_PLAIN = "ar"
DEFAULT = DEFAULT_ARM.replace(",", "+")  # the bench spells modifiers with '+'
OUR_ARMS = (OUR_PLAIN, DEFAULT, "adaspark", "ngram")

LLAMA_PLAIN = "llama-server"
DSPARK3, DSPARK7 = "llama-server-dspark3", "llama-server-dspark7"
NGRAM_MOD = "llama-server-ngram-mod"
DSPARK_N_MAX = {DSPARK3: 3, DSPARK7: 7}
LLAMA_ARMS = (LLAMA_PLAIN, DSPARK3, DSPARK7, NGRAM_MOD)

ALL_ARMS = OUR_ARMS + LLAMA_ARMS

# (c): each of our arms against llama.cpp's counterpart on the same GGUF (and drafter file)
HEAD_TO_HEAD = ((DEFAULT, DSPARK3), (DEFAULT, DSPARK7), ("ngram", NGRAM_MOD),
                (OUR_PLAIN, LLAMA_PLAIN))

# llama-server's line when a slot finishes a request that drafted (server-context.cpp)
LOG_ACCEPTANCE = re.compile(r"draft acceptance = [0-9.naif]+ \(\s*(\d+) accepted /\s*(\d+) "
                            r"generated\)")


def is_llama(label: str) -> bool:
    return label in LLAMA_ARMS


def plain_of(label: str) -> str:
    """The arm that is the label's engine decoding plainly (the paper's right-hand column)."""
    return LLAMA_PLAIN if is_llama(label) else OUR_PLAIN


def llama_args(label: str, draft_gguf: str | None, threads: int) -> list[str]:
    """llama-server's options for one of its arms (beyond the model, threads and context); the
    drafter's context gets the target's threads, said rather than left to llama.cpp's default."""
    if label == LLAMA_PLAIN:
        return []
    if label == NGRAM_MOD:
        return ["--spec-type", "ngram-mod"]
    if label in DSPARK_N_MAX:
        if not draft_gguf:
            raise ValueError(f"{label} needs the drafter GGUF")
        return ["--spec-draft-model", str(draft_gguf), "--spec-type", "draft-dspark",
                "--spec-draft-n-max", str(DSPARK_N_MAX[label]), "--spec-draft-threads",
                str(threads), "--spec-draft-threads-batch", str(threads)]
    raise ValueError(f"not a llama-server arm: {label}")


def needs_draft_gguf(labels: list[str]) -> bool:
    return any(label in DSPARK_N_MAX for label in labels)


@dataclass(frozen=True)
class DraftCounts:
    accepted: int
    drafted: int
    source: str  # "stream" (each reply's timings), "log" (llama-server's log), "rounds" (ours)

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def llama_stream_counts(records: list[dict], label: str) -> DraftCounts | None:
    """llama-server's drafted and accepted tokens summed over the label's replies, from the
    `timings` its last stream chunk carries (draft_n, draft_n_accepted: only where it drafted);
    None when no reply reported any."""
    drafted = accepted = 0
    seen = False
    for r in records:
        timings = r.get("timings") or {}
        if r.get("kind") == "reply" and r.get("arm") == label and "draft_n" in timings:
            seen = True
            drafted += int(timings["draft_n"])
            accepted += int(timings.get("draft_n_accepted") or 0)
    return DraftCounts(accepted, drafted, "stream") if seen else None


def llama_log_counts(log_text: str) -> DraftCounts | None:
    """The same counts from llama-server's log lines (every request the log saw, replies a
    resume dropped included); None when it logged none."""
    found = LOG_ACCEPTANCE.findall(log_text)
    if not found:
        return None
    return DraftCounts(sum(int(a) for a, _ in found), sum(int(d) for _, d in found), "log")


def our_round_counts(rounds: list[dict]) -> DraftCounts | None:
    """Accepted draft tokens over verified draft rows (a round's rows less its anchor) from our
    server's round log; None for an arm that never verified a draft row (`ar`)."""
    drafted = sum(int(r["rows"]) - 1 for r in rounds if r.get("rows"))
    accepted = sum(int(r["accepted"]) for r in rounds if r.get("accepted") is not None)
    return DraftCounts(accepted, drafted, "rounds") if drafted else None


def capped_keys(replies: dict) -> set:
    return {key for key, r in replies.items() if r.looped}


def _ratio(r: Ratio) -> dict:
    out = asdict(r)
    out["capped"] = out.pop("looped")
    return out


def pair_ratios(strict: dict[str, dict], loose: dict[str, dict], numerator: str,
                denominator: str, n_boot: int) -> dict:
    """numerator over denominator: over the pairs where neither reached the cap, and apart
    over the pairs where either did (each reply still timed on its own)."""
    capped = capped_keys(strict[numerator]) | capped_keys(strict[denominator])

    def either_capped(a: Reply, _b: Reply) -> bool:
        return a.key in capped

    return {
        "numerator": numerator, "denominator": denominator,
        "ended": _ratio(compare(strict[numerator], strict[denominator], n_boot=n_boot)),
        "capped": _ratio(compare(loose[numerator], loose[denominator], where=either_capped,
                                 n_boot=n_boot)),
    }


def summarise(records: list[dict], labels: list[str], rounds: dict[str, list[dict]] | None = None,
              logs: dict[str, str] | None = None, n_boot: int = 2000) -> dict:
    """Per arm: speed, capped replies, (a) over our `ar`, (b) over its engine's plain decoding,
    draft counts, replies equal to our `ar`; then (c) the head-to-head pairs. Arms with no
    reply are left out (a partial run reports what it has)."""
    strict = replies_by_arm(records)
    loose = replies_by_arm(records, include_capped=True)
    labels = [label for label in labels if label in strict]
    rounds, logs = rounds or {}, logs or {}
    arms = []
    for label in labels:
        speed = arm_speed(strict[label])
        row = {"label": label, "engine": "llama.cpp" if is_llama(label) else "adaspark",
               "plain": plain_of(label), "replies": len(strict[label]),
               "capped": len(capped_keys(strict[label])),
               "tok_s_geomean": speed.geomean, "tok_s_pooled": speed.pooled,
               "tok_s_geomean_all": arm_speed(loose[label]).geomean,  # capped ones too
               "over_ar": None, "over_plain": None, "drafts": None, "same_as_ar": None}
        if label != OUR_PLAIN and OUR_PLAIN in strict:
            row["over_ar"] = pair_ratios(strict, loose, label, OUR_PLAIN, n_boot)
            same = identical_replies(strict[label], strict[OUR_PLAIN])
            row["same_as_ar"] = asdict(same)
        if label != plain_of(label) and plain_of(label) in strict:
            row["over_plain"] = pair_ratios(strict, loose, label, plain_of(label), n_boot)
        if is_llama(label):
            counts = llama_stream_counts(records, label) or llama_log_counts(logs.get(label, ""))
        else:
            counts = our_round_counts(rounds.get(label, []))
        row["drafts"] = asdict(counts) if counts else None
        arms.append(row)
    head = [pair_ratios(strict, loose, a, b, n_boot) for a, b in HEAD_TO_HEAD
            if a in strict and b in strict]
    return {"arms": arms, "head_to_head": head}


def differing_greedy(summary: dict) -> list[str]:
    """Our arms whose greedy replies are not all byte-identical to our `ar`'s (a bug: every arm
    of ours must emit the target's greedy tokens)."""
    return [a["label"] for a in summary["arms"] if a["engine"] == "adaspark"
            and a["same_as_ar"] and a["same_as_ar"]["same"] != a["same_as_ar"]["total"]]


# --- Markdown ---------------------------------------------------------------------------------

def _x(ratio: dict | None) -> str:
    if not ratio or ratio["value"] is None:
        return "–"
    return f"{ratio['value']:.2f}x [{ratio['low']:.2f}, {ratio['high']:.2f}] (n={ratio['n']})"


def _pair(pair: dict | None, which: str) -> str:
    return _x(pair[which]) if pair else "–"


def _counts(drafts: dict | None) -> str:
    if not drafts:
        return "–"
    rate = drafts["accepted"] / drafts["drafted"] if drafts["drafted"] else 0.0
    return f"{drafts['accepted']:,} of {drafts['drafted']:,} ({rate:.1%}, {drafts['source']})"


def _same(same: dict | None) -> str:
    if not same:
        return "–"
    return f"{same['same']}/{same['total']} (first replies {same['same_first']}/" \
           f"{same['total_first']})"


def _speed(arm: dict) -> str:
    return " / ".join("–" if x is None else f"{x:.1f}"
                      for x in (arm["tok_s_geomean"], arm["tok_s_geomean_all"]))


def markdown(summary: dict, header: list[str]) -> str:
    lines = ["# The paper's Table 4 on this CPU", "", *header, ""]
    lines += ["Decode speed: client clock, tokens over first to last streamed delta, per reply. "
              "Ratios: geometric mean of per-reply ratios [95% bootstrap over conversations] "
              "(n = reply pairs). Pairs where either reply reached the cap are left out and "
              "given apart in the last table.", ""]
    lines += ["| server | arm | replies (reached cap) | decode tok/s, geomean (ended / all) | "
              "over our `ar` | "
              "over its own plain decoding | accepted of drafted | replies equal to our `ar` |",
              "|---|---|---|---|---|---|---|---|"]
    for a in summary["arms"]:
        own = "1 (itself)" if a["label"] == a["plain"] else _pair(a["over_plain"], "ended")
        ar = "1 (itself)" if a["label"] == OUR_PLAIN else _pair(a["over_ar"], "ended")
        lines.append(f"| {a['engine']} | `{a['label']}` | {a['replies']} ({a['capped']}) | "
                     f"{_speed(a)} | {ar} | {own} | {_counts(a['drafts'])} | "
                     f"{_same(a['same_as_ar'])} |")
    lines += ["", "Head to head (same GGUF, same threads; DSpark: the same drafter):", "",
              "| ours | over llama-server | ratio | conversations |", "|---|---|---|---|"]
    for p in summary["head_to_head"]:
        lines.append(f"| `{p['numerator']}` | `{p['denominator']}` | {_x(p['ended'])} | "
                     f"{p['ended']['conversations']} |")
    if not summary["head_to_head"]:
        lines.append("| – | – | no pair of arms ran | – |")
    lines += ["", "Pairs where either reply reached the cap, apart:", "",
              "| arm | over our `ar` | over its own plain decoding |", "|---|---|---|"]
    for a in summary["arms"]:
        lines.append(f"| `{a['label']}` | {_pair(a['over_ar'], 'capped')} | "
                     f"{_pair(a['over_plain'], 'capped')} |")
    for p in summary["head_to_head"]:
        lines.append(f"| `{p['numerator']}` over `{p['denominator']}` | {_x(p['capped'])} | |")
    wrong = differing_greedy(summary)
    if wrong:
        lines += ["", f"**Not greedy-exact**: {', '.join(wrong)} gave replies that differ from "
                      "our `ar`'s (every arm of ours must emit the target's greedy tokens)."]
    lines += ["", "Accepted of drafted: llama-server's drafted tokens (`stream`: the `timings` of "
                  "each reply; `log`: its log lines), ours the draft rows our rounds verified "
                  "(`rounds`: a tree verifies several branches, a chain one). llama-server's "
                  "replies equal to ours are informational (another engine's kernels may round "
                  "differently)."]
    return "\n".join(lines) + "\n"
