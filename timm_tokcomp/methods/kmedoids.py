"""K-Medoids merging ("Which Tokens to Use?"): each reducing block clusters its patch tokens (features after
the attention residual) into as many clusters as tokens stay, with 3 K-Medoids iterations, and each cluster
becomes its size-weighted mean (sizes and source maps tracked as for ToMe)."""
from typing import Optional

import torch

from ..matching import ClusterPlan, k_medoids
from .base import ScheduledReducer


class KMedoids(ScheduledReducer):
    """iterations: K-Medoids steps per reducing block (the study: 3)."""

    name = "kmedoids"
    plan_on_tokens = True
    iterations = 3

    def default_prop_attn(self, global_pool: str) -> bool:
        return global_pool != "avg"

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the plan reads the tokens

    def plan(self, tokens: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[ClusterPlan]:
        n = tokens.shape[1] - num_prefix
        r = max(min(r, n - 1), 0)
        if r == 0:
            return None
        return ClusterPlan(num_prefix, k_medoids(tokens[:, num_prefix:], n - r, self.iterations), n - r)
