"""AdaSpark: adaptive DSpark tree speculative decoding that learns while it serves."""

import os

# Idle OpenMP threads spin by default; on a small shared CPU (2 cores, a client and a server)
# spinning threads starve each other (measured: 2.5-14 tok/s spinning vs 59 passive under
# load). Set before torch is imported; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
