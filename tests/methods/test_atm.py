"""ATM: threshold schedule, size-distinctive split, batch-adaptive counts, equivalences, presets, names."""
import math

import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.ops.matching import batch_adaptive_r, best_matches, count_above, size_distinctive_split
from timm_tokcomp.methods.atm import ATM, PRESETS, ATMStep, get_preset, model_family, threshold_schedule
from conftest import REPO, SMALL, make_model


def test_threshold_schedule_values():
    got = threshold_schedule(1.0, 0.035, 0.88, 12)
    assert got[0] == 1.0
    assert got[1] == pytest.approx(1.0 - (math.exp(0.035) - 1.0))
    assert got[3] == pytest.approx(1.0 - (math.exp(0.105) - 1.0))  # 0.8893, still above the floor
    assert got[4:] == [0.88] * 8
    assert all(a >= b for a, b in zip(got, got[1:]))
    assert threshold_schedule(0.9, 0.0, 0.5, 3) == [0.9, 0.9, 0.9]
    assert threshold_schedule(1.0, 237.0, 0.6, 4) == [1.0, 0.6, 0.6, 0.6]  # exp would overflow (found by hypothesis)


def test_block_settings_skip_thresholds_of_one_and_split_late_layers():
    steps = ATM(1.0, 0.035, 0.88).block_settings(12, 197, 1, cost=None)
    assert steps[0] is None  # theta_1 = alpha = 1: nothing can exceed it
    assert [s.size_split for s in steps[1:]] == [False] * 8 + [True] * 3  # l > 9 of 12
    assert [s.size_split for s in ATM(0.9, 0.0, 0.9, split_layer=0).block_settings(4, 10, 1, None)] == [True] * 4


def test_size_distinctive_split_never_pairs_two_large_tokens():
    g = torch.Generator().manual_seed(0)
    for num_prefix in (0, 1, 2):
        size = torch.randint(1, 6, (3, 29 + num_prefix, 1), generator=g).float()
        metric = torch.randn(3, 29 + num_prefix, 8, generator=g)
        a_idx, b_idx = size_distinctive_split(size, num_prefix)
        s = size[:, num_prefix:, 0]
        assert a_idx.shape[1] + b_idx.shape[1] == 29 and a_idx.shape[1] == len(range(num_prefix % 2, 29, 2))
        for row in range(3):
            assert torch.cat([a_idx[row], b_idx[row]]).sort().values.tolist() == list(range(29))
            # A is the smaller-sized half: no source is larger than any destination candidate
            assert s[row, a_idx[row]].max() <= s[row, b_idx[row]].min()
        plan = ATM(-1.0, 0.0, -1.0).plan(metric, ATMStep(-1.0, size_split=True), num_prefix, size)
        src_pos = a_idx.gather(1, plan.src_idx)
        dst_pos = b_idx.gather(1, plan.dst_idx)
        assert (s.gather(1, src_pos) <= s.gather(1, dst_pos)).all()
        assert all(set(src_pos[r].tolist()).isdisjoint(b_idx[r].tolist()) for r in range(3))


def test_size_distinctive_split_with_equal_sizes_is_the_alternate_split():
    for num_prefix in (0, 1, 4):
        size = torch.ones(2, 17 + num_prefix, 1)
        a_idx, b_idx = size_distinctive_split(size, num_prefix)
        a_start = num_prefix % 2
        assert a_idx[0].tolist() == list(range(a_start, 17, 2))
        assert b_idx[1].tolist() == list(range(1 - a_start, 17, 2))


def _metric_with_pairs(num_pairs, na=6, dim=16):
    """One image's keys (1 + 2 * na tokens, class token first): A token i (position 2i + 1... see below)
    has a near-copy in B for i < num_pairs and is orthogonal to every B token otherwise."""
    # with one prefix token, A = odd absolute positions 1, 3, ..., B = even positions 2, 4, ...
    m = torch.zeros(1 + 2 * na, dim)
    m[0, -1] = 1.0
    for i in range(na):
        m[2 + 2 * i, i] = 1.0  # B token i on axis i
        m[1 + 2 * i, i if i < num_pairs else na + i] = 1.0  # A token i: a copy of B token i, or orthogonal
    return m


def test_batch_adaptive_count_is_the_rounded_mean_of_the_per_image_counts():
    counts = [3, 6, 1]  # mean 3.33 -> 3
    metric = torch.stack([_metric_with_pairs(c) for c in counts])
    node_max, _ = best_matches(metric, 1)
    assert count_above(node_max, 0.5).tolist() == counts
    plan = ATM(0.5, 0.0, 0.5).plan(metric, ATMStep(0.5, size_split=False), 1, None)
    assert plan.r == 3
    assert batch_adaptive_r(torch.tensor([3, 6])) == 5  # 4.5 rounds half up
    assert batch_adaptive_r(torch.tensor([1, 2, 2, 2])) == 2  # 1.75
    assert batch_adaptive_r(torch.tensor([0, 0, 1])) == 0  # 0.33
    single = ATM(0.5, 0.0, 0.5).plan(metric[1:2], ATMStep(0.5, size_split=False), 1, None)
    assert single.r == 6 and sorted(single.src_idx[0].tolist()) == list(range(6))


def test_identical_images_in_a_batch_give_the_single_image_result():
    model = timm_tokcomp.apply(make_model("cls"), "atm", alpha=0.6, beta=0.1, theta_min=0.2)
    torch.manual_seed(3)
    x = torch.randn(1, 3, SMALL["img_size"], SMALL["img_size"])
    with torch.no_grad():
        one = model(x)
        one_counts = timm_tokcomp.last_stats(model).tokens_per_block
        many = model(x.expand(5, -1, -1, -1))
    assert one_counts != [65] * SMALL["depth"]  # it does merge
    assert timm_tokcomp.last_stats(model).tokens_per_block == one_counts
    torch.testing.assert_close(many, one.expand(5, -1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["cls", "distilled", "registers", "layerscale_qknorm", "avgpool_noclass"])
def test_thresholds_above_one_equal_the_unpatched_model(variant, images):
    model = make_model(variant)
    with torch.no_grad():
        expected = model(images)
        timm_tokcomp.apply(model, "atm", alpha=1.5, beta=0.01, theta_min=1.2, prefix_only_last_block=False)
        assert torch.equal(model(images), expected)
        timm_tokcomp.set_params(model, prefix_only_last_block=None)  # the default: on where exact
        torch.testing.assert_close(model(images), expected, rtol=0, atol=1e-6)
    n0 = (SMALL["img_size"] // SMALL["patch_size"]) ** 2 + model.num_prefix_tokens
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_per_block == [n0] * SMALL["depth"]
    assert stats.tokens_out == (n0 if variant == "avgpool_noclass" else model.num_prefix_tokens)


def test_atm_is_deterministic_and_merges_adaptively(images):
    model = timm_tokcomp.apply(make_model("cls"), "atm", alpha=0.7, beta=0.1, theta_min=0.3, split_layer=2)
    with torch.no_grad():
        a = model(images)
        counts = timm_tokcomp.last_stats(model).tokens_per_block
        b = model(images)
        model(images.mean(dim=(2, 3), keepdim=True).expand_as(images) + 0.01 * images)
    assert torch.equal(a, b)
    assert timm_tokcomp.last_stats(model).tokens_per_block[-1] < counts[-1]  # flat images merge more


def test_prefix_only_last_block_is_exact_and_refused_where_it_is_not(images):
    plain = make_model("cls")
    with torch.no_grad():
        expected = timm_tokcomp.apply(make_model("cls"), "tome", r=4)(images)
        model = timm_tokcomp.apply(plain, "tome", r=4, prefix_only_last_block=True)
        torch.testing.assert_close(model(images), expected, rtol=0, atol=1e-6)
    assert timm_tokcomp.last_stats(model).tokens_out == 1
    with pytest.raises(ValueError, match="prefix_only_last_block"):
        timm_tokcomp.apply(make_model("avgpool_noclass"), "tome", r=4, prefix_only_last_block=True)
    model = timm_tokcomp.apply(make_model("cls"), "atm", prefix_only_last_block=True)
    model.reset_classifier(10, global_pool="avg")
    with pytest.raises(ValueError, match="global_pool='avg'"):
        model(images)


def test_presets_by_model_width_and_explicit_parameters_win():
    assert [model_family(w) for w in (192, 384, 768, 1024, 64)] == ["tiny", "small", "base", "base", "tiny"]
    model = timm_tokcomp.apply(make_model("cls"), "atm")  # width 48 -> the tiny family
    lossless = PRESETS["lossless"]["tiny"]
    reducer = timm_tokcomp.get_reducer(model)
    assert (reducer.alpha, reducer.beta, reducer.theta_min) == (lossless.alpha, lossless.beta, lossless.theta_min)
    timm_tokcomp.set_params(model, beta=0.05)
    assert (timm_tokcomp.get_reducer(model).alpha, timm_tokcomp.get_reducer(model).beta) == (1.0, 0.05)
    timm_tokcomp.set_params(model, preset="lossless", theta_min=0.8)
    assert (timm_tokcomp.get_reducer(model).beta, timm_tokcomp.get_reducer(model).theta_min) == (0.035, 0.8)


@pytest.mark.parametrize("params, match", [
    (dict(preset="nope"), "preset must be one of"),
    (dict(beta=-0.1), "beta must be a finite number >= 0"),
    (dict(alpha=float("nan")), "alpha must be a finite number"),
    (dict(split_layer=5), r"split_layer must be in \[0, 4\]"),
    (dict(split_layer=-1), "split_layer must be an integer >= 0 or None"),
])
def test_bad_atm_parameters_are_named(params, match):
    model = make_model("cls")
    with pytest.raises(ValueError, match=match):
        timm_tokcomp.apply(model, "atm", **params)
    assert not timm_tokcomp.is_reduced(model)


def test_atm_names_in_timm():
    model = timm.create_model("deit_small.atm")
    reducer = timm_tokcomp.get_reducer(model)
    assert (reducer.alpha, reducer.beta, reducer.theta_min) == (0.99, 0.04, 0.88)
    base = timm.create_model("deit_base_patch16_224.fb_in1k.atm_lossless", pretrained=False)
    assert timm_tokcomp.get_reducer(base).beta == 0.025
    assert timm_tokcomp.get_reducer(timm.create_model("deit_tiny_patch16_224.atm")).beta == 0.035
    assert "deit_small_patch16_224.fb_in1k.atm" in timm.list_models("deit_small*", pretrained=True)
    with pytest.raises(ValueError, match="atm_lossless"):
        timm.create_model("deit_small.atm_turbo")
    with pytest.raises(ValueError, match=r"preset 'fast' exists for the \['tiny'\] families only.*calibrate"):
        timm.create_model("deit_small.atm_fast")
    assert timm_tokcomp.get_reducer(timm.create_model("deit_tiny.atm_fast")).theta_min == PRESETS["fast"]["tiny"].theta_min


def test_every_paper_setting_is_a_preset_of_its_model():
    """Each (alpha, beta, theta_min) row of the paper's Tables A2 / A5 is reachable by name (atm_g<GFLOPs x 100>,
    atm_mae_g<...> for MAE ViT-B) on its model, and gives exactly that setting."""
    import csv
    from pathlib import Path

    table = REPO.parent / "shared" / "reference" / "atm_table_a2_a5.csv"
    if not table.is_file():
        table = Path(timm_tokcomp.__file__).parent / "assets" / "atm_paper_settings.csv"
    widths = {"deit_tiny_patch16_224": 192, "deit_small_patch16_224": 384, "deit_base_patch16_224": 768,
              "vit_base_patch16_224.mae": 768}
    rows = [r for r in csv.DictReader(open(table, newline="")) if r["alpha"]]
    assert len(rows) == 59
    for row in rows:
        name = ("mae_" if row["model"].endswith(".mae") else "") + f"g{round(float(row['gflops']) * 100):03d}"
        preset = get_preset(name, widths[row["model"]])
        assert (preset.alpha, preset.beta, preset.theta_min) == (float(row["alpha"]), float(row["beta"]),
                                                                 float(row["theta_min"])), name
        assert row["gflops"] in preset.source
    model = timm.create_model("deit_tiny_patch16_224.atm_g090")
    assert timm_tokcomp.get_reducer(model).theta_min == 0.88
