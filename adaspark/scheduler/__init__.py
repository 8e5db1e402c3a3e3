"""AdaSpark's scheduler: numpy only, no engine imports; `Scheduler` is the round API (round.py)."""

from adaspark.scheduler.arm import Arm
from adaspark.scheduler.plan import Outcome, Plan
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.tree import Block

__all__ = ["Arm", "Block", "Outcome", "Plan", "Scheduler"]
