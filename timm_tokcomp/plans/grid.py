"""Grid-preserving merges (CubistMerge): the patch tokens stay a complete row-major grid, smaller."""
from dataclasses import dataclass
from typing import Tuple

import torch

from .base import GridCells, Plan, Reduced, ones_like_size


@dataclass
class GridMergePlan(Plan):
    """Merge the patch tokens of a rows x cols grid into a smaller grid (row-major), each cell the
    per-channel value of largest magnitude among its members (the larger of the group's max and -min; ties to the
    positive), sizes and source maps summed.

    num_prefix: leading tokens copied unchanged.
    group: (B, n) int64, the output cell in [0, num_groups) of each patch token (n = rows * cols, raster order).
    shape: (rows, cols) of the smaller grid, num_groups = rows * cols cells.
    Output order: prefix tokens, then the cells in raster order. A cell has no single destination (its value mixes
    members channel by channel): on rope models it sits at the centroid of what it holds."""

    num_prefix: int
    group: torch.Tensor
    shape: Tuple[int, int]

    @property
    def num_groups(self) -> int:
        return self.shape[0] * self.shape[1]

    def grid_cells(self) -> GridCells:
        return GridCells(self.shape, self.group)

    def apply(self, x: torch.Tensor, size, source) -> Reduced:
        p = self.num_prefix
        cells = max_magnitude(x[:, p:], self.group, self.num_groups)
        size = ones_like_size(x, size)
        return (torch.cat([x[:, :p], cells], dim=1), grid_sum(size, self),
                None if source is None else grid_sum(source, self))


def max_magnitude(t: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per group and channel, the member value of largest magnitude (ties to the positive): t (B, n, C), group (B, n)
    in [0, num_groups), every group non-empty -> (B, num_groups, C)."""
    idx = group.unsqueeze(-1).expand(-1, -1, t.shape[-1])
    empty = t.new_zeros(t.shape[0], num_groups, t.shape[-1])
    high = empty.scatter_reduce(1, idx, t, reduce="amax", include_self=False)
    low = empty.scatter_reduce(1, idx, t, reduce="amin", include_self=False)
    return torch.where(high >= -low, high, low)


def grid_sum(t: torch.Tensor, plan: GridMergePlan) -> torch.Tensor:
    """Sum every cell's members: (B, N, C) -> (B, p + num_groups, C)."""
    p, rest = plan.num_prefix, t[:, plan.num_prefix:]
    sums = rest.new_zeros(rest.shape[0], plan.num_groups, rest.shape[-1])
    sums = sums.scatter_add(1, plan.group.unsqueeze(-1).expand(-1, -1, rest.shape[-1]), rest)
    return torch.cat([t[:, :p], sums], dim=1)
