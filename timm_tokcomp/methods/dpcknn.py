"""DPC-KNN merging ("Which Tokens to Use?", after TCFormer): each reducing block picks as many cluster centres
as tokens stay by density-peak clustering of its patch tokens (the block's features; density from the 5
nearest neighbours), every token joins its nearest centre, and each cluster becomes its size-weighted mean
(sizes and source maps tracked as for ToMe)."""
import torch

from ..ops.matching import nearest_centre, pairwise_distances
from .clustering import ClusterMerging
from .register import register_method


def density_peaks(x: torch.Tensor, num_clusters: int, neighbours: int = 5) -> torch.Tensor:
    """DPC-KNN on the tokens x: (B, n, C) -> assign (B, n) in [0, num_clusters).

    Density rho_i = exp(-mean squared distance to the `neighbours` nearest tokens (itself included)), with
    distances scaled by 1 / sqrt(C); delta_i = distance to the nearest denser token (ties: the lower index
    counts as denser; the densest token takes the largest distance). The num_clusters tokens with the largest
    rho * delta are the centres (ties: lower index), and every token joins its nearest centre."""
    B, n, C = x.shape
    with torch.no_grad():
        dist = pairwise_distances(x) / C ** 0.5
        nearest = dist.topk(min(neighbours, n), dim=-1, largest=False).values
        density = (-(nearest ** 2).mean(dim=-1)).exp()  # (B, n)
        index = torch.arange(n, device=x.device)
        denser = (density.unsqueeze(1) > density.unsqueeze(2)) | (
            (density.unsqueeze(1) == density.unsqueeze(2)) & (index.unsqueeze(0) < index.unsqueeze(1)))
        farthest = dist.flatten(1).max(dim=-1).values.view(B, 1, 1)
        delta = torch.where(denser, dist, farthest).min(dim=-1).values
        centres = (density * delta).argsort(dim=-1, descending=True, stable=True)[:, :num_clusters]
        return nearest_centre(dist, centres)


@register_method
class DPCKNN(ClusterMerging):
    """neighbours: k of the k-nearest-neighbour density (the study: 5). Proportional attention as ToMe."""

    spec = ClusterMerging.spec.but(
        name="dpcknn",
        export_refusal=None,
        tune_space=({"keep_rate": 0.9},),
    )
    neighbours = 5

    def cluster(self, tokens: torch.Tensor, num_clusters: int) -> torch.Tensor:
        return density_peaks(tokens, num_clusters, self.neighbours)
