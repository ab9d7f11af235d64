"""ATC, Agglomerative Token Clustering (Haurum et al., ECCV 2024): each reducing block clusters its patch tokens
bottom-up, repeatedly joining the two closest clusters under a linkage rule until as many clusters as tokens stay,
on the keys averaged over heads (cosine distance), and each cluster becomes its size-weighted mean. Training-free.
The clustering runs on the device, batched over images, in n - K dependent steps (matching.agglomerative_clusters),
where the authors' code copies the distances to the CPU and runs scikit-learn per image."""
from typing import Optional

import torch

from ..matching import agglomerative_clusters, check_linkage
from ..plans import ClusterPlan
from .base import ScheduledReducer, prop_attn_unless_avg_pool
from .params import COMMON, SCHEDULE, Param


class ATC(ScheduledReducer):
    """linkage: 'single', 'average' or 'complete' (the cluster distance: the min, mean or max of its points'
    pairwise distances). Proportional attention is on by default, as ToMe's (off for avg-pooled models). Under
    keep_rate (the study's protocol) the tokens are clustered at the end of the block before each stage; the
    authors cluster inside the stage block, after its attention, so their MACs hold one more attention at the
    larger count per stage."""

    name = "atc"
    export_refusal = None
    tune_space = ({"keep_rate": 0.9},)
    PARAMS = (*SCHEDULE,
              Param("linkage", "average", check_linkage,
                    "ATC: the cluster distance, 'single' (min), 'average' (mean) or 'complete' (max) of point pairs"),
              *COMMON)

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
