"""Merging by clustering: a reducing block's patch tokens (its features, not a metric) become as many clusters as
tokens stay, each cluster its size-weighted mean (k-medoids, DPC-KNN)."""
from abc import abstractmethod
from typing import Optional

import torch

from ..plans import ClusterPlan
from .base import PlansOnTokens, ScheduledReducer, prop_attn_unless_avg_pool


class ClusterMerging(PlansOnTokens, ScheduledReducer):
    """A method that merges each reducing block's patch tokens (the block's features, not a metric) into as
    many clusters as tokens stay; every cluster becomes its size-weighted mean. Subclasses give cluster()."""

    default_prop_attn = prop_attn_unless_avg_pool

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the plan reads the tokens

    @abstractmethod
    def cluster(self, tokens: torch.Tensor, num_clusters: int) -> torch.Tensor:
        """tokens: (B, n, C) patch tokens -> (B, n) cluster index in [0, num_clusters), none empty."""

    def plan(self, tokens: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[ClusterPlan]:
        n = tokens.shape[1] - num_prefix
        r = max(min(r, n - 1), 0)
        if r == 0:
            return None
        return ClusterPlan(num_prefix, self.cluster(tokens[:, num_prefix:], n - r), n - r)
