"""ATS, the Adaptive Token Sampler ("Which Tokens to Use?", after Fayyaz et al.): each reducing block scores the
patch tokens by significance, the class token's attention times the norm of their values (summed over heads,
normalised), and keeps the tokens that inverse-transform sampling of as many points as tokens may stay picks.
A token picked twice is kept once, so r is only an upper bound: images keep different counts. The batch keeps
its largest count and pads the other images with size-0 tokens, which the log-size attention bias keeps out
of attention and the pooling ignores; `last_stats(model).real_tokens_per_block` gives each image's count."""
from typing import List, Optional

import torch

from ..ops.matching import class_attention
from ..plans import PrunePlan
from .schedules import BlockCost
from .base import ScheduledReducer, warn_if_compiling
from .register import register_method


def adaptive_sampling(scores: torch.Tensor, k: int, num_prefix: int) -> PrunePlan:
    """ATS's inverse-transform sampling: k points (i + 0.5) / k on the cumulative distribution of the
    significance scores pick tokens; a token picked more than once is kept once, so each image keeps at most k.

    scores: (B, N) significance of every token (prefix entries ignored; zero for padding). Rows keep different
    counts: the plan keeps the batch's largest count M, each row's kept tokens first (original order), then
    padding marked in plan.valid. One host synchronisation (M)."""
    n = scores.shape[1] - num_prefix
    k = max(min(k, n), 1)
    with torch.no_grad():
        s = scores[:, num_prefix:].float()
        order = s.argsort(dim=-1, stable=True)
        cdf = s.gather(1, order).cumsum(dim=-1)
        cdf = cdf / cdf[:, -1:].clamp_min(torch.finfo(cdf.dtype).tiny)
        points = (torch.arange(k, device=s.device, dtype=cdf.dtype) + 0.5) / k
        picked = torch.searchsorted(cdf, points.expand(s.shape[0], -1).contiguous()).clamp_max(n - 1)
        kept = torch.zeros_like(s, dtype=torch.bool).scatter(1, order.gather(1, picked), True)  # (B, n)
        m = int(kept.sum(dim=1).max().item())
        index = torch.arange(n, device=s.device)
        keep_idx = (index + n * (~kept)).argsort(dim=-1)[:, :m]  # kept tokens first, each part ascending
        valid = kept.gather(1, keep_idx).unsqueeze(-1)
    return PrunePlan(num_prefix, keep_idx, valid=valid.to(scores.dtype))


@register_method
class ATS(ScheduledReducer):
    """Proportional attention is always on (it masks the padding); one host synchronisation per reducing
    block (the batch's largest count)."""

    spec = ScheduledReducer.spec.but(
        name="ats",
        holds_patches="dropped",
        data_dependent=True,
        export_refusal="the number of tokens it keeps is counted from the data in every forward",
        tune_space=({"keep_rate": 0.9},),
        needs_class_token=True,
        masks_by_size=True,
    )

    def default_prop_attn(self, global_pool: str) -> bool:
        return True

    def attention_metric(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: Optional[torch.Tensor],
                         scale: float, inputs: torch.Tensor) -> torch.Tensor:
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
