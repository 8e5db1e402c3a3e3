"""A routed (mixture-of-experts) FFN on the torch path (reference and fast precision), as
llama.cpp's build_moe_ffn runs it for qwen3moe and lfm2moe:

    logits = W_router h                      (float32: the file keeps the router F32)
    p      = softmax(logits) | sigmoid(logits)
    chosen = top-k of p (+ exp_probs_b where the architecture has it; ties: lower expert first)
    w      = p[chosen] / max(sum p[chosen], 2^-14)   (renormalised where norm_weights)
    out    = sum over ranks r = 0..k-1 of w_r * down_e(silu(gate_e h) * up_e h),  e = chosen[r]

Experts are the slices of three 3-D tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps:
[experts, rows, inputs]); each expert's projections are made from its slice (a view of the
file's blocks, no copy) when a row first routes to it. The rows routed to one expert run as
one matmul; each row's expert outputs are then added in rank order (its highest weight first),
so a row's result is the same whatever rows share the call (with the reference's exact_linear,
bit for bit) - the native forward (native/moe.h) keeps the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaspark.model.config import Experts
from adaspark.model.gguf import GGUFTensor
from adaspark.model.kernels import Linear, exact_linear

PARTS = ("gate", "up", "down")
WEIGHT_SUM_FLOOR = 6.103515625e-5  # llama.cpp clamps the chosen weights' sum (fp16's smallest)


def expert_slice(t: GGUFTensor, expert: int) -> GGUFTensor:
    """Expert `expert`'s [rows, inputs] matrix of a 3-D expert tensor: a view of its blocks."""
    return GGUFTensor(f"{t.name}[{expert}]", t.qtype, t.shape[1:], t.data[expert])


def row_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) as softmax over (x, 0): torch.sigmoid's vector body and scalar tail round
    differently, and which elements fall in the tail depends on the tensor's size, so a row's
    probabilities would depend on how many rows share the call; softmax over the last dim
    runs each (row, expert) pair alike."""
    return torch.softmax(torch.stack([x, torch.zeros_like(x)], -1), -1)[..., 0]


def route(scores: torch.Tensor, experts: Experts,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [m, k] expert ids, best first; their weights [m, k] float32) from the router's
    logits [m, E] float32. A stable sort breaks ties towards the lower expert id."""
    p = torch.softmax(scores, -1) if experts.gating == "softmax" else row_sigmoid(scores)
    select = p if bias is None else p + bias
    chosen = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :experts.used]
    weights = p.gather(-1, chosen)
    if experts.norm_weights:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=WEIGHT_SUM_FLOOR)
    return chosen, weights


class MoE:
    """One routed layer: the router [E, dim] and selection bias [E] float32, the expert
    tensors as stored; each expert's Linear made when first used."""

    def __init__(self, tensors: dict[str, GGUFTensor], router: torch.Tensor,
                 bias: torch.Tensor | None, experts: Experts, precision: str,
                 device: torch.device):
        self.tensors, self.experts = tensors, experts
        self.router = router.float().reshape(experts.count, -1).contiguous()
        self.bias = None if bias is None else bias.float().reshape(-1)
        self._precision, self._device = precision, device
        self._linears: dict[int, tuple[Linear, Linear]] = {}

    def expert(self, e: int) -> tuple[Linear, Linear]:
        """Expert e's (gate|up, down) projections."""
        if e not in self._linears:
            t = self.tensors
            self._linears[e] = (
                Linear([expert_slice(t["gate"], e), expert_slice(t["up"], e)],
                       self._precision, self._device),
                Linear([expert_slice(t["down"], e)], self._precision, self._device))
        return self._linears[e]

    def linears(self) -> list[Linear]:
        return [lin for e in range(self.experts.count) for lin in self.expert(e)]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [m, dim] float32 (the normed rows) -> route()'s (chosen, weights)."""
        return route(exact_linear(h.float(), self.router, None), self.experts, self.bias)

    def __call__(self, h: torch.Tensor, kernel: str, act: torch.dtype) -> torch.Tensor:
        """h [m, dim] float32 normed rows -> [m, dim] in act dtype."""
        chosen, weights = self.route(h)
        m, k = chosen.shape
        x = h.to(act)
        ranked = torch.zeros(m, k, h.shape[1], dtype=torch.float32, device=h.device)
        for e in torch.unique(chosen).tolist():  # ascending: one matmul per expert
            rows, ranks = (chosen == e).nonzero(as_tuple=True)
            gate_up, down = self.expert(e)
            gate, up = gate_up(x[rows], kernel).chunk(2, dim=-1)
            y = down(F.silu(gate) * up, kernel).float()
            ranked[rows, ranks] = y * weights[rows, ranks, None]
        out = ranked[:, 0]
        for r in range(1, k):  # rank order, whatever the experts' order above
            out = out + ranked[:, r]
        return out.to(act)
