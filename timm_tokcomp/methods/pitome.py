"""PiToMe, Protect Informative Tokens before Merging (Tran et al., NeurIPS 2024): each token's energy (how many
similar tokens surround it) ranks the tokens; the low-energy, informative ones are protected and only the
redundant ones merge. Training-free."""
import math
from typing import List, Optional, Tuple

import torch

from ..ops.matching import best_matches, merge_top_r
from ..plans import MergePlan
from ..utils.checks import check_real
from .schedules import BlockCost
from .base import ScheduledReducer, prop_attn_unless_avg_pool
from .params import COMMON, SCHEDULE, Param
from .register import register_method

# (r, block index l, block count L, protect): the block's margin, margin (1 - l / L), is computed in plan from the
# two counts, which a compiled block keeps symbolic (a float setting would make each block a graph of its own)
Setting = Tuple[int, int, int, bool]


def energy_scores(metric: torch.Tensor, margin: float) -> torch.Tensor:
    """PiToMe's energy of every token of metric (B, n, C): the mean over all tokens j (itself included) of
    ELU(cos(i, j) - margin), alpha 1. High: the token sits among many similar ones (redundant); low: informative."""
    m = metric / metric.norm(dim=-1, keepdim=True)
    return torch.nn.functional.elu(torch.bmm(m, m.transpose(1, 2)) - margin).mean(dim=-1)


def energy_matching(metric: torch.Tensor, r: int, num_prefix: int, margin: float, protect: bool) -> MergePlan:
    """PiToMe's plan of r merges on metric (B, N, C), the non-prefix tokens ranked by energy (descending; ties: lower
    position first). protect False: all of them split alternately by rank into A (even ranks) and B, and ToMe's
    rule merges the r A tokens most similar to their best B. protect True: only the 2r highest-energy tokens are
    candidates, split alternately by rank, and every candidate in A merges into its most similar B; the others are
    protected (kept in A, never merged). r is clamped to half the non-prefix tokens."""
    n = metric.shape[1] - num_prefix
    r = max(min(r, n // 2), 0)
    with torch.no_grad():
        rest = metric[:, num_prefix:]
        order = energy_scores(rest, margin).argsort(dim=-1, descending=True, stable=True)
        if protect:
            a_rank, b_rank = order[:, 0:2 * r:2], order[:, 1:2 * r:2]
            guarded = order[:, 2 * r:]
            a_idx = torch.cat([a_rank, guarded], dim=1).sort(dim=-1).values
            b_idx = b_rank.sort(dim=-1).values
        else:
            a_idx, b_idx = order[:, 0::2].sort(dim=-1).values, order[:, 1::2].sort(dim=-1).values
        node_max, node_idx = best_matches(metric, num_prefix, (a_idx, b_idx))
        if protect:  # only the candidates may merge: the protected A tokens rank last
            candidate = torch.zeros_like(order, dtype=torch.bool).scatter(1, a_rank, True).gather(1, a_idx)
            node_max = torch.where(candidate, node_max, torch.full_like(node_max, -torch.inf))
        return merge_top_r(node_max, node_idx, r, num_prefix, (a_idx, b_idx))


def _check_margin(value: float) -> float:
    return check_real("margin", value, 0.0, strict=False, high=2.0, high_strict=True,
                      note="(a cosine similarity offset)")


@register_method
class PiToMe(ScheduledReducer):
    """Metric: keys averaged over heads (cosine). Block l of L: energy with margin m_l = margin (1 - l / L); the first
    ceil(L / 2) blocks match all tokens in energy order (alternate ranks into A and B, ToMe's rule), the later ones
    protect all but the 2 r highest-energy tokens and merge every candidate of A into its best B
    (energy_matching). Merge: size-weighted mean. Proportional attention is on by default, as ToMe's (off
    for avg-pooled models): the public code runs without it (prop_attn=False), which on real DeiT-Tiny at r = 16
    costs 5.5 (imagenet-val-1300) and 9.0 (nips17-1000) more points of top-1 (docs/study.md)."""

    spec = ScheduledReducer.spec.but(
        name="pitome",
        export_refusal=None,
        tune_space=(),  # not in tune's default space: not significantly above ToMe at matched GMACs (study.md), and
        params=(*SCHEDULE,
                Param("margin", 0.75, _check_margin, "PiToMe: the energy margin of the first block, falling linearly "
                                                     "with depth to margin / L in the last"),
                *COMMON),
    )
    # near-copies of ToMe's settings add chances to pass tune's held-out budget by luck (docs/speed.md)
    min_keep_rate = 0.5  # at most half of a block's tokens merge

    default_prop_attn = prop_attn_unless_avg_pool

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int,
                       cost: BlockCost) -> List[Optional[Setting]]:
        switch = math.ceil(num_blocks / 2)
        return [None if r is None else (r, i, num_blocks, i >= switch)
                for i, r in enumerate(super().block_settings(num_blocks, num_tokens, num_prefix, cost))]

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k.mean(dim=1)

    def plan(self, metric: torch.Tensor, setting: Setting, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        r, index, count, protect = setting
        plan = energy_matching(metric, r, num_prefix, self.margin * (1 - index / count), protect)
        return plan if plan.r > 0 else None
