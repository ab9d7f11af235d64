"""DPC-KNN merging ("Which Tokens to Use?", after TCFormer): each reducing block picks as many cluster centres
as tokens stay by density-peak clustering of its patch tokens (features after the attention residual; density
from the 5 nearest neighbours), every token joins its nearest centre, and each cluster becomes its
size-weighted mean (sizes and source maps tracked as for ToMe)."""
from typing import Optional

import torch

from ..matching import ClusterPlan, density_peaks
from .base import ScheduledReducer


class DPCKNN(ScheduledReducer):
    """neighbours: k of the k-nearest-neighbour density (the study: 5)."""

    name = "dpcknn"
    plan_on_tokens = True
    neighbours = 5

    def default_prop_attn(self, global_pool: str) -> bool:
        return global_pool != "avg"

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the plan reads the tokens

    def plan(self, tokens: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[ClusterPlan]:
        n = tokens.shape[1] - num_prefix
        r = max(min(r, n - 1), 0)
        if r == 0:
            return None
        return ClusterPlan(num_prefix, density_peaks(tokens[:, num_prefix:], n - r, self.neighbours), n - r)
