"""Top-K ("Which Tokens to Use?"): each reducing block keeps the patch tokens the class token attends to
most (attention averaged over heads) and drops the others, with nothing fused."""
from typing import Optional

import torch

from ..matching import PrunePlan, top_k_pruning
from .base import ScheduledReducer
from .evit import EViT


class TopK(ScheduledReducer):
    """Metric: EViT's class-token attention row, computed next to SDPA. Proportional attention is off
    unless asked (kept tokens all have size 1)."""

    name = "topk"
    needs_class_token = True
    metric = EViT.metric

    def plan(self, metric: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[PrunePlan]:
        if r <= 0 or metric.shape[1] - num_prefix < 2:
            return None
        return top_k_pruning(metric, r, num_prefix)
