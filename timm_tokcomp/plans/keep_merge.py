"""Prune, then merge into kept tokens by unweighted means (DiffRate)."""
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Plan, Reduced, gather_tokens


@dataclass
class KeepMergePlan(Plan):
    """Prune, then merge into kept tokens by unweighted means (DiffRate's step).

    num_prefix: leading tokens copied unchanged.
    keep_idx: (B, P) the non-prefix tokens that stay (the rest are dropped), most important first.
    assign: (B, P) int64, the output in [0, num_keepers) of each kept token; kept token j < num_keepers is keeper j.
    size_weight: (B, P, 1) what each kept token's size counts for in its output's size: 1 for a keeper, its cosine
        similarity to its keeper (>= 0) for a token merged into one.
    num_keepers: M. Output order: prefix tokens, then the M keepers, each the unweighted mean of itself and the
    tokens merged into it. Source maps add up whole (every kept patch held with weight 1).
    """

    num_prefix: int
    keep_idx: torch.Tensor
    assign: torch.Tensor
    size_weight: torch.Tensor
    num_keepers: int

    def at_destinations(self, t: torch.Tensor) -> torch.Tensor:
        """t: (B, n, C) -> (B, M, C) each output's keeper's row."""
        return gather_tokens(t, self.keep_idx[:, :self.num_keepers])

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        ones = x.new_ones(x.shape[0], x.shape[1], 1)
        x = keep_merge_sum(x, self) / keep_merge_sum(ones, self)  # the prefix rows divide by 1
        return (x, keep_merge_sum(ones if size is None else size, self, self.size_weight),
                None if source is None else keep_merge_sum(source, self))


def keep_merge_sum(t: torch.Tensor, plan: KeepMergePlan, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The kept tokens (times weight (B, P, 1), if given) summed into their outputs: (B, N, C) -> (B, p + M, C)."""
    p = plan.num_prefix
    kept = gather_tokens(t[:, p:], plan.keep_idx)
    if weight is not None:
        kept = kept * weight.to(kept.dtype)
    sums = kept.new_zeros(kept.shape[0], plan.num_keepers, kept.shape[2])
    sums = sums.scatter_add(1, plan.assign.unsqueeze(-1).expand(-1, -1, kept.shape[2]), kept)
    return torch.cat([t[:, :p], sums], dim=1)
