"""Apply reduction plans to token tensors (torch reference implementation).

All functions take t: (B, N, C) and return (B, N', C) in the plan's output order.
"""
from typing import Optional, Tuple, Union

import torch

from .matching import MergePlan, PrunePlan
from .matching import gather_tokens as _gather


def _split(t: torch.Tensor, plan: MergePlan):
    p = plan.num_prefix
    rest = t[:, p:]
    if plan.a_idx is not None:
        return t[:, :p], _gather(rest, plan.a_idx), _gather(rest, plan.b_idx)
    return t[:, :p], rest[:, plan.a_start::2], rest[:, 1 - plan.a_start::2]


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
    """
    if size is None:
        size = x.new_ones(x.shape[0], x.shape[1], 1)
        x_sum = merge_sum(x, plan)
    else:
        x_sum = merge_sum(x * size, plan)
    new_size = merge_sum(size, plan)
    return x_sum / new_size, new_size


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
    plan: Union[MergePlan, PrunePlan],
    x: torch.Tensor,
    size: Optional[torch.Tensor],
    source: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Reduce x: (B, N, C), size: (B, N, 1) or None, source: (B, N, N0) or None by one plan."""
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
