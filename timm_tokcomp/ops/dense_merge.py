"""The dense variant's merge and unmerge in torch (the reference the fused kernels are tested against): a merged
group's mean before the MLP, every token its group's row after it. The plans' own execution is in
timm_tokcomp.plans."""
from typing import Optional

import torch

from ..plans import gather_tokens as _gather


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
