"""ToMe's and EViT's fused Triton reduction steps (kernel='triton'): against the torch reference in Triton's CPU
interpreter, on whole models, their launches, and where it falls back to torch (what a forward pays in aten ops +
launches: test_fused_counts.py; compiled for real GPUs: test_kernel_compilation.py)."""

import pytest
import torch

import timm_tokcomp
from timm_tokcomp.ops import dense_merge as ops
from timm_tokcomp.plans.merge import group_index, merge_mean
from timm_tokcomp.kernels import triton_dense, triton_evit, triton_tome
from timm_tokcomp.ops.matching import (attentive_pruning, batch_adaptive_r, best_matches, bipartite_soft_matching,
    class_attention, count_above, merge_top_r, size_distinctive_split)
from timm_tokcomp.measure.counting import OpCounter
from conftest import assert_within_ulps, make_model, op_counts

pytestmark = [pytest.mark.slow]  # the kernels in Triton's interpreter

CASES = [  # (batch, tokens, prefix, r, metric dim, channels)
    (2, 197, 1, 16, 64, 48),  # DeiT-Tiny's first block
    (3, 50, 2, 10, 8, 40),  # distillation token: A starts at the first non-prefix token
    (1, 11, 0, 5, 16, 20),  # no prefix, the maximum r
    (2, 198, 2, 49, 64, 32),
    (2, 70, 4, 1, 24, 1000),  # registers; channels above a power of two
    (2, 301, 1, 40, 16, 24),  # 150 A tokens: a launch per phase, a program per tile
    (1, 321, 1, 100, 16, 24),  # 161 B offsets: more list programs than A tiles
]


def _inputs(batch, tokens, dim, channels, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    metric = torch.randn(batch, tokens, dim, generator=g).to(dtype)
    x = torch.randn(batch, channels, tokens, generator=g).to(dtype).transpose(1, 2)  # non-contiguous
    size = (torch.rand(batch, tokens, 1, generator=g) * 3 + 0.5).to(dtype)
    return metric, x, size


@pytest.mark.parametrize("batch, tokens, num_prefix, r, dim, channels", CASES)
@pytest.mark.parametrize("with_size", [False, True])
def test_fused_step_matches_reference_fp32(batch, tokens, num_prefix, r, dim, channels, with_size):
    metric, x, size = _inputs(batch, tokens, dim, channels)
    size = size if with_size else None
    plan = bipartite_soft_matching(metric, r, num_prefix)
    want_x, want_size = merge_mean(x, size, plan)
    got_x, got_size, got_log = triton_tome.tome_merge(metric, x, size, r, num_prefix)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_size, want_size, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_log, got_size.log())  # the next block's bias: the log of the size written


def test_fused_step_fp16_within_rounding():
    metric, x, size = _inputs(2, 197, 64, 48, dtype=torch.float16)
    plan = bipartite_soft_matching(metric.float(), 16, 1)
    want_x, want_size = merge_mean(x.float(), size.float(), plan)
    got_x, got_size, got_log = triton_tome.tome_merge(metric, x, size, 16, 1)
    assert got_x.dtype == got_size.dtype == torch.float16
    torch.testing.assert_close(got_x.float(), want_x, rtol=2e-3, atol=2e-3)  # one fp16 rounding of an fp32 sum
    torch.testing.assert_close(got_size.float(), want_size, rtol=2e-3, atol=0)
    assert got_log.dtype == torch.float16
    torch.testing.assert_close(got_log, got_size.log())  # the fp32 log rounded to fp16 (within an fp16 step)


def _keys(batch, heads, tokens, dim, seed=1, dtype=torch.float32):
    """Keys (B, H, N, d) as attention makes them: a view of a qkv projection (non-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, batch, tokens, heads, dim, generator=g).to(dtype).permute(0, 1, 3, 2, 4)[1]


@pytest.mark.parametrize("batch, tokens, num_prefix, r, dim, channels", CASES)
def test_fused_step_on_keys_averages_the_heads_as_torch_does(batch, tokens, num_prefix, r, dim, channels):
    """The match kernel reads ToMe's keys (B, H, N, d) and averages them over heads itself: the same outputs as
    the kernel on k.mean(dim=1) (bit for bit: the same mean in fp32) and as the reference plan on it."""
    _, x, size = _inputs(batch, tokens, dim, channels)
    k = _keys(batch, 3, tokens, dim)
    got_x, got_size, got_log = triton_tome.tome_merge(k, x, size, r, num_prefix)
    on_mean = triton_tome.tome_merge(k.mean(dim=1), x, size, r, num_prefix)
    assert torch.equal(got_x, on_mean[0]) and torch.equal(got_size, on_mean[1])
    want_x, want_size = merge_mean(x, size, bipartite_soft_matching(k.mean(dim=1), r, num_prefix))
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_size, want_size, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_log, got_size.log())  # the next block's bias: the log of the size written


@pytest.mark.parametrize("tokens", [197, 301])  # one program per image; a launch per phase
def test_atm_step_and_dense_groups_on_keys_as_on_their_mean(tokens):
    """ATM's step and the dense variant's groups read the keys too: the same outputs as on k.mean(dim=1)."""
    _, x, size = _inputs(2, tokens, 16, 24)
    k = _keys(2, 3, tokens, 16)
    got, want = triton_tome.atm_merge(k, x, size, 0.1, 1), triton_tome.atm_merge(k.mean(dim=1), x, size, 0.1, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    got, want = triton_tome.tome_groups(k, 40, 1), triton_tome.tome_groups(k.mean(dim=1), 40, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fused_step_on_fp16_keys_within_rounding():
    _, x, size = _inputs(2, 197, 64, 48, dtype=torch.float16)
    k = _keys(2, 4, 197, 64, dtype=torch.float16)
    plan = bipartite_soft_matching(k.mean(dim=1).float(), 16, 1)  # the mean rounded to fp16, as the kernel rounds it
    want_x, want_size = merge_mean(x.float(), size.float(), plan)
    got_x, got_size, got_log = triton_tome.tome_merge(k, x, size, 16, 1)
    torch.testing.assert_close(got_x.float(), want_x, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got_size.float(), want_size, rtol=2e-3, atol=0)
    assert got_log.dtype == torch.float16
    torch.testing.assert_close(got_log, got_size.log())  # the fp32 log rounded to fp16 (within an fp16 step)


def _kernel_plan(metric, r, num_prefix):
    """Run the matching kernel alone -> its node_max, node_idx and the plan it wrote (as index lists)."""
    lay = triton_tome._layout(metric.shape[1], num_prefix)
    ws = torch.empty(metric.shape[0], lay.width, dtype=torch.int32)
    triton_tome._match_and_plan(metric, ws, lay, r, num_prefix, None, 0.0, True, True, "test")
    n_a = lay.n_a
    node_max, node_idx = ws[:, :n_a].view(torch.float32), ws[:, n_a:2 * n_a].long()
    kept = ws[:, 3 * n_a:4 * n_a - r].long()
    merged = ws[:, 4 * n_a - r:4 * n_a].long()
    offsets = ws[:, 4 * n_a:4 * n_a + lay.n_b + 1].long()
    return node_max, node_idx, kept, merged, offsets


def test_plan_on_exact_ties_follows_the_reference_rules():
    """Duplicated tokens give exact ties (and self-similarities 1 +- 1 ulp, which round differently in the
    kernel and in torch's bmm, so the choice among them may differ from torch's). The kernel's plan must follow
    the reference rules on its own similarities, and the merge must be the reference merge of that plan."""
    g = torch.Generator().manual_seed(3)
    batch, tokens, num_prefix, dim = 2, 65, 1, 16
    metric = torch.randn(batch, 4, dim, generator=g)[:, torch.randint(0, 4, (tokens,), generator=g)]
    x = torch.randn(batch, tokens, 24, generator=g)
    ref_max, _ = best_matches(metric, num_prefix)
    m = metric / metric.norm(dim=-1, keepdim=True)
    sim = m[:, num_prefix + 1::2] @ m[:, num_prefix::2].transpose(1, 2)  # (B, Na, Nb): A odd, B even positions
    for r in (1, 7, 16, 32):
        node_max, node_idx, kept, merged, offsets = _kernel_plan(metric, r, num_prefix)
        torch.testing.assert_close(node_max, ref_max, rtol=0, atol=1e-6)
        torch.testing.assert_close(sim.gather(2, node_idx.unsqueeze(-1))[..., 0], ref_max, rtol=0, atol=1e-6)
        plan = merge_top_r(node_max, node_idx, r, num_prefix)
        assert torch.equal(kept, plan.unm_idx)
        assert torch.equal(merged.sort(dim=1).values, plan.src_idx.sort(dim=1).values)
        dst = node_idx.gather(1, merged)  # merged tokens sorted by destination, then index
        assert torch.equal(dst, dst.sort(dim=1).values)
        assert torch.equal(offsets[:, 1:] - offsets[:, :-1],
                           torch.stack([torch.bincount(d, minlength=offsets.shape[1] - 1) for d in plan.dst_idx]))
        want_x, want_size = merge_mean(x, None, plan)
        got_x, got_size, got_log = triton_tome.tome_merge(metric, x, None, r, num_prefix)
        torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-6)
        assert torch.equal(got_size, want_size)
        assert torch.equal(got_log[want_size == 1], torch.zeros_like(got_log[want_size == 1]))  # log(1) = 0 exactly
        assert_within_ulps(got_log, want_size.log())  # the interpreter's log (NumPy's) vs torch's: each rounds its own


def test_log_of_whole_sizes_within_an_ulp_of_torchs():
    """The kernel's log of the sizes it writes (the next block's attention bias) agrees with torch's within one
    ulp, not bit for bit: the interpreter computes it with NumPy, whose float32 log differs from torch's in the last
    bit for some integers on some CPUs (37, 49, 179 on an AVX-512 Xeon). Whole sizes 1..255 on unmerged tokens."""
    metric, x, _ = _inputs(1, 256, 16, 8)
    size = torch.arange(1, 257, dtype=torch.float32).view(1, 256, 1)
    _, got_size, got_log = triton_tome.tome_merge(metric, x, size, 1, 1)
    assert_within_ulps(got_log, got_size.log())


def test_within_ulps_refuses_two_ulps_and_a_changed_exact_value():
    one = torch.tensor([1.0, 37.0, 0.0])
    up = torch.nextafter(one, torch.full_like(one, 100.0))
    assert_within_ulps(up, one)
    with pytest.raises(AssertionError, match="over 1 ulp"):
        assert_within_ulps(torch.nextafter(up, torch.full_like(one, 100.0)), one)
    with pytest.raises(AssertionError):
        assert_within_ulps(one.double(), one)


@pytest.mark.parametrize("tokens, launches", [(197, ["tome_match_and_plan"]),
                                              (301, ["tome_match_and_plan.metric", "tome_match_and_plan.match",
                                                     "tome_match_and_plan.rank", "tome_match_and_plan.lists"])])
def test_matching_launches_per_image_or_per_tile(tokens, launches):
    """Up to 4 tiles of A tokens one program per image runs every phase; above, each phase is a launch of a
    program per tile (the 301-token case of CASES checks those launches' plan against the reference)."""
    metric, x, _ = _inputs(2, tokens, 16, 8)
    with OpCounter() as launched:
        triton_tome.tome_merge(metric, x, None, 16, 1)
    assert {k: n for k, n in launched.counts.items() if k.startswith("triton.tome_match")} == {
        f"triton.{name}": 1 for name in launches}
    assert triton_tome._layout(tokens, 1).programs == (1 if tokens == 197 else 5)


def _same_on_both_paths(model, x, kernel_name):
    """A reduced model's logits, token counts per block and token sizes on x, on the torch path and then with
    kernel='triton' (which must launch kernel_name): equal (logits and sizes within 1e-5). Returns the stats."""
    with torch.no_grad():
        want = model(x)
        stats_want = timm_tokcomp.last_stats(model)
        timm_tokcomp.set_params(model, kernel="triton")
        with OpCounter() as launched:
            got = model(x)
        stats_got = timm_tokcomp.last_stats(model)
    assert launched.counts[f"triton.{kernel_name}"] > 0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert stats_got.tokens_per_block == stats_want.tokens_per_block
    torch.testing.assert_close(stats_got.size, stats_want.size, rtol=0, atol=1e-5)
    return stats_got


@pytest.mark.parametrize("variant", ["cls", "distilled", "registers", "avgpool_noclass", "layerscale_qknorm"])
def test_model_with_triton_kernel_matches_torch(variant):
    model = timm_tokcomp.apply(make_model(variant).eval(), "tome", r=12)
    _same_on_both_paths(model, torch.randn(3, 3, 32, 32), "tome_merge")


@pytest.mark.parametrize("method, kernel_name", [("tome", "tome_merge"), ("evit", "evit_prune_fuse")])
def test_study_protocol_reduces_after_the_mlp_on_the_triton_path(method, kernel_name):
    """keep_rate: the reduction runs after the block's MLP, with the metric of its attention (kept until then)."""
    model = timm_tokcomp.apply(make_model("cls").eval(), method, keep_rate=0.7, stages=(2, 3, 4))
    _same_on_both_paths(model, torch.randn(2, 3, 32, 32), kernel_name)
    assert timm_tokcomp.last_stats(model).tokens_per_block == [65, 45, 32, 22]


@pytest.mark.parametrize("batch, tokens, num_prefix, r, dim, channels", CASES)
def test_fused_step_on_a_size_distinctive_split(batch, tokens, num_prefix, r, dim, channels):
    metric, x, size = _inputs(batch, tokens, dim, channels, seed=2)
    size = size.round()  # ties in size: the split then also orders by position parity
    split = size_distinctive_split(size, num_prefix)
    node_max, node_idx = best_matches(metric, num_prefix, split)
    plan = merge_top_r(node_max, node_idx, r, num_prefix, split)
    want_x, want_size = merge_mean(x, size, plan)
    got_x, got_size, got_log = triton_tome.tome_merge(metric, x, size, r, num_prefix, split)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_size, want_size, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_log, got_size.log())  # the next block's bias: the log of the size written


@pytest.mark.parametrize("batch, tokens, num_prefix, r, dim, channels", CASES)
def test_dense_groups_match_group_index(batch, tokens, num_prefix, r, dim, channels):
    """The dense variant's groups from the matching kernel: every token's group as ops.group_index gives it, and
    member lists that hold each group's tokens (its B token first) for the merge kernel."""
    metric, x, _ = _inputs(batch, tokens, dim, channels, seed=3)
    want_group, num_groups = group_index(bipartite_soft_matching(metric, r, num_prefix), tokens)
    group, order, starts = triton_tome.tome_groups(metric, r, num_prefix)
    assert torch.equal(group.long(), want_group) and starts.shape == (batch, num_groups + 1)
    assert torch.equal(starts[:, -1], torch.full((batch,), tokens, dtype=torch.int32))
    for b in range(batch):
        for g in range(num_groups):
            members = order[b, starts[b, g]:starts[b, g + 1]].long()
            assert torch.equal(members.sort().values, (want_group[b] == g).nonzero()[:, 0])
    ln = torch.nn.LayerNorm(channels)
    torch.testing.assert_close(triton_dense.merge(x, group, num_groups, ln.weight, ln.bias, ln.eps, (order, starts)),
                               ops.group_mean(ln(x), want_group, num_groups), rtol=0, atol=2e-6)


@pytest.mark.parametrize("variant", ["cls", "distilled", "registers", "avgpool_noclass"])
def test_dense_model_with_triton_groups_matches_torch(variant):
    model = timm_tokcomp.apply(make_model(variant).eval(), "dense_tome", k=12, kernel="torch")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
        timm_tokcomp.set_params(model, kernel="triton")
        with OpCounter() as launched:
            got = model(x)
    assert launched.counts["triton.tome_match_and_group"] == len(model.blocks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("threshold", [-1.0, 0.1, 0.3, 2.0])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("tokens", [61, 301])  # one program per image; a launch per phase (counts per program)
def test_atm_step_matches_reference(threshold, split, tokens):
    """The batch-adaptive count (mean of the images' counts above the threshold, rounded half up, capped) and the
    merge it gives, on both splits; None where nothing merges."""
    metric, x, size = _inputs(3, tokens, 16, 24, seed=4)
    size = size.round()
    sp = size_distinctive_split(size, 1) if split else None
    node_max, node_idx = best_matches(metric, 1, sp)
    r = min(batch_adaptive_r(count_above(node_max, threshold)), (tokens - 1) // 2)
    got = triton_tome.atm_merge(metric, x, size, threshold, 1, sp)
    if r == 0:
        assert got is None
        return
    want_x, want_size = merge_mean(x, size, merge_top_r(node_max, node_idx, r, 1, sp))
    torch.testing.assert_close(got[0], want_x, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], want_size, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[2], got[1].log())


@pytest.mark.parametrize("variant", ["cls", "distilled", "registers"])
def test_atm_model_with_triton_kernel_matches_torch(variant):
    """Low thresholds so that the small random models merge, with the size-distinctive split from block 2 on."""
    model = make_model(variant).eval()
    x = torch.randn(3, 3, 32, 32)
    timm_tokcomp.apply(model, "atm", alpha=0.3, beta=0.0, theta_min=0.0, split_layer=1)
    tokens = _same_on_both_paths(model, x, "tome_merge").tokens_per_block
    assert tokens[-1] < tokens[0]


EVIT_CASES = [  # (batch, heads, tokens, prefix, r, head dim, channels, attention bias)
    (2, 3, 197, 1, 8, 64, 48, False),  # DeiT-Tiny's first block
    (3, 2, 50, 2, 10, 8, 40, True),  # distillation token; proportional attention
    (1, 1, 11, 1, 9, 16, 20, False),  # every patch token fused into one
    (2, 4, 70, 5, 1, 24, 1000, True),  # registers; channels above a power of two
    (1, 2, 130, 1, 60, 16, 2100, True),  # 61 fused tokens read 2 rows at a time (wide channels)
    (2, 3, 301, 1, 40, 16, 24, True),  # 300 patch tokens: a launch per phase, a program per head or tile
]


@pytest.mark.parametrize("tokens, launches", [(197, ["evit_class_attention_plan"]),
                                              (301, [f"evit_class_attention_plan.{phase}"
                                                     for phase in ("stats", "attention", "rank", "lists")])])
def test_evit_plan_launches_per_image_or_per_tile(tokens, launches):
    """Up to 256 patch tokens one program per image runs every phase; above, a launch per phase (the 301-token
    case of EVIT_CASES checks their result against the reference)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, tokens, 16, generator=g) for _ in range(2))
    with OpCounter() as launched:
        triton_evit.evit_prune(q, k, None, 0.25, torch.randn(1, tokens, 8, generator=g), None, 8, 1)
    assert {n: c for n, c in launched.counts.items() if n.startswith("triton.evit_class")} == {
        f"triton.{name}": 1 for name in launches}


@pytest.mark.parametrize("batch, heads, tokens, num_prefix, r, dim, channels, with_bias", EVIT_CASES)
@pytest.mark.parametrize("with_size", [False, True])
def test_evit_fused_step_matches_reference_fp32(batch, heads, tokens, num_prefix, r, dim, channels, with_bias,
                                                with_size):
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(batch, tokens, heads, dim, generator=g).transpose(1, 2) for _ in range(2))  # strided
    x = torch.randn(batch, tokens, channels, generator=g)
    size = torch.rand(batch, tokens, 1, generator=g) * 3 + 0.5
    bias = size.log().view(batch, 1, 1, tokens) if with_bias else None
    size = size if with_size else None
    plan = attentive_pruning(class_attention(q, k, bias, 0.3).mean(dim=1), r, num_prefix)
    want_x, want_size, _ = plan.apply(x, size, None)
    got_x, got_size, got_log = triton_evit.evit_prune(q, k, bias, 0.3, x, size, r, num_prefix)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_size, want_size, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_log, got_size.log())  # the next block's bias: the log of the size written


@pytest.mark.parametrize("variant", ["cls", "distilled", "registers", "layerscale_qknorm"])
@pytest.mark.parametrize("prop_attn", [False, True])
def test_evit_model_with_triton_kernel_matches_torch(variant, prop_attn):
    model = timm_tokcomp.apply(make_model(variant).eval(), "evit", r=6, prop_attn=prop_attn)
    _same_on_both_paths(model, torch.randn(3, 3, 32, 32), "evit_prune_fuse")


def test_evit_trace_source_falls_back_to_torch():
    model = make_model("cls").eval()
    timm_tokcomp.apply(model, "evit", r=6, kernel="triton", trace_source=True)
    x = torch.randn(2, 3, 32, 32)
    assert op_counts(model, x).counts["triton.evit_prune_fuse"] == 0
    timm_tokcomp.set_params(model, kernel="torch")
    with torch.no_grad():
        want = model(x)
        timm_tokcomp.set_params(model, kernel="triton")
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["eva02_cat_swiglu", "dinov3_registers", "ropevit_mixed", "pe_core_rope_map"])
@pytest.mark.parametrize("rope_merge", ["dst", "centroid"])
def test_tome_kernels_move_the_rotary_positions_as_the_torch_plan_does(name, rope_merge):
    from conftest import family_model

    x = torch.randn(2, 3, 32, 32)
    fused = timm_tokcomp.apply(family_model(name), "tome", r=3, kernel="triton", rope_merge=rope_merge)
    reference = timm_tokcomp.apply(family_model(name), "tome", r=3, kernel="torch", rope_merge=rope_merge)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-5, atol=1e-5)
    # a merge launch per block, and under 'centroid' one more for the coordinates
    assert op_counts(fused, x).counts["triton.tome_merge"] == (3 if rope_merge == "dst" else 6)


@pytest.mark.parametrize("name", ["eva02_cat_swiglu", "dinov3_registers", "ropevit_mixed"])
def test_evit_kernels_move_the_rotary_positions_as_the_torch_plan_does(name):
    """EViT on a rope model (with a class token) runs its kernels in eager inference too: the fused token's
    coordinates are the fuse kernel's weighted mean of what it holds, as the torch plan's."""
    from conftest import family_model

    x = torch.randn(2, 3, 32, 32)
    fused = timm_tokcomp.apply(family_model(name), "evit", r=3, kernel="triton")
    reference = timm_tokcomp.apply(family_model(name), "evit", r=3, kernel="torch")
    with torch.no_grad():
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-5, atol=1e-5)
    # per reducing block: the plan, the prune-fuse of the tokens, that of their coordinates
    counts = op_counts(fused, x).counts
    assert counts["triton.evit_prune_fuse"] == 2 * counts["triton.evit_class_attention_plan"] > 0, counts


@pytest.mark.parametrize("num_prefix", [1, 4])
def test_compiled_destination_coords_equal_eager_and_never_guard_on_r(num_prefix):
    """'dst' coordinates under compile come from one index per output (no tensor n_a - r long): the same rows as the
    eager gather and concatenation, and one traced graph for every r up to n_a, where every A token merges (before: a
    recompile at r = n_a - 1 and r = n_a, from the size-0 / size-1 checks on the kept list)."""
    import torch._dynamo.testing

    def moved(ws, coords, r):  # ws: the plan's workspace row
        lay = triton_tome._layout(num_prefix + coords.shape[1], num_prefix)
        return triton_tome._destination_coords(ws, lay, coords, r, num_prefix)

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(moved, backend=counter, dynamic=True)
    torch._dynamo.reset()
    for batch, patches, unmerged in ((3, 16, 5), (4, 16, 1), (3, 16, 0), (4, 15, 0), (3, 17, 0), (3, 15, 6)):
        r = triton_tome._layout(num_prefix + patches, num_prefix).n_a - unmerged  # A tokens left unmerged
        g = torch.Generator().manual_seed(batch * patches + r)
        metric = torch.randn(batch, num_prefix + patches, 8, generator=g)
        coords = torch.randn(batch, patches, 2, generator=g)
        ws = triton_tome._planned(metric, r, num_prefix, None)[1]
        want = moved(ws, coords, r)
        torch.testing.assert_close(compiled(ws, coords, r), want, rtol=0, atol=0)
        assert want.shape == (batch, patches - r, 2)
    assert counter.frame_count == 1


def test_kernel_choice_and_fallbacks():
    model = make_model("cls").eval()
    x = torch.randn(2, 3, 32, 32)
    timm_tokcomp.apply(model, "tome", r=8, kernel="auto")
    assert op_counts(model, x).counts["triton.tome_merge"] == 0  # auto: CPU tensors run the torch reference
    timm_tokcomp.set_params(model, kernel="triton", trace_source=True)
    assert op_counts(model, x).counts["triton.tome_merge"] == 0  # a source map needs the plan: torch path
    timm_tokcomp.set_params(model, trace_source=False)
    model.train()
    with pytest.raises(ValueError, match="inference-only"):
        model(x)  # parameters need gradients: the kernels have no backward
    with pytest.raises(ValueError, match="kernel must be one of"):
        timm_tokcomp.set_params(model, kernel="cuda")


def test_triton_forced_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    model = make_model("cls").eval()
    timm_tokcomp.apply(model, "tome", r=8, kernel="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"), torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
