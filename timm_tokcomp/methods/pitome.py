"""PiToMe, Protect Informative Tokens before Merging (Tran et al., NeurIPS 2024): each token's energy (how many
similar tokens surround it) ranks the tokens; the low-energy, informative ones are protected and only the
redundant ones merge. Training-free."""
import math
from typing import List, Optional, Tuple

import torch

from ..matching import energy_matching
from ..plans import MergePlan
from ..schedules import BlockCost, is_real
from .base import ScheduledReducer, prop_attn_unless_avg_pool
from .params import COMMON, SCHEDULE, Param

Setting = Tuple[int, float, bool]  # (r, margin, protect)


def _check_margin(value: float) -> float:
    if not is_real(value) or not 0.0 <= value < 2.0:
        raise ValueError(f"margin must be a number in [0, 2) (a cosine similarity offset), got {value!r}")
    return float(value)


class PiToMe(ScheduledReducer):
    """Metric: keys averaged over heads (cosine). Block l of L: energy with margin m_l = margin (1 - l / L); the first
    ceil(L / 2) blocks match all tokens in energy order (alternate ranks into A and B, ToMe's rule), the later ones
    protect all but the 2 r highest-energy tokens and merge every candidate of A into its best B
    (matching.energy_matching). Merge: size-weighted mean. Proportional attention is on by default, as ToMe's (off
    for avg-pooled models): the public code runs without it (prop_attn=False), which on real DeiT-Tiny at r = 16
    costs 5.5 (imagenet-val-1300) and 9.0 (nips17-1000) more points of top-1 (docs/study.md)."""

    name = "pitome"
    export_refusal = None
    tune_space = ()  # not in tune's default space: not significantly above ToMe at matched GMACs (study.md), and
    # near-copies of ToMe's settings add chances to pass tune's held-out budget by luck (docs/speed.md)
    min_keep_rate = 0.5  # at most half of a block's tokens merge
    PARAMS = (*SCHEDULE,
              Param("margin", 0.75, _check_margin, "PiToMe: the energy margin of the first block, falling linearly "
                                                   "with depth to margin / L in the last"),
              *COMMON)

    default_prop_attn = prop_attn_unless_avg_pool

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int,
                       cost: BlockCost) -> List[Optional[Setting]]:
        switch = math.ceil(num_blocks / 2)
        return [None if r is None else (r, self.margin * (1 - i / num_blocks), i >= switch)
                for i, r in enumerate(super().block_settings(num_blocks, num_tokens, num_prefix, cost))]

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k.mean(dim=1)

    def plan(self, metric: torch.Tensor, setting: Setting, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        r, margin, protect = setting
        plan = energy_matching(metric, r, num_prefix, margin, protect)
        return plan if plan.r > 0 else None
