"""What every plan shares: the Plan interface and the token-index helpers its execution uses.

Index conventions: prefix tokens (class / distillation / register) come first and are never reduced; a plan's
indices index the non-prefix tokens (or ToMe's A / B sets of them), per batch row."""
from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple, Optional, Tuple

import torch

Reduced = Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]  # x, size, source


class Plan(ABC):
    """One block's reduction, decided by a method (methods/) and carried out by the plan itself. A method's training
    step is a plan kind too (in its method file): it keeps every token in place and changes sizes softly.

    keeps_positions: no token moves (a training mask): rotary positions travel unchanged.
    defines_positions: False for a step that mixes tokens softly in place, which defines no rotary position for a
    merged token (rope models refuse it)."""

    keeps_positions: ClassVar[bool] = False
    defines_positions: ClassVar[bool] = True

    @abstractmethod
    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x: (B, N, C), size: (B, N, 1) or None (all ones), source: (B, N, N0) or None -> the same after the
        reduction, N' tokens in the plan's output order."""

    def at_destinations(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """t: (B, n, C) rows of the non-prefix inputs (their rotary coordinates) -> (B, n', C) the row of each
        non-prefix output's destination (a merge's destination, a keeper, a group's lead, a kept token), what
        rope_merge='dst' keeps; None where an output has no destination (a cluster, a soft mix, a resampled or fused
        token: it sits at the centroid of what it holds)."""
        return None

    def grid_cells(self) -> Optional["GridCells"]:
        """For a plan whose output keeps the patch tokens a complete row-major grid: that grid and the cell of each
        patch token (GridCells); None for any other plan (windowed encoders refuse it)."""
        return None


class GridCells(NamedTuple):
    """Where a grid-keeping plan puts the patch tokens: shape (rows, cols) of the grid after it; cell (B, n) int64,
    the output cell in [0, rows * cols) of each of the n patch tokens before it (raster order)."""

    shape: Tuple[int, int]
    cell: torch.Tensor


def ones_like_size(x: torch.Tensor, size: Optional[torch.Tensor]) -> torch.Tensor:
    """size, or (B, N, 1) ones for x: (B, N, C) when it is None."""
    return x.new_ones(x.shape[0], x.shape[1], 1) if size is None else size


def gather_tokens(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t: (B, N, C), idx: (B, K) -> (B, K, C)."""
    return t.gather(1, idx.unsqueeze(-1).expand(-1, -1, t.shape[-1]))


def split_tokens(t: torch.Tensor, num_prefix: int, split: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
    """The A and B tokens of t (B, N, C) after its num_prefix prefix tokens: the alternate positions (A
    starting at the first even absolute position), or the (a_idx, b_idx) non-prefix positions of split."""
    if split is None:
        a_start = num_prefix % 2
        return t[:, num_prefix + a_start::2], t[:, num_prefix + 1 - a_start::2]
    rest = t[:, num_prefix:]
    return gather_tokens(rest, split[0]), gather_tokens(rest, split[1])


def weighted_mean(x: torch.Tensor, size: Optional[torch.Tensor], reduce_sum) -> Tuple[torch.Tensor, torch.Tensor]:
    """Size-weighted mean of every group a summing reduction forms, in one pass over (B, N, C + 1) rows.
    x: (B, N, C); size: (B, N, 1) or None (all ones). Returns x (B, M, C), size (B, M, 1)."""
    if size is None:
        size = x.new_ones(x.shape[0], x.shape[1], 1)
    total, new_size = reduce_sum(torch.cat([x * size, size.to(x.dtype)], dim=-1)).split([x.shape[-1], 1], -1)
    return total / new_size, new_size
