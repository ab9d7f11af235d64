"""Sinkhorn merging (a learned soft-merging method of "Which Tokens to Use?"): PatchMerger's learned queries and
scores S = W LayerNorm(x)^T / sqrt(D) (M, n), but the assignment is balanced by Sinkhorn's algorithm with entropy
eps = 1: starting from log K = S / eps, each of 3 iterations normalises every input's weights over the M outputs
to 1 and then every output's weights over the n inputs to n / M (equal mass per output token). Each output token
is then the weighted mean of its inputs (its row normalised to 1). Sizes and source maps are shared out by the
weights, as for PatchMerger."""
import math

import torch

from .patchmerger import MergerLayer, PatchMerger, PatchMergerParams
from .register import register_method

ITERATIONS = 3
EPSILON = 1.0


class SinkhornLayer(MergerLayer):
    """PatchMerger's layer (LayerNorm, queries (M, D)) with Sinkhorn-balanced weights."""

    def weights(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, n, D) -> (B, M, n) mixing weights, each row summing to 1."""
        keys = self.norm(tokens)
        scores = torch.einsum("md,bnd->bmn", self.queries.to(keys.dtype), keys).float() * keys.shape[-1] ** -0.5
        log_k = scores / EPSILON
        m, n = log_k.shape[1], log_k.shape[2]
        for _ in range(ITERATIONS):
            log_k = log_k - log_k.logsumexp(dim=1, keepdim=True)  # every input: total weight 1
            log_k = log_k - log_k.logsumexp(dim=2, keepdim=True) + math.log(n / m)  # every output: n / M
        return log_k.softmax(dim=-1).to(tokens.dtype)


class SinkhornParams(PatchMergerParams):
    """Sinkhorn's parameters: PatchMerger's shape, Sinkhorn layers."""

    layer_class = SinkhornLayer


@register_method
class Sinkhorn(PatchMerger):
    """Learned queries with Sinkhorn-balanced soft assignment; parameters as `merger_params`, on the model as
    model.tokcomp['sinkhorn']."""

    spec = PatchMerger.spec.but(
        name="sinkhorn",
        holds_patches="soft",
        learned_class=SinkhornParams,
    )
