"""DPC-KNN merging ("Which Tokens to Use?", after TCFormer): each reducing block picks as many cluster centres
as tokens stay by density-peak clustering of its patch tokens (the block's features; density from the 5
nearest neighbours), every token joins its nearest centre, and each cluster becomes its size-weighted mean
(sizes and source maps tracked as for ToMe)."""
import torch

from ..matching import density_peaks
from .base import ClusterMerging


class DPCKNN(ClusterMerging):
    """neighbours: k of the k-nearest-neighbour density (the study: 5). Proportional attention as ToMe."""

    name = "dpcknn"
    export_refusal = None
    tune_space = ({"keep_rate": 0.9},)
    neighbours = 5

    def cluster(self, tokens: torch.Tensor, num_clusters: int) -> torch.Tensor:
        return density_peaks(tokens, num_clusters, self.neighbours)
