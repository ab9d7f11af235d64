"""Dense-prediction ToMe (as in the ToCom paper's segmentation experiments): attention sees every token;
k tokens are merged (bipartite soft matching on the keys) before each block's MLP and unmerged after
it, so every block keeps its input shape. k = 32 r by default."""
from typing import List, Optional, Union

import torch

from .. import kernels
from ..plans import MergePlan
from ..utils.checks import check_int
from .schedules import BlockCost
from .base import TokenReducer
from .tags import R_TAG
from .params import Param, kernel_choice, optional
from .tome import HeadKeys, ToMe, tome_plan
from .register import register_method

MERGES_PER_R = 32


@register_method
class DenseToMe(TokenReducer):
    """r: the paper's compression degree, k = 32 r merges per block; k: merges per block, overriding r
    (both clamped per block to half the non-prefix tokens); kernel: 'auto' (the Triton merge / unmerge on CUDA
    when no gradient is needed, torch otherwise), 'triton' (the matching in Triton too) or 'torch'."""

    spec = TokenReducer.spec.but(
        name="dense_tome",
        export_refusal=None,
        dense=True,
        params=(Param("r", 0, lambda v: check_int("r", v), "dense ToMe: merges 32 r tokens before each MLP"),
                Param("k", None, optional(lambda v: check_int("k", v)),
                      "tokens merged before each MLP, instead of 32 r"),
                kernel_choice("auto")),
        tags=(R_TAG,),
    )

    @property
    def merges(self) -> int:
        """Tokens merged before each MLP (before the per-block clamp)."""
        return self.k if self.k is not None else MERGES_PER_R * self.r

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[Optional[int]]:
        return [self.merges if self.merges > 0 else None] * num_blocks

    metric = ToMe.metric

    def attention_metric(self, q, k, v, attn_bias, scale, inputs) -> Union[torch.Tensor, HeadKeys]:
        """The keys themselves (HeadKeys) where kernel='triton' lists the groups (kernels.tome_groups averages
        them), metric() otherwise."""
        fused = self.kernel == "triton" and kernels.use_triton(self.kernel, k)
        return HeadKeys(k) if fused else self.metric(q, k, attn_bias, scale)

    def plan(self, metric: torch.Tensor, k: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        return tome_plan(metric, k, num_prefix)
