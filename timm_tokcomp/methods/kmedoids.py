"""K-Medoids merging ("Which Tokens to Use?"): each reducing block clusters its patch tokens (the block's
features) into as many clusters as tokens stay, with 3 K-Medoids iterations from evenly spaced medoids, and
each cluster becomes its size-weighted mean (sizes and source maps tracked as for ToMe)."""
import torch

from ..matching import nearest_centre, pairwise_distances
from .clustering import ClusterMerging


def evenly_spaced(n: int, k: int, device: torch.device) -> torch.Tensor:
    """k positions in [0, n) evenly spaced, ends included: (k,) long, torch.linspace(0, n - 1, k).round() computed
    as linspace computes it in float32 (its halves from each end), bit for bit (checked for every n < 1300). Written
    out so that a compiled block keeps n and k symbolic: one graph for every block (linspace specialises its count)."""
    j = torch.arange(k, device=device, dtype=torch.float32)
    end = torch.full((), n - 1, device=device, dtype=torch.float32)
    step = end / max(k - 1, 1)
    return torch.where(j < max(k // 2, 1), step * j, end - step * (k - 1 - j)).round().long()


def k_medoids(x: torch.Tensor, num_clusters: int, iterations: int = 3) -> torch.Tensor:
    """K-Medoids on the tokens x: (B, n, C) -> assign (B, n) in [0, num_clusters).

    Start: num_clusters medoids evenly spaced over the token order. Each iteration assigns every token to its
    nearest medoid and moves each medoid to the member with the least summed distance to its cluster."""
    B, n, _ = x.shape
    with torch.no_grad():
        dist = pairwise_distances(x)
        medoids = evenly_spaced(n, num_clusters, x.device).expand(B, -1)
        for _ in range(iterations):
            # (B, n, K) one-hot membership by scatter: F.one_hot checks its range on the host (a device sync)
            members = dist.new_zeros(B, n, num_clusters).scatter_(2, nearest_centre(dist, medoids).unsqueeze(-1), 1.0)
            cost = torch.bmm(dist, members).masked_fill(members == 0, float("inf"))  # member's cost per cluster
            medoids = cost.argmin(dim=1)
        return nearest_centre(dist, medoids)


class KMedoids(ClusterMerging):
    """iterations: K-Medoids steps per reducing block (the study: 3). Proportional attention as ToMe."""

    name = "kmedoids"
    export_refusal = ("onnxruntime's round-off in the pairwise distances (up to 4e-3 where PyTorch's differ) "
                      "flips near-tied cluster assignments, so the exported graph does not match PyTorch")
    tune_space = ({"keep_rate": 0.9},)
    iterations = 3

    def cluster(self, tokens: torch.Tensor, num_clusters: int) -> torch.Tensor:
        return k_medoids(tokens, num_clusters, self.iterations)
