"""CrossGET (Shi et al., ICML 2024) on a single-modality ViT: complete-graph soft matching guided by a query token,
with an importance-weighted ("ensemble") merge. In each reducing block, between attention and MLP:

1. S: the cosine similarities of the patch tokens' keys (concatenated over heads), its diagonal -inf.
2. Each token's best similarity m_i; the tokens ranked by it (descending), and m'_i, token i's best similarity among
   the tokens ranked after it (-inf for the last): of two similar tokens only the earlier ranked counts as redundant.
3. Importance imp_i: the cosine of token i's key with the guiding query. CrossGET's cross token is learned against
   the other modality; a single-modality model has none, so the class token's own query guides (our adaptation:
   nothing is added to the model, and r = 0 leaves it unchanged).
4. The r tokens with the smallest imp_i - m'_i are the sources; each merges into its most similar non-source patch
   token. Every group becomes the mean of its members weighted by size x exp(imp) (for one source and unit sizes:
   the softmax of the two importances, as the paper's ensemble), sizes summed; the other tokens keep their order.
Training-free. Implemented from the paper's description and its authors' account of the code (BSD-3-Clause);
no code copied."""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..plans import MergePlan, Reduced
from ..plans.merge import merge_sum
from .base import ScheduledReducer, prop_attn_unless_avg_pool
from .register import register_method


class GuidedKeys(NamedTuple):
    """What a reducing block's attention hands CrossGET: keys (B, N, C) concatenated over heads, and the guiding
    query (B, C), the class token's."""

    keys: torch.Tensor
    query: torch.Tensor


@dataclass
class WeightedMergePlan(MergePlan):
    """A MergePlan whose groups are means weighted by size x weight: weight (B, n, 1) per non-prefix token, > 0."""

    weight: Optional[torch.Tensor] = None

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x (B, N, C), size (B, N, 1) or None, source (B, N, N0) or None -> x: each group's weighted mean, sizes and
        source maps summed, N - r tokens."""
        p = self.num_prefix
        size = x.new_ones(x.shape[0], x.shape[1], 1) if size is None else size
        weight = torch.cat([self.weight.new_ones(x.shape[0], p, 1), self.weight], dim=1).to(x.dtype) * size
        total = merge_sum(torch.cat([x * weight, weight, size], dim=-1), self)
        x_sum, w_sum, new_size = total.split([x.shape[-1], 1, 1], dim=-1)
        return x_sum / w_sum, new_size, None if source is None else merge_sum(source, self)


def guided_matching(keys: torch.Tensor, query: torch.Tensor, r: int, num_prefix: int) -> WeightedMergePlan:
    """CrossGET's matching of r sources (clamped to [0, n // 2] for n patch tokens) on keys (B, N, C) guided by
    query (B, C) (see the module docstring) -> the plan: sources as A, the other patch tokens as B, both ascending,
    so the output keeps the tokens' order."""
    B, N, _ = keys.shape
    n = N - num_prefix
    r = max(min(r, n // 2), 0)
    k = keys[:, num_prefix:].float()
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(k.dtype).tiny)
    q = query.float()
    importance = (k @ (q / q.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)).unsqueeze(-1))[..., 0]
    with torch.no_grad():
        sim = k @ k.transpose(1, 2)
        eye = torch.eye(n, dtype=torch.bool, device=keys.device)
        sim = sim.masked_fill(eye, float("-inf"))
        rank = sim.amax(dim=-1).argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # (B, n)
        later = rank.unsqueeze(1) > rank.unsqueeze(2)  # [b, i, j]: j ranked after i
        redundancy = sim.masked_fill(~later, float("-inf")).amax(dim=-1)
        order = (importance - redundancy).argsort(dim=-1, stable=True)
        a_idx = order[:, :r].sort(dim=-1).values
        b_idx = order[:, r:].sort(dim=-1).values
        to_b = sim.gather(1, a_idx.unsqueeze(-1).expand(-1, -1, n)).gather(2, b_idx.unsqueeze(1).expand(-1, r, -1))
        dst_idx = to_b.argmax(dim=-1)  # ties: the lower index
    arange = torch.arange(r, device=keys.device).expand(B, -1)
    return WeightedMergePlan(num_prefix, 0, a_idx.new_zeros(B, 0), arange, dst_idx, a_idx, b_idx,
                             weight=importance.exp().unsqueeze(-1))


@register_method
class CrossGET(ScheduledReducer):
    """Needs a class token (its query guides). Proportional attention on by default (off for avg-pooled models), as
    in the paper's code. r <= n // 2 per block."""

    spec = ScheduledReducer.spec.but(
        name="crossget",
        export_refusal=None,
        needs_class_token=True,
        tune_space=({"keep_rate": 0.9}, {"keep_rate": 0.7}),
    )
    min_keep_rate = 0.5
    default_prop_attn = prop_attn_unless_avg_pool

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> GuidedKeys:
        B, H, N, d = k.shape
        return GuidedKeys(k.transpose(1, 2).reshape(B, N, H * d), q[:, :, 0].reshape(B, H * d))

    def plan(self, metric: GuidedKeys, r: int, num_prefix: int, size: Optional[torch.Tensor]
             ) -> Optional[WeightedMergePlan]:
        if r <= 0 or (metric.keys.shape[1] - num_prefix) // 2 == 0:
            return None
        return guided_matching(metric.keys, metric.query, r, num_prefix)
