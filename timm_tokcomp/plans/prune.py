"""Pruning: keep some tokens, fuse the others into one or drop them (EViT, Top-K, ATS, radial patterns)."""
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Plan, Reduced, gather_tokens, ones_like_size


@dataclass
class PrunePlan(Plan):
    """Keep some tokens; fuse the others into one token appended at the end, or drop them.

    num_prefix: leading tokens copied unchanged.
    keep_idx: (B, K) non-prefix tokens kept, ascending (original order).
    fuse_idx: (B, F) non-prefix tokens fused into the new last token; None: they are dropped.
    fuse_weight: (B, F, 1) weights of the fused tokens, summing to 1 per row; None when dropped.
    valid: (B, K, 1) 1 for a kept token, 0 for padding (rows that keep fewer than K): padding gets size 0
        and holds no patch. None: every kept token is real.
    """

    num_prefix: int
    keep_idx: torch.Tensor
    fuse_idx: Optional[torch.Tensor] = None
    fuse_weight: Optional[torch.Tensor] = None
    valid: Optional[torch.Tensor] = None

    def at_destinations(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """t: (B, n, C) -> (B, K, C) the kept tokens' own rows; None with a fused token (it has no destination: it
        sits at the centroid of what it holds, and every kept token there too is its own centroid)."""
        return gather_tokens(t, self.keep_idx) if self.fuse_idx is None else None

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        x, size = prune_fuse(x, self), prune_sum(ones_like_size(x, size), self)
        source = None if source is None else prune_sum(source, self)
        if self.valid is not None:  # padding holds nothing and has size 0
            valid = torch.cat([self.valid.new_ones(self.valid.shape[0], self.num_prefix, 1), self.valid], dim=1)
            size = size * valid.to(size.dtype)
            source = None if source is None else source * valid.to(source.dtype)
        return x, size, source


def prune_sum(t: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """Keep plan.keep_idx, sum the fused tokens into one last token: (B, N, C) -> (B, p + K (+ 1), C)."""
    p = plan.num_prefix
    rest = t[:, p:]
    parts = [t[:, :p], gather_tokens(rest, plan.keep_idx)]
    if plan.fuse_idx is not None:
        parts.append(gather_tokens(rest, plan.fuse_idx).sum(dim=1, keepdim=True))
    return torch.cat(parts, dim=1)


def prune_fuse(x: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """Keep plan.keep_idx, fuse the others into their attention-weighted mean (or drop them):
    (B, N, C) -> (B, p + K (+ 1), C)."""
    p = plan.num_prefix
    rest = x[:, p:]
    parts = [x[:, :p], gather_tokens(rest, plan.keep_idx)]
    if plan.fuse_idx is not None:
        parts.append((gather_tokens(rest, plan.fuse_idx) * plan.fuse_weight).sum(dim=1, keepdim=True))
    return torch.cat(parts, dim=1)
