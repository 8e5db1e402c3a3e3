"""`--arm`: the switches that select one of the paper's arms on one Scheduler (round.py).

`Arm.parse("adaspark,gate")` (or `adaspark+gate`) is the default arm; docs/round.md says what each
base and modifier changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from adaspark.errors import UserError

MAX_WIDTH = 64


@dataclass(frozen=True)
class Arm:
    """Switches that select one of the paper's arms; the default is AdaSpark."""

    name: str = "adaspark"
    draft: bool = True  # False: autoregressive, every round is a plain 1-row round
    chain: int | None = None  # a chain of at most this many picks (the spine only)
    pinned: int | None = None  # a fixed width instead of the chooser's
    fitted: bool = True  # False: the head-based estimate prices every tree
    ngram: bool = True
    ratio_rule: bool = False  # the per-round ratio instead of the long-run rate
    hysteresis: bool = True
    plain_rounds: bool = False  # skip drafting when a plain decode step is worth more
    gate: bool = False  # per round, draft or plan from the n-gram index alone (gate.py)
    classes: bool = False  # widths fixed to the kernel's row classes (KERNEL_CLASSES)
    # The default arm's cold start (docs/round.md): the plain step is measured first, and a
    # width only where this round's tree says it could pay, within the request's PROBE_BUDGET.
    # `gate` switches it on with the gate; `ladder` measures the paper's whole ladder instead.
    paced: bool = False
    # Every tree comes from the n-gram index alone and the drafter never runs (`ngram`: the
    # arm for a model without a drafter); a round verifies that tree or one plain row.
    ngram_only: bool = False

    BASES = ("ar", "chain3", "chain", "tree:N", "cost", "adaspark", "adaspark:N", "ngram",
             "ngram:N")
    MODIFIERS = ("head", "no-ngram", "ratio", "no-hysteresis", "plain", "gate", "classes",
                 "ladder")
    # what `ngram` takes: the others switch the drafter's part of a round, which it has not
    NGRAM_MODIFIERS = ("head", "ratio", "no-hysteresis", "classes")

    @property
    def needs_drafter(self) -> bool:
        """The arm runs a drafter's forward in some rounds (not `ar`, not `ngram`)."""
        return self.draft and not self.ngram_only

    @classmethod
    def parse(cls, text: str | Arm) -> Arm:
        """`ar`, `chain3`, `chain`, `tree:N`, `cost`, `adaspark`, `adaspark:N`, `ngram`,
        `ngram:N`, optionally with modifiers after commas or plus signs (`adaspark,gate` ==
        `adaspark+gate`: the bench spells arms with `+` because its arm list is
        comma-separated): head, no-ngram, ratio, no-hysteresis, plain, gate (with the paced
        cold start), classes, ladder (the paper's whole ladder of probes under the gate);
        `ngram` takes head, ratio, no-hysteresis and classes. The name keeps the comma
        spelling."""
        if isinstance(text, Arm):
            return text
        base, *mods = [part.strip() for part in str(text).replace("+", ",").split(",")]
        name, _, width = base.partition(":")
        pinned = None
        if width:
            if name not in ("tree", "adaspark", "ngram"):
                raise UserError(f"arm {base!r}: only tree:N, adaspark:N and ngram:N take a "
                                "width")
            try:
                pinned = int(width)
            except ValueError:
                raise UserError(f"arm {base!r}: the width must be an integer") from None
            if not 1 <= pinned <= MAX_WIDTH:
                raise UserError(f"arm {base!r}: the width must lie in 1..{MAX_WIDTH}")
        if name == "ar":
            arm = cls(name=base, draft=False, ngram=False)
        elif name == "chain3":
            arm = cls(name=base, chain=3, fitted=False, ngram=False)
        elif name == "chain":
            arm = cls(name=base, chain=MAX_WIDTH, fitted=False, ngram=False)
        elif name == "tree" and pinned is not None:
            arm = cls(name=base, pinned=pinned, fitted=False, ngram=False)
        elif name == "cost":
            arm = cls(name=base, fitted=False, ngram=False)
        elif name == "adaspark":
            arm = cls(name=base, pinned=pinned)
        elif name == "ngram":
            # paced: the plain step first, then widths measured only where a tree could pay
            arm = cls(name=base, pinned=pinned, ngram_only=True, paced=True)
            wrong = [m for m in mods if m in cls.MODIFIERS and m not in cls.NGRAM_MODIFIERS]
            if wrong:
                raise UserError(f"arm {text!r}: ngram has no drafter for modifier "
                                f"{wrong[0]!r}; its modifiers: {', '.join(cls.NGRAM_MODIFIERS)}")
        else:
            raise UserError(f"unknown arm {base!r}; arms: {', '.join(cls.BASES)}")
        switches = {"head": {"fitted": False}, "no-ngram": {"ngram": False},
                    "ratio": {"ratio_rule": True}, "no-hysteresis": {"hysteresis": False},
                    "plain": {"plain_rounds": True}, "gate": {"gate": True, "paced": True},
                    "classes": {"classes": True}, "ladder": {"paced": False}}
        for mod in mods:
            if mod not in switches:
                raise UserError(f"arm {text!r}: unknown modifier {mod!r}; "
                                f"modifiers: {', '.join(cls.MODIFIERS)}")
            arm = replace(arm, **switches[mod])
        if "ladder" in mods:  # whatever the order of the modifiers
            arm = replace(arm, paced=False)
        return replace(arm, name=",".join([base, *mods]))

    def at_width(self, width: int) -> Arm:
        """This arm pinned to `width` (its base at :width, its modifiers kept): the sweep's."""
        base, *mods = self.name.split(",")
        return Arm.parse(",".join([f"{base.partition(':')[0]}:{int(width)}", *mods]))
