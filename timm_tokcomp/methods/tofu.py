"""ToFu, Token Fusion (Kim et al., WACV 2024): ToMe's matching, with each merge done as the block's depth suits it:
in the early blocks the merged-away tokens are dropped (the destination keeps its value: pruning), in the later
blocks a group becomes MLERP, its members' mean direction at the largest member norm, so merging does not shrink
the tokens' norms. Training-free."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..plans import MergePlan, Reduced
from ..plans.merge import merge_keep_destination, merge_mlerp, merge_sum
from ..utils.checks import check_int
from .schedules import BlockCost
from .base import ScheduledReducer, prop_attn_unless_avg_pool
from .params import COMMON, SCHEDULE, Param, optional
from .tome import tome_plan
from .register import register_method

PRUNE, MLERP = "prune", "mlerp"


@dataclass
class FusionPlan(MergePlan):
    """ToMe's matches, merged by the block's step: 'prune' (the destination keeps its value) or 'mlerp'."""

    step: str = PRUNE

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x: (B, N, C) -> (B, N - r, C) by the block's step; sizes (B, N, 1) and source maps (B, N, N0) summed."""
        if size is None:
            size = x.new_ones(x.shape[0], x.shape[1], 1)
        size, source = merge_sum(size, self), None if source is None else merge_sum(source, self)
        merged = merge_mlerp(x, self) if self.step == MLERP else merge_keep_destination(x, self)
        return merged, size, source


@register_method
class ToFu(ScheduledReducer):
    """Metric: keys averaged over heads (cosine), ToMe's bipartite matching. Blocks 0 .. merge_from - 1 prune
    (sources dropped), blocks from merge_from on merge by MLERP; merge_from None: depth // 2 + 1 (blocks 0-6 of 12
    prune, as both public re-implementations do; the paper's switching point could not be checked). Sizes and
    source maps add up in both steps. Proportional attention is on by default, as ToMe's (off for avg-pooled
    models): the public re-implementations run without it (prop_attn=False), which on real DeiT-Tiny at r = 16
    costs 3.7 (imagenet-val-1300) and 8.9 (nips17-1000) more points of top-1 (docs/study.md)."""

    spec = ScheduledReducer.spec.but(
        name="tofu",
        export_refusal=None,
        tune_space=(),  # not in tune's default space: not significantly above ToMe at matched GMACs (study.md), and
        params=(*SCHEDULE,
                Param("merge_from", None, optional(lambda v: check_int("merge_from", v)),
                      "ToFu: the first block that merges by MLERP (earlier blocks prune); None: depth // 2 + 1"),
                *COMMON),
    )
    # near-copies of ToMe's settings add chances to pass tune's held-out budget by luck (docs/speed.md)
    min_keep_rate = 0.5  # bipartite matching merges at most half of a block's tokens

    default_prop_attn = prop_attn_unless_avg_pool

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int,
                       cost: BlockCost) -> List[Optional[Tuple[int, str]]]:
        """(r, 'prune' or 'mlerp') per reducing block."""
        first = num_blocks // 2 + 1 if self.merge_from is None else self.merge_from
        return [None if r is None else (r, MLERP if i >= first else PRUNE)
                for i, r in enumerate(super().block_settings(num_blocks, num_tokens, num_prefix, cost))]

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k.mean(dim=1)

    def plan(self, metric: torch.Tensor, setting: Tuple[int, str], num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        plan = tome_plan(metric, setting[0], num_prefix)
        return None if plan is None else FusionPlan.of(plan, step=setting[1])
