"""AdaSpark's scheduler: numpy only, no engine imports; `Scheduler` is the round API (round.py)."""

from adaspark.scheduler.round import Arm, Outcome, Plan, Scheduler
from adaspark.scheduler.tree import Block

__all__ = ["Arm", "Block", "Outcome", "Plan", "Scheduler"]
