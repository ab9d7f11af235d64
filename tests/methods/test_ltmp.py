"""LTMP: the eval step against a per-image loop definition (padding included), the training forward against the eval
forward, its MACs penalty against the eval run's counts, training through `tokcomp finetune`, the saved thresholds,
and refusals."""
import pytest
import timm
import torch
import torch.nn.functional as F

import timm_tokcomp
from conftest import SMALL, make_model, thresholds
from timm_tokcomp.methods.learned import load_learned, save_learned
from timm_tokcomp.plans import GroupPlan
from timm_tokcomp.methods import make_reducer
from timm_tokcomp.methods.base import BlockSetting
from timm_tokcomp.methods.schedules import BlockCost
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned

N_PATCH = (SMALL["img_size"] // SMALL["patch_size"]) ** 2


def _reference_step(x, keys, importance, size, merge_at, prune_at, p):
    """One image written as loops: x (N, C), keys (N, d), importance (N,), size (N,) with 0 for padding -> (x, size)
    of the prefix and the kept groups, in order of their first member."""
    n = x.shape[0] - p
    real = [size[p + i] > 0 for i in range(n)]
    a_start = p % 2
    a_pos, b_pos = list(range(a_start, n, 2)), list(range(1 - a_start, n, 2))
    slot = list(range(n))
    for i in a_pos:
        sims = [float(F.cosine_similarity(keys[p + i], keys[p + j], dim=0)) if real[j] else float("-inf") for j in b_pos]
        best = max(range(len(b_pos)), key=lambda k: (sims[k], -k))
        if real[i] and sims[best] > merge_at:
            slot[i] = b_pos[best]
    groups = {}
    for i in range(n):
        if real[i]:
            groups.setdefault(slot[i], []).append(i)
    kept = [s for s in sorted(groups) if max(float(importance[p + i]) for i in groups[s]) >= prune_at]
    out_x = [x[i] for i in range(p)]
    out_size = [size[i] for i in range(p)]
    for s in kept:
        members = groups[s]
        total = sum(size[p + i] for i in members)
        out_x.append(sum(size[p + i] * x[p + i] for i in members) / total)
        out_size.append(total)
    return torch.stack(out_x), torch.stack(out_size)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("merge_at, prune_at", [(0.3, 0.0), (0.1, 0.015), (1.0, 0.02), (0.0, 0.0)])
def test_eval_step_equals_the_loop_definition(p, merge_at, prune_at):
    torch.manual_seed(0)
    B, n = 3, 20
    x, keys = torch.randn(B, p + n, 8), torch.randn(B, p + n, 6)
    importance = torch.rand(B, p + n) / n
    size = torch.randint(1, 4, (B, p + n, 1)).float()
    size[1, p + 15:] = 0  # image 1 holds padding from an earlier block
    method = make_reducer("ltmp", threshold_params=thresholds(1, merge_at, prune_at * 1000))
    method.threshold_params.eval()
    plan = method.plan((keys, importance), BlockSetting(0, 1, n, p, BlockCost(1, 1, 1)), p, size)
    got_x, got_size = (x, size) if plan is None else plan.apply(x, size, None)[:2]
    assert plan is None or isinstance(plan, GroupPlan)
    for b in range(B):
        want_x, want_size = _reference_step(x[b], keys[b], importance[b], size[b, :, 0], merge_at, prune_at, p)
        count = len(want_size)
        torch.testing.assert_close(got_x[b, :count], want_x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_size[b, :count, 0], want_size)
        assert (got_size[b, count:] == 0).all() and (got_x[b, count:] == 0).all()  # the padding


def test_the_training_forward_makes_the_eval_decisions_and_its_penalty_reads_their_macs(images):
    """With merges in block 0 only (the alternate split then pairs the same tokens in both modes: training keeps every
    token in place, eval compacts them), the training forward gives the eval logits; the penalty's MACs share is that
    of the eval run's counts; the gradient reaches both thresholds."""
    params = thresholds(SMALL["depth"], merge=1.0, prune=20.0)
    with torch.no_grad():  # block 0 merges, block 1 prunes
        params.merge[0], params.prune[0] = 0.5, 0.0
    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "ltmp", macs_target=0.5, threshold_params=params).eval()
    image = images[:1]
    with torch.no_grad():
        expected = model(image)
    stats = timm_tokcomp.last_stats(model)
    counts = stats.tokens_per_block
    assert counts[1] < counts[0] and counts[2] < counts[1]
    model.train()
    got = model(image)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # the eval run's kept fractions leaving each block (the last block's: the tokens out of its MLP)
    fractions = [(c - 1) / N_PATCH for c in stats.tokens_per_block[1:] + [stats.tokens_out]]
    cost, n = model._tokcomp.block_cost, N_PATCH + 1
    before, shares = 1.0, []
    for after in fractions:
        shares.append(cost.macs(1 + before * N_PATCH, 1 + after * N_PATCH) / cost.macs(n, n))
        before = after
    value = timm_tokcomp.get_reducer(model).method_loss()
    assert value.item() == pytest.approx(10.0 * (0.5 - sum(shares) / len(shares)) ** 2, rel=1e-5)
    (got.sum() + value).backward()
    assert params.merge.grad[0] != 0 and (params.prune.grad != 0).any()


def test_training_through_finetune_moves_the_macs_toward_the_target(image_folder, tmp_path):
    """`tokcomp finetune --distill --lora-rank 0 --method ltmp_m50`: only the thresholds train, the folder holds them,
    and the reloaded model runs at fewer MACs than the thresholds' start (which merges little and prunes nothing)."""
    from timm_tokcomp.measure.counting import count_macs

    out = tmp_path / "ltmp"
    config = FinetuneConfig(method="ltmp_m50", epochs=4, warmup_epochs=0, batch_size=10, distill=True, lora_rank=0,
                            lr=0.2, weight_decay=0.0)
    finetune("deit_tiny_patch16_224", str(image_folder), str(out), config=config, show_progress=False, num_workers=0)
    assert (out / "ltmp.safetensors").is_file() and (out / "ltmp_config.json").is_file()
    trained = load_finetuned(str(out)).eval()
    torch.manual_seed(0)
    start = timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224"), "ltmp").eval()
    x = torch.randn(1, 3, 224, 224)
    assert count_macs(trained, x) < 0.9 * count_macs(start, x)
    assert torch.equal(load_learned("ltmp", out).merge, trained.tokcomp["ltmp"].merge)


def test_saved_thresholds_reload_and_refuse_another_depth(tmp_path, images):
    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "ltmp", threshold_params=thresholds(4, 0.3, 10.0)).eval()
    with torch.no_grad():
        expected = model(images)
    save_learned(model.tokcomp["ltmp"], "ltmp", tmp_path)
    torch.manual_seed(0)
    again = timm_tokcomp.apply(make_model("cls"), "ltmp", threshold_params=load_learned("ltmp", tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(again(images), expected)
    with pytest.raises(ValueError, match="these LTMP thresholds are for 4 blocks; the model has 6"):
        timm_tokcomp.apply(timm.models.vision_transformer.VisionTransformer(**{**SMALL, "depth": 6}), "ltmp",
                           threshold_params=load_learned("ltmp", tmp_path))


@pytest.mark.parametrize("params, match", [
    (dict(tau=0), "tau must be a finite number > 0"),
    (dict(tau=float("inf")), "tau must be a finite number > 0"),
    (dict(macs_target=1.5), r"macs_target must be a finite number in \(0, 1\]"),
    (dict(macs_weight=-1), "macs_weight must be a finite number > 0"),
    (dict(prop_attn=False), "prop_attn must stay on"),
    (dict(threshold_params=torch.nn.Linear(2, 2)), "threshold_params must be LTMPParams"),
])
def test_bad_settings_are_refused_naming_the_parameter(params, match):
    with pytest.raises(ValueError, match=match):
        make_reducer("ltmp", **params)


def test_trained_thresholds_carried_as_numbers_in_a_preset_give_the_same_model(tmp_path, images):
    from timm_tokcomp.deployment.specs import method_spec
    from timm_tokcomp.deployment.presets import write_preset

    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "ltmp", threshold_params=thresholds(4, 0.3, 12.0)).eval()
    with torch.no_grad():
        expected = model(images)
    write_preset(tmp_path / "ltmp.json", "ltmp", {"thresholds": model.tokcomp["ltmp"].values()})
    method, params = method_spec(str(tmp_path / "ltmp.json"))
    torch.manual_seed(0)
    again = timm_tokcomp.apply(make_model("cls"), method, **params).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(images), expected)
    with pytest.raises(ValueError, match=r"thresholds needs one entry per block \(4\), got 2"):
        timm_tokcomp.apply(make_model("cls"), "ltmp", thresholds={"merge": [0.5, 0.5], "prune": [0.0, 0.0]})
    with pytest.raises(ValueError, match="give thresholds or threshold_params, not both"):
        make_reducer("ltmp", thresholds=params["thresholds"], threshold_params=thresholds(4, 0.3))
    with pytest.raises(ValueError, match=r"thresholds\['prune'\] must be a non-empty list of numbers in \[0, 1\]"):
        make_reducer("ltmp", thresholds={"merge": [0.5], "prune": [2.0]})


def test_ltmp_waits_for_the_device_once_per_block(images):
    from timm_tokcomp.measure.counting import OpCounter

    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "ltmp", threshold_params=thresholds(4, 0.3, 12.0)).eval()
    with torch.no_grad(), OpCounter() as ops:
        model(images)
    assert ops.host_syncs == SMALL["depth"]
