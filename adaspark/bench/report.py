"""`adaspark report DIR`: Markdown tables shaped like the paper's and PNG figures from a bench run.

Tables follow the paper's Tables 2, 3, 4, 6, 7, 8, 9 and 10 as far as the run's arms allow; a
table whose arms were not run is left out with a note. Table 2 (acceptance log loss) and Table 7
(mechanism counts) come from the round logs, whose fields scheduler/record.py defines. Ratios are
geometric means of per-reply ratios with 95% bootstrap intervals over conversations (stats.py).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from adaspark.bench import plots
from adaspark.bench.rounds import has, load_rounds
from adaspark.bench.runner import RUN_FILE, ResultsFile
from adaspark.bench.servers import ADASPARK, SECOND_RUN
from adaspark.bench.stats import (
    BANDS,
    Ratio,
    arm_speed,
    band,
    compare,
    from_source,
    identical_replies,
    in_band,
    mean_of_runs,
    replies_by_arm,
)
from adaspark.errors import UserError

PINNED = re.compile(r"^adaspark:(\d+)$")


def _ratio(r: Ratio) -> str:
    if r.value is None:
        return "–"
    return f"{r.value:.3f}× [{r.low:.3f}, {r.high:.3f}]"


def _num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pct(part: float, whole: float) -> str:
    return "–" if not whole else f"{part / whole:.1%}"


def _is_rate(field: str) -> bool:
    """A per-reply mean or rate is averaged over replies, not summed."""
    return "mean" in field or field.endswith(("tok_s", "_rate", "per_round"))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


class Report:
    def __init__(self, out_dir: Path, n_boot: int = 2000, include_capped: bool = False):
        self.dir = out_dir
        self.n_boot = n_boot
        self.include_capped = include_capped
        run_path = out_dir / RUN_FILE
        self.run = json.loads(run_path.read_text()) if run_path.exists() else {}
        self.records = records = ResultsFile(out_dir).load()
        self.errors = [r for r in records if r.get("kind") == "conversation"
                       and r.get("status") == "error"]
        self.raw = replies_by_arm(records, include_capped)
        if not self.raw:
            raise UserError(f"{out_dir}: no replies in {out_dir / 'results.jsonl'}")
        listed = self.run.get("settings", {}).get("arms", [])
        self.labels = [a for a in listed if a in self.raw] + sorted(set(self.raw) - set(listed))
        self.external = list(self.run.get("settings", {}).get("external", {}))
        self.arms = {label: self.raw[label] for label in self.labels}
        second = ADASPARK + SECOND_RUN
        self.two_runs = ADASPARK in self.raw and second in self.raw
        if self.two_runs:  # AdaSpark's speed on a reply is the mean of its two runs (§3.4)
            self.arms[ADASPARK] = mean_of_runs(self.raw[ADASPARK], self.raw[second])
            del self.arms[second]
        self.sources = list(dict.fromkeys(r.source for rs in self.raw.values()
                                          for r in rs.values()))
        ids = {label: {r["response_id"] for r in records if r.get("kind") == "reply"
                       and r.get("arm") == label and r.get("response_id")} for label in self.raw}
        self.rounds = load_rounds(out_dir, list(self.raw), ids)

    def cmp(self, a: str, b: str, where=None) -> Ratio:
        return compare(self.arms[a], self.arms[b], where, n_boot=self.n_boot)

    def base(self) -> str:
        for name in (*self.external, "ar", "chain3"):
            if name in self.arms:
                return name
        return next(iter(self.arms))

    def pinned(self) -> list[tuple[int, str]]:
        found = [(int(m.group(1)), a) for a in self.arms if (m := PINNED.match(a))]
        return sorted(found)

    # ---- sections -------------------------------------------------------------------------

    def header(self) -> list[str]:
        s = self.run.get("settings", {})
        lines = ["# Bench report", ""]
        lines.append(f"- conversations: `{s.get('conversations', '?')}` "
                     f"(sha256 {s.get('conversations_sha256', '?')}), subset: "
                     f"{s.get('subset') or 'all'}, cap: {s.get('cap', '?')} tokens")
        lines.append(f"- arms, in run order: {', '.join(s.get('arms', self.labels))}")
        if s.get("temperature", 0) > 0:
            lines.append(f"- **sampled** at temperature {s['temperature']} (base seed "
                         f"{s.get('seed', 0)}): each request's seed comes from the base seed and "
                         "its conversation turn, the same for every arm")
        for url_name, url in s.get("external", {}).items():
            lines.append(f"- external arm `{url_name}`: {url}")
        for inv in self.run.get("invocations", []):
            m = inv.get("machine", {})
            lines.append(f"- run {inv.get('started')}: `{shlex.join(inv.get('argv') or [])}` on "
                         f"{m.get('cpu')}, {m.get('cpus_usable')} usable CPUs, "
                         f"{m.get('memory')}, {m.get('platform')}, Python {m.get('python')}")
        if self.two_runs:
            lines.append("- `adaspark` ran before the other arms and again after them "
                         "(`adaspark#2`); its speed on a reply is the mean of the two runs.")
        lines.append("- Ratios: geometric mean of per-reply client-clock decode-speed ratios, "
                     "95% bootstrap interval over conversations; replies that reached the cap "
                     "(loops) or streamed one delta are left out and counted.")
        if self.include_capped:
            lines.append("- **Replies that reached the cap are kept** (`--include-capped`): the "
                         "cap cut them off; they are not counted as loops.")
        if self.errors:
            lines.append(f"- {len(self.errors)} conversation(s) ended in a server error: "
                         + "; ".join(f"{e['arm']} {e['conversation']}: {e.get('error', '')[:80]}"
                                     for e in self.errors[:5]))
        return lines + [""]

    def end_to_end(self) -> list[str]:
        lines = ["## End to end (Table 4)", ""]
        rows = []
        for label in self.labels:
            name = label if label in self.arms else None
            if name is None:
                continue
            sp = arm_speed(self.arms[name])
            raw = self.raw[name]
            rows.append([name, str(len(raw)), str(sp.n), str(sp.looped), str(sp.single_delta),
                         _num(sp.geomean), _num(sp.pooled)])
        if self.two_runs:  # each run on its own, beside their per-reply mean above
            for label in (ADASPARK, ADASPARK + SECOND_RUN):
                sp = arm_speed(self.raw[label])
                rows.append([f"{label} (this run alone)", str(len(self.raw[label])), str(sp.n),
                             str(sp.looped), str(sp.single_delta), _num(sp.geomean),
                             _num(sp.pooled)])
        lines += _table(["arm", "replies", "timed", "looped", "single delta",
                         "tok/s (geo-mean per reply)", "tok/s (pooled)"], rows)
        if ADASPARK in self.arms:
            lines += ["AdaSpark over each other arm:", ""]
            rows = []
            for other in self.arms:
                if other == ADASPARK:
                    continue
                r = self.cmp(ADASPARK, other)
                rows.append([f"adaspark / {other}", _ratio(r), str(r.n), str(r.conversations),
                             str(r.looped), str(r.single_delta)])
            if self.two_runs:
                r = compare(self.raw[ADASPARK + SECOND_RUN], self.raw[ADASPARK],
                            n_boot=self.n_boot)
                rows.append(["adaspark#2 / adaspark (again)", _ratio(r), str(r.n),
                             str(r.conversations), str(r.looped), str(r.single_delta)])
            lines += _table(["comparison", "ratio [95% CI]", "replies", "conversations",
                             "looped", "single delta"], rows)
        return lines

    def headline(self) -> list[str]:
        if ADASPARK not in self.arms:
            return []
        lines = ["## Headline", ""]
        for other in [*self.external, "ar", "chain3"]:
            if other in self.arms:
                lines.append(f"- AdaSpark over `{other}`: {_ratio(self.cmp(ADASPARK, other))}")
        best = self.best_pinned()
        if best:
            r = self.cmp(ADASPARK, best)
            lines.append(f"- AdaSpark over the best pinned width (`{best}`): {_ratio(r)}")
        return lines + [""]

    def best_pinned(self) -> str | None:
        scored = [(self.cmp(a, ADASPARK).value or 0.0, a) for _, a in self.pinned()]
        return max(scored)[1] if scored and ADASPARK in self.arms else None

    def width_table(self) -> list[str]:
        pinned = self.pinned()
        if not pinned or ADASPARK not in self.arms:
            return ["## The width (Table 3)", "", "Not run: needs `adaspark` and `adaspark:N`.", ""]
        best = self.best_pinned()
        lines = ["## The width (Table 3)", "",
                 "Each pinned arm's speed over AdaSpark's (above 1: faster than AdaSpark); "
                 "best pinned width in bold.", ""]
        header = ["replies", "n", *[f"{n} rows" for n, _ in pinned], "AdaSpark / best", "again"]
        rows = []
        for name, where in [("all replies", None), *[(b, in_band(b)) for b in BANDS]]:
            cells = []
            for _, arm in pinned:
                value = _num(self.cmp(arm, ADASPARK, where).value, 3)
                cells.append(f"**{value}**" if arm == best else value)
            vs_best = self.cmp(ADASPARK, best, where)
            again = "–"
            if self.two_runs:
                second = compare(self.raw[ADASPARK + SECOND_RUN], self.raw[ADASPARK], where,
                                 n_boot=self.n_boot)
                again = _num(second.value, 3)
            rows.append([name, str(vs_best.n), *cells, _ratio(vs_best), again])
        return lines + _table(header, rows)

    def by_source(self) -> list[str]:
        base = self.base()
        lines = ["## By source (Tables 6 and 8)", "",
                 f"First row: `{base}` tok/s (geo-mean per reply); every other row: the arm over "
                 f"`{base}`.", ""]
        speeds = [_num(arm_speed(self.arms[base], lambda r, s=s: r.source == s).geomean)
                  for s in self.sources]
        rows = [[f"{base} (tok/s)", *speeds, _num(arm_speed(self.arms[base]).geomean)]]
        for arm in self.arms:
            if arm == base:
                continue
            cells = [_num(self.cmp(arm, base, from_source(s)).value, 3) for s in self.sources]
            rows.append([arm, *cells, _ratio(self.cmp(arm, base))])
        lines += _table(["arm", *self.sources, "all replies"], rows)
        if ADASPARK in self.arms and "chain3" in self.arms:
            lines += ["AdaSpark over `chain3` by source (the scheduler's gain, Table 8):", ""]
            rows = [[s, _ratio(self.cmp(ADASPARK, "chain3", from_source(s)))]
                    for s in self.sources]
            rows.append(["all replies", _ratio(self.cmp(ADASPARK, "chain3"))])
            lines += _table(["source", "adaspark / chain3"], rows)
        return lines

    def by_band(self) -> list[str]:
        base = self.base()
        counts = {b: sum(1 for r in self.arms[base].values()
                         if band(r.context) == b) for b in BANDS}
        lines = ["## By context band (prompt plus half the reply)", "",
                 f"Every arm over `{base}`; replies of `{base}` per band: "
                 + ", ".join(f"{b}: {n}" for b, n in counts.items()), ""]
        rows = [[arm, *[_ratio(self.cmp(arm, base, in_band(b))) for b in BANDS]]
                for arm in self.arms if arm != base]
        return lines + _table(["arm", *BANDS], rows)

    def mechanism(self) -> list[str]:
        lines = ["## Mechanism counts from the round logs (Table 7)", ""]
        if not self.rounds:
            return lines + ["No round logs (plain decoding and external arms write none).", ""]
        header = ["", *self.rounds]
        stats: dict[str, list[str]] = {}

        def add(name: str, fn) -> None:
            stats.setdefault(name, []).extend([fn(rs) for rs in self.rounds.values()])

        def total(rs, f):
            return sum(r[f] for r in has(rs, f))

        def past_anchor(rs):
            return sum(r["rows"] - 1 for r in has(rs, "rows"))

        add("rounds", lambda rs: f"{len(rs):,}")
        add("cold-start rounds", lambda rs: f"{sum(bool(r.get('cold')) for r in rs):,}")
        add("plain 1-row rounds", lambda rs: f"{sum(r.get('rows') == 1 for r in rs):,}")
        add("n-gram tree rounds without the drafter (gate)", lambda rs: "{:,}".format(sum(
            r.get("drafted") is False and r.get("rows", 1) > 1 for r in rs)))
        add("mean rows verified", lambda rs: _num(
            past_anchor(rs) / max(len(has(rs, "rows")), 1) + 1, 2))
        add("tokens per round", lambda rs: _num(
            (total(rs, "accepted") + len(has(rs, "accepted"))) / max(len(has(rs, "accepted")), 1),
            2))
        add("verified rows held by n-gram-only nodes",
            lambda rs: _pct(total(rs, "rows_ngram"), past_anchor(rs)) if has(rs, "rows_ngram")
            else "n/a")
        add("accepted draft tokens from n-gram-only nodes",
            lambda rs: _pct(total(rs, "accepted_ngram"), total(rs, "accepted"))
            if has(rs, "accepted_ngram") else "n/a")
        add("accepted draft tokens from nodes both proposed",
            lambda rs: _pct(total(rs, "agreed"), total(rs, "accepted"))
            if has(rs, "agreed") else "n/a")
        for kind, acc, rows in [("drafter-only", "accepted_drafter", "rows_drafter"),
                                ("both proposed", "agreed", "rows_agreed"),
                                ("n-gram-only", "accepted_ngram", "rows_ngram")]:
            add(f"acceptance rate, {kind} nodes",
                lambda rs, a=acc, n=rows: _pct(total(rs, a), total(rs, n))
                if has(rs, a, n) else "n/a")

        def with_ngram(rs):
            return [r for r in rs if (r.get("rows_ngram") or 0) + (r.get("rows_agreed") or 0) > 0]

        add("rounds with n-gram candidates",
            lambda rs: f"{len(with_ngram(rs)):,}" if has(rs, "rows_ngram") else "n/a")
        add("of those, rounds the n-gram widened",
            lambda rs: _pct(sum(bool(r.get("ngram_widened")) for r in with_ngram(rs)),
                            len(with_ngram(rs))) if has(rs, "ngram_widened") else "n/a")
        return lines + _table(header, [[name, *cells] for name, cells in stats.items()])

    def acceptance(self) -> list[str]:
        """Table 2: log loss per labelled node of the head-based estimate and the fitted model,
        both scored on a round's labels before either learned from them, by source; the first
        request of each arm's log (an empty store) is left out, as in the paper."""
        lines = ["## Acceptance prediction (Table 2)", ""]
        logs = {label: has(rs, "labels", "logloss_fitted", "logloss_head")
                for label, rs in self.rounds.items()}
        logs = {label: rs for label, rs in logs.items() if any(r["labels"] for r in rs)}
        if not logs:
            return lines + ["No round log carries acceptance labels (needs a drafting arm).", ""]
        rows = []
        for label, rs in logs.items():
            source_of = {r.get("response_id"): r.get("source") for r in self.records
                         if r.get("kind") == "reply" and r.get("arm") == label}
            first = self.rounds[label][0].get("request")  # the run's first, from an empty store
            later = [r for r in rs if r.get("request") != first]
            groups: dict[str, list[dict]] = {}
            for r in later:
                groups.setdefault(source_of.get(r.get("request")) or "?", []).append(r)
            for name, group in [*sorted(groups.items()), ("all", later)]:
                nodes = sum(r["labels"] for r in group)
                head = sum(r["logloss_head"] for r in group)
                fitted = sum(r["logloss_fitted"] for r in group)
                trees = [r for r in group if (r.get("rows") or 1) > 1]
                priced = sum(bool(r.get("fitted_prices")) for r in trees)
                rows.append([label, name, f"{len({r.get('request') for r in group}):,}",
                             f"{nodes:,}", _num(head / nodes if nodes else None, 4),
                             _num(fitted / nodes if nodes else None, 4),
                             _pct(head - fitted, head), _pct(priced, len(trees))])
        header = ["arm", "source", "requests", "nodes", "head-based", "fitted", "change",
                  "priced"]
        note = ("Log loss per labelled node (nats); change: how much lower the fitted model's "
                "is; priced: tree rounds whose tree the fitted model priced (the guard's "
                "choice). Every request but each log's first.")
        return lines + [note, ""] + _table(header, rows)

    def kernel_classes(self) -> list[str]:
        """Table 9: learned widths over the kernel's row classes (`adaspark+classes`)."""
        lines = ["## Learned against kernel-class widths (Table 9)", ""]
        classes = next((a for a in self.arms if a.replace("+", ",") == "adaspark,classes"), None)
        if ADASPARK not in self.arms or classes is None:
            return lines + ["Not run: needs `adaspark` and `adaspark+classes`.", ""]
        rows = [["all replies", _ratio(self.cmp(ADASPARK, classes))]]
        rows += [[name, _ratio(self.cmp(ADASPARK, classes, in_band(name)))] for name in BANDS]
        return lines + _table(["", "adaspark / adaspark+classes"], rows)

    def server_timings(self) -> list[str]:
        """Totals of the numeric fields of each reply's server `timings` object."""
        per_arm: dict[str, dict[str, float]] = {}
        for label in self.labels:
            sums: dict[str, list[float]] = {}
            for reply in self._records_of(label):
                for key, value in (reply.get("timings") or {}).items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        sums.setdefault(key, []).append(float(value))
            if sums:
                per_arm[label] = {k: (sum(v) / len(v) if _is_rate(k) else sum(v))
                                  for k, v in sums.items()}
        if not per_arm:
            return []
        keys = list(dict.fromkeys(k for d in per_arm.values() for k in d))
        rows = [[label, *[_num(d.get(k), 3) for k in keys]] for label, d in per_arm.items()]
        return (["## Server timings (summed over replies; means and rates averaged)", ""]
                + _table(["arm", *keys], rows))

    def sampling(self) -> list[str]:
        """At temperature > 0: how many replies each arm ran to the cap (greedy loops are why
        one samples), and how many match the first arm's (position-keyed noise: the same seed
        gives the same reply on every arm, up to the fast kernels' near-ties)."""
        temperature = self.run.get("settings", {}).get("temperature", 0)
        if not temperature or temperature <= 0:
            return []
        first = self.labels[0]
        rows = []
        for label in self.labels:
            records = self._records_of(label)
            capped = sum(bool(r.get("reached_cap")) for r in records)
            same = identical_replies(self.raw[first], self.raw[label])
            rows.append([label, str(len(records)), str(capped), f"{same.same}/{same.total}"])
        return ([f"## Sampling (temperature {temperature})", ""]
                + _table(["arm", "replies", "reached the cap", f"identical to {first}"], rows))

    def _records_of(self, label: str) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "reply" and r.get("arm") == label]

    def identical(self) -> list[str]:
        references = [a for a in (ADASPARK, "ar") if a in self.raw]
        if not references or len(self.raw) < 2:
            return []
        lines = ["## Byte-identical replies (Table 10)", "",
                 "Text and reasoning compared as bytes (`adaspark`: its first run). Later turns "
                 "carry each arm's own replies, so one difference carries forward.", ""]
        rows = []
        for reference in references:
            for other in self.raw:
                if other in references[: references.index(reference) + 1]:
                    continue
                same = identical_replies(self.raw[reference], self.raw[other])
                rows.append([reference, other, f"{same.same}/{same.total}",
                             f"{same.same_first}/{same.total_first}"])
        return lines + _table(["arm", "against", "all replies", "first turns"], rows)

    def figures(self) -> list[str]:
        lines = ["## Figures (from the round logs)", ""]
        for name, (draw, needs) in plots.FIGURES.items():
            path = draw(self.rounds, self.dir / "figures" / name) if self.rounds else None
            if path is None:
                lines.append(f"- {name}: not drawn (round logs lack the fields: {needs})")
            else:
                lines += [f"![{name}](figures/{name})", ""]
        return lines + [""]

    def markdown(self) -> str:
        sections = [self.header(), self.sampling(), self.headline(), self.end_to_end(),
                    self.width_table(),
                    self.by_source(), self.by_band(), self.acceptance(), self.mechanism(),
                    self.kernel_classes(), self.server_timings(),
                    self.identical(), self.figures()]
        return "\n".join(line for section in sections for line in section)


def write_report(out_dir: Path, n_boot: int = 2000, include_capped: bool = False) -> Path:
    if not out_dir.is_dir():
        raise UserError(f"not a bench directory: {out_dir}")
    report = Report(out_dir, n_boot=n_boot, include_capped=include_capped)
    path = out_dir / "report.md"
    path.write_text(report.markdown())
    return path

