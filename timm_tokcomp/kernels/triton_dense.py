"""Fused Triton kernels of the dense variant, implementing the contract of ops.group_mean (with the
LayerNorm before it) and ops.unmerge_add. Deterministic: the merge reads every group's members in a
fixed (destination-sorted) order and accumulates in fp32; no atomics.

Set TRITON_INTERPRET=1 before importing this module to run the kernels on the CPU (fp32 / fp16 only).
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..measure.counting import kernel_launch


# token counts (and what follows them: widths, strides, slice offsets) change per block and, for ATM, per batch:
# not specialized, so that each kernel compiles once per set of constexprs
@triton.jit(do_not_specialize=["N", "M", "stride_order_b", "stride_offsets_b"],
            do_not_specialize_on_alignment=["ORDER", "OFFSETS"])
def _merge_kernel(
    X, Y, W, BIAS, ORDER, OFFSETS,
    N, M, C, stride_order_b, stride_offsets_b,
    stride_xb, stride_xn, stride_xc,
    stride_yb, stride_ym, stride_yc,
    eps,
    HAS_NORM: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per (batch row, group): mean over the group's tokens of LayerNorm(x) (or of x)."""
    b = tl.program_id(0).to(tl.int64)  # row offsets in 64 bits: B * N * C may pass 2 ** 31
    m = tl.program_id(1)
    start = tl.load(OFFSETS + b * stride_offsets_b + m)
    end = tl.load(OFFSETS + b * stride_offsets_b + m + 1)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    i = start
    while i < end:  # a while loop: older Triton interpreters cannot take loaded values as range() bounds
        n = tl.load(ORDER + b * stride_order_b + i)
        row = tl.load(X + b * stride_xb + n * stride_xn + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            mean = tl.sum(row, axis=0) / C
            centred = tl.where(mask, row - mean, 0.0)
            var = tl.sum(centred * centred, axis=0) / C
            row = centred / tl.sqrt(var + eps)
        acc += row
        i += 1
    acc = acc / (end - start).to(tl.float32)
    if HAS_NORM:  # the affine part is linear: applied once to the mean
        acc = acc * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) \
            + tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + b * stride_yb + m * stride_ym + cols * stride_yc, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "stride_group_b"],
            do_not_specialize_on_alignment=["GROUP"])
def _unmerge_add_kernel(
    X, Y, GROUP, GAMMA, OUT,
    N, C, stride_group_b,
    stride_xb, stride_xn, stride_xc,
    stride_yb, stride_ym, stride_yc,
    stride_ob, stride_on, stride_oc,
    HAS_GAMMA: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program per (batch row, token): out = x + gamma * y[group], in fp32, one rounding."""
    b = tl.program_id(0).to(tl.int64)  # row offsets in 64 bits: B * N * C may pass 2 ** 31
    n = tl.program_id(1)
    g = tl.load(GROUP + b * stride_group_b + n)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(X + b * stride_xb + n * stride_xn + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + b * stride_yb + g * stride_ym + cols * stride_yc, mask=mask, other=0.0).to(tl.float32)
    if HAS_GAMMA:
        y = y * tl.load(GAMMA + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + b * stride_ob + n * stride_on + cols * stride_oc, (x + y).to(OUT.dtype.element_ty), mask=mask)


def _sorted_members(group: torch.Tensor, num_groups: int):
    """group (B, N) -> order (B, N) int32: token indices sorted by group (stable), offsets (B, M + 1) int32."""
    order = group.argsort(dim=1, stable=True).to(torch.int32)
    counts = torch.zeros(group.shape[0], num_groups, dtype=torch.int32, device=group.device)
    counts.scatter_add_(1, group, torch.ones_like(group, dtype=torch.int32))
    offsets = torch.nn.functional.pad(counts.cumsum(dim=1, dtype=torch.int32), (1, 0))
    return order.contiguous(), offsets.contiguous()


def merge(
    x: torch.Tensor,
    group: torch.Tensor,
    num_groups: int,
    norm_weight: Optional[torch.Tensor] = None,
    norm_bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    members: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """x (B, N, C), group (B, N) -> (B, M, C): group means of LayerNorm(x) when norm_weight / norm_bias
    are given (fused), else of x. members: (order (B, N), starts (B, M + 1)) int32 with unit column stride, the
    tokens grouped and where each group begins (triton_tome.tome_groups); None: sorted from group here. Any
    strides; output contiguous in x's dtype."""
    B, N, C = x.shape
    order, offsets = members if members is not None else _sorted_members(group, num_groups)
    y = torch.empty(B, num_groups, C, dtype=x.dtype, device=x.device)
    has_norm = norm_weight is not None
    w = norm_weight if has_norm else x  # placeholders are never read when HAS_NORM is False
    bias = norm_bias if has_norm else x
    with kernel_launch("dense_merge", macs=0):
        _merge_kernel[(B, num_groups)](
            x, y, w, bias, order, offsets, N, num_groups, C, order.stride(0), offsets.stride(0),
            *x.stride(), *y.stride(), eps,
            HAS_NORM=has_norm, BLOCK_C=triton.next_power_of_2(C),
        )
    return y


def unmerge_add(x: torch.Tensor, y: torch.Tensor, group: torch.Tensor, gamma: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (B, N, C) + gamma (C,) * y (B, M, C)[group (B, N)] in one pass; output contiguous in x's dtype."""
    B, N, C = x.shape
    out = torch.empty(B, N, C, dtype=x.dtype, device=x.device)
    if group.dtype != torch.int32 or group.stride(1) != 1:
        group = group.to(torch.int32).contiguous()
    with kernel_launch("dense_unmerge_add", macs=0):
        _unmerge_add_kernel[(B, N)](
            x, y, group, gamma if gamma is not None else x, out, N, C, group.stride(0),
            *x.stride(), *y.stride(), *out.stride(),
            HAS_GAMMA=gamma is not None, BLOCK_C=triton.next_power_of_2(C),
        )
    return out
