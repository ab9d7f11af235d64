"""Pure tensor functions that decide which tokens reduce into which (no nn.Module here).

Index conventions: prefix tokens (class / distillation / register) are split off first and never take
part in matching. The remaining tokens are split alternately by their absolute position: set A holds
the even positions, set B the odd ones (the class token of a plain ViT would be position 0, so A is
the same set as in the ToMe reference). ATM's size-distinctive split instead puts the smaller-sized
half of the tokens in A and the larger half in B. The plans these functions return (timm_tokcomp.plans) index
into A / B / the non-prefix tokens, per batch row.
"""
from typing import Optional, Tuple

import torch

from .plans import ClusterPlan, MergePlan, PrunePlan, gather_tokens, split_tokens


def dct_matrix(n: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix (n, n), float32: row u is alpha_u cos(pi (2 t + 1) u / (2 n)) over t."""
    t = torch.arange(n, device=device)
    phase = ((2 * t + 1) * t.unsqueeze(1)) % (4 * n)  # exact in integers: the cosine's argument stays below 2 pi
    phi = torch.cos(phase.float() * (torch.pi / (2 * n))) * (2 / n) ** 0.5
    return torch.cat([phi[:1] / 2 ** 0.5, phi[1:]])


def dct_resample(n: int, m: int, inflate: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
    """(m, n) float32: the n-point DCT, its m lowest frequencies kept, the m-point inverse DCT. inflate=False
    scales by sqrt(m / n), so a constant sequence stays that constant (each row sums to 1); inflate=True is the
    plain transform pair (OpenToMe's form), which scales a constant by sqrt(n / m)."""
    if not 1 <= m <= n:
        raise ValueError(f"a DCT resample needs 1 <= m <= n, got m={m}, n={n}")
    matrix = dct_matrix(m, device).T @ dct_matrix(n, device)[:m]
    return matrix if inflate else matrix * (m / n) ** 0.5


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


def energy_scores(metric: torch.Tensor, margin: float) -> torch.Tensor:
    """PiToMe's energy of every token of metric (B, n, C): the mean over all tokens j (itself included) of
    ELU(cos(i, j) - margin), alpha 1. High: the token sits among many similar ones (redundant); low: informative."""
    m = metric / metric.norm(dim=-1, keepdim=True)
    return torch.nn.functional.elu(torch.bmm(m, m.transpose(1, 2)) - margin).mean(dim=-1)


def energy_matching(metric: torch.Tensor, r: int, num_prefix: int, margin: float, protect: bool) -> MergePlan:
    """PiToMe's plan of r merges on metric (B, N, C), the non-prefix tokens ranked by energy (descending; ties: lower
    position first). protect False: all of them split alternately by rank into A (even ranks) and B, and ToMe's
    rule merges the r A tokens most similar to their best B. protect True: only the 2r highest-energy tokens are
    candidates, split alternately by rank, and every candidate in A merges into its most similar B; the others are
    protected (kept in A, never merged). r is clamped to half the non-prefix tokens."""
    n = metric.shape[1] - num_prefix
    r = max(min(r, n // 2), 0)
    with torch.no_grad():
        rest = metric[:, num_prefix:]
        order = energy_scores(rest, margin).argsort(dim=-1, descending=True, stable=True)
        if protect:
            a_rank, b_rank = order[:, 0:2 * r:2], order[:, 1:2 * r:2]
            guarded = order[:, 2 * r:]
            a_idx = torch.cat([a_rank, guarded], dim=1).sort(dim=-1).values
            b_idx = b_rank.sort(dim=-1).values
        else:
            a_idx, b_idx = order[:, 0::2].sort(dim=-1).values, order[:, 1::2].sort(dim=-1).values
        node_max, node_idx = best_matches(metric, num_prefix, (a_idx, b_idx))
        if protect:  # only the candidates may merge: the protected A tokens rank last
            candidate = torch.zeros_like(order, dtype=torch.bool).scatter(1, a_rank, True).gather(1, a_idx)
            node_max = torch.where(candidate, node_max, torch.full_like(node_max, -torch.inf))
        return merge_top_r(node_max, node_idx, r, num_prefix, (a_idx, b_idx))


def keep_best(keep: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """keep: (B, n) bool, with each row's best-scoring token (score (B, n)) kept too, so that a data-dependent
    reduction never leaves an image without a patch token (as r is clamped for a fixed count)."""
    if keep.shape[1] == 0:
        return keep
    best = score.argmax(dim=1, keepdim=True)
    return keep.scatter(1, best, True)


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


def top_k_pruning(cls_attn: torch.Tensor, r: int, num_prefix: int) -> PrunePlan:
    """Top-K: keep the non-prefix tokens the class token attends to most, drop the r others (ties: the lower
    index is kept). cls_attn: (B, N) as in attentive_pruning; r clamped so that one non-prefix token remains."""
    n = cls_attn.shape[1] - num_prefix
    r = max(min(r, n - 1), 0)
    with torch.no_grad():
        order = cls_attn[:, num_prefix:].argsort(dim=-1, descending=True, stable=True)
        return PrunePlan(num_prefix, order[:, : n - r].sort(dim=-1).values)


def adaptive_sampling(scores: torch.Tensor, k: int, num_prefix: int) -> PrunePlan:
    """ATS's inverse-transform sampling: k points (i + 0.5) / k on the cumulative distribution of the
    significance scores pick tokens; a token picked more than once is kept once, so each image keeps at most k.

    scores: (B, N) significance of every token (prefix entries ignored; zero for padding). Rows keep different
    counts: the plan keeps the batch's largest count M, each row's kept tokens first (original order), then
    padding marked in plan.valid. One host synchronisation (M)."""
    n = scores.shape[1] - num_prefix
    k = max(min(k, n), 1)
    with torch.no_grad():
        s = scores[:, num_prefix:].float()
        order = s.argsort(dim=-1, stable=True)
        cdf = s.gather(1, order).cumsum(dim=-1)
        cdf = cdf / cdf[:, -1:].clamp_min(torch.finfo(cdf.dtype).tiny)
        points = (torch.arange(k, device=s.device, dtype=cdf.dtype) + 0.5) / k
        picked = torch.searchsorted(cdf, points.expand(s.shape[0], -1).contiguous()).clamp_max(n - 1)
        kept = torch.zeros_like(s, dtype=torch.bool).scatter(1, order.gather(1, picked), True)  # (B, n)
        m = int(kept.sum(dim=1).max().item())
        index = torch.arange(n, device=s.device)
        keep_idx = (index + n * (~kept)).argsort(dim=-1)[:, :m]  # kept tokens first, each part ascending
        valid = kept.gather(1, keep_idx).unsqueeze(-1)
    return PrunePlan(num_prefix, keep_idx, valid=valid.to(scores.dtype))


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


def k_medoids(x: torch.Tensor, num_clusters: int, iterations: int = 3) -> torch.Tensor:
    """K-Medoids on the tokens x: (B, n, C) -> assign (B, n) in [0, num_clusters).

    Start: num_clusters medoids evenly spaced over the token order. Each iteration assigns every token to its
    nearest medoid and moves each medoid to the member with the least summed distance to its cluster."""
    B, n, _ = x.shape
    with torch.no_grad():
        dist = pairwise_distances(x)
        medoids = torch.linspace(0, n - 1, num_clusters, device=x.device).round().long().expand(B, -1)
        for _ in range(iterations):
            # (B, n, K) one-hot membership by scatter: F.one_hot checks its range on the host (a device sync)
            members = dist.new_zeros(B, n, num_clusters).scatter_(2, nearest_centre(dist, medoids).unsqueeze(-1), 1.0)
            cost = torch.bmm(dist, members).masked_fill(members == 0, float("inf"))  # member's cost per cluster
            medoids = cost.argmin(dim=1)
        return nearest_centre(dist, medoids)


def density_peaks(x: torch.Tensor, num_clusters: int, neighbours: int = 5) -> torch.Tensor:
    """DPC-KNN on the tokens x: (B, n, C) -> assign (B, n) in [0, num_clusters).

    Density rho_i = exp(-mean squared distance to the `neighbours` nearest tokens (itself included)), with
    distances scaled by 1 / sqrt(C); delta_i = distance to the nearest denser token (ties: the lower index
    counts as denser; the densest token takes the largest distance). The num_clusters tokens with the largest
    rho * delta are the centres (ties: lower index), and every token joins its nearest centre."""
    B, n, C = x.shape
    with torch.no_grad():
        dist = pairwise_distances(x) / C ** 0.5
        nearest = dist.topk(min(neighbours, n), dim=-1, largest=False).values
        density = (-(nearest ** 2).mean(dim=-1)).exp()  # (B, n)
        index = torch.arange(n, device=x.device)
        denser = (density.unsqueeze(1) > density.unsqueeze(2)) | (
            (density.unsqueeze(1) == density.unsqueeze(2)) & (index.unsqueeze(0) < index.unsqueeze(1)))
        farthest = dist.flatten(1).max(dim=-1).values.view(B, 1, 1)
        delta = torch.where(denser, dist, farthest).min(dim=-1).values
        centres = (density * delta).argsort(dim=-1, descending=True, stable=True)[:, :num_clusters]
        return nearest_centre(dist, centres)


LINKAGES = ("single", "average", "complete")


def check_linkage(linkage: str) -> str:
    """linkage itself, or ValueError naming the valid ones."""
    if linkage not in LINKAGES:
        raise ValueError(f"linkage must be one of {', '.join(LINKAGES)}, got {linkage!r}")
    return linkage


def agglomerative_clusters(dist: torch.Tensor, num_clusters: int, linkage: str) -> torch.Tensor:
    """Bottom-up hierarchical clustering of each image's n points from their distances dist: (B, n, n) (the smaller of
    d[i, j] and d[j, i] is used for both), down to num_clusters clusters -> assign (B, n) in [0, num_clusters).

    Each of the n - num_clusters steps merges the two closest clusters (ties: the pair (i, j), i < j, first in
    row-major order; the cluster keeps its lowest point's index) and updates that cluster's distances by the
    Lance-Williams rule of the linkage: 'single' the min, 'complete' the max, 'average' the mean over all pairs of
    points (count-weighted). The steps depend on each other, so this runs n - num_clusters small batched steps:
    rows and columns updated in place in eager mode, by masks (a functional graph) under torch.compile / export.
    Clusters are numbered by their lowest point, ascending."""
    check_linkage(linkage)
    n = dist.shape[1]
    if not 1 <= num_clusters <= n:
        raise ValueError(f"num_clusters must be in [1, {n}], got {num_clusters}")
    with torch.no_grad():
        step = _join_by_masks if torch.compiler.is_compiling() else _join_in_place
        d = dist.float()
        d = torch.minimum(d, d.transpose(1, 2))  # exactly symmetric (a matmul's two halves may round apart)
        d = d.masked_fill(torch.eye(n, dtype=torch.bool, device=dist.device), float("inf"))
        count = torch.ones(dist.shape[0], n, device=dist.device)
        label = torch.arange(n, device=dist.device).expand(dist.shape[0], n)
        for _ in range(n - num_clusters):
            flat = d.flatten(1).argmin(dim=1)
            i, j = flat // n, flat % n  # i < j: d is symmetric and (i, j) comes first in row-major order
            d, count = step(d, count, i, j, linkage)
            label = torch.where(label == j.unsqueeze(1), i.unsqueeze(1), label)
        lowest = label == torch.arange(n, device=dist.device)  # the surviving clusters' lowest points
        return (lowest.long().cumsum(dim=1) - 1).gather(1, label)


def _joined_row(row_i: torch.Tensor, row_j: torch.Tensor, count_i: torch.Tensor, count_j: torch.Tensor,
                linkage: str) -> torch.Tensor:
    """The joined cluster's distances (B, n) by the Lance-Williams rule, from the two rows and counts (B, 1)."""
    if linkage == "single":
        return torch.minimum(row_i, row_j)
    if linkage == "complete":
        return torch.maximum(row_i, row_j)
    return (count_i * row_i + count_j * row_j) / (count_i + count_j)


def _join_in_place(d: torch.Tensor, count: torch.Tensor, i: torch.Tensor, j: torch.Tensor, linkage: str):
    """Join cluster j into i: d (B, n, n) and count (B, n) updated in place (O(B n) per step)."""
    rows = torch.arange(d.shape[0], device=d.device)
    inf = d.new_full((), float("inf"))  # a device tensor: a Python float written by index would be copied each time
    new = _joined_row(d[rows, i], d[rows, j], count[rows, i].unsqueeze(1), count[rows, j].unsqueeze(1), linkage)
    new[rows, i] = inf  # the joined cluster's distance to itself (gone clusters are inf in both rows)
    new[rows, j] = inf
    d[rows, i], d[rows, :, i] = new, new
    d[rows, j], d[rows, :, j] = inf, inf
    count[rows, i] = count[rows, i] + count[rows, j]
    return d, count


def _join_by_masks(d: torch.Tensor, count: torch.Tensor, i: torch.Tensor, j: torch.Tensor, linkage: str):
    """_join_in_place without in-place updates, for graphs that must be functional (O(B n^2) per step)."""
    n = d.shape[1]
    at_i = torch.arange(n, device=d.device) == i.unsqueeze(1)  # (B, n)
    at_j = torch.arange(n, device=d.device) == j.unsqueeze(1)
    row_i = d.gather(1, i.view(-1, 1, 1).expand(-1, 1, n)).squeeze(1)
    row_j = d.gather(1, j.view(-1, 1, 1).expand(-1, 1, n)).squeeze(1)
    count_i, count_j = count.gather(1, i.unsqueeze(1)), count.gather(1, j.unsqueeze(1))
    new = _joined_row(row_i, row_j, count_i, count_j, linkage).masked_fill(at_i | at_j, float("inf"))
    d = torch.where(at_i.unsqueeze(2), new.unsqueeze(1), d)
    d = torch.where(at_i.unsqueeze(1), new.unsqueeze(2), d)
    d = d.masked_fill(at_j.unsqueeze(2) | at_j.unsqueeze(1), float("inf"))
    return d, torch.where(at_i, count_i + count_j, count)


def mctf_matching(x: torch.Tensor, received: torch.Tensor, size: Optional[torch.Tensor], r: int, num_prefix: int,
                  info_power: float = 1 / 20, size_power: float = 1 / 40) -> ClusterPlan:
    """MCTF's bidirectional multi-criteria matching -> the groups as a ClusterPlan over the non-prefix tokens.

    x: (B, N, C) the tokens entering the block (cosine similarity on x itself); received: (B, N) the mean attention
    each token receives in this block (over heads and queries); size: (B, N, 1) or None. On the alternate split,
    W[a, b] = (cos(x_a, x_b) + 1) / 2 * (i_a i_b) ** info_power * (s_a s_b) ** size_power, with i = min(received) /
    received (less attended: higher) and s = min(size) / size (smaller: higher). Step 1: the r // 2 A tokens with
    the highest best W merge into their best B. Step 2: on the same W, the r - r // 2 B tokens with the highest best
    W towards the A tokens left merge into their best one (with what step 1 merged into them). Ties: lower index.
    Groups: the A tokens left (ascending), then the B tokens left (ascending). r: clamped to max_merges, keeping at
    least 10 non-prefix tokens (or all of them, if fewer)."""
    B, N, _ = x.shape
    p, n = num_prefix, N - num_prefix
    r = max(min(r, max_merges(N, p), n - 10), 0)
    r1, r2 = r // 2, r - r // 2
    with torch.no_grad():
        unit = x / x.norm(dim=-1, keepdim=True)
        info = received.amin(dim=1, keepdim=True) / received
        small = torch.ones_like(info) if size is None else size[..., 0].amin(dim=1, keepdim=True) / size[..., 0]
        score = info.pow(info_power) * small.pow(size_power)  # (B, N)
        (ua, ub), (sa, sb) = split_tokens(unit, p), split_tokens(score.unsqueeze(-1), p)
        w = (torch.bmm(ua, ub.transpose(1, 2)) + 1) / 2 * sa * sb.transpose(1, 2)  # (B, na, nb)
        na, nb = w.shape[1], w.shape[2]
        best1, dst1 = w.max(dim=-1)
        order1 = best1.argsort(dim=-1, descending=True, stable=True)
        src1, kept_a = order1[:, :r1], order1[:, r1:].sort(dim=-1).values  # (B, r1), (B, na - r1) into A
        best2, dst2 = w.gather(1, kept_a.unsqueeze(-1).expand(-1, -1, nb)).max(dim=1)  # (B, nb): into kept_a
        order2 = best2.argsort(dim=-1, descending=True, stable=True)
        src2, kept_b = order2[:, :r2], order2[:, r2:].sort(dim=-1).values
        left = na - r1
        group_b = torch.empty(B, nb, dtype=torch.long, device=x.device)
        group_b.scatter_(1, kept_b, left + torch.arange(nb - r2, device=x.device).expand(B, -1))
        group_b.scatter_(1, src2, dst2.gather(1, src2))
        group_a = torch.empty(B, na, dtype=torch.long, device=x.device)
        group_a.scatter_(1, kept_a, torch.arange(left, device=x.device).expand(B, -1))
        group_a.scatter_(1, src1, group_b.gather(1, dst1.gather(1, src1)))
        a_start = p % 2
        assign = torch.empty(B, n, dtype=torch.long, device=x.device)
        assign[:, a_start::2], assign[:, 1 - a_start::2] = group_a, group_b
    return ClusterPlan(p, assign, n - r)
