"""Top-K ("Which Tokens to Use?"): each reducing block keeps the patch tokens the class token attends to
most (attention averaged over heads) and drops the others, with nothing fused."""
from typing import Optional

import torch

from ..ops.matching import class_attention
from ..plans import PrunePlan
from .base import ScheduledReducer
from .register import register_method


def top_k_pruning(cls_attn: torch.Tensor, r: int, num_prefix: int) -> PrunePlan:
    """Top-K: keep the non-prefix tokens the class token attends to most, drop the r others (ties: the lower
    index is kept). cls_attn: (B, N) as in attentive_pruning; r clamped so that one non-prefix token remains."""
    n = cls_attn.shape[1] - num_prefix
    r = max(min(r, n - 1), 0)
    with torch.no_grad():
        order = cls_attn[:, num_prefix:].argsort(dim=-1, descending=True, stable=True)
        return PrunePlan(num_prefix, order[:, : n - r].sort(dim=-1).values)


@register_method
class TopK(ScheduledReducer):
    """Metric: EViT's class-token attention row, computed next to SDPA. Proportional attention is off
    unless asked (kept tokens all have size 1)."""

    spec = ScheduledReducer.spec.but(
        name="topk",
        holds_patches="dropped",
        export_refusal=None,
        tune_space=({"keep_rate": 0.9}, {"keep_rate": 0.7}),
        needs_class_token=True,
    )

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return class_attention(q, k, attn_bias, scale).mean(dim=1)

    def plan(self, metric: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[PrunePlan]:
        if r <= 0 or metric.shape[1] - num_prefix < 2:
            return None
        return top_k_pruning(metric, r, num_prefix)
