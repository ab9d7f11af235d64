"""Resampling the token axis by a fixed linear map (the DCT pair)."""
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Plan, Reduced, ones_like_size


@dataclass
class ResamplePlan(Plan):
    """Resample the non-prefix tokens by a fixed linear map along the token axis (no matching): x_out =
    [prefix, matrix @ x[:, num_prefix:]]. matrix: (m, n), each row summing to 1 for a mean-preserving map.
    What each output holds (sizes, source maps) is `shares`: output t of a band-limited resample is the signal at
    input position (t + 1/2) n / m - 1/2, so it holds the inputs its cell [t n / m, (t + 1) n / m) of the token
    axis overlaps, in proportion to the overlap; every input is held with total weight 1. Output order: prefix
    tokens, then the m outputs."""

    num_prefix: int
    matrix: torch.Tensor


    @property
    def shares(self) -> torch.Tensor:
        """(m, n) float32, non-negative: the overlap of output cell t with input cell j; columns sum to 1, rows to
        n / m (computed in integers scaled by m, so exact up to the final division)."""
        m, n = self.matrix.shape
        out = torch.arange(m, device=self.matrix.device).unsqueeze(1)
        cell = torch.arange(n, device=self.matrix.device)
        overlap = (torch.minimum((out + 1) * n, (cell + 1) * m) - torch.maximum(out * n, cell * m)).clamp_min(0)
        return overlap.float() / m

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x: (B, N, C) -> (B, p + m, C), the non-prefix tokens mapped by matrix (m, n) in x's dtype; size and source
        mapped by shares (what each output holds)."""
        p = self.num_prefix

        def mapped(t: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[:, :p], torch.matmul(matrix.to(t.dtype), t[:, p:])], dim=1)

        shares = self.shares
        return (mapped(x, self.matrix), mapped(ones_like_size(x, size), shares),
                None if source is None else mapped(source, shares))
