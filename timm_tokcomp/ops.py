"""Apply reduction plans to token tensors (torch reference implementation).

All functions take t: (B, N, C) and return (B, N', C) in the plan's output order.
"""
from typing import Optional, Tuple, Union

import torch

from .matching import ClusterPlan, GroupPlan, KeepMergePlan, MergePlan, PrunePlan, ResamplePlan, SoftPlan, TruncatePlan
from .matching import gather_tokens as _gather
from .matching import split_tokens


def _split(t: torch.Tensor, plan: MergePlan):
    split = None if plan.a_idx is None else (plan.a_idx, plan.b_idx)
    return (t[:, :plan.num_prefix], *split_tokens(t, plan.num_prefix, split))


def merge_sum(t: torch.Tensor, plan: MergePlan, src: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum every merged group: (B, N, C) -> (B, N - r, C). Used for sizes, source maps, weighted x.
    src: (B, r, C) rows to add into the targets instead of t's merged-away rows (a learned merge's)."""
    prefix, a, b = _split(t, plan)
    kept = _gather(a, plan.unm_idx)
    if src is None:
        src = _gather(a, plan.src_idx)
    idx = plan.dst_idx.unsqueeze(-1).expand(-1, -1, t.shape[-1])
    b = b.scatter_add(1, idx, src)
    return torch.cat([prefix, kept, b], dim=1)


def merge_amax(t: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """The largest value of every merged group, per channel: (B, N, C) -> (B, N - r, C)."""
    prefix, a, b = _split(t, plan)
    idx = plan.dst_idx.unsqueeze(-1).expand(-1, -1, t.shape[-1])
    b = b.scatter_reduce(1, idx, _gather(a, plan.src_idx), reduce="amax", include_self=True)
    return torch.cat([prefix, _gather(a, plan.unm_idx), b], dim=1)


def merge_keep_destination(x: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """Every group takes its destination's value: the merged-away tokens are dropped (B, N, C) -> (B, N - r, C)."""
    prefix, a, b = _split(x, plan)
    return torch.cat([prefix, _gather(a, plan.unm_idx), b], dim=1)


def merge_mlerp(x: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """ToFu's norm-preserving merge (MLERP): a merged group becomes the direction of its members' plain mean with
    the largest member norm; a token merged with nothing is unchanged. (B, N, C) -> (B, N - r, C)."""
    count = merge_sum(x.new_ones(x.shape[0], x.shape[1], 1), plan)
    mean = merge_sum(x, plan) / count
    longest = merge_amax(x.norm(dim=-1, keepdim=True), plan)
    unit = mean / mean.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return torch.where(count > 1, unit * longest, merge_keep_destination(x, plan))


def merge_mean(x: torch.Tensor, size: Optional[torch.Tensor], plan: MergePlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted mean of every merged group.

    x: (B, N, C); size: (B, N, 1) or None (all ones). Returns x: (B, N - r, C), size: (B, N - r, 1).
    The weighted tokens and their sizes are merged in one pass, as (B, N, C + 1) rows.
    """
    return weighted_mean(x, size, lambda t: merge_sum(t, plan))


def prune_sum(t: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """Keep plan.keep_idx, sum the fused tokens into one last token: (B, N, C) -> (B, p + K (+ 1), C)."""
    p = plan.num_prefix
    rest = t[:, p:]
    parts = [t[:, :p], _gather(rest, plan.keep_idx)]
    if plan.fuse_idx is not None:
        parts.append(_gather(rest, plan.fuse_idx).sum(dim=1, keepdim=True))
    return torch.cat(parts, dim=1)


def prune_fuse(x: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """Keep plan.keep_idx, fuse the others into their attention-weighted mean (or drop them):
    (B, N, C) -> (B, p + K (+ 1), C)."""
    p = plan.num_prefix
    rest = x[:, p:]
    parts = [x[:, :p], _gather(rest, plan.keep_idx)]
    if plan.fuse_idx is not None:
        parts.append((_gather(rest, plan.fuse_idx) * plan.fuse_weight).sum(dim=1, keepdim=True))
    return torch.cat(parts, dim=1)


def cluster_sum(t: torch.Tensor, plan: ClusterPlan) -> torch.Tensor:
    """Sum every cluster: (B, N, C) -> (B, p + num_clusters, C)."""
    p = plan.num_prefix
    rest = t[:, p:]
    sums = rest.new_zeros(rest.shape[0], plan.num_clusters, rest.shape[2])
    sums = sums.scatter_add(1, plan.assign.unsqueeze(-1).expand(-1, -1, rest.shape[2]), rest)
    return torch.cat([t[:, :p], sums], dim=1)


def cluster_attention(probs: torch.Tensor, plan: ClusterPlan, weight: torch.Tensor) -> torch.Tensor:
    """Attention probabilities merged as the plan merges their tokens: probs (B, H, N, N), weight (B, N, 1) each
    token's weight in its cluster's mean -> (B, H, M, M). A cluster's key column is the sum of its members' (what they
    receive together); its query row is their weighted mean, so every row still sums to 1."""
    B, H, N, _ = probs.shape
    p, M = plan.num_prefix, plan.num_prefix + plan.num_clusters
    group = torch.cat([torch.arange(p, device=probs.device).expand(B, -1), p + plan.assign], dim=1)  # (B, N)
    share = weight / cluster_sum(weight, plan).gather(1, group.unsqueeze(-1))  # (B, N, 1): sums to 1 per cluster
    cols = probs.new_zeros(B, H, N, M).scatter_add(3, group.view(B, 1, 1, N).expand(B, H, N, N), probs)
    rows = cols * share.to(probs.dtype).view(B, 1, N, 1)
    return probs.new_zeros(B, H, M, M).scatter_add(2, group.view(B, 1, N, 1).expand(B, H, N, M), rows)


def keep_merge_sum(t: torch.Tensor, plan: KeepMergePlan, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kept tokens (times weight (B, P, 1), if given) summed into their outputs: (B, N, C) -> (B, p + M, C)."""
    p = plan.num_prefix
    kept = _gather(t[:, p:], plan.keep_idx)
    if weight is not None:
        kept = kept * weight.to(kept.dtype)
    sums = kept.new_zeros(kept.shape[0], plan.num_keepers, kept.shape[2])
    sums = sums.scatter_add(1, plan.assign.unsqueeze(-1).expand(-1, -1, kept.shape[2]), kept)
    return torch.cat([t[:, :p], sums], dim=1)


def group_sum(t: torch.Tensor, plan: GroupPlan) -> torch.Tensor:
    """Sum every group, dropping the tokens of group -1: (B, N, C) -> (B, p + num_groups, C)."""
    p, rest = plan.num_prefix, t[:, plan.num_prefix:]
    slot = torch.where(plan.group < 0, plan.num_groups, plan.group)  # one slot past the groups takes the dropped
    sums = rest.new_zeros(rest.shape[0], plan.num_groups + 1, rest.shape[2])
    sums = sums.scatter_add(1, slot.unsqueeze(-1).expand(-1, -1, rest.shape[2]), rest)
    return torch.cat([t[:, :p], sums[:, :plan.num_groups]], dim=1)


def soft_mix(t: torch.Tensor, plan: SoftPlan, weight: torch.Tensor) -> torch.Tensor:
    """Prefix rows unchanged, then weight @ the non-prefix rows: (B, N, C) -> (B, p + M, C)."""
    p = plan.num_prefix
    return torch.cat([t[:, :p], weight.to(t.dtype) @ t[:, p:]], dim=1)


def weighted_mean(x: torch.Tensor, size: Optional[torch.Tensor], reduce_sum) -> Tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted mean of every group a summing reduction forms, in one pass over (B, N, C + 1) rows.
    x: (B, N, C); size: (B, N, 1) or None (all ones). Returns x (B, M, C), size (B, M, 1)."""
    if size is None:
        size = x.new_ones(x.shape[0], x.shape[1], 1)
    total, new_size = reduce_sum(torch.cat([x * size, size.to(x.dtype)], dim=-1)).split([x.shape[-1], 1], -1)
    return total / new_size, new_size


def apply_plan(
    plan: Union[MergePlan, PrunePlan, ClusterPlan, SoftPlan, TruncatePlan, ResamplePlan, KeepMergePlan, GroupPlan],
    x: torch.Tensor,
    size: Optional[torch.Tensor],
    source: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Reduce x: (B, N, C), size: (B, N, 1) or None, source: (B, N, N0) or None by one plan."""
    if isinstance(plan, ResamplePlan):
        return resample(x, size, source, plan)
    if isinstance(plan, TruncatePlan):
        keep = plan.num_keep
        return x[:, :keep], None if size is None else size[:, :keep], None if source is None else source[:, :keep]
    if isinstance(plan, GroupPlan):
        size = x.new_ones(x.shape[0], x.shape[1], 1) if size is None else size
        total, new_size = group_sum(torch.cat([x * size, size.to(x.dtype)], dim=-1), plan).split([x.shape[-1], 1], -1)
        x = torch.where(new_size > 0, total / new_size.clamp_min(torch.finfo(new_size.dtype).tiny), 0.0)
        return x, new_size, None if source is None else group_sum(source, plan)
    if isinstance(plan, KeepMergePlan):
        ones = x.new_ones(x.shape[0], x.shape[1], 1)
        x = keep_merge_sum(x, plan) / keep_merge_sum(ones, plan)  # the prefix rows divide by 1
        return (x, keep_merge_sum(ones if size is None else size, plan, plan.size_weight),
                None if source is None else keep_merge_sum(source, plan))
    if isinstance(plan, SoftPlan):
        shares = plan.shares
        if size is None:
            size = x.new_ones(x.shape[0], x.shape[1], 1)
        return (soft_mix(x, plan, plan.weight), soft_mix(size, plan, shares),
                None if source is None else soft_mix(source, plan, shares))
    if isinstance(plan, MergePlan):
        x, size = merge_mean(x, size, plan)
        reduce_sum = merge_sum
    elif isinstance(plan, ClusterPlan):
        x, size = weighted_mean(x, size, lambda t: cluster_sum(t, plan))
        reduce_sum = cluster_sum
    else:
        if size is None:
            size = x.new_ones(x.shape[0], x.shape[1], 1)
        x = prune_fuse(x, plan)
        size = prune_sum(size, plan)
        reduce_sum = prune_sum
    if source is not None:
        source = reduce_sum(source, plan)
    if isinstance(plan, PrunePlan) and plan.valid is not None:  # padding holds nothing and has size 0
        valid = torch.cat([plan.valid.new_ones(plan.valid.shape[0], plan.num_prefix, 1), plan.valid], dim=1)
        size = size * valid.to(size.dtype)
        source = None if source is None else source * valid.to(source.dtype)
    return x, size, source


def resample(x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor], plan: ResamplePlan
             ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """x: (B, N, C) -> (B, p + m, C), the non-prefix tokens mapped by plan.matrix (m, n) in x's dtype; size (B, N, 1)
    or None (ones) and source (B, N, N0) or None -> mapped by plan.shares (what each output holds)."""
    p = plan.num_prefix

    def mapped(t: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, :p], torch.matmul(matrix.to(t.dtype), t[:, p:])], dim=1)

    if size is None:
        size = x.new_ones(x.shape[0], x.shape[1], 1)
    shares = plan.shares
    return mapped(x, plan.matrix), mapped(size, shares), None if source is None else mapped(source, shares)


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
