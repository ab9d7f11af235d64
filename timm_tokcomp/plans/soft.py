"""Soft merging: every output a convex combination of the non-prefix tokens (PatchMerger, Sinkhorn, SiT)."""
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Plan, Reduced, ones_like_size


@dataclass
class SoftPlan(Plan):
    """Soft merging: every output token is a convex combination of the non-prefix tokens.

    num_prefix: leading tokens copied unchanged.
    weight: (B, M, n) mixing weights, each output row summing to 1 over the n inputs (x_out = weight @ x).
    Each input's size and source map are shared out over the outputs in proportion to the weights it
    gives them (the weights' columns normalised to 1), so sizes still count patches and every patch
    stays held with total weight 1. Output order: prefix tokens, then the M outputs.
    """

    num_prefix: int
    weight: torch.Tensor


    @property
    def shares(self) -> torch.Tensor:
        """(B, M, n) the weights with every column normalised to sum 1: how each input is shared out."""
        return self.weight / self.weight.sum(dim=1, keepdim=True).clamp_min(torch.finfo(self.weight.dtype).tiny)

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        shares = self.shares
        return (soft_mix(x, self, self.weight), soft_mix(ones_like_size(x, size), self, shares),
                None if source is None else soft_mix(source, self, shares))


def soft_mix(t: torch.Tensor, plan: SoftPlan, weight: torch.Tensor) -> torch.Tensor:
    """Prefix rows unchanged, then weight @ the non-prefix rows: (B, N, C) -> (B, p + M, C)."""
    p = plan.num_prefix
    return torch.cat([t[:, :p], weight.to(t.dtype) @ t[:, p:]], dim=1)
