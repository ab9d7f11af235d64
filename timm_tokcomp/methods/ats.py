"""ATS, the Adaptive Token Sampler ("Which Tokens to Use?", after Fayyaz et al.): each reducing block scores the
patch tokens by significance, the class token's attention times the norm of their values (summed over heads,
normalised), and keeps the tokens that inverse-transform sampling of as many points as tokens may stay picks.
A token picked twice is kept once, so r is only an upper bound: images keep different counts. The batch keeps
its largest count and pads the other images with size-0 tokens, which the log-size attention bias keeps out
of attention and the pooling ignores; `last_stats(model).real_tokens_per_block` gives each image's count."""
from typing import List, Optional

import torch

from ..matching import adaptive_sampling, class_attention
from ..plans import PrunePlan
from ..schedules import BlockCost
from .base import ScheduledReducer, warn_if_compiling


class ATS(ScheduledReducer):
    """Proportional attention is always on (it masks the padding); one host synchronisation per reducing
    block (the batch's largest count)."""

    name = "ats"
    data_dependent = True
    export_refusal = "the number of tokens it keeps is counted from the data in every forward"
    tune_space = ({"keep_rate": 0.9},)
    needs_class_token = True
    metric_reads_values = True
    masks_by_size = True

    def default_prop_attn(self, global_pool: str) -> bool:
        return True

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float,
               v: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, N): sum over heads of softmax(q_cls k^T * scale + bias) * ||v||, normalised to sum 1."""
        significance = (class_attention(q, k, attn_bias, scale) * v.norm(dim=-1)).sum(dim=1)
        return significance / significance.sum(dim=-1, keepdim=True)

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[Optional[int]]:
        """The patch tokens each reducing block samples: the count the schedule leaves after it. An absolute
        target, so an image samples the same points in a batch (padded to the batch's largest count) as alone."""
        return [None if c is None else c[1] for c in self.patch_counts(num_blocks, num_tokens, num_prefix, cost)]

    def plan(self, metric: torch.Tensor, target: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[PrunePlan]:
        if metric.shape[1] - num_prefix < 2:
            return None
        warn_if_compiling(self.name)
        return adaptive_sampling(metric, target, num_prefix)
