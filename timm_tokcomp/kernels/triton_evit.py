"""Fused Triton kernels of EViT's reduction step, implementing the contract of matching.class_attention (averaged
over heads) + matching.attentive_pruning + plans.prune (prune_fuse / prune_sum) in two launches per block (five on
larger images):

1. `_class_attention_plan_kernel`: the class token's softmax attention row of every head (fp32, online max / sum
   over token tiles), averaged over heads; the rank of every non-prefix token by it (descending, ties to the lower
   index, as a stable sort); the kept tokens in their order and the fused ones in rank order, with the sum of the
   fused tokens' attention, into a workspace. Up to TILES_IN_ONE_PROGRAM tiles of tokens (224 px ViTs), one
   program per batch row runs it all; above, each phase is a launch of a program per head or per tile.
2. `_prune_fuse_kernel`, one program per (batch row, output token): a kept token's row and size, or for the last
   output the attention-weighted mean of the fused tokens (read 8 rows at a time) and the sum of their sizes
   (fp32, fixed order); and the log of each size (the next block's proportional-attention bias). On a rope model
   a second launch moves the rotary coordinates by the same plan (evit_prune_with_coords).

Set TRITON_INTERPRET=1 before importing this module to run the kernels on the CPU (fp32 / fp16 only).
"""
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..measure.counting import kernel_launch
from ..ops.rope import with_prefix_rows
from .triton_common import contiguous_empty, descending_rank, launched, store_size

# workspace row (int32): attention (float32 bits) [n] | rank [n] | kept [n - f] | fused, by rank [f] |
# per-head softmax max and sum (float32 bits) [2 H] | fused attention sum, per list program (float32 bits) [parts]
BLOCK = 64  # tokens per tile
TILES_IN_ONE_PROGRAM = 4  # up to 256 patch tokens (DeiT at 224 px: 196), one program per image runs every phase


@triton.jit
def _head_scores(q_row, k_row, bias_row, cols, cmask, dcols, dmask, stride_kn, stride_kd, stride_bias_n, scale,
                 HAS_BIAS: tl.constexpr):
    """Scaled scores of the class query against the tokens cols: (BLOCK_N,), -inf outside cmask."""
    q = tl.load(q_row + dcols, mask=dmask, other=0.0).to(tl.float32)
    k = tl.load(k_row + cols[:, None] * stride_kn + dcols[None, :] * stride_kd,
                mask=cmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    s = tl.sum(k * q[None, :], axis=1) * scale
    if HAS_BIAS:
        s += tl.load(bias_row + cols * stride_bias_n, mask=cmask, other=0.0).to(tl.float32)
    return tl.where(cmask, s, float("-inf"))


# token counts (and what follows them: widths, strides, slice offsets) change per block and, for ATM, per batch:
# not specialized, so that each kernel compiles once per set of constexprs
@triton.jit(do_not_specialize=["N", "W", "num_fused", "stride_bias_b"])
def _class_attention_plan_kernel(
    Q, K, BIAS, WS,
    H, N, D, W, num_prefix, num_fused, scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_bias_b, stride_bias_n,
    STATS: tl.constexpr, ATTN: tl.constexpr, RANK: tl.constexpr, LISTS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (batch, programs): program p of a row runs heads / tiles p, p + programs, ... of each phase given."""
    b = tl.program_id(0).to(tl.int64)  # row offsets in 64 bits: B * N * C may pass 2 ** 31
    p = tl.program_id(1)
    programs = tl.num_programs(1)
    step = programs * BLOCK
    n = N - num_prefix
    ws = WS + b * W
    attn_ptr = ws
    rank_ptr = ws + n
    kept_ptr = ws + 2 * n
    fused_ptr = kept_ptr + (n - num_fused)
    stats_ptr = ws + 3 * n
    wsum_ptr = stats_ptr + 2 * H
    lane = tl.arange(0, BLOCK)
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D
    bias_row = BIAS + b * stride_bias_b

    # 1. every head's softmax max and sum over all tokens (online), then the head-averaged attention
    if STATS:
        for h in range(p, H, programs):
            q_row = Q + b * stride_qb + h * stride_qh  # the class token: token 0
            k_row = K + b * stride_kb + h * stride_kh
            m = tl.full([], float("-inf"), tl.float32)
            l = tl.zeros([], tl.float32)
            for c0 in range(0, N, BLOCK):
                cols = c0 + lane
                s = _head_scores(q_row, k_row, bias_row, cols, cols < N, dcols, dmask, stride_kn, stride_kd,
                                 stride_bias_n, scale, HAS_BIAS)
                m_new = tl.maximum(m, tl.max(s, axis=0))
                l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), axis=0)
                m = m_new
            tl.store(stats_ptr + 2 * h, m.to(tl.int32, bitcast=True))
            tl.store(stats_ptr + 2 * h + 1, l.to(tl.int32, bitcast=True))
        tl.debug_barrier()
    if ATTN:
        for c0 in range(p * BLOCK, n, step):
            cols = num_prefix + c0 + lane
            cmask = cols < N
            acc = tl.zeros([BLOCK], tl.float32)
            for h in range(H):
                q_row = Q + b * stride_qb + h * stride_qh
                k_row = K + b * stride_kb + h * stride_kh
                s = _head_scores(q_row, k_row, bias_row, cols, cmask, dcols, dmask, stride_kn, stride_kd,
                                 stride_bias_n, scale, HAS_BIAS)
                m = tl.load(stats_ptr + 2 * h).to(tl.float32, bitcast=True)
                l = tl.load(stats_ptr + 2 * h + 1).to(tl.float32, bitcast=True)
                acc += tl.exp(s - m) / l
            tl.store(attn_ptr + c0 + lane, (acc / H).to(tl.int32, bitcast=True), mask=cmask)
        tl.debug_barrier()

    # 2. rank by attention, descending, ties to the lower index
    if RANK:
        for i0 in range(p * BLOCK, n, step):
            ii = i0 + lane
            imask = ii < n
            tl.store(rank_ptr + ii, descending_rank(attn_ptr, ii, imask, n, lane, BLOCK), mask=imask)
        tl.debug_barrier()

    # 3. kept tokens in their order, fused tokens in rank order, and this program's part of the fused attention sum
    if LISTS:
        num_kept = n - num_fused
        wsum = tl.zeros([], tl.float32)
        for i0 in range(p * BLOCK, n, step):
            ii = i0 + lane
            imask = ii < n
            rank_i = tl.load(rank_ptr + ii, mask=imask, other=0)
            kept_i = (rank_i < num_kept) & imask
            fused_i = (rank_i >= num_kept) & imask
            kept_before = tl.zeros([BLOCK], tl.int32)
            for j0 in range(0, n, BLOCK):
                jj = j0 + lane
                jmask = jj < n
                kept_j = (tl.load(rank_ptr + jj, mask=jmask, other=0) < num_kept) & jmask
                kept_before += tl.sum((kept_j[None, :] & (jj[None, :] < ii[:, None])).to(tl.int32), axis=1)
            tl.store(kept_ptr + kept_before, ii, mask=kept_i)
            tl.store(fused_ptr + (rank_i - num_kept), ii, mask=fused_i)
            attn_i = tl.load(attn_ptr + ii, mask=imask, other=0).to(tl.float32, bitcast=True)
            wsum += tl.sum(tl.where(fused_i, attn_i, 0.0), axis=0)
        tl.store(wsum_ptr + p, wsum.to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["N", "W", "num_fused", "num_parts", "stride_sb", "stride_ob"])
def _prune_fuse_kernel(
    X, SIZE, WS, Y, SIZE_OUT, LOG_OUT,
    C, N, H, W, num_prefix, num_fused, num_parts,
    stride_xb, stride_xn, stride_xc,
    stride_sb, stride_sn,
    stride_yb, stride_yn, stride_yc,
    stride_ob, stride_on,
    HAS_SIZE: tl.constexpr, BLOCK_C: tl.constexpr, FUSE_ROWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # row offsets in 64 bits: B * N * C may pass 2 ** 31
    g = tl.program_id(1)
    n = N - num_prefix
    ws = WS + b * W
    kept_ptr = ws + 2 * n
    fused_ptr = kept_ptr + (n - num_fused)
    wsum_ptr = ws + 3 * n + 2 * H
    num_kept = n - num_fused
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    x_row = X + b * stride_xb
    s_row = SIZE + b * stride_sb
    in_kept = (g >= num_prefix) & (g < num_prefix + num_kept)
    is_fused = g >= num_prefix + num_kept
    kept = tl.load(kept_ptr + (g - num_prefix), mask=in_kept, other=0)
    token = tl.where(in_kept, num_prefix + kept, g)  # a prefix or kept token's input row
    acc = tl.zeros([BLOCK_C], tl.float32)
    total = tl.zeros([], tl.float32)
    if is_fused:
        wsum = tl.zeros([], tl.float32)
        for part in range(0, num_parts):  # the list programs' parts, in a fixed order
            wsum += tl.load(wsum_ptr + part).to(tl.float32, bitcast=True)
        wsum = tl.maximum(wsum, 1.1754943508222875e-38)
        rows = tl.arange(0, FUSE_ROWS)
        for k0 in range(0, num_fused, FUSE_ROWS):  # FUSE_ROWS fused tokens per step, their loads in parallel
            kk = k0 + rows
            kmask = kk < num_fused
            i = tl.load(fused_ptr + kk, mask=kmask, other=0)
            w = tl.load(ws + i, mask=kmask, other=0).to(tl.float32, bitcast=True) / wsum
            tile = tl.load(x_row + (num_prefix + i)[:, None] * stride_xn + cols[None, :] * stride_xc,
                           mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(tile * w[:, None], axis=0)
            if HAS_SIZE:
                total += tl.sum(tl.load(s_row + (num_prefix + i) * stride_sn, mask=kmask, other=0.0).to(tl.float32),
                                axis=0)
            else:
                total += tl.sum(kmask.to(tl.float32), axis=0)
    else:
        acc = tl.load(x_row + token * stride_xn + cols * stride_xc, mask=cmask, other=0.0).to(tl.float32)
        if HAS_SIZE:
            total = tl.load(s_row + token * stride_sn).to(tl.float32)
        else:
            total = tl.full([], 1.0, tl.float32)
    tl.store(Y + b * stride_yb + g * stride_yn + cols * stride_yc, acc.to(Y.dtype.element_ty), mask=cmask)
    store_size(SIZE_OUT, LOG_OUT, b * stride_ob + g * stride_on, total)


def evit_prune(q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float, x: torch.Tensor,
               size: Optional[torch.Tensor], r: int, num_prefix: int
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EViT's reduction step: q, k (B, H, N, d) after q/k norm, attn_bias (B, 1, 1, N) or None, x (B, N, C), size
    (B, N, 1) or None (all ones), 0 < r <= N - num_prefix - 1 -> x (B, N - r, C), size (B, N - r, 1) and its log
    (B, N - r, 1) (the next block's proportional-attention bias) in x's dtype: prefix tokens, kept tokens, the fused
    token."""
    plan = _planned(q, k, attn_bias, scale, r, num_prefix)
    return _prune_fuse(plan, x, size, r, num_prefix)


def evit_prune_with_coords(q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float,
                           x: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int, coords: torch.Tensor
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """evit_prune, and the patch tokens' rotary coords (B, N - num_prefix, 2), float32, moved by the same plan ->
    (x, size, log size, coords (B, N - r - num_prefix, 2)): each kept token's own, the fused token's the weighted mean
    of what it holds, as x's (plans.prune.prune_fuse; rope.moved_coords), by the fuse kernel in fp32 (one more
    launch)."""
    plan = _planned(q, k, attn_bias, scale, r, num_prefix)
    pruned, pruned_size, log_size = _prune_fuse(plan, x, size, r, num_prefix)
    moved = _prune_fuse(plan, with_prefix_rows(coords, num_prefix), None, r, num_prefix)[0][:, num_prefix:]
    return pruned, pruned_size, log_size, moved


class _Plan(NamedTuple):
    ws: torch.Tensor  # (B, width) int32: the weights, ranks and lists of the class attention's plan
    heads: int
    parts: int  # the list programs of a row, each with its share of the fused weights' sum


def _planned(q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float, r: int,
             num_prefix: int) -> _Plan:
    """The class token's attention over q, k (B, H, N, d) (attn_bias (B, 1, 1, N) or None) and the plan that fuses
    its r + 1 least attended patch tokens: one launch, or one per phase on a layout of several programs."""
    B, H, N, D = k.shape
    n = N - num_prefix
    num_fused = r + 1
    tiles = triton.cdiv(n, BLOCK)
    parts = 1 if tiles <= TILES_IN_ONE_PROGRAM else tiles
    width = 3 * n + 2 * H + parts
    ws = contiguous_empty((B, width), dtype=torch.int32, device=k.device)
    bias = attn_bias if attn_bias is not None else k  # never read without HAS_BIAS

    def launch(name: str, programs: int, macs: int, **phases: bool) -> None:
        reads_scores = phases["STATS"] or phases["ATTN"]  # ranking and listing never read the bias
        with kernel_launch(name, macs=macs):
            launched(_class_attention_plan_kernel)[(B, programs)](
                q, k, bias, ws, H, N, D, width, num_prefix, num_fused, scale,
                q.stride(0), q.stride(1), q.stride(3), *k.stride(), bias.stride(0), bias.stride(-1),
                **phases, HAS_BIAS=attn_bias is not None and reads_scores, BLOCK=BLOCK,
                BLOCK_D=max(16, triton.next_power_of_2(D)),
            )

    if parts == 1:
        launch("evit_class_attention_plan", 1, B * H * N * D, STATS=True, ATTN=True, RANK=True, LISTS=True)
    else:  # a launch per phase: heads, then tiles of tokens, in parallel
        launch("evit_class_attention_plan.stats", H, B * H * N * D, STATS=True, ATTN=False, RANK=False, LISTS=False)
        launch("evit_class_attention_plan.attention", tiles, 0, STATS=False, ATTN=True, RANK=False, LISTS=False)
        launch("evit_class_attention_plan.rank", tiles, 0, STATS=False, ATTN=False, RANK=True, LISTS=False)
        launch("evit_class_attention_plan.lists", tiles, 0, STATS=False, ATTN=False, RANK=False, LISTS=True)
    return _Plan(ws, H, parts)


def _prune_fuse(plan: _Plan, x: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prune-and-fuse launch of a plan on x (B, N, C), size (B, N, 1) or None -> x (B, N - r, C), size and its
    log (B, N - r, 1), in x's dtype."""
    B, N, C = x.shape
    y = contiguous_empty((B, N - r, C), dtype=x.dtype, device=x.device)
    size_out = contiguous_empty((B, N - r, 1), dtype=x.dtype, device=x.device)
    log_out = contiguous_empty((B, N - r, 1), dtype=x.dtype, device=x.device)
    s = size if size is not None else x  # never read when HAS_SIZE is False (no output: see triton_common)
    block_c = triton.next_power_of_2(C)
    with kernel_launch("evit_prune_fuse", macs=0):
        launched(_prune_fuse_kernel)[(B, N - r)](
            x, s, plan.ws, y, size_out, log_out, C, N, plan.heads, plan.ws.shape[1], num_prefix, r + 1, plan.parts,
            *x.stride(), s.stride(0), s.stride(1), *y.stride(), size_out.stride(0), size_out.stride(1),
            HAS_SIZE=size is not None, BLOCK_C=block_c, FUSE_ROWS=max(1, min(8, 8192 // block_c)),
        )
    return y, size_out, log_out
