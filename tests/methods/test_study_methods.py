"""The "Which Tokens to Use?" protocol (keep rate, three stages) and its training-free methods: Top-K, radial
l1 / l2 / l-inf, K-Medoids, DPC-KNN, with ToMe and EViT on the same schedule."""
import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.families import VIT
from timm_tokcomp.measure.counting import count_macs
from timm_tokcomp.methods.ats import adaptive_sampling
from timm_tokcomp.ops.matching import float32_linspace
from timm_tokcomp.methods.dpcknn import density_peaks
from timm_tokcomp.methods.kmedoids import k_medoids
from timm_tokcomp.methods.topk import top_k_pruning
from timm_tokcomp.plans import ClusterPlan
from timm_tokcomp.methods import parse_method_tag
from timm_tokcomp.methods.radial import centre_order
from timm_tokcomp.methods.schedules import stage_schedule
from conftest import make_model, real_model_and_images


def test_stage_schedule_is_the_studys_token_counts():
    assert stage_schedule(0.7, (4, 7, 10), 12, 196) == [0, 0, 59, 0, 0, 41, 0, 0, 29, 0, 0, 0]  # 137, 96, 67
    assert stage_schedule(0.25, (4, 7, 10), 12, 196) == [0, 0, 147, 0, 0, 37, 0, 0, 9, 0, 0, 0]  # 49, 12, 3
    assert stage_schedule(1.0, (4, 7, 10), 12, 196) == [0] * 12


@pytest.mark.parametrize("keep_rate, depth", [(0.9, 10.29), (0.7, 7.59), (0.5, 5.62), (0.25, 3.98)])
def test_mean_token_depth_matches_the_notes_check_values(keep_rate, depth):
    """Mean over the 196 patches of the blocks that processed each as its own token (a fixed-count pruner)."""
    model = timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224").eval(), "topk", keep_rate=keep_rate)
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    patches_per_block = [n - 1 for n in timm_tokcomp.last_stats(model).tokens_per_block]
    assert round(sum(patches_per_block) / 196, 2) == depth


def test_keep_rate_tags_parameters_and_errors():
    assert parse_method_tag("topk_k70") == ("topk", {"keep_rate": 0.7})
    assert parse_method_tag("dpcknn_r8") == ("dpcknn", {"r": 8})
    assert parse_method_tag("l2_k100") == ("l2", {"keep_rate": 1.0})
    for bad in ("topk_k0", "topk_k101", "topk_k7.5"):
        with pytest.raises(ValueError, match="valid forms"):
            parse_method_tag(bad)
    model = make_model("cls")
    with pytest.raises(ValueError, match=r"keep_rate must be in \[0.5, 1\] for tome"):
        timm_tokcomp.apply(model, "tome", keep_rate=0.25)
    with pytest.raises(ValueError, match=r"keep_rate must be a finite number in \(0, 1\]"):
        timm_tokcomp.apply(model, "topk", keep_rate=1.5)
    with pytest.raises(ValueError, match="give one of r, flops_ratio, keep_rate"):
        timm_tokcomp.apply(model, "evit", r=4, keep_rate=0.5)
    with pytest.raises(ValueError, match="stages must be blocks 2..4"):
        timm_tokcomp.apply(model, "topk", keep_rate=0.5)  # the default stages (4, 7, 10) need 10 blocks
    with pytest.raises(ValueError, match="strictly increasing"):
        timm_tokcomp.apply(model, "topk", keep_rate=0.5, stages=(3, 2))
    for stages in (4, (1, 3), ()):  # refused even where r, not keep_rate, sets the schedule
        with pytest.raises(ValueError, match="stages must be"):
            timm_tokcomp.apply(model, "topk", r=2, stages=stages)
    with pytest.raises(ValueError, match="class token"):
        timm_tokcomp.apply(make_model("avgpool_noclass"), "topk", keep_rate=0.5, stages=(2, 3))
    timm_tokcomp.apply(model, "topk", keep_rate=0.5, stages=(2, 3))
    timm_tokcomp.set_params(model, r=3)  # one of r / flops_ratio / keep_rate replaces the others
    assert timm_tokcomp.get_reducer(model).keep_rate is None


def test_top_k_keeps_the_most_attended_and_breaks_ties_towards_the_lower_index():
    cls_attn = torch.tensor([[0.5, 0.1, 0.3, 0.3, 0.05, 0.3]])  # prefix, then 5 patches
    plan = top_k_pruning(cls_attn, 2, num_prefix=1)
    assert plan.keep_idx.tolist() == [[1, 2, 4]] and plan.fuse_idx is None  # 0.3, 0.3 kept; third 0.3 dropped


def test_radial_patterns_keep_the_patches_nearest_the_centre():
    assert set(centre_order((4, 4), 2.0)[:4]) == {5, 6, 9, 10}
    assert centre_order((4, 4), 1.0)[:4] == centre_order((4, 4), float("inf"))[:4]
    assert set(centre_order((2, 8), float("inf"))[:4]) == {3, 4, 11, 12}  # a 2 x 8 grid: the middle columns
    model = timm_tokcomp.apply(make_model("registers"), "l2", keep_rate=0.5, stages=(2, 3), trace_source=True)
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    p = model.num_prefix_tokens
    held = timm_tokcomp.last_stats(model).source.sum(1)[:, p:]  # (B, 64): 1 where the patch is still held
    for b in range(2):
        assert set(held[b].nonzero().flatten().tolist()) == set(centre_order((8, 8), 2.0)[:16])  # 64 -> 32 -> 16


def test_radial_index_made_under_inference_mode_still_serves_training():
    """The keep index is made once per device and reused: one first made inside inference_mode must not be an
    inference tensor, or a later training forward could not save it for backward."""
    model = timm_tokcomp.apply(make_model("registers"), "linf", keep_rate=0.5, stages=(2, 3))
    with torch.inference_mode():
        model.eval()(torch.randn(2, 3, 32, 32))
    model.train()(torch.randn(2, 3, 32, 32)).sum().backward()
    assert model.patch_embed.proj.weight.grad is not None


def _blobs(seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[8.0, 0, 0, 0], [0, 8.0, 0, 0], [0, 0, 8.0, 0]])
    labels = torch.arange(3).repeat_interleave(5)[torch.randperm(15, generator=g)]
    return (centres[labels] + 0.3 * torch.randn(15, 4, generator=g)).unsqueeze(0), labels


@pytest.mark.parametrize("cluster", [k_medoids, density_peaks])
def test_clustering_recovers_separated_groups(cluster):
    x, labels = _blobs()
    assign = cluster(x, 3)[0]
    pairs = set(zip(assign.tolist(), labels.tolist()))
    assert len(pairs) == 3 and len({a for a, _ in pairs}) == 3  # a one-to-one map between clusters and groups


@pytest.mark.parametrize("cluster", [k_medoids, density_peaks])
def test_clustering_identical_tokens_leaves_no_cluster_empty(cluster):
    assign = cluster(torch.ones(2, 10, 4), 4)
    for row in assign:
        assert sorted(set(row.tolist())) == [0, 1, 2, 3]


def test_the_written_out_linspace_is_linspace_and_rounds_as_it_does():
    # K-Medoids starts at its rounding: ties of float32 linspace (end 47, 23 steps: 23.5 comes out below the half)
    # are where a rational formula's rounding differs
    for end in range(0, 200):
        for steps in range(1, end + 2):
            got, want = float32_linspace(end, steps, torch.device("cpu")), torch.linspace(0, end, steps)
            torch.testing.assert_close(got, want, rtol=2e-7, atol=0)
            assert torch.equal(got.round(), want.round())


def test_the_linspace_is_built_once_outside_a_trace_and_written_out_inside_it():
    """Eager blocks reuse one tensor per (end, steps) (no op per forward); a compiled one computes the same values
    with symbolic sizes (one graph for two counts)."""
    from timm_tokcomp.measure.counting import OpCounter
    cpu = torch.device("cpu")
    first = float32_linspace(96, 13, cpu)
    with OpCounter() as ops:
        again = float32_linspace(96, 13, cpu)
    assert again is first and ops.total == 0
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    traced = torch.compile(lambda x: x[0] * 0 + float32_linspace(x.shape[0] - 1, x.shape[1], x.device),
                           backend="eager", dynamic=True, fullgraph=True)
    for end, steps in [(96, 13), (47, 23)]:
        assert torch.equal(traced(torch.zeros(end + 1, steps)), float32_linspace(end, steps, cpu))
    assert counters["stats"]["unique_graphs"] == 1


def test_cluster_plan_is_the_size_weighted_mean_of_each_cluster():
    x = torch.randn(1, 5, 3)
    size = torch.tensor([[[1.0], [1.0], [2.0], [3.0], [1.0]]])
    plan = ClusterPlan(num_prefix=1, assign=torch.tensor([[1, 0, 1, 0]]), num_clusters=2)
    out, new_size, _ = plan.apply(x, size, None)
    assert torch.equal(new_size, torch.tensor([[[1.0], [3.0], [4.0]]]))  # prefix, cluster 0, cluster 1
    torch.testing.assert_close(out[0, 0], x[0, 0])
    torch.testing.assert_close(out[0, 1], (x[0, 2] * 2 + x[0, 4]) / 3)
    torch.testing.assert_close(out[0, 2], (x[0, 1] + x[0, 3] * 3) / 4)


def _analytic_macs(model, plain_macs):
    """MACs from the token counts alone: the plain model's non-block MACs plus every block at its count."""
    cost, stats = VIT.block_cost(model.blocks[0]), timm_tokcomp.last_stats(model)
    n = stats.tokens_per_block
    non_block = plain_macs - len(n) * cost.macs(n[0], n[0])
    return non_block + sum(cost.macs(t, t) for t in n)


@pytest.mark.parametrize("tag", ["topk_k70", "evit_k70", "l2_k50", "tome_k70", "kmedoids_k70", "dpcknn_k90"])
def test_fixed_count_methods_land_on_the_analytic_macs(tag):
    """Counted from the run: the blocks at the study's token counts, plus the method's own matching or
    clustering, which is all the difference (under 0.5 % for ranking and matching; clustering costs more)."""
    x = torch.randn(1, 3, 224, 224)
    plain = timm.create_model("deit_tiny_patch16_224").eval()
    model = timm.create_model(f"deit_tiny_patch16_224.{tag}").eval()
    plain_macs, macs = count_macs(plain, x), count_macs(model, x)
    analytic = _analytic_macs(model, plain_macs)
    overhead = (macs - analytic) / analytic
    if tag.startswith(("kmedoids", "dpcknn")):
        assert 0.005 < overhead < 0.08  # pairwise distances (and K-Medoids' cost sums) per stage
    else:
        assert 0 <= overhead < 0.005


def test_adaptive_sampling_collapses_duplicates_and_pads_rows_that_keep_fewer():
    scores = torch.tensor([[0.0, 0.25, 0.25, 0.25, 0.25],    # prefix, then four equal patches: 3 points, 3 tokens
                           [0.0, 0.7, 0.1, 0.1, 0.1]])        # one dominant patch takes two of the three points
    plan = adaptive_sampling(scores, 3, num_prefix=1)
    assert plan.keep_idx.shape == (2, 3)
    assert plan.valid[..., 0].tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert 0 in plan.keep_idx[1, :2].tolist()  # the dominant patch is kept
    x, size, source = plan.apply(torch.randn(2, 5, 4), None, torch.eye(5).expand(2, -1, -1))
    assert size[..., 0].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]] and source[1, 3].sum() == 0


@pytest.mark.realdata
def test_ats_images_in_a_batch_run_as_they_run_alone():
    """Real weights and images: images keep different counts, and the size-0 padding changes nothing."""
    model, images = real_model_and_images("deit_tiny_patch16_224.ats_k50", 4)
    with torch.no_grad():
        together = model(images)
        real = timm_tokcomp.last_stats(model).real_tokens_per_block[-1]
        alone = torch.cat([model(images[i:i + 1]) for i in range(4)])
    assert real.max() <= 25 and len(set(real.tolist())) > 1  # r is an upper bound; counts differ per image
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)


def test_ats_refuses_to_run_without_the_masking_bias():
    with pytest.raises(ValueError, match="prop_attn must stay on for ats"):
        timm_tokcomp.apply(make_model("cls"), "ats", r=2, prop_attn=False)
