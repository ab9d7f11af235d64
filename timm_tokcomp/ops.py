"""Apply reduction plans to token tensors (torch reference implementation).

All functions take t: (B, N, C) and return (B, N', C) in the plan's output order.
"""
from typing import Optional, Tuple, Union

import torch

from .matching import MergePlan, PrunePlan, TruncatePlan
from .matching import gather_tokens as _gather
from .matching import split_tokens


def _split(t: torch.Tensor, plan: MergePlan):
    split = None if plan.a_idx is None else (plan.a_idx, plan.b_idx)
    return (t[:, :plan.num_prefix], *split_tokens(t, plan.num_prefix, split))


def merge_sum(t: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """Sum every merged group: (B, N, C) -> (B, N - r, C). Used for sizes, source maps, weighted x."""
    prefix, a, b = _split(t, plan)
    kept = _gather(a, plan.unm_idx)
    src = _gather(a, plan.src_idx)
    idx = plan.dst_idx.unsqueeze(-1).expand(-1, -1, t.shape[-1])
    b = b.scatter_add(1, idx, src)
    return torch.cat([prefix, kept, b], dim=1)


def merge_mean(x: torch.Tensor, size: Optional[torch.Tensor], plan: MergePlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted mean of every merged group.

    x: (B, N, C); size: (B, N, 1) or None (all ones). Returns x: (B, N - r, C), size: (B, N - r, 1).
    The weighted tokens and their sizes are merged in one pass, as (B, N, C + 1) rows.
    """
    if size is None:
        size = x.new_ones(x.shape[0], x.shape[1], 1)
    weighted = x * size
    total, new_size = merge_sum(torch.cat([weighted, size.to(weighted.dtype)], dim=-1), plan).split([x.shape[-1], 1], -1)
    return total / new_size, new_size


def prune_sum(t: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """Keep plan.keep_idx, sum the fused tokens into one last token: (B, N, C) -> (B, N - F + 1, C)."""
    p = plan.num_prefix
    rest = t[:, p:]
    fused = _gather(rest, plan.fuse_idx).sum(dim=1, keepdim=True)
    return torch.cat([t[:, :p], _gather(rest, plan.keep_idx), fused], dim=1)


def prune_fuse(x: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """Keep plan.keep_idx, fuse the others into their attention-weighted mean: (B, N, C) -> (B, N - F + 1, C)."""
    p = plan.num_prefix
    rest = x[:, p:]
    fused = (_gather(rest, plan.fuse_idx) * plan.fuse_weight).sum(dim=1, keepdim=True)
    return torch.cat([x[:, :p], _gather(rest, plan.keep_idx), fused], dim=1)


def apply_plan(
    plan: Union[MergePlan, PrunePlan, TruncatePlan],
    x: torch.Tensor,
    size: Optional[torch.Tensor],
    source: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Reduce x: (B, N, C), size: (B, N, 1) or None, source: (B, N, N0) or None by one plan."""
    if isinstance(plan, TruncatePlan):
        keep = plan.num_keep
        return x[:, :keep], None if size is None else size[:, :keep], None if source is None else source[:, :keep]
    if isinstance(plan, MergePlan):
        x, size = merge_mean(x, size, plan)
        reduce_sum = merge_sum
    else:
        if size is None:
            size = x.new_ones(x.shape[0], x.shape[1], 1)
        x = prune_fuse(x, plan)
        size = prune_sum(size, plan)
        reduce_sum = prune_sum
    if source is not None:
        source = reduce_sum(source, plan)
    return x, size, source


def group_index(plan: MergePlan, num_tokens: int) -> Tuple[torch.Tensor, int]:
    """Which merged token each of the num_tokens input tokens belongs to, in merge_mean's output order.

    Returns group: (B, N) int64 with values in [0, M), and M = N - plan.r. unmerge(y, group) gives
    every input token the output of its group.
    """
    p, r = plan.num_prefix, plan.r
    B, device = plan.unm_idx.shape[0], plan.unm_idx.device
    n = num_tokens - p
    if plan.a_idx is not None:
        a_pos, b_pos = plan.a_idx, plan.b_idx
    else:
        a_pos = torch.arange(plan.a_start, n, 2, device=device).expand(B, -1)
        b_pos = torch.arange(1 - plan.a_start, n, 2, device=device).expand(B, -1)
    num_kept = plan.unm_idx.shape[1]
    group = torch.empty(B, n, dtype=torch.long, device=device)
    group.scatter_(1, a_pos.gather(1, plan.unm_idx), p + torch.arange(num_kept, device=device).expand(B, -1))
    group.scatter_(1, b_pos, p + num_kept + torch.arange(b_pos.shape[1], device=device).expand(B, -1))
    group.scatter_(1, a_pos.gather(1, plan.src_idx), p + num_kept + plan.dst_idx)
    prefix = torch.arange(p, device=device).expand(B, -1)
    return torch.cat([prefix, group], dim=1), num_tokens - r


def group_mean(x: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Mean of the tokens of every group (reference of the merge kernel): x (B, N, C), group (B, N)
    -> (B, M, C), accumulated in fp32, returned in x's dtype."""
    acc = x.new_zeros(x.shape[0], num_groups, x.shape[2], dtype=torch.float32)
    acc.scatter_add_(1, group.unsqueeze(-1).expand(-1, -1, x.shape[2]), x.float())
    count = torch.zeros(x.shape[0], num_groups, 1, dtype=torch.float32, device=x.device)
    count.scatter_add_(1, group.unsqueeze(-1), torch.ones_like(group, dtype=torch.float32).unsqueeze(-1))
    return (acc / count).to(x.dtype)


def unmerge(y: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Every input token receives its group's row: y (B, M, C), group (B, N) -> (B, N, C)."""
    return _gather(y, group)


def unmerge_add(x: torch.Tensor, y: torch.Tensor, group: torch.Tensor, gamma: Optional[torch.Tensor]) -> torch.Tensor:
    """Residual add of the unmerged branch (reference of the unmerge kernel):
    x + gamma * unmerge(y, group); x (B, N, C), y (B, M, C), gamma (C,) or None."""
    h = unmerge(y, group)
    return x + (h if gamma is None else h * gamma)
