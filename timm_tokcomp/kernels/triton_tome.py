"""Fused Triton kernels of ToMe's reduction step (bipartite soft matching, then the size-weighted merge),
implementing the contract of matching.best_matches + merge_top_r + plans.merge.merge_mean in two launches per block
(five above MATCH_TILES_IN_ONE_PROGRAM tiles of A tokens) instead of about 16 kernels and 15 views:

1. `_match_and_plan_kernel`: the metric of every token, normalized (a metric (B, N, D) as given, or ToMe's keys
   (B, H, N, D) averaged over heads as `k.mean(dim=1)` averages them: fp32 sum in head order, divided by H, rounded
   to the keys' dtype) into an fp32 scratch, every A token's best cosine similarity to a B token (fp32, IEEE dot
   products; the lowest B index on ties), each A token's rank by it, then the plan as the torch reference makes it
   (the r best-matched A tokens merge, ties to the lower index), written as index lists into an int32 workspace.
   Up to MATCH_TILES_IN_ONE_PROGRAM tiles of A tokens (224 px ViTs), one program per batch row runs all four
   phases; above that (larger images, where one program per image would leave most of the GPU idle) each phase
   is a launch of one program per (batch row, tile). ATM launches the matching alone (with each image's count of
   similarities above its threshold), then, once the host has the batch's merge count, the rest.
2. `_merge_kernel`, one program per (batch row, output token): the size-weighted mean of the output token's
   group and its size, accumulated in fp32 in a fixed order (no atomics: deterministic), and the log of that size
   (the next block's proportional-attention bias, so that block launches nothing for it).

A and B are the alternate positions, or the positions a size-distinctive split lists (ATM's late blocks).
Set TRITON_INTERPRET=1 before importing this module to run the kernels on the CPU (fp32 / fp16 only).
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..measure.counting import kernel_launch
from ..ops.rope import with_prefix_rows
from .triton_common import contiguous_empty, descending_rank, launched, store_size

# workspace row (int32): node_max (float32 bits) [n_a] | node_idx [n_a] | rank [n_a] | kept A [n_a - r] |
# merged A sorted by (destination, index) [r] | per-B offsets into that list [n_b + 1] |
# count above threshold, per matching program [programs]
BLOCK = 32  # tokens per tile
MATCH_TILES_IN_ONE_PROGRAM = 4  # up to n_a = 128 (DeiT at 224 px: 98), one program per image runs every phase


@triton.jit
def _positions(pos_row, first, idx, mask, num_prefix, HAS_SPLIT: tl.constexpr):
    """Token positions of the A (or B) tokens idx: listed in pos_row (after the prefix), or first + 2 * idx."""
    if HAS_SPLIT:
        return num_prefix + tl.load(pos_row + idx, mask=mask, other=0).to(tl.int32)
    return first + 2 * idx


@triton.jit
def _normalize_rows(base, out, tokens, mask, heads, stride_h, stride_n, stride_d, D, dcols, dmask):
    """The metric rows of tokens (BLOCK,): the mean over heads of base's rows (heads = 1: the rows themselves) in
    base's dtype, each divided by its L2 norm in fp32, stored at out (rows of D fp32)."""
    at = tokens[:, None] * stride_n + dcols[None, :] * stride_d
    rmask = mask[:, None] & dmask[None, :]
    rows = tl.load(base + at, mask=rmask, other=0.0).to(tl.float32)
    for h in range(1, heads):
        rows += tl.load(base + h * stride_h + at, mask=rmask, other=0.0).to(tl.float32)
    if heads > 1:
        rows = (rows / heads).to(base.dtype.element_ty).to(tl.float32)
    norm = tl.sqrt(tl.sum(rows * rows, axis=1))
    tl.store(out + tokens[:, None] * D + dcols[None, :], rows / tl.where(mask, norm, 1.0)[:, None], mask=rmask)


@triton.jit
def _load_rows(base, positions, mask, D, dcols, dmask):
    """The normalized fp32 rows at positions (rows of D): (BLOCK, BLOCK_D)."""
    return tl.load(base + positions[:, None] * D + dcols[None, :], mask=mask[:, None] & dmask[None, :], other=0.0)


# token counts (and what follows them: widths, strides, slice offsets) change per block and, for ATM, per batch:
# not specialized, so that each kernel compiles once per set of constexprs
@triton.jit(do_not_specialize=["n_a", "n_b", "r", "W", "groups_width", "stride_pos_a", "stride_pos_b", "stride_mb",
                             "stride_mh", "stride_mn"])
def _match_and_plan_kernel(
    METRIC, NORMED, WS, A_POS, B_POS, GROUPS,
    n_a, n_b, r, D, W, num_prefix, groups_width, heads,
    stride_mb, stride_mh, stride_mn, stride_md, stride_pos_a, stride_pos_b,
    a_first, b_first, threshold,
    NORM: tl.constexpr, MATCH: tl.constexpr, RANK: tl.constexpr, LISTS: tl.constexpr, HAS_SPLIT: tl.constexpr,
    GROUP_LISTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (batch, programs): program p of a row runs tiles p, p + programs, ... of each phase it is given."""
    b = tl.program_id(0).to(tl.int64)  # row offsets in 64 bits: B * N * C may pass 2 ** 31
    p = tl.program_id(1)
    step = tl.num_programs(1) * BLOCK
    num_tokens = num_prefix + n_a + n_b
    base = NORMED + b * num_tokens * D
    ws = WS + b * W
    a_pos_row = A_POS + b * stride_pos_a
    b_pos_row = B_POS + b * stride_pos_b
    node_max_ptr = ws
    node_idx_ptr = ws + n_a
    rank_ptr = ws + 2 * n_a
    kept_ptr = ws + 3 * n_a
    merged_ptr = kept_ptr + (n_a - r)
    offsets_ptr = merged_ptr + r
    counts_ptr = offsets_ptr + n_b + 1
    lane = tl.arange(0, BLOCK)
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D

    # 0. the normalized metric of every token
    if NORM:
        for t0 in range(p * BLOCK, num_tokens, step):
            tt = t0 + lane
            _normalize_rows(METRIC + b * stride_mb, base, tt, tt < num_tokens, heads, stride_mh, stride_mn,
                            stride_md, D, dcols, dmask)
        tl.debug_barrier()
    # 1. best match of every A token among the B tokens (and how many exceed the threshold)
    if MATCH:
        above = tl.zeros([], tl.int32)
        for a0 in range(p * BLOCK, n_a, step):
            ai = a0 + lane
            amask = ai < n_a
            a_at = _positions(a_pos_row, a_first, ai, amask, num_prefix, HAS_SPLIT)
            a = _load_rows(base, a_at, amask, D, dcols, dmask)
            best = tl.full([BLOCK], float("-inf"), tl.float32)
            best_idx = tl.zeros([BLOCK], tl.int32)
            for b0 in range(0, n_b, BLOCK):
                bj = b0 + lane
                bmask = bj < n_b
                b_at = _positions(b_pos_row, b_first, bj, bmask, num_prefix, HAS_SPLIT)
                bt = _load_rows(base, b_at, bmask, D, dcols, dmask)
                sim = tl.dot(a, tl.trans(bt), input_precision="ieee")
                sim = tl.where(bmask[None, :], sim, float("-inf"))
                tile_max = tl.max(sim, axis=1)
                tile_idx = tl.argmax(sim, axis=1, tie_break_left=True).to(tl.int32) + b0
                better = tile_max > best  # strict: an earlier tile keeps its tie
                best = tl.where(better, tile_max, best)
                best_idx = tl.where(better, tile_idx, best_idx)
            tl.store(node_max_ptr + ai, best.to(tl.int32, bitcast=True), mask=amask)
            tl.store(node_idx_ptr + ai, best_idx, mask=amask)
            above += tl.sum((amask & (best > threshold)).to(tl.int32), axis=0)
        tl.store(counts_ptr + p, above)
        tl.debug_barrier()
    # 2. rank of every A token by best similarity, descending, ties to the lower index (a stable sort)
    if RANK:
        for i0 in range(p * BLOCK, n_a, step):
            ii = i0 + lane
            imask = ii < n_a
            tl.store(rank_ptr + ii, descending_rank(node_max_ptr, ii, imask, n_a, lane, BLOCK), mask=imask)
        tl.debug_barrier()
    if LISTS:
        _lists(node_idx_ptr, rank_ptr, kept_ptr, merged_ptr, offsets_ptr, n_a, n_b, r, lane, p, step,
               GROUPS + b * groups_width, a_pos_row, b_pos_row, a_first, b_first, num_prefix,
               HAS_SPLIT, GROUP_LISTS, BLOCK)


@triton.jit
def _lists(node_idx_ptr, rank_ptr, kept_ptr, merged_ptr, offsets_ptr, n_a, n_b, r, lane, p, step,
           groups_row, a_pos_row, b_pos_row, a_first, b_first, num_prefix,
           HAS_SPLIT: tl.constexpr, GROUP_LISTS: tl.constexpr, BLOCK: tl.constexpr):
    """The merge plan of r merges from the ranks, as index lists (see the workspace layout), tiles p, p + step /
    BLOCK, ... of each list. With GROUP_LISTS, also every token's group and the groups' members, as
    plans.merge.group_index and the dense merge kernel take them: groups_row holds group [N] | members, grouped [N] |
    offsets [N - r + 1] (one row of GROUPS)."""
    num_tokens = num_prefix + n_a + n_b
    num_kept = n_a - r
    group_ptr = groups_row
    order_ptr = groups_row + num_tokens
    starts_ptr = order_ptr + num_tokens
    if GROUP_LISTS:  # prefix tokens: groups of their own
        for t0 in range(p * BLOCK, num_prefix, step):
            tt = t0 + lane
            tmask = tt < num_prefix
            tl.store(group_ptr + tt, tt, mask=tmask)
            tl.store(order_ptr + tt, tt, mask=tmask)
            tl.store(starts_ptr + tt, tt, mask=tmask)
    # 3. kept A tokens in their order; merged A tokens sorted by (destination, index)
    for i0 in range(p * BLOCK, n_a, step):
        ii = i0 + lane
        imask = ii < n_a
        merged_i = (tl.load(rank_ptr + ii, mask=imask, other=0) < r) & imask
        dst_i = tl.load(node_idx_ptr + ii, mask=imask, other=0)
        merged_before = tl.zeros([BLOCK], tl.int32)  # merged tokens of lower index
        list_pos = tl.zeros([BLOCK], tl.int32)  # merged tokens before it in (destination, index) order
        for j0 in range(0, n_a, BLOCK):
            jj = j0 + lane
            jmask = jj < n_a
            merged_j = (tl.load(rank_ptr + jj, mask=jmask, other=0) < r) & jmask
            dst_j = tl.load(node_idx_ptr + jj, mask=jmask, other=0)
            lower = jj[None, :] < ii[:, None]
            merged_before += tl.sum((merged_j[None, :] & lower).to(tl.int32), axis=1)
            first = (dst_j[None, :] < dst_i[:, None]) | ((dst_j[None, :] == dst_i[:, None]) & lower)
            list_pos += tl.sum((merged_j[None, :] & first).to(tl.int32), axis=1)
        tl.store(kept_ptr + (ii - merged_before), ii, mask=imask & ~merged_i)
        tl.store(merged_ptr + list_pos, ii, mask=merged_i)
        if GROUP_LISTS:
            a_at = _positions(a_pos_row, a_first, ii, imask, num_prefix, HAS_SPLIT)
            kept_group = num_prefix + ii - merged_before
            tl.store(group_ptr + a_at, tl.where(merged_i, num_prefix + num_kept + dst_i, kept_group), mask=imask)
            # a kept token alone in its group; a merged one after its destination's B token and the merged
            # tokens before it in (destination, index) order
            tl.store(order_ptr + tl.where(merged_i, num_prefix + num_kept + dst_i + 1 + list_pos, kept_group), a_at,
                     mask=imask)
            tl.store(starts_ptr + kept_group, kept_group, mask=imask & ~merged_i)
    for j0 in range(p * BLOCK, n_b + 1, step):
        jj = j0 + lane
        jmask = jj < n_b + 1
        count = tl.zeros([BLOCK], tl.int32)
        for i0 in range(0, n_a, BLOCK):
            ii = i0 + lane
            imask = ii < n_a
            merged_i = (tl.load(rank_ptr + ii, mask=imask, other=0) < r) & imask
            dst_i = tl.load(node_idx_ptr + ii, mask=imask, other=0)
            count += tl.sum((merged_i[None, :] & (dst_i[None, :] < jj[:, None])).to(tl.int32), axis=1)
        tl.store(offsets_ptr + jj, count, mask=jmask)
        if GROUP_LISTS:  # B token j: group num_prefix + num_kept + j, listed first in its group
            b_group = num_prefix + num_kept + jj
            is_b = jj < n_b
            b_at = _positions(b_pos_row, b_first, jj, is_b, num_prefix, HAS_SPLIT)
            tl.store(group_ptr + b_at, b_group, mask=is_b)
            tl.store(order_ptr + b_group + count, b_at, mask=is_b)
            tl.store(starts_ptr + b_group, b_group + count, mask=jmask)  # j = n_b: the end, num_tokens


@triton.jit(do_not_specialize=["n_a", "r", "W", "stride_sb", "stride_ob", "stride_pos_a", "stride_pos_b"])
def _merge_kernel(
    X, SIZE, WS, Y, SIZE_OUT, LOG_OUT, A_POS, B_POS,
    C, n_a, r, W, num_prefix, a_first, b_first,
    stride_xb, stride_xn, stride_xc,
    stride_sb, stride_sn,
    stride_yb, stride_yn, stride_yc,
    stride_ob, stride_on, stride_pos_a, stride_pos_b,
    HAS_SIZE: tl.constexpr, HAS_SPLIT: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # row offsets in 64 bits: B * N * C may pass 2 ** 31
    g = tl.program_id(1)
    ws = WS + b * W
    a_pos_row = A_POS + b * stride_pos_a
    b_pos_row = B_POS + b * stride_pos_b
    kept_ptr = ws + 3 * n_a
    merged_ptr = kept_ptr + (n_a - r)
    offsets_ptr = merged_ptr + r
    num_kept = n_a - r
    in_a = (g >= num_prefix) & (g < num_prefix + num_kept)
    in_b = g >= num_prefix + num_kept
    j = g - num_prefix - num_kept  # B index of an output in the B part
    kept = tl.load(kept_ptr + (g - num_prefix), mask=in_a, other=0)
    a_token = _positions(a_pos_row, a_first, kept, in_a, num_prefix, HAS_SPLIT)
    b_token = _positions(b_pos_row, b_first, j, in_b, num_prefix, HAS_SPLIT)
    token = tl.where(in_b, b_token, tl.where(in_a, a_token, g))
    start = tl.load(offsets_ptr + j, mask=in_b, other=0)
    end = tl.load(offsets_ptr + j + 1, mask=in_b, other=0)

    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    x_row = X + b * stride_xb
    s_row = SIZE + b * stride_sb
    total = tl.full([], 1.0, tl.float32)
    if HAS_SIZE:
        total = tl.load(s_row + token * stride_sn).to(tl.float32)
    acc = tl.load(x_row + token * stride_xn + cols * stride_xc, mask=cmask, other=0.0).to(tl.float32) * total
    k = start
    while k < end:  # the A tokens merged into this B token (a while loop: loaded bounds)
        t = _positions(a_pos_row, a_first, tl.load(merged_ptr + k), k < end, num_prefix, HAS_SPLIT)
        s = tl.full([], 1.0, tl.float32)
        if HAS_SIZE:
            s = tl.load(s_row + t * stride_sn).to(tl.float32)
        acc += tl.load(x_row + t * stride_xn + cols * stride_xc, mask=cmask, other=0.0).to(tl.float32) * s
        total += s
        k += 1
    tl.store(Y + b * stride_yb + g * stride_yn + cols * stride_yc, (acc / total).to(Y.dtype.element_ty), mask=cmask)
    store_size(SIZE_OUT, LOG_OUT, b * stride_ob + g * stride_on, total)


class _Layout(NamedTuple):
    n_a: int
    n_b: int
    a_first: int  # position of the first A / B token on the alternate split
    b_first: int
    programs: int  # per batch row and phase: 1 (every phase in one launch) or one per tile of A tokens
    width: int  # of a workspace row


def _layout(num_tokens: int, num_prefix: int) -> _Layout:
    n = num_tokens - num_prefix
    a_start = num_prefix % 2
    n_a = (n - a_start + 1) // 2
    tiles = triton.cdiv(n_a, BLOCK)
    programs = 1 if tiles <= MATCH_TILES_IN_ONE_PROGRAM else tiles
    return _Layout(n_a, n - n_a, num_prefix + a_start, num_prefix + 1 - a_start, programs,
                   4 * n_a + (n - n_a) + 1 + programs)


def _heads_view(metric: torch.Tensor) -> Tuple[int, Tuple[int, int, int, int]]:
    """(heads, strides (batch, head, token, channel)) of a metric (B, N, D) (one head) or keys (B, H, N, D)."""
    if metric.dim() == 4:
        return metric.shape[1], metric.stride()
    return 1, (metric.stride(0), 0, metric.stride(1), metric.stride(2))


def _match_and_plan(metric: torch.Tensor, ws: torch.Tensor, lay: _Layout, r: int, num_prefix: int,
                    split: Optional[Tuple[torch.Tensor, torch.Tensor]], threshold: float, match: bool, plan: bool,
                    name: str, groups: Optional[torch.Tensor] = None) -> None:
    """The matching (match: the normalized metric, then the best matches) and / or the plan (plan: ranks, then lists)
    into ws, on metric (B, N, D) or keys (B, H, N, D) (averaged over heads): one launch with one program per batch
    row, or, on a layout of several programs, one launch per phase."""
    B, D = metric.shape[0], metric.shape[-1]
    heads, strides = _heads_view(metric)
    num_tokens = num_prefix + lay.n_a + lay.n_b
    unused = metric  # for the pointers a launch never touches: an input it only reads (see triton_common)
    # the normalized rows, written by the matching launch and read by it
    normed = contiguous_empty((B, num_tokens, D), dtype=torch.float32, device=metric.device) if match else unused
    a_pos, b_pos = split if split is not None else (unused, unused)

    def launch(phase_name: str, programs: int, macs: int, **phases: bool) -> None:
        with kernel_launch(phase_name, macs=macs):
            launched(_match_and_plan_kernel)[(B, programs)](
                metric, normed, ws, a_pos, b_pos, groups if groups is not None else unused,
                lay.n_a, lay.n_b, r, D, lay.width, num_prefix, groups.shape[1] if groups is not None else 0, heads,
                *strides, a_pos.stride(0), b_pos.stride(0), lay.a_first, lay.b_first, threshold,
                **phases, HAS_SPLIT=split is not None, GROUP_LISTS=groups is not None,
                BLOCK=BLOCK, BLOCK_D=max(16, triton.next_power_of_2(D)),
            )

    macs = B * lay.n_a * lay.n_b * D if match else 0
    if lay.programs == 1:
        launch(name, 1, macs, NORM=match, MATCH=match, RANK=plan, LISTS=plan)
        return
    if match:
        launch(f"{name}.metric", lay.programs, 0, NORM=True, MATCH=False, RANK=False, LISTS=False)
        launch(f"{name}.match", lay.programs, macs, NORM=False, MATCH=True, RANK=False, LISTS=False)
    if plan:
        launch(f"{name}.rank", lay.programs, 0, NORM=False, MATCH=False, RANK=True, LISTS=False)
        list_programs = max(lay.programs, triton.cdiv(lay.n_b + 1, BLOCK), triton.cdiv(num_prefix, BLOCK))
        launch(f"{name}.lists", list_programs, 0, NORM=False, MATCH=False, RANK=False, LISTS=True)


def _merge(ws: torch.Tensor, lay: _Layout, x: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int,
           split: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merge launch of a planned step (ws) -> x (B, N - r, C), size and its log (B, N - r, 1), in x's dtype."""
    B, N, C = x.shape
    y = contiguous_empty((B, N - r, C), dtype=x.dtype, device=x.device)
    size_out = contiguous_empty((B, N - r, 1), dtype=x.dtype, device=x.device)
    log_out = contiguous_empty((B, N - r, 1), dtype=x.dtype, device=x.device)  # the next block's log sizes
    s = size if size is not None else x  # never read when HAS_SIZE is False (no output: see triton_common)
    a_pos, b_pos = split if split is not None else (ws, ws)
    with kernel_launch("tome_merge", macs=0):
        launched(_merge_kernel)[(B, N - r)](
            x, s, ws, y, size_out, log_out, a_pos, b_pos, C, lay.n_a, r, lay.width, num_prefix, lay.a_first,
            lay.b_first,
            *x.stride(), s.stride(0), s.stride(1), *y.stride(), size_out.stride(0), size_out.stride(1),
            a_pos.stride(0), b_pos.stride(0),
            HAS_SIZE=size is not None, HAS_SPLIT=split is not None, BLOCK_C=triton.next_power_of_2(C),
        )
    return y, size_out, log_out


def tome_merge(metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int,
               split: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ToMe's reduction step: metric (B, N, D) or keys (B, H, N, D) (the metric: their mean over heads),
    x (B, N, C), size (B, N, 1) or None (all ones), 0 < r <= max_merges(N, num_prefix), split (a_idx, b_idx) from
    matching.size_distinctive_split or None (the alternate split) -> x (B, N - r, C), size (B, N - r, 1) and its log
    (B, N - r, 1) (the next block's proportional-attention bias), in x's dtype, in merge_mean's order (prefix tokens,
    kept A tokens, B tokens)."""
    lay, ws = _planned(metric, r, num_prefix, split)
    return _merge(ws, lay, x, size, r, num_prefix, split)


def _planned(metric: torch.Tensor, r: int, num_prefix: int, split: Optional[Tuple[torch.Tensor, torch.Tensor]]
             ) -> Tuple[_Layout, torch.Tensor]:
    """ToMe's matching and plan of r merges on metric (B, N, D) or keys (B, H, N, D) -> (its layout, the workspace
    holding the plan)."""
    lay = _layout(metric.shape[-2], num_prefix)
    ws = contiguous_empty((metric.shape[0], lay.width), dtype=torch.int32, device=metric.device)
    _match_and_plan(metric, ws, lay, r, num_prefix, split, 0.0, True, True, "tome_match_and_plan")
    return lay, ws


def tome_merge_with_coords(metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor], r: int,
                           num_prefix: int, coords: torch.Tensor, coords_merge: str
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tome_merge, and the patch tokens' rotary coords (B, N - num_prefix, 2) moved by the same plan ->
    (x, size, log size, coords (B, N - r - num_prefix, 2)). coords_merge 'dst': each output keeps its destination's
    row (a kept A token's own, a B token's: read from the plan's list of kept A tokens); 'centroid': the size-weighted
    mean of what it holds, by the merge kernel in fp32 on the same plan (one more launch)."""
    lay, ws = _planned(metric, r, num_prefix, None)
    merged, merged_size, log_size = _merge(ws, lay, x, size, r, num_prefix, None)
    if coords_merge == "dst":
        moved = _destination_coords(ws, lay, coords, r, num_prefix)
    else:
        weights = None if size is None else size.float()
        moved = _merge(ws, lay, with_prefix_rows(coords, num_prefix), weights, r, num_prefix, None)[0][:, num_prefix:]
    return merged, merged_size, log_size, moved


def _destination_coords(ws: torch.Tensor, lay: _Layout, coords: torch.Tensor, r: int, num_prefix: int
                        ) -> torch.Tensor:
    """Each output patch token's coords (B, P - r, 2), from coords (B, P, 2): its destination's, in merge_mean's
    order (the kept A tokens, read from the plan's list in ws, then the B tokens)."""
    a_start, num_kept = lay.a_first - num_prefix, lay.n_a - r
    # traced: torch.compile (torch 2.11's dynamo runs a triton_op's body on fake tensors with is_compiling() False)
    traced = torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None
    if not traced:  # eager: a conversion, a gather and a concatenation
        kept = ws[:, 3 * lay.n_a:3 * lay.n_a + num_kept].long().unsqueeze(-1).expand(-1, -1, 2)
        return torch.cat([coords[:, a_start::2].gather(1, kept), coords[:, 1 - a_start::2]], dim=1)
    # traced: one source index per output (pointwise arithmetic for Inductor to fuse), so that no tensor is n_a - r
    # long, whose size-0 and size-1 checks would guard on r and recompile the block where every A token merges
    out = torch.arange(coords.shape[1] - r, device=coords.device)
    kept = ws[:, 3 * lay.n_a:4 * lay.n_a].gather(1, out.clamp(max=lay.n_a - 1).expand(ws.shape[0], -1))
    source = torch.where(out < num_kept, 2 * kept + a_start, 2 * (out - num_kept) + 1 - a_start)
    return coords.gather(1, source.long().unsqueeze(-1).expand(-1, -1, 2))


def atm_merge(metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor], threshold: float, num_prefix: int,
              split: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
              ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """ATM's reduction step on metric (B, N, D) or keys (B, H, N, D), as tome_merge (x, size, log size) with r = the
    batch-adaptive count of best similarities above threshold (matching.batch_adaptive_r, at most max_merges): one host
    synchronisation, for that count. None when r = 0. B >= 1."""
    B = x.shape[0]
    lay = _layout(x.shape[1], num_prefix)
    ws = contiguous_empty((B, lay.width), dtype=torch.int32, device=x.device)
    _match_and_plan(metric, ws, lay, 0, num_prefix, split, threshold, True, False, "tome_match")
    r = min(math.floor(int(ws[:, -lay.programs:].sum()) / B + 0.5), (x.shape[1] - num_prefix) // 2)
    if r <= 0:
        return None
    _match_and_plan(metric, ws, lay, r, num_prefix, split, threshold, False, True, "tome_plan")
    return _merge(ws, lay, x, size, r, num_prefix, split)


def tome_groups(metric: torch.Tensor, r: int, num_prefix: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ToMe's matching of r merges on metric (B, N, D) or keys (B, H, N, D) (alternate split, 0 < r <= max_merges),
    as the groups the dense variant merges: group (B, N) int32, each token's group in merge_mean's output order (as
    plans.merge.group_index); order (B, N) int32, the tokens grouped, each group's B token first; starts (B, N - r + 1)
    int32, where each group begins in order (the last entry N). One launch (four on larger images)."""
    B, N = metric.shape[0], metric.shape[-2]
    lay = _layout(N, num_prefix)
    ws = contiguous_empty((B, lay.width), dtype=torch.int32, device=metric.device)
    groups = contiguous_empty((B, 3 * N - r + 1), dtype=torch.int32, device=metric.device)
    _match_and_plan(metric, ws, lay, r, num_prefix, None, 0.0, True, True, "tome_match_and_group", groups)
    group, order, starts = groups.split([N, N, N - r + 1], dim=1)
    return group, order, starts
