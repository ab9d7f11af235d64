"""K-Medoids merging ("Which Tokens to Use?"): each reducing block clusters its patch tokens (the block's
features) into as many clusters as tokens stay, with 3 K-Medoids iterations from evenly spaced medoids, and
each cluster becomes its size-weighted mean (sizes and source maps tracked as for ToMe)."""
import torch

from ..matching import k_medoids
from .base import ClusterMerging


class KMedoids(ClusterMerging):
    """iterations: K-Medoids steps per reducing block (the study: 3). Proportional attention as ToMe."""

    name = "kmedoids"
    export_refusal = ("onnxruntime's round-off in the pairwise distances (up to 4e-3 where PyTorch's differ) "
                      "flips near-tied cluster assignments, so the exported graph does not match PyTorch")
    tune_space = ({"keep_rate": 0.9},)
    iterations = 3

    def cluster(self, tokens: torch.Tensor, num_clusters: int) -> torch.Tensor:
        return k_medoids(tokens, num_clusters, self.iterations)
