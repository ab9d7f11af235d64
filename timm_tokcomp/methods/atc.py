"""ATC, Agglomerative Token Clustering (Haurum et al., ECCV 2024): each reducing block clusters its patch tokens
bottom-up, repeatedly joining the two closest clusters under a linkage rule until as many clusters as tokens stay,
on the keys averaged over heads (cosine distance), and each cluster becomes its size-weighted mean. Training-free.
The clustering runs on the device, batched over images, in n - K dependent steps (agglomerative_clusters),
where the authors' code copies the distances to the CPU and runs scikit-learn per image."""
from typing import Optional

import torch

from ..plans import ClusterPlan
from .base import ScheduledReducer, prop_attn_unless_avg_pool
from .params import COMMON, SCHEDULE, Param
from .register import register_method
from ..utils.checks import check_choice


LINKAGES = ("single", "average", "complete")


def check_linkage(linkage: str) -> str:
    """linkage itself, or ValueError naming the valid ones."""
    return check_choice("linkage", linkage, LINKAGES)


def agglomerative_clusters(dist: torch.Tensor, num_clusters: int, linkage: str) -> torch.Tensor:
    """Bottom-up hierarchical clustering of each image's n points from their distances dist: (B, n, n) (the smaller of
    d[i, j] and d[j, i] is used for both), down to num_clusters clusters -> assign (B, n) in [0, num_clusters).

    Each of the n - num_clusters steps merges the two closest clusters (ties: the pair (i, j), i < j, first in
    row-major order; the cluster keeps its lowest point's index) and updates that cluster's distances by the
    Lance-Williams rule of the linkage: 'single' the min, 'complete' the max, 'average' the mean over all pairs of
    points (count-weighted). The steps depend on each other, so this runs n - num_clusters small batched steps:
    rows and columns updated in place in eager mode, by masks (a functional graph) under torch.compile / export.
    Clusters are numbered by their lowest point, ascending."""
    check_linkage(linkage)
    n = dist.shape[1]
    if not 1 <= num_clusters <= n:
        raise ValueError(f"num_clusters must be in [1, {n}], got {num_clusters}")
    with torch.no_grad():
        step = _join_by_masks if torch.compiler.is_compiling() else _join_in_place
        d = dist.float()
        d = torch.minimum(d, d.transpose(1, 2))  # exactly symmetric (a matmul's two halves may round apart)
        d = d.masked_fill(torch.eye(n, dtype=torch.bool, device=dist.device), float("inf"))
        count = torch.ones(dist.shape[0], n, device=dist.device)
        label = torch.arange(n, device=dist.device).expand(dist.shape[0], n)
        for _ in range(n - num_clusters):
            flat = d.flatten(1).argmin(dim=1)
            i, j = flat // n, flat % n  # i < j: d is symmetric and (i, j) comes first in row-major order
            d, count = step(d, count, i, j, linkage)
            label = torch.where(label == j.unsqueeze(1), i.unsqueeze(1), label)
        lowest = label == torch.arange(n, device=dist.device)  # the surviving clusters' lowest points
        return (lowest.long().cumsum(dim=1) - 1).gather(1, label)


def _joined_row(row_i: torch.Tensor, row_j: torch.Tensor, count_i: torch.Tensor, count_j: torch.Tensor,
                linkage: str) -> torch.Tensor:
    """The joined cluster's distances (B, n) by the Lance-Williams rule, from the two rows and counts (B, 1)."""
    if linkage == "single":
        return torch.minimum(row_i, row_j)
    if linkage == "complete":
        return torch.maximum(row_i, row_j)
    return (count_i * row_i + count_j * row_j) / (count_i + count_j)


def _join_in_place(d: torch.Tensor, count: torch.Tensor, i: torch.Tensor, j: torch.Tensor, linkage: str):
    """Join cluster j into i: d (B, n, n) and count (B, n) updated in place (O(B n) per step)."""
    rows = torch.arange(d.shape[0], device=d.device)
    inf = d.new_full((), float("inf"))  # a device tensor: a Python float written by index would be copied each time
    new = _joined_row(d[rows, i], d[rows, j], count[rows, i].unsqueeze(1), count[rows, j].unsqueeze(1), linkage)
    new[rows, i] = inf  # the joined cluster's distance to itself (gone clusters are inf in both rows)
    new[rows, j] = inf
    d[rows, i], d[rows, :, i] = new, new
    d[rows, j], d[rows, :, j] = inf, inf
    count[rows, i] = count[rows, i] + count[rows, j]
    return d, count


def _join_by_masks(d: torch.Tensor, count: torch.Tensor, i: torch.Tensor, j: torch.Tensor, linkage: str):
    """_join_in_place without in-place updates, for graphs that must be functional (O(B n^2) per step)."""
    n = d.shape[1]
    at_i = torch.arange(n, device=d.device) == i.unsqueeze(1)  # (B, n)
    at_j = torch.arange(n, device=d.device) == j.unsqueeze(1)
    row_i = d.gather(1, i.view(-1, 1, 1).expand(-1, 1, n)).squeeze(1)
    row_j = d.gather(1, j.view(-1, 1, 1).expand(-1, 1, n)).squeeze(1)
    count_i, count_j = count.gather(1, i.unsqueeze(1)), count.gather(1, j.unsqueeze(1))
    new = _joined_row(row_i, row_j, count_i, count_j, linkage).masked_fill(at_i | at_j, float("inf"))
    d = torch.where(at_i.unsqueeze(2), new.unsqueeze(1), d)
    d = torch.where(at_i.unsqueeze(1), new.unsqueeze(2), d)
    d = d.masked_fill(at_j.unsqueeze(2) | at_j.unsqueeze(1), float("inf"))
    return d, torch.where(at_i, count_i + count_j, count)


@register_method
class ATC(ScheduledReducer):
    """linkage: 'single', 'average' or 'complete' (the cluster distance: the min, mean or max of its points'
    pairwise distances). Proportional attention is on by default, as ToMe's (off for avg-pooled models). Under
    keep_rate (the study's protocol) the tokens are clustered at the end of the block before each stage; the
    authors cluster inside the stage block, after its attention, so their MACs hold one more attention at the
    larger count per stage."""

    spec = ScheduledReducer.spec.but(
        name="atc",
        export_refusal=None,
        tune_space=({"keep_rate": 0.9},),
        params=(*SCHEDULE,
                Param("linkage", "average", check_linkage,
                      "ATC: the cluster distance, 'single' (min), 'average' (mean) or 'complete' (max) of point pairs"),
                *COMMON),
    )

    default_prop_attn = prop_attn_unless_avg_pool

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k.mean(dim=1)

    def plan(self, metric: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]
             ) -> Optional[ClusterPlan]:
        """metric: (B, N, d) -> the patch tokens' clusters at n - r (at least 1), or None for r = 0."""
        n = metric.shape[1] - num_prefix
        r = max(min(r, n - 1), 0)
        if r == 0:
            return None
        unit = torch.nn.functional.normalize(metric[:, num_prefix:].float(), dim=-1)
        dist = 1 - unit @ unit.transpose(1, 2)
        return ClusterPlan(num_prefix, agglomerative_clusters(dist, n - r, self.linkage), n - r)
