"""Matching and merge ops against a plain per-image reference written with Python loops."""
import torch

from timm_tokcomp.ops.matching import attentive_pruning, bipartite_soft_matching
from timm_tokcomp.plans.merge import merge_mean, merge_sum


def reference_tome(x, size, metric, r, p):
    """One image: x (N, C), size (N,), metric (N, C). Straight from the method's description."""
    idx = list(range(p, x.shape[0]))
    a = [i for i in idx if i % 2 == 0]
    b = [i for i in idx if i % 2 == 1]
    m = metric / metric.norm(dim=-1, keepdim=True)
    best = []
    for i in a:
        sims = [float(m[i] @ m[j]) for j in b]
        j = max(range(len(b)), key=lambda k: (sims[k], -k))
        best.append((sims[j], i, b[j]))
    best.sort(key=lambda t: -t[0])  # stable: ties keep the lower a index first
    merged = best[:r]
    groups = {j: [j] for j in b}
    for _, i, j in merged:
        groups[j].append(i)
    kept_a = sorted(i for _, i, _ in best[r:])
    out_x, out_s = [], []
    for i in list(range(p)) + kept_a:
        out_x.append(x[i]); out_s.append(size[i])
    for j in b:
        g = groups[j]
        s = sum(size[k] for k in g)
        out_x.append(sum(size[k] * x[k] for k in g) / s); out_s.append(s)
    return torch.stack(out_x), torch.stack(out_s)


def test_bipartite_merge_matches_reference():
    torch.manual_seed(0)
    B, N, C = 3, 23, 8
    for p in (0, 1, 2, 5):
        x = torch.randn(B, N, C, dtype=torch.float64)
        size = torch.randint(1, 4, (B, N, 1)).double()
        metric = torch.randn(B, N, 6, dtype=torch.float64)
        plan = bipartite_soft_matching(metric, 5, p)
        got_x, got_s = merge_mean(x, size, plan)
        for i in range(B):
            ref_x, ref_s = reference_tome(x[i], size[i, :, 0], metric[i], 5, p)
            assert torch.allclose(got_x[i], ref_x)
            assert torch.equal(got_s[i, :, 0], ref_s)


def test_merge_conserves_size_weighted_sum():
    torch.manual_seed(1)
    x = torch.randn(2, 41, 16, dtype=torch.float64)
    size = torch.randint(1, 5, (2, 41, 1)).double()
    plan = bipartite_soft_matching(torch.randn(2, 41, 16), 12, 1)
    new_x, new_size = merge_mean(x, size, plan)
    assert new_x.shape == (2, 29, 16)
    assert torch.allclose((new_x * new_size).sum(1), (x * size).sum(1))
    assert torch.equal(new_size.sum(1), size.sum(1))


def test_r_clamped_to_half_the_unprotected_tokens():
    plan = bipartite_soft_matching(torch.randn(1, 11, 4), 100, 2)
    assert plan.r == 4 and plan.unm_idx.shape[1] == 1  # 9 unprotected tokens: A has 5, B has 4


def test_ties_are_broken_deterministically():
    metric = torch.ones(2, 17, 4)  # every pair equally similar
    plan = bipartite_soft_matching(metric, 3, 1)
    assert plan.src_idx.tolist() == [[0, 1, 2]] * 2
    assert plan.dst_idx.tolist() == [[0, 0, 0]] * 2


def test_source_and_size_follow_merges():
    x = torch.randn(1, 9, 3)
    source = torch.eye(9)[None]
    plan = bipartite_soft_matching(torch.randn(1, 9, 5), 3, 1)
    _, size, src = plan.apply(x, None, source)
    assert torch.equal(src.sum(-1, keepdim=True), size)
    assert torch.equal(merge_sum(torch.ones(1, 9, 1), plan), size)


def test_attentive_pruning_fuses_least_attended():
    torch.manual_seed(2)
    attn = torch.tensor([[0.5, 0.05, 0.2, 0.01, 0.14, 0.02, 0.08]])
    x = torch.randn(1, 7, 4)
    plan = attentive_pruning(attn, 2, 1)  # fuse 3 least attended of tokens 1..6: 3, 5, 1
    new_x, size, _ = plan.apply(x, None, None)
    assert plan.keep_idx.tolist() == [[1, 3, 5]]  # non-prefix indices of tokens 2, 4, 6 in order
    w = torch.tensor([0.01, 0.02, 0.05])
    fused = (w[:, None] * x[0, [3, 5, 1]]).sum(0) / w.sum()
    assert torch.allclose(new_x[0, -1], fused)
    assert torch.equal(new_x[0, :4], x[0, [0, 2, 4, 6]])
    assert size[0, :, 0].tolist() == [1, 1, 1, 1, 3]


def test_pairwise_distances_are_exactly_symmetric_with_a_zero_diagonal():
    """A large component shared by all tokens (as in a ViT's residual stream) must neither break the symmetry (a
    two-member cluster's medoid tie) nor cancel the precision of the differences."""
    from timm_tokcomp.ops.matching import pairwise_distances

    torch.manual_seed(0)
    x = torch.randn(2, 37, 64) * 0.1 + torch.randn(2, 1, 64) * 50
    d = pairwise_distances(x)
    assert torch.equal(d, d.transpose(1, 2))
    assert torch.equal(d.diagonal(dim1=1, dim2=2), torch.zeros(2, 37))
    torch.testing.assert_close(d, torch.cdist(x.double(), x.double()).float(), atol=1e-4, rtol=1e-4)
