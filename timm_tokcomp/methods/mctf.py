"""MCTF, Multi-Criteria Token Fusion with one-step-ahead attention (Lee, Choi & Kim, CVPR 2024), off the shelf: at the
start of a reducing block its attention probabilities are computed on the tokens entering it; the tokens merge by
three criteria multiplied (similarity of the tokens themselves, informativeness: less attention received scores
higher, size: smaller scores higher) in a bidirectional matching; each group becomes its attention x size weighted
mean; the probabilities are merged alike (key columns summed, query rows weighted) and applied to the merged
tokens' values, so attention is not recomputed after merging. Training-free here (the paper also fine-tunes)."""
from typing import Any, List, Optional

import torch

from ..ops.matching import max_merges
from ..plans import ClusterPlan, split_tokens
from ..plans.cluster import cluster_attention, cluster_sum
from ..utils.checks import real
from .schedules import BlockCost
from .places import ReducesAt
from .base import ScheduledReducer, prop_attn_unless_avg_pool
from .params import COMMON, SCHEDULE, Param
from .register import register_method


def mctf_matching(x: torch.Tensor, received: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int,
                  info_power: float = 1 / 20, size_power: float = 1 / 40) -> ClusterPlan:
    """MCTF's bidirectional multi-criteria matching -> the groups as a ClusterPlan over the non-prefix tokens.

    x: (B, N, C) the tokens entering the block (cosine similarity on x itself); received: (B, N) the mean attention
    each token receives in this block (over heads and queries); size: (B, N, 1) or None. On the alternate split,
    W[a, b] = (cos(x_a, x_b) + 1) / 2 * (i_a i_b) ** info_power * (s_a s_b) ** size_power, with i = min(received) /
    received (less attended: higher) and s = min(size) / size (smaller: higher). Step 1: the r // 2 A tokens with
    the highest best W merge into their best B. Step 2: on the same W, the r - r // 2 B tokens with the highest best
    W towards the A tokens left merge into their best one (with what step 1 merged into them). Ties: lower index.
    Groups: the A tokens left (ascending), then the B tokens left (ascending). r: clamped to max_merges, keeping at
    least 10 non-prefix tokens (or all of them, if fewer)."""
    B, N, _ = x.shape
    p, n = num_prefix, N - num_prefix
    r = max(min(r, max_merges(N, p), n - 10), 0)
    r1, r2 = r // 2, r - r // 2
    with torch.no_grad():
        unit = x / x.norm(dim=-1, keepdim=True)
        info = received.amin(dim=1, keepdim=True) / received
        small = torch.ones_like(info) if size is None else size[..., 0].amin(dim=1, keepdim=True) / size[..., 0]
        score = info.pow(info_power) * small.pow(size_power)  # (B, N)
        (ua, ub), (sa, sb) = split_tokens(unit, p), split_tokens(score.unsqueeze(-1), p)
        w = (torch.bmm(ua, ub.transpose(1, 2)) + 1) / 2 * sa * sb.transpose(1, 2)  # (B, na, nb)
        na, nb = w.shape[1], w.shape[2]
        best1, dst1 = w.max(dim=-1)
        order1 = best1.argsort(dim=-1, descending=True, stable=True)
        src1, kept_a = order1[:, :r1], order1[:, r1:].sort(dim=-1).values  # (B, r1), (B, na - r1) into A
        best2, dst2 = w.gather(1, kept_a.unsqueeze(-1).expand(-1, -1, nb)).max(dim=1)  # (B, nb): into kept_a
        order2 = best2.argsort(dim=-1, descending=True, stable=True)
        src2, kept_b = order2[:, :r2], order2[:, r2:].sort(dim=-1).values
        left = na - r1
        group_b = torch.empty(B, nb, dtype=torch.long, device=x.device)
        group_b.scatter_(1, kept_b, left + torch.arange(nb - r2, device=x.device).expand(B, -1))
        group_b.scatter_(1, src2, dst2.gather(1, src2))
        group_a = torch.empty(B, na, dtype=torch.long, device=x.device)
        group_a.scatter_(1, kept_a, torch.arange(left, device=x.device).expand(B, -1))
        group_a.scatter_(1, src1, group_b.gather(1, dst1.gather(1, src1)))
        a_start = p % 2
        assign = torch.empty(B, n, dtype=torch.long, device=x.device)
        assign[:, a_start::2], assign[:, 1 - a_start::2] = group_a, group_b
    return ClusterPlan(p, assign, n - r)


@register_method
class MCTF(ScheduledReducer):
    """The reduction a schedule puts at the end of block l runs at the start of block l + 1, before its attention
    (block 0 never reduces, as in the paper's blocks 1-11; under keep_rate the stage blocks themselves reduce): the
    tokens counted after it are those of the same schedule under ToMe, but each reducing block also computes its
    attention scores at the larger count, and runs qkv again on the merged tokens for their values. info_power,
    size_power: the exponents of the informativeness and size terms (the paper's 1 / tau: 1 / 20 and 1 / 40).
    Needs explicit attention probabilities in the reducing blocks (no fused SDPA there); serves timm's
    VisionTransformer blocks (not the rotary Eva family). flops_ratio is refused: its solver assumes the reduction
    between attention and MLP."""

    spec = ScheduledReducer.spec.but(
        name="mctf",
        export_refusal=None,
        tune_space=({"r": 8}, {"r": 12}),
        place=ReducesAt.BEFORE_ATTENTION,
        params=(*SCHEDULE,
                Param("info_power", 1 / 20, real("info_power"),
                      "MCTF: exponent of the informativeness term (min received attention / received)"),
                Param("size_power", 1 / 40, real("size_power"), "MCTF: exponent of the size term (min size / size)"),
                *COMMON),
    )
    min_keep_rate = 0.5

    def validate(self) -> None:
        super().validate()
        if self.flops_ratio is not None:
            raise ValueError("flops_ratio is not available for mctf (its solver places the reduction between "
                             "attention and MLP); give r or keep_rate")

    default_prop_attn = prop_attn_unless_avg_pool

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost
                       ) -> List[Optional[int]]:
        """The schedule's r of block l at block l + 1 (its start); block 0 reduces nothing."""
        return [None] + super().block_settings(num_blocks, num_tokens, num_prefix, cost)[:-1]

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        raise NotImplementedError("mctf reads the whole attention of its reducing blocks (lookahead), not a metric")

    def plan(self, metric: torch.Tensor, setting: Any, num_prefix: int, size: Optional[torch.Tensor]):
        raise NotImplementedError("mctf plans in lookahead, from the attention probabilities")

    def lookahead(self, x: torch.Tensor, probs: torch.Tensor, size: Optional[torch.Tensor],
                  source: Optional[torch.Tensor], setting: int, num_prefix: int):
        """x (B, N, C), probs (B, H, N, N) fp32 -> (x, probs, size, source) with N - r tokens, or None."""
        received = probs.mean(dim=(1, 2))  # (B, N): attention each token receives, over heads and queries
        plan = mctf_matching(x, received, size, setting, num_prefix, self.info_power, self.size_power)
        if plan.num_clusters == x.shape[1] - num_prefix:
            return None
        size = x.new_ones(x.shape[0], x.shape[1], 1) if size is None else size
        weight = received.unsqueeze(-1) * size.float()  # (B, N, 1): attention received x size
        merged = (cluster_sum(x.float() * weight, plan) / cluster_sum(weight, plan)).to(x.dtype)
        return (merged, cluster_attention(probs, plan, weight), cluster_sum(size, plan),
                None if source is None else cluster_sum(source, plan))
