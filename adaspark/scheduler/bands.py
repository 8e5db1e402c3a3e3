"""Context bands: contexts grouped by the bit length of their token count (§3.2, §3.4).

API (stable):
    context_band(context: int) -> int    bit length of the context (0 for 0, 8 for 128-255, ...)
    CONTEXT_UNIT                         the context scale u = c / 8192 of Eq. (4) and the gains

The cost model keeps its sample bank per band and the width chooser its long-run rate per band,
so both see the same partition: 128-255 tokens, 256-511, and so on.
"""

from __future__ import annotations

from adaspark.errors import UserError

# The context scale of every learned context term (cost laws, gains, acceptance): u = c / unit.
CONTEXT_UNIT = 8192.0


def context_band(context: int) -> int:
    """The band of a context of `context` tokens: its bit length."""
    c = int(context)
    if c < 0:
        raise UserError(f"context length must be >= 0, got {context!r}")
    return c.bit_length()
