"""The matching that several methods share (no nn.Module here): ToMe's bipartite matching and its tie-breaking, ATM's
size-distinctive split and threshold counting, the class token's attention, EViT's attentive pruning (also the fused
kernels' reference), and the pairwise distances and nearest centres of the clustering methods. What one method
alone uses lives in its own file (methods/).

Index conventions: prefix tokens (class / distillation / register) are split off first and never take
part in matching. The remaining tokens are split alternately by their absolute position: set A holds
the even positions, set B the odd ones (the class token of a plain ViT would be position 0, so A is
the same set as in the ToMe reference). ATM's size-distinctive split instead puts the smaller-sized
half of the tokens in A and the larger half in B. The plans these functions return (timm_tokcomp.plans) index
into A / B / the non-prefix tokens, per batch row.
"""
import functools
from typing import Any, Callable, Optional, Tuple

import torch

from ..plans import MergePlan, PrunePlan, split_tokens


def max_merges(num_tokens: int, num_prefix: int) -> int:
    """Largest r bipartite matching allows for num_tokens tokens with num_prefix protected."""
    return max(num_tokens - num_prefix, 0) // 2


def size_distinctive_split(size: torch.Tensor, num_prefix: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """ATM's split for late layers: the smaller-sized half of the non-prefix tokens forms A (sources),
    the larger half B (destinations), so two tokens of the larger half are never merged together.

    size: (B, N, 1) tokens' merging sizes. Tokens are ordered by (size, parity of the absolute
    position, position); A takes as many tokens as the alternate split would, so with equal sizes
    the split is exactly the alternate one. Returns a_idx (B, Na), b_idx (B, Nb), each ascending.
    """
    n = size.shape[1] - num_prefix
    a_start = num_prefix % 2
    num_a = len(range(a_start, n, 2))
    with torch.no_grad():
        parity = (torch.arange(n, device=size.device) + a_start) % 2  # 0 on A's positions
        by_parity = parity.argsort(stable=True).expand(size.shape[0], -1)
        s = size[:, num_prefix:, 0].gather(1, by_parity)
        order = by_parity.gather(1, s.argsort(dim=-1, stable=True))
        a_idx = order[:, :num_a].sort(dim=-1).values
        b_idx = order[:, num_a:].sort(dim=-1).values
    return a_idx, b_idx


def best_matches(
    metric: torch.Tensor,
    num_prefix: int,
    split: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cosine similarity of every A token to its most similar B token.

    metric: (B, N, C); split: (a_idx, b_idx) from size_distinctive_split, or None for the alternate
    split. Returns node_max (B, Na) best similarity and node_idx (B, Na) its index in B (the lowest
    index on ties).
    """
    with torch.no_grad():
        m = metric / metric.norm(dim=-1, keepdim=True)  # prefix rows too: one slice fewer per block
        a, b = split_tokens(m, num_prefix, split)
        return torch.bmm(a, b.transpose(1, 2)).max(dim=-1)


def merge_top_r(
    node_max: torch.Tensor,
    node_idx: torch.Tensor,
    r: int,
    num_prefix: int,
    split: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> MergePlan:
    """The plan merging the r A tokens with the highest best-match similarity (ties: lower index first).

    node_max, node_idx: (B, Na) from best_matches; r: clamped to [0, Na]; split as in best_matches.
    """
    r = max(min(r, node_max.shape[1]), 0)
    with torch.no_grad():
        edge_idx = node_max.argsort(dim=-1, descending=True, stable=True)
        src_idx, unm_idx = edge_idx.split([r, edge_idx.shape[1] - r], dim=1)
        unm_idx = unm_idx.sort(dim=-1).values
        dst_idx = node_idx.gather(1, src_idx)
    a_idx, b_idx = split if split is not None else (None, None)
    return MergePlan(num_prefix, num_prefix % 2, unm_idx, src_idx, dst_idx, a_idx, b_idx)


def bipartite_soft_matching(metric: torch.Tensor, r: int, num_prefix: int) -> MergePlan:
    """ToMe's bipartite soft matching on the alternate split.

    metric: (B, N, C) per-token features (e.g. keys averaged over heads); cosine similarity is used.
    r: merges wanted; clamped to max_merges(N, num_prefix).
    Ties are broken towards the lower index (stable sort), so the plan is deterministic.
    """
    r = min(r, max_merges(metric.shape[1], num_prefix))
    node_max, node_idx = best_matches(metric, num_prefix)
    return merge_top_r(node_max, node_idx, r, num_prefix)


def keep_best(keep: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """keep: (B, n) bool, with each row's best-scoring token (score (B, n)) kept too, so that a data-dependent
    reduction never leaves an image without a patch token (as r is clamped for a fixed count)."""
    if keep.shape[1] == 0:
        return keep
    best = score.argmax(dim=1, keepdim=True)
    return keep.scatter(1, best, True)


def alternate_matches(keys: torch.Tensor, real: torch.Tensor, p: int):
    """ToMe's alternate split of the non-prefix tokens of keys (B, N, d), B tokens that are not real (B, n) excluded:
    (slot (B, n): an A token's best B token, a B token itself; the A positions (na,); best (B, n): an A token's best
    cosine similarity, -inf for a B token). For the methods that merge every A token above a threshold (LTMP, DyMU)."""
    n = keys.shape[1] - p
    a_start = p % 2
    positions = torch.arange(n, device=keys.device)
    a_pos, b_pos = positions[a_start::2], positions[1 - a_start::2]
    with torch.no_grad():
        unit = torch.nn.functional.normalize(keys[:, p:].float(), dim=-1)
        sim = unit[:, a_pos] @ unit[:, b_pos].transpose(1, 2)
        sim = sim.masked_fill(~real[:, b_pos].unsqueeze(1), float("-inf"))
        a_best, a_dst = sim.max(dim=-1)
        slot = positions.expand(keys.shape[0], n).clone()
        slot[:, a_pos] = b_pos[a_dst]
        best = sim.new_full((keys.shape[0], n), float("-inf"))
        best[:, a_pos] = a_best
    return slot, a_pos, best


def count_above(node_max: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, Na) best-match similarities -> (B,) number of A tokens whose similarity exceeds threshold."""
    return (node_max > threshold).sum(dim=-1)


def batch_adaptive_r(counts: torch.Tensor) -> int:
    """ATM's batch-adaptive merge count: the mean of the per-image counts (B,), rounded half up; 0 for an
    empty batch."""
    if counts.numel() == 0:
        return 0
    return int(torch.floor(counts.double().mean() + 0.5).item())


def class_attention(q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Each head's softmax attention row of the class token, computed beside fused attention at O(N) cost.
    q, k: (B, H, N, d) after q/k norm; attn_bias: (B, 1, 1, N) or None. Returns (B, H, N)."""
    scores = (q[:, :, :1] * scale) @ k.transpose(-2, -1)  # (B, H, 1, N)
    if attn_bias is not None:
        scores = scores + attn_bias
    return scores.softmax(dim=-1)[:, :, 0]


def attentive_pruning(cls_attn: torch.Tensor, r: int, num_prefix: int) -> PrunePlan:
    """EViT's attentive token selection with fusion.

    cls_attn: (B, N) attention of the class token to every token, averaged over heads.
    r: net tokens removed; the r + 1 least attended non-prefix tokens are fused into one token.
       Clamped so that at least one non-prefix token remains. r = 0 gives an empty fusion (no-op plan).
    """
    B, N = cls_attn.shape
    n = N - num_prefix
    r = max(min(r, n - 1), 0)
    with torch.no_grad():
        attn = cls_attn[:, num_prefix:]
        order = attn.argsort(dim=-1, descending=True, stable=True)
        num_fused = r + 1 if r > 0 else 0
        keep_idx = order[:, : n - num_fused].sort(dim=-1).values
        fuse_idx = order[:, n - num_fused:]
    w = attn.gather(1, fuse_idx)  # outside no_grad: the fused token's weights stay differentiable
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    return PrunePlan(num_prefix, keep_idx, fuse_idx, w.unsqueeze(-1))


def float32_linspace(end: int, steps: int, device: torch.device) -> torch.Tensor:
    """(steps,) float32: torch.linspace(0, end, steps) as its scalar loop computes it, each half from its own end,
    written out so that a compiled block keeps end and steps symbolic: one graph for every block (linspace
    specialises its count, a graph per value). linspace's vectorised CPU loop (and CUDA) may differ in the last bit;
    rounded to integers, this equals this machine's linspace for every end < 1300, and it is the same on every
    device. Built once per (end, steps, device) outside a trace (built_once); do not write into it."""
    return built_once(_written_out_linspace, end, steps, device=device)


def _written_out_linspace(end, steps, device: torch.device) -> torch.Tensor:
    j = torch.arange(steps, device=device, dtype=torch.float32)
    last = torch.full((), end, device=device, dtype=torch.float32)
    step = last / max(steps - 1, 1)
    return torch.where(j < max(steps // 2, 1), step * j, last - step * (steps - 1 - j))


def built_once(build: Callable[..., torch.Tensor], *args: Any, device: torch.device) -> torch.Tensor:
    """build(*args, device): a tensor made from Python values (positions, indices), made once per (build, args,
    device) and reused in eager forwards: no op per call and, on a GPU, no blocking copy of host data per call.
    Under a compiler, exporter or tracer (where args may be symbolic and a kept tensor would be baked in as a
    constant) it is built in the trace. The kept tensor is shared: never write into it."""
    traced = (torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._guards.detect_fake_mode() is not None
              or any(isinstance(a, torch.SymInt) for a in args))
    if traced:
        return build(*args, device)
    return _kept(build, args, torch.device(device))


@functools.lru_cache(maxsize=512)
def _kept(build: Callable[..., torch.Tensor], args: Tuple[Any, ...], device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in and out of inference mode
        return build(*args, device)


def pairwise_distances(x: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between the tokens of x: (B, n, C) -> (B, n, n), in fp32 (a batched matmul, so
    the MAC counter sees the cost). Exactly symmetric with an exact zero diagonal: a two-member cluster's members
    tie exactly as medoids, and the tie-break (the lower index) decides, not which rounding of d(a, b) or d(b, a)
    came out smaller (that made K-Medoids follow noise of 1e-6 in its input). The tokens are centred first, so
    the large component they share does not cancel away the precision of their differences."""
    x = x.float()
    x = x - x.mean(dim=1, keepdim=True)
    sq = (x * x).sum(dim=-1)
    d2 = sq.unsqueeze(2) + sq.unsqueeze(1) - 2 * torch.bmm(x, x.transpose(1, 2))
    d2 = (d2 + d2.transpose(1, 2)) * 0.5
    d2 = d2.masked_fill(torch.eye(d2.shape[1], dtype=torch.bool, device=d2.device), 0.0)  # functional: exports
    return d2.clamp_min(0).sqrt()


def nearest_centre(dist: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """dist: (B, n, n), centres: (B, K) distinct token indices -> (B, n) index in [0, K) of each token's
    nearest centre (ties: the lower index); every centre is in its own cluster, so none is empty."""
    to_centres = dist.gather(2, centres.unsqueeze(1).expand(-1, dist.shape[1], -1))
    assign = to_centres.argmin(dim=-1)
    return assign.scatter(1, centres, torch.arange(centres.shape[1], device=centres.device).expand_as(centres))


