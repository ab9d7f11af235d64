"""Pure tensor functions that decide which tokens reduce into which (no nn.Module here).

Index conventions: prefix tokens (class / distillation / register) are split off first and never take
part in matching. The remaining tokens are split alternately by their absolute position: set A holds
the even positions, set B the odd ones (the class token of a plain ViT would be position 0, so A is
the same set as in the ToMe reference). Indices in the plans below index into A / B / the non-prefix
tokens, per batch row.
"""
from dataclasses import dataclass

import torch


@dataclass
class MergePlan:
    """Bipartite merge of r tokens of A into their most similar partner in B.

    num_prefix: leading tokens copied unchanged.
    a_start: offset of A within the non-prefix tokens (0 or 1); B starts at 1 - a_start.
    unm_idx: (B, Na - r) A tokens kept, ascending (original order).
    src_idx: (B, r) A tokens merged away.
    dst_idx: (B, r) index in B each source merges into.
    Output order: prefix tokens, kept A tokens, all B tokens.
    """

    num_prefix: int
    a_start: int
    unm_idx: torch.Tensor
    src_idx: torch.Tensor
    dst_idx: torch.Tensor

    @property
    def r(self) -> int:
        return self.src_idx.shape[1]


@dataclass
class PrunePlan:
    """Keep the most attended tokens, fuse the others into one token appended at the end.

    num_prefix: leading tokens copied unchanged.
    keep_idx: (B, K) non-prefix tokens kept, ascending (original order).
    fuse_idx: (B, F) non-prefix tokens fused into the new last token.
    fuse_weight: (B, F, 1) weights of the fused tokens, summing to 1 per row.
    """

    num_prefix: int
    keep_idx: torch.Tensor
    fuse_idx: torch.Tensor
    fuse_weight: torch.Tensor


def max_merges(num_tokens: int, num_prefix: int) -> int:
    """Largest r bipartite matching allows for num_tokens tokens with num_prefix protected."""
    return max(num_tokens - num_prefix, 0) // 2


def bipartite_soft_matching(metric: torch.Tensor, r: int, num_prefix: int) -> MergePlan:
    """ToMe's bipartite soft matching.

    metric: (B, N, C) per-token features (e.g. keys averaged over heads); cosine similarity is used.
    r: merges wanted; clamped to max_merges(N, num_prefix).
    Ties are broken towards the lower index (stable sort), so the plan is deterministic.
    """
    B, N, _ = metric.shape
    r = min(r, max_merges(N, num_prefix))
    a_start = num_prefix % 2
    with torch.no_grad():
        m = metric[:, num_prefix:]
        m = m / m.norm(dim=-1, keepdim=True)
        a, b = m[:, a_start::2], m[:, 1 - a_start::2]
        scores = a @ b.transpose(-1, -2)
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True, stable=True)
        src_idx = edge_idx[:, :r]
        unm_idx = edge_idx[:, r:].sort(dim=-1).values
        dst_idx = node_idx.gather(1, src_idx)
    return MergePlan(num_prefix, a_start, unm_idx, src_idx, dst_idx)


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
