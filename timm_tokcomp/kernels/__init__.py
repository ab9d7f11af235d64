"""Backends of ToMe's reduction step (matching + size-weighted merge) and of the dense variant's merge
(LayerNorm + group mean) and unmerge (+ LayerScale + residual): the torch reference in `matching` / `plans` / `ops`
and the fused Triton kernels in `triton_tome` / `triton_dense` (imported on first use).

backend 'auto' picks, for CUDA tensors when no gradient is needed, what the measured table of the device class says
(timm_tokcomp.measure.device_table; Triton where it has no entry), torch otherwise; 'triton'
forces the kernels (CUDA, or any device under TRITON_INTERPRET=1), 'torch' the reference.
"""
import os
from typing import Optional, Tuple

import torch
from torch import nn

from ..ops import dense_merge as ops
from ..measure.device_table import measured
from ..utils.checks import check_choice

BACKENDS = ("auto", "torch", "triton")


def check_kernel(kernel: str) -> str:
    """kernel itself, or ValueError naming the valid choices."""
    return check_choice("kernel", kernel, BACKENDS)


def use_triton(kernel: str, x: torch.Tensor) -> bool:
    """Whether a method's fused Triton step runs on x: 'triton' or 'auto' resolved to Triton, and not inside
    torch.compile / export (which trace the torch path). Raises as resolve_backend does."""
    return kernel != "torch" and not torch.compiler.is_compiling() and resolve_backend(kernel, x) == "triton"


def resolve_backend(kernel: str, x: torch.Tensor) -> str:
    """'torch' or 'triton' for a tensor x. Raises ValueError when 'triton' is forced where it cannot run."""
    check_kernel(kernel)
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    if kernel == "auto":  # Triton for CUDA inference unless the device class's measured table says torch
        return (measured("kernel", x) or "triton") if x.is_cuda and not needs_grad else "torch"
    if kernel == "triton":
        if needs_grad:
            raise ValueError("kernel='triton' is inference-only (no backward); use kernel='auto' or 'torch' to train")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"kernel='triton' needs CUDA tensors (got {x.device}) or TRITON_INTERPRET=1 set "
                             "before timm_tokcomp is imported")
    return kernel


def merge_normed(x: torch.Tensor, norm: nn.Module, group: torch.Tensor, num_groups: int, backend: str,
                 members: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Group means of norm(x): x (B, N, C), group (B, N) -> (B, M, C). The Triton path fuses an affine
    nn.LayerNorm into the merge; other norms run first in torch. members: the groups' member lists from
    tome_groups (Triton path), or None."""
    if backend == "torch":
        return ops.group_mean(norm(x), group, num_groups)
    from . import triton_dense

    if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine and norm.bias is not None:
        return triton_dense.merge(x, group, num_groups, norm.weight, norm.bias, norm.eps, members)
    return triton_dense.merge(norm(x), group, num_groups, members=members)


def unmerge_add(x: torch.Tensor, y: torch.Tensor, group: torch.Tensor, gamma: Optional[torch.Tensor],
                backend: str) -> torch.Tensor:
    """x + gamma * y[group]: x (B, N, C), y (B, M, C), gamma (C,) or None -> (B, N, C)."""
    if backend == "torch":
        return ops.unmerge_add(x, y, group, gamma)
    from . import triton_dense

    return triton_dense.unmerge_add(x, y, group, gamma)


def tome_merge(metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int,
               coords: Optional[torch.Tensor] = None, coords_merge: str = "dst"):
    """ToMe's bipartite matching of r merges on metric (B, N, D), or keys (B, H, N, D) averaged over heads inside
    the match kernel, and the size-weighted merge of x (B, N, C), size (B, N, 1) or None, in two Triton launches
    (five above 128 A tokens):
    -> x (B, N - r, C), size (B, N - r, 1), log size (B, N - r, 1) (the next block's proportional-attention bias);
    with coords (B, N - num_prefix, 2), the patch tokens' rotary positions, also those moved by the same plan
    (triton_tome.tome_merge)."""
    from . import triton_tome

    if coords is None:
        return triton_tome.tome_merge(metric, x, size, r, num_prefix)
    return triton_tome.tome_merge_with_coords(metric, x, size, r, num_prefix, coords, coords_merge)


def tome_groups(metric: torch.Tensor, r: int, num_prefix: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ToMe's matching of r merges on metric (B, N, D) or keys (B, H, N, D) as the dense variant's groups, in one
    Triton launch (four above 128 A tokens): group (B, N) (as plans.merge.group_index), and the members (order
    (B, N), starts (B, N - r + 1)) merge_normed takes."""
    from . import triton_tome

    return triton_tome.tome_groups(metric, r, num_prefix)


def atm_merge(metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor], threshold: float, num_prefix: int,
              split: Optional[Tuple[torch.Tensor, torch.Tensor]]
              ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """ATM's matching on metric (B, N, D) or keys (B, H, N, D) (averaged over heads in the kernel), batch-adaptive
    merge count (one host synchronisation) and merge in three Triton launches (six above 128 A tokens):
    -> x (B, N - r, C), size (B, N - r, 1), log size (B, N - r, 1), or None when nothing merges. split: (a_idx,
    b_idx) or None."""
    from . import triton_tome

    return triton_tome.atm_merge(metric, x, size, threshold, num_prefix, split)


def evit_prune(q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float, x: torch.Tensor,
               size: Optional[torch.Tensor], r: int, num_prefix: int, coords: Optional[torch.Tensor] = None,
               coords_merge: str = "dst"):
    """EViT's class attention (q, k: (B, H, N, d)), pruning of r tokens and fusion of x (B, N, C), size (B, N, 1)
    or None, in two Triton launches: -> x (B, N - r, C), size (B, N - r, 1), log size (B, N - r, 1); with coords
    (B, N - num_prefix, 2), the patch tokens' rotary positions, also those moved by the same plan (one launch more:
    triton_evit.evit_prune_with_coords; the fused token at the weighted mean of what it holds under either
    coords_merge, as tome_merge takes it)."""
    from . import triton_evit

    if coords is None:
        return triton_evit.evit_prune(q, k, attn_bias, scale, x, size, r, num_prefix)
    return triton_evit.evit_prune_with_coords(q, k, attn_bias, scale, x, size, r, num_prefix, coords)
