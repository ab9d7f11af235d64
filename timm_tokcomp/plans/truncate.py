"""Truncation: the lower bound on any reduction's cost (the 'limit' rows of `tokcomp speed`)."""
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Plan, Reduced


@dataclass
class TruncatePlan(Plan):
    """Keep the first num_keep tokens and drop the rest, with no matching: the lower bound on the cost
    of any reduction to num_keep tokens (the 'limit' rows of `tokcomp speed`)."""

    num_keep: int

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        keep = self.num_keep  # sizes stay None when they were: the limit pays for no size bias
        return x[:, :keep], None if size is None else size[:, :keep], None if source is None else source[:, :keep]
