"""Groups with dropping, images keeping different counts (LTMP)."""
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Plan, Reduced, gather_tokens, ones_like_size


@dataclass
class GroupPlan(Plan):
    """Merge the non-prefix tokens into groups and drop the others, images keeping different counts (LTMP).

    num_prefix: leading tokens copied unchanged.
    group: (B, n) int64, the output in [0, num_groups) of each non-prefix token, or -1 where it is dropped.
    num_groups: K, the batch's largest count; a row with fewer groups is padded with empty ones (size 0, zero
    features), which the log-size attention bias keeps out of attention. Each group is the size-weighted mean of its
    members, sizes and source maps summed. Output order: prefix tokens, then the groups by index.
    leads: (B, n) bool, True at each group's lead (the token the others merged into), or None (then a group has no
    destination and sits at its members' centroid).
    """

    num_prefix: int
    group: torch.Tensor
    num_groups: int
    leads: Optional[torch.Tensor] = None

    def at_destinations(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """t: (B, n, C) -> (B, num_groups, C) each group's lead's row (an empty group's: the first token's)."""
        if self.leads is None:
            return None
        n = self.group.shape[1]
        lead = self.group.new_zeros(self.group.shape[0], self.num_groups + 1)  # the last column takes the non-leads
        slot = torch.where(self.leads, self.group, self.num_groups)
        lead.scatter_(1, slot, torch.arange(n, device=slot.device).expand_as(slot))
        return gather_tokens(t, lead[:, :self.num_groups])

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        size = ones_like_size(x, size)
        total, new_size = group_sum(torch.cat([x * size, size.to(x.dtype)], dim=-1), self).split([x.shape[-1], 1], -1)
        x = torch.where(new_size > 0, total / new_size.clamp_min(torch.finfo(new_size.dtype).tiny), 0.0)
        return x, new_size, None if source is None else group_sum(source, self)


def group_sum(t: torch.Tensor, plan: GroupPlan) -> torch.Tensor:
    """Sum every group, dropping the tokens of group -1: (B, N, C) -> (B, p + num_groups, C)."""
    p, rest = plan.num_prefix, t[:, plan.num_prefix:]
    slot = torch.where(plan.group < 0, plan.num_groups, plan.group)  # one slot past the groups takes the dropped
    sums = rest.new_zeros(rest.shape[0], plan.num_groups + 1, rest.shape[2])
    sums = sums.scatter_add(1, slot.unsqueeze(-1).expand(-1, -1, rest.shape[2]), rest)
    return torch.cat([t[:, :p], sums[:, :plan.num_groups]], dim=1)
