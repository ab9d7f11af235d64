"""EViT (Liang et al.) as ToCom uses it: each block removes r tokens by keeping the patch tokens the
class token attends to most and fusing the r + 1 least attended ones into one token."""
from typing import Optional

import torch

from ..matching import PrunePlan, attentive_pruning, class_attention
from .base import ScheduledReducer


class EViT(ScheduledReducer):
    """Metric: the class token's attention row, softmaxed and averaged over heads (computed next to
    SDPA at O(N) cost). The fused token is the attention-weighted mean of the pruned tokens and is
    an ordinary token in later blocks. Proportional attention is off unless asked."""

    name = "evit"
    needs_class_token = True

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return class_attention(q, k, attn_bias, scale).mean(dim=1)

    def plan(self, metric: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[PrunePlan]:
        if r <= 0 or metric.shape[1] - num_prefix < 2:
            return None
        return attentive_pruning(metric, r, num_prefix)
