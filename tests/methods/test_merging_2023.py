"""The merging methods of 2023-2025 (ToFu, PiToMe, DCT, ATC, MCTF): their defining steps checked exactly against simple
references, and each method on real DeiT-Tiny (deterministic, nothing merged equals plain timm, MACs counted from
the run, a batch equal to its images one by one)."""
import copy
import itertools

import pytest
import timm
import torch
import torch.nn.functional as F

import timm_tokcomp
import math

from timm_tokcomp.ops.matching import bipartite_soft_matching
from timm_tokcomp.methods.atc import agglomerative_clusters
from timm_tokcomp.methods.dct import dct_resample
from timm_tokcomp.methods.mctf import mctf_matching
from timm_tokcomp.methods.pitome import energy_matching, energy_scores
from timm_tokcomp.measure.counting import count_macs
from timm_tokcomp.methods.tofu import MLERP, PRUNE, ToFu
from timm_tokcomp.plans.cluster import cluster_attention, cluster_sum
from timm_tokcomp.plans.merge import merge_keep_destination, merge_mlerp, merge_sum
from timm_tokcomp.methods.schedules import BlockCost
from conftest import real_model_and_images


def test_mlerp_keeps_the_largest_norm_and_the_mean_direction():
    torch.manual_seed(0)
    x = torch.randn(3, 17, 8) * torch.rand(3, 17, 1) * 4
    plan = bipartite_soft_matching(x, 6, 1)
    out = merge_mlerp(x, plan)
    held = merge_sum(torch.eye(17).expand(3, -1, -1), plan)  # (B, 11, 17): which inputs each output holds
    for b in range(3):
        for j in range(out.shape[1]):
            members = x[b, held[b, j] > 0]
            if len(members) == 1:
                assert torch.equal(out[b, j], members[0])  # merged with nothing: unchanged
                continue
            want = members.mean(0) / members.mean(0).norm() * members.norm(dim=-1).max()
            torch.testing.assert_close(out[b, j], want, rtol=1e-5, atol=1e-6)
            assert out[b, j].norm() == pytest.approx(members.norm(dim=-1).max().item(), rel=1e-5)
    assert (held.sum(-1) > 1).any()


def test_tofus_prune_step_keeps_each_destination_and_its_sizes_add_up():
    torch.manual_seed(1)
    x = torch.randn(2, 13, 8)
    plan = bipartite_soft_matching(x, 4, 1)
    kept = merge_keep_destination(x, plan)
    held = merge_sum(torch.eye(13).expand(2, -1, -1), plan)
    for b in range(2):
        for j in range(kept.shape[1]):
            members = held[b, j].nonzero().flatten()
            assert any(torch.equal(kept[b, j], x[b, i]) for i in members)
    step = ToFu(r=4).plan(x, (4, PRUNE), 1, None)  # the same matches as plan, carried out by ToFu's prune step
    out, size, _ = step.apply(x, None, None)
    assert torch.equal(out, kept) and torch.equal(size[..., 0], held.sum(-1))


def test_tofu_prunes_early_and_merges_late():
    cost = BlockCost(1, 1, 1)
    assert [s[1] for s in ToFu(r=2).block_settings(12, 197, 1, cost)] == [PRUNE] * 7 + [MLERP] * 5
    assert [s[1] for s in ToFu(r=2, merge_from=3).block_settings(6, 50, 1, cost)] == [PRUNE] * 3 + [MLERP] * 3


def test_energy_matches_its_definition():
    torch.manual_seed(2)
    m = torch.randn(2, 9, 5)
    unit = m / m.norm(dim=-1, keepdim=True)
    want = torch.stack([torch.stack([F.elu(unit[b, i] @ unit[b, j] - 0.4) for j in range(9)]).mean()
                        for b in range(2) for i in range(9)]).view(2, 9)
    torch.testing.assert_close(energy_scores(m, 0.4), want)


@pytest.mark.parametrize("protect", [False, True])
def test_pitome_merges_only_its_candidates_and_never_a_protected_token(protect):
    torch.manual_seed(3)
    metric = torch.randn(4, 31, 16)  # 1 prefix token, 30 others
    r = 6
    plan = energy_matching(metric, r, 1, 0.5, protect)
    assert plan.r == r
    order = energy_scores(metric[:, 1:], 0.5).argsort(dim=-1, descending=True, stable=True)
    sources = plan.a_idx.gather(1, plan.src_idx)  # non-prefix positions merged away
    for b in range(4):
        ranks = {int(p): k for k, p in enumerate(order[b])}
        if protect:  # the candidates are the 2 r highest-energy tokens; every A candidate merges
            assert sorted(ranks[int(p)] for p in sources[b]) == list(range(0, 2 * r, 2))
            destinations = plan.b_idx.gather(1, plan.dst_idx)[b]
            assert all(ranks[int(p)] < 2 * r and ranks[int(p)] % 2 == 1 for p in destinations)
        else:  # A = the even energy ranks, merged by ToMe's rule
            assert sorted(ranks[int(p)] for p in plan.a_idx[b]) == list(range(0, 30, 2))
            assert all(ranks[int(p)] % 2 == 0 for p in sources[b])


def test_dct_resample_is_the_truncated_transform_pair_without_inflation():
    """The (m, n) map against the DCT-II and its inverse written as sums: inflate=True is the plain pair (a constant
    comes back sqrt(n / m) times larger, 1.0435 for 196 -> 180, as the reference notes); the default is that pair
    times sqrt(m / n), which keeps a constant sequence and never lets a token norm grow on one."""
    torch.manual_seed(4)
    n, m = 11, 7
    x = torch.randn(n, 3, dtype=torch.float64)
    coeff = [math.sqrt((1 if u == 0 else 2) / n) * sum(x[t] * math.cos(math.pi * (2 * t + 1) * u / (2 * n))
                                                      for t in range(n)) for u in range(n)]
    back = torch.stack([sum(math.sqrt((1 if u == 0 else 2) / m) * coeff[u]
                            * math.cos(math.pi * (2 * t + 1) * u / (2 * m)) for u in range(m)) for t in range(m)])
    torch.testing.assert_close(dct_resample(n, m, inflate=True).double() @ x, back, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dct_resample(n, m).double() @ x, back * math.sqrt(m / n), rtol=1e-5, atol=1e-5)
    const = torch.full((196, 4), 2.5)
    assert (dct_resample(196, 180, inflate=True) @ const / 2.5).mean().item() == pytest.approx(1.0435, abs=1e-4)
    torch.testing.assert_close(dct_resample(196, 180) @ const, torch.full((180, 4), 2.5), rtol=5e-5, atol=0)  # fp32
    with pytest.raises(ValueError, match="1 <= m <= n"):
        dct_resample(5, 6)


def test_dct_tokens_hold_the_stretch_of_the_token_axis_they_resample():
    """Output t holds input j by the overlap of [t n / m, (t + 1) n / m) with [j, j + 1): 9 patch tokens -> 6, so
    output 0 holds input 0 and half of input 1; sizes and source maps follow those shares."""
    from timm_tokcomp.methods.dct import DCT
    x, size = torch.randn(2, 10, 4), torch.rand(2, 10, 1) + 1
    plan = DCT(r=3).plan(x, 3, 1, size)
    shares = plan.shares
    assert shares.shape == (6, 9) and shares[0, :3].tolist() == [1.0, 0.5, 0.0]
    assert shares[1, 1:3].tolist() == [0.5, 1.0]
    torch.testing.assert_close(shares.sum(0), torch.ones(9))
    out, new_size, source = plan.apply(x, size, torch.eye(10).expand(2, -1, -1))
    assert out.shape == (2, 7, 4) and torch.equal(out[:, :1], x[:, :1])
    torch.testing.assert_close(out[:, 1:], plan.matrix @ x[:, 1:])
    torch.testing.assert_close(new_size[:, 1:], shares @ size[:, 1:])
    torch.testing.assert_close(source[:, 1:, 1:], shares.expand(2, -1, -1))
    assert DCT(r=8).plan(x, 8, 1, None).matrix.shape == (5, 9)  # at most half of the patch tokens per block


def _agglomerative_by_definition(dist, k, linkage):
    """Clusters as lists of points; each step joins the pair whose linkage distance, computed from every pair of their
    points, is the least (ties: the pair of lowest first points); clusters numbered by their lowest point."""
    clusters = [[i] for i in range(dist.shape[0])]
    combine = {"single": min, "complete": max, "average": lambda v: sum(v) / len(v)}[linkage]
    while len(clusters) > k:
        _, _, _, x, y = min((combine([float(dist[a, b]) for a in ca for b in cb]), ca[0], cb[0], x, y)
                            for (x, ca), (y, cb) in itertools.combinations(enumerate(clusters), 2))
        clusters[x] = sorted(clusters[x] + clusters.pop(y))
    assign = [0] * dist.shape[0]
    for c, members in enumerate(sorted(clusters)):
        for point in members:
            assign[point] = c
    return assign


@pytest.mark.parametrize("functional", [False, True])  # eager's in-place steps, and the masked ones graphs trace
@pytest.mark.parametrize("linkage", ["single", "average", "complete"])
def test_atc_clusters_equal_agglomerative_clustering_by_definition(linkage, functional, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: functional)
    torch.manual_seed(5)
    for _ in range(8):
        x = torch.randn(3, 10, 4, dtype=torch.float64)
        dist = torch.cdist(x, x)
        for k in (1, 3, 7, 10):
            got = agglomerative_clusters(dist, k, linkage)
            assert [got[b].tolist() for b in range(3)] == [_agglomerative_by_definition(dist[b], k, linkage)
                                                           for b in range(3)]
    with pytest.raises(ValueError, match="linkage must be one of single, average, complete"):
        agglomerative_clusters(dist, 3, "ward")
    with pytest.raises(ValueError, match=r"num_clusters must be in \[1, 10\]"):
        agglomerative_clusters(dist, 0, "single")


def _mctf_groups_by_definition(x, received, size, r, p):
    """One image, in loops: the A / B split by absolute parity, the three criteria, step 1 (A -> B), step 2 on the
    same scores (B -> the A tokens left), then which tokens each output holds, in output order."""
    n = x.shape[0]
    a = [i for i in range(p, n) if i % 2 == 0]
    b = [i for i in range(p, n) if i % 2 == 1]
    info = [float(received.min() / received[i]) for i in range(n)]
    small = [float(size.min() / size[i]) for i in range(n)]

    def score(i, j):
        cos = float(x[i] @ x[j] / (x[i].norm() * x[j].norm()))
        return (cos + 1) / 2 * (info[i] * info[j]) ** (1 / 20) * (small[i] * small[j]) ** (1 / 40)

    best1 = {i: max(b, key=lambda j: (score(i, j), -j)) for i in a}  # ties: the lower index
    src1 = sorted(a, key=lambda i: (-score(i, best1[i]), i))[:r // 2]
    kept_a = [i for i in a if i not in src1]
    best2 = {j: max(kept_a, key=lambda i: (score(i, j), -i)) for j in b}
    src2 = sorted(b, key=lambda j: (-score(best2[j], j), j))[:r - r // 2]
    holds = {i: {i} for i in range(n)}
    for i in src1:
        holds[best1[i]] |= holds.pop(i)
    for j in src2:
        holds[best2[j]] |= holds.pop(j)
    return [holds[i] for i in range(p)] + [holds[i] for i in kept_a] + [holds[j] for j in b if j not in src2]


def test_mctf_matching_equals_its_definition():
    torch.manual_seed(6)
    B, N, p, r = 3, 21, 1, 6
    x, received, size = torch.randn(B, N, 8), torch.rand(B, N) + 0.05, torch.randint(1, 4, (B, N, 1)).float()
    plan = mctf_matching(x, received, size, r, p)
    held = cluster_sum(torch.eye(N).expand(B, -1, -1), plan)  # (B, N - r, N): the tokens each output holds
    for i in range(B):
        got = [set(row.nonzero().flatten().tolist()) for row in held[i]]
        assert got == _mctf_groups_by_definition(x[i], received[i], size[i, :, 0], r, p)
    assert plan.num_clusters == N - p - r
    assert mctf_matching(x[:, :15], received[:, :15], None, 8, 1).num_clusters == 10  # keeps 10 tokens


def test_merged_attention_sums_key_columns_and_weighs_query_rows():
    torch.manual_seed(7)
    B, H, N, p = 2, 3, 15, 1
    probs = torch.randn(B, H, N, N).softmax(-1)
    plan = mctf_matching(torch.randn(B, N, 4), probs.mean(dim=(1, 2)), None, 3, p)
    weight = torch.rand(B, N, 1) + 0.1
    merged = cluster_attention(probs, plan, weight)
    onehot = cluster_sum(torch.eye(N).expand(B, -1, -1), plan)  # (B, M, N)
    rows = onehot * weight.transpose(1, 2)
    rows = rows / rows.sum(-1, keepdim=True)
    want = rows.unsqueeze(1) @ probs @ onehot.transpose(1, 2).unsqueeze(1)
    torch.testing.assert_close(merged, want)
    torch.testing.assert_close(merged.sum(-1), torch.ones(B, H, N - 3))


def test_mctf_reduces_at_the_start_of_the_next_block_and_refuses_flops_ratio_and_bad_powers():
    from timm_tokcomp.methods.mctf import MCTF
    cost = BlockCost(1, 1, 1)
    assert MCTF(r=4).block_settings(4, 50, 1, cost) == [None, 4, 4, 4]
    assert MCTF(keep_rate=0.5, stages=(2, 3)).block_settings(4, 65, 1, cost) == [None, 32, 16, None]
    with pytest.raises(ValueError, match="flops_ratio is not available for mctf"):
        MCTF(flops_ratio=1.5)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "0.05"):
        with pytest.raises(ValueError, match="info_power must be a finite number > 0"):
            MCTF(r=4, info_power=bad)


def test_atc_refuses_an_unknown_linkage_naming_the_choices():
    with pytest.raises(ValueError, match="linkage must be one of single, average, complete, got 'ward'"):
        timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224"), "atc", r=4, linkage="ward")


@pytest.mark.realdata
@pytest.mark.parametrize("tag", ["tofu_r8", "pitome_r8", "dct_r8", "atc_r8", "mctf_r8"])
def test_on_real_deit_tiny(tag):
    plain, images = real_model_and_images("deit_tiny_patch16_224", 4)
    method, params = timm_tokcomp.methods.parse_method_tag(tag)
    model = timm_tokcomp.apply(copy.deepcopy(plain), method, **params)
    with torch.no_grad():
        out = model(images)
        assert torch.equal(out, model(images))  # deterministic
        one_by_one = torch.cat([model(images[i:i + 1]) for i in range(len(images))])
        torch.testing.assert_close(out, one_by_one, rtol=1e-4, atol=1e-4)
        assert torch.equal(timm_tokcomp.apply(copy.deepcopy(plain), method, r=0)(images), plain(images))
        agree = (out.argmax(-1) == plain(images).argmax(-1)).float().mean()
    # MCTF's last reduction runs at the start of the last block (its attention scores at the larger count)
    assert timm_tokcomp.last_stats(model).tokens_per_block[-1] == 197 - 8 * (10 if tag == "mctf_r8" else 11)
    macs, plain_macs = count_macs(model, images[:1]), count_macs(plain, images[:1])
    # DCT reduces after each block's MLP; MCTF computes its reducing blocks' scores at the count entering them
    low, high = (0.8, 0.87) if tag in ("dct_r8", "mctf_r8") else (0.6, 0.8)
    assert low < macs / plain_macs < high and agree >= 0.5


def test_mctf_values_of_a_wrapped_qkv_equal_those_of_the_plain_linear():
    """MCTF projects only the v rows of a plain nn.Linear qkv; a wrapped one (an adapter, a quantized module) is
    called whole and its v part taken: with the same weights both give the same output."""
    torch.manual_seed(8)
    plain = timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224").eval(), "mctf", r=8)
    wrapped = copy.deepcopy(plain)
    for blk in wrapped.blocks:
        blk.attn.qkv = torch.nn.Sequential(blk.attn.qkv)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), plain(x), rtol=0, atol=1e-5)
