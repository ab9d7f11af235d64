"""ToMe's bipartite merge and the sums, maxima and means over its groups."""
from dataclasses import dataclass, fields
from typing import Optional, Tuple

import torch

from .base import Plan, Reduced, gather_tokens, split_tokens, weighted_mean


@dataclass
class MergePlan(Plan):
    """Bipartite merge of r tokens of A into their most similar partner in B.

    num_prefix: leading tokens copied unchanged.
    a_start: offset of A within the non-prefix tokens (0 or 1); B starts at 1 - a_start.
    unm_idx: (B, Na - r) A tokens kept, ascending (original order).
    src_idx: (B, r) A tokens merged away.
    dst_idx: (B, r) index in B each source merges into.
    a_idx, b_idx: (B, Na), (B, Nb) non-prefix positions of A and B, ascending, for a split other than
        the alternate one (None: A and B are the alternate positions given by a_start).
    Output order: prefix tokens, kept A tokens, all B tokens.
    """

    num_prefix: int
    a_start: int
    unm_idx: torch.Tensor
    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    a_idx: Optional[torch.Tensor] = None
    b_idx: Optional[torch.Tensor] = None

    @property
    def r(self) -> int:
        return self.src_idx.shape[1]

    @classmethod
    def of(cls, plan: "MergePlan", **extra) -> "MergePlan":
        """The same matches as plan, as this kind (a subclass carrying its step's data in extra)."""
        return cls(**{f.name: getattr(plan, f.name) for f in fields(plan)}, **extra)  # fields of the object: dynamo traces it

    def at_destinations(self, t: torch.Tensor) -> torch.Tensor:
        """t: (B, n, C) -> (B, n - r, C): a kept A token's own row, a B token's (what merged into it keeps it)."""
        if self.a_idx is not None:
            a, b = gather_tokens(t, self.a_idx), gather_tokens(t, self.b_idx)
        else:
            a, b = t[:, self.a_start::2], t[:, 1 - self.a_start::2]
        return torch.cat([gather_tokens(a, self.unm_idx), b], dim=1)

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        x, size = merge_mean(x, size, self)
        return x, size, None if source is None else merge_sum(source, self)


def _split(t: torch.Tensor, plan: MergePlan):
    split = None if plan.a_idx is None else (plan.a_idx, plan.b_idx)
    return (t[:, :plan.num_prefix], *split_tokens(t, plan.num_prefix, split))


def merge_sum(t: torch.Tensor, plan: MergePlan, src: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum every merged group: (B, N, C) -> (B, N - r, C). Used for sizes, source maps, weighted x.
    src: (B, r, C) rows to add into the targets instead of t's merged-away rows (a learned merge's)."""
    prefix, a, b = _split(t, plan)
    kept = gather_tokens(a, plan.unm_idx)
    if src is None:
        src = gather_tokens(a, plan.src_idx)
    idx = plan.dst_idx.unsqueeze(-1).expand(-1, -1, t.shape[-1])
    b = b.scatter_add(1, idx, src)
    return torch.cat([prefix, kept, b], dim=1)


def merge_amax(t: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """The largest value of every merged group, per channel: (B, N, C) -> (B, N - r, C)."""
    prefix, a, b = _split(t, plan)
    idx = plan.dst_idx.unsqueeze(-1).expand(-1, -1, t.shape[-1])
    b = b.scatter_reduce(1, idx, gather_tokens(a, plan.src_idx), reduce="amax", include_self=True)
    return torch.cat([prefix, gather_tokens(a, plan.unm_idx), b], dim=1)


def merge_keep_destination(x: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """Every group takes its destination's value: the merged-away tokens are dropped (B, N, C) -> (B, N - r, C)."""
    prefix, a, b = _split(x, plan)
    return torch.cat([prefix, gather_tokens(a, plan.unm_idx), b], dim=1)


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
