"""Clustering: every non-prefix token joins one cluster, each output the size-weighted mean of one (K-Medoids,
DPC-KNN, ATC, MCTF's merged attention)."""
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Plan, Reduced, weighted_mean


@dataclass
class ClusterPlan(Plan):
    """Merge the non-prefix tokens into clusters (each output token: the size-weighted mean of one cluster).

    num_prefix: leading tokens copied unchanged.
    assign: (B, n) int64, the cluster in [0, num_clusters) of each non-prefix token; every cluster non-empty.
    Output order: prefix tokens, then the clusters by index.
    """

    num_prefix: int
    assign: torch.Tensor
    num_clusters: int

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        x, size = weighted_mean(x, size, lambda t: cluster_sum(t, self))
        return x, size, None if source is None else cluster_sum(source, self)


def cluster_sum(t: torch.Tensor, plan: ClusterPlan) -> torch.Tensor:
    """Sum every cluster: (B, N, C) -> (B, p + num_clusters, C)."""
    p = plan.num_prefix
    rest = t[:, p:]
    sums = rest.new_zeros(rest.shape[0], plan.num_clusters, rest.shape[2])
    sums = sums.scatter_add(1, plan.assign.unsqueeze(-1).expand(-1, -1, rest.shape[2]), rest)
    return torch.cat([t[:, :p], sums], dim=1)


def cluster_attention(probs: torch.Tensor, plan: ClusterPlan, weight: torch.Tensor) -> torch.Tensor:
    """Attention probabilities merged as the plan merges their tokens: probs (B, H, N, N), weight (B, N, 1) each
    token's weight in its cluster's mean -> (B, H, M, M). A cluster's key column is the sum of its members' (what they
    receive together); its query row is their weighted mean, so every row still sums to 1."""
    B, H, N, _ = probs.shape
    p, M = plan.num_prefix, plan.num_prefix + plan.num_clusters
    group = torch.cat([torch.arange(p, device=probs.device).expand(B, -1), p + plan.assign], dim=1)  # (B, N)
    share = weight / cluster_sum(weight, plan).gather(1, group.unsqueeze(-1))  # (B, N, 1): sums to 1 per cluster
    cols = probs.new_zeros(B, H, N, M).scatter_add(3, group.view(B, 1, 1, N).expand(B, H, N, N), probs)
    rows = cols * share.to(probs.dtype).view(B, 1, N, 1)
    return probs.new_zeros(B, H, M, M).scatter_add(2, group.view(B, 1, N, 1).expand(B, H, N, M), rows)
