"""K-Medoids merging ("Which Tokens to Use?"): each reducing block clusters its patch tokens (the block's
features) into as many clusters as tokens stay, with 3 K-Medoids iterations from evenly spaced medoids, and
each cluster becomes its size-weighted mean (sizes and source maps tracked as for ToMe)."""
import torch

from ..ops.matching import float32_linspace, nearest_centre, pairwise_distances
from .clustering import ClusterMerging
from .register import register_method


def k_medoids(x: torch.Tensor, num_clusters: int, iterations: int = 3) -> torch.Tensor:
    """K-Medoids on the tokens x: (B, n, C) -> assign (B, n) in [0, num_clusters).

    Start: num_clusters medoids evenly spaced over the token order. Each iteration assigns every token to its
    nearest medoid and moves each medoid to the member with the least summed distance to its cluster."""
    B, n, _ = x.shape
    with torch.no_grad():
        dist = pairwise_distances(x)
        medoids = float32_linspace(n - 1, num_clusters, x.device).round().long().expand(B, -1)
        for _ in range(iterations):
            # (B, n, K) one-hot membership by scatter: F.one_hot checks its range on the host (a device sync)
            members = dist.new_zeros(B, n, num_clusters).scatter_(2, nearest_centre(dist, medoids).unsqueeze(-1), 1.0)
            cost = torch.bmm(dist, members).masked_fill(members == 0, float("inf"))  # member's cost per cluster
            medoids = cost.argmin(dim=1)
        return nearest_centre(dist, medoids)


@register_method
class KMedoids(ClusterMerging):
    """iterations: K-Medoids steps per reducing block (the study: 3). Proportional attention as ToMe."""

    spec = ClusterMerging.spec.but(
        name="kmedoids",
        export_refusal="onnxruntime's round-off in the pairwise distances (up to 4e-3 where PyTorch's differ) "
                       "flips near-tied cluster assignments, so the exported graph does not match PyTorch",
        tune_space=({"keep_rate": 0.9},),
    )
    iterations = 3

    def cluster(self, tokens: torch.Tensor, num_clusters: int) -> torch.Tensor:
        return k_medoids(tokens, num_clusters, self.iterations)
