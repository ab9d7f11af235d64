"""DiffRate: the eval step against a per-image loop definition, the search's training forward against the eval forward
(same decisions, every token kept in place), its MACs share against the MACs counted from the run, the search through
`tokcomp finetune` meeting its MACs target, the saved rates as a folder and as a schedule preset, and refusals."""
import copy

import pytest
import timm
import torch
import torch.nn.functional as F

import timm_tokcomp
from conftest import SMALL, make_model
from timm_tokcomp.methods.learned import load_learned, save_learned
from timm_tokcomp.plans import KeepMergePlan
from timm_tokcomp.measure.counting import count_macs
from timm_tokcomp.methods import make_reducer
from timm_tokcomp.methods.diffrate import DiffRateParams, macs_share
from timm_tokcomp.methods.schedules import BlockCost
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned

N_PATCH = (SMALL["img_size"] // SMALL["patch_size"]) ** 2


def _reference_step(x, importance, size, prune, merge, p):
    """One image's DiffRate step written as loops: x (N, C), importance (N,), size (N,) -> (x, size) of the prefix
    and the keepers, keepers in importance order."""
    order = sorted(range(p, x.shape[0]), key=lambda i: (-float(importance[i]), i))[:prune]
    keepers, tail = order[:merge], order[merge:]
    members = {j: [j] for j in keepers}
    weight = {j: 1.0 for j in keepers}
    for i in tail:
        sims = [float(F.cosine_similarity(x[i], x[j], dim=0)) for j in keepers]
        best = max(range(len(keepers)), key=lambda k: (sims[k], -k))
        members[keepers[best]].append(i)
        weight[i] = max(sims[best], 0.0)
    out_x = [x[i] for i in range(p)] + [torch.stack([x[i] for i in members[j]]).mean(0) for j in keepers]
    out_size = [size[i] for i in range(p)] + [sum(weight[i] * size[i] for i in members[j]) for j in keepers]
    return torch.stack(out_x), torch.stack(out_size)


@pytest.mark.parametrize("prune, merge", [(40, 25), (64, 30), (20, 20), (50, 1)])
def test_eval_step_equals_the_loop_definition(prune, merge):
    torch.manual_seed(0)
    p, B = 1, 3
    x = torch.randn(B, p + N_PATCH, 16)
    importance = torch.rand(B, p + N_PATCH)
    size = torch.rand(B, p + N_PATCH, 1) + 1
    method = make_reducer("diffrate", schedule={"prune": [N_PATCH, prune], "merge": [N_PATCH, merge]})
    side = SMALL["img_size"] // SMALL["patch_size"]
    setting = method.settings_for(2, p + N_PATCH, p, BlockCost(1, 1, 1), (side, side))[1]  # the block's counts in it
    plan = method.plan((importance, x), setting, p, size)
    assert isinstance(plan, KeepMergePlan) and plan.num_keepers == merge
    got_x, got_size, _ = plan.apply(x, size, None)
    for b in range(B):
        want_x, want_size = _reference_step(x[b], importance[b], size[b, :, 0], prune, merge, p)
        torch.testing.assert_close(got_x[b], want_x, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got_size[b, :, 0], want_size, atol=1e-6, rtol=1e-5)


def _small(**params):
    torch.manual_seed(0)
    return timm_tokcomp.apply(make_model("cls"), "diffrate", **params)


def test_the_search_forward_makes_the_eval_decisions_with_every_token_in_place(images):
    """Training mode keeps every token (the dropped ones with size 1e-6) and gives the eval logits; the MACs share
    its penalty reads is that of the eval run's token counts."""
    model = _small(macs_target=0.5).eval()
    with torch.no_grad():
        expected = model(images)
    counts = timm_tokcomp.last_stats(model).tokens_per_block
    assert counts[-1] < counts[0]
    model.train()
    got = model(images)
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_per_block == [N_PATCH + 1] * SMALL["depth"]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    params = model.tokcomp["diffrate"]
    share = macs_share(params, params._record)
    cost = model._tokcomp.block_cost
    want = 0.0  # each block's attention on the count entering it (the eval stats), its MLP on what it keeps
    for block in range(SMALL["depth"]):
        kept = params.counts()[block - 1] if block else (N_PATCH, N_PATCH)
        want += cost.macs(counts[block], min(counts[block] - 1, *kept) + 1)
    n = N_PATCH + 1
    assert share.item() == pytest.approx(want / (SMALL["depth"] * cost.macs(n, n)), rel=1e-6)
    assert model.tokcomp["diffrate"].training
    loss = timm_tokcomp.get_reducer(model).method_loss()
    assert loss.item() == pytest.approx(50.0 * (share.item() - 0.5) ** 2, rel=1e-5)
    loss.backward()
    assert params.prune.grad.abs().sum() > 0 and params.merge.grad.abs().sum() > 0


def test_the_measured_macs_of_the_eval_model_are_the_share_the_penalty_reads():
    """Real DeiT-Tiny shape (random weights): the block stack's MACs counted from the run over the plain model's equal
    macs_share of the search forward's record (up to the class-attention row the metric adds)."""
    torch.manual_seed(0)
    plain = timm.create_model("deit_tiny_patch16_224").eval()
    model = timm_tokcomp.apply(copy.deepcopy(plain), "diffrate", macs_target=0.6)
    x = torch.randn(1, 3, 224, 224)
    model.train()
    model(x)
    share = macs_share(model.tokcomp["diffrate"], model.tokcomp["diffrate"]._record).item()
    model.eval()
    cost, n, depth = model._tokcomp.block_cost, 197, 12
    blocks = depth * cost.macs(n, n)
    other = count_macs(plain, x) - blocks
    assert (count_macs(model, x) - other) / blocks == pytest.approx(share, rel=2e-3)


def test_the_search_through_finetune_meets_its_macs_target(image_folder, tmp_path):
    """`tokcomp finetune --distill --lora-rank 0 --method diffrate_m60`: only the rates train; the searched schedule
    (read back from the folder) runs at 60 % of the unreduced blocks' MACs, within 1 %, counted from the run."""
    out = tmp_path / "search"
    config = FinetuneConfig(method="diffrate_m60", epochs=12, warmup_epochs=0, batch_size=10, distill=True, lora_rank=0,
                            lr=0.1, weight_decay=0.0)
    finetune("deit_tiny_patch16_224", str(image_folder), str(out), config=config, show_progress=False, num_workers=0)
    assert (out / "diffrate.safetensors").is_file() and (out / "diffrate_config.json").is_file()
    model = load_finetuned(str(out)).eval()
    schedule = model.tokcomp["diffrate"].schedule()
    torch.manual_seed(0)
    plain = timm.create_model("deit_tiny_patch16_224").eval()
    preset = timm_tokcomp.apply(copy.deepcopy(plain), "diffrate", schedule=schedule)  # the schedule as a preset
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(preset(x), model(x), atol=1e-5, rtol=1e-5)
    cost, n, depth = preset._tokcomp.block_cost, 197, 12
    blocks = depth * cost.macs(n, n)
    other = count_macs(plain, x[:1]) - blocks  # count_macs counts the whole batch
    assert (count_macs(preset, x[:1]) - other) / blocks == pytest.approx(0.6, abs=0.01)


def test_saved_rates_reload_and_refuse_another_model(tmp_path, images):
    model = _small(macs_target=0.4)
    model.train()
    for _ in range(3):  # move the rates off their start
        model(images)
        timm_tokcomp.get_reducer(model).method_loss().backward()
        with torch.no_grad():
            for p in model.tokcomp["diffrate"].parameters():
                p -= 5 * p.grad
                p.grad = None
    model.eval()
    with torch.no_grad():
        expected = model(images)
    save_learned(model.tokcomp["diffrate"], "diffrate", tmp_path)
    rates = load_learned("diffrate", tmp_path)
    assert rates.counts() == model.tokcomp["diffrate"].counts()
    again = _small(rate_params=rates).eval()
    with torch.no_grad():
        assert torch.equal(again(images), expected)
    with pytest.raises(ValueError, match="rates are for 4 blocks of 64 patch tokens; the model has 6 blocks of 64"):
        timm_tokcomp.apply(timm.models.vision_transformer.VisionTransformer(**{**SMALL, "depth": 6}), "diffrate",
                           rate_params=load_learned("diffrate", tmp_path))


@pytest.mark.parametrize("params, match", [
    (dict(schedule={"prune": [64] * 4}), r"schedule must be a dict \{'prune'"),
    (dict(schedule={"prune": [64, 0, 3, 3], "merge": [64] * 4}), r"schedule\['prune'\] must be a non-empty list of integers >= 1"),
    (dict(schedule={"prune": [64] * 4, "merge": [64] * 3}), "one entry per block each, got 4 and 3"),
    (dict(macs_target=0.0), r"macs_target must be a finite number in \(0, 1\]"),
    (dict(macs_target=float("nan")), r"macs_target must be a finite number in \(0, 1\]"),
    (dict(granularity=0), "granularity must be an integer >= 1"),
    (dict(macs_weight=float("inf")), "macs_weight must be a finite number > 0"),
    (dict(prop_attn=False), "prop_attn must stay on"),
    (dict(schedule={"prune": [64] * 4, "merge": [64] * 4}, rate_params=DiffRateParams(4, 64, 4)),
     "give schedule or rate_params, not both"),
])
def test_bad_settings_are_refused_naming_the_parameter(params, match):
    with pytest.raises(ValueError, match=match):
        make_reducer("diffrate", **params)


def test_a_schedule_of_another_depth_is_refused():
    with pytest.raises(ValueError, match=r"schedule needs one entry per block \(4\), got 3"):
        timm_tokcomp.apply(make_model("cls"), "diffrate", schedule={"prune": [64] * 3, "merge": [64] * 3})


def test_a_searched_schedule_in_a_preset_file_deploys_by_name(tmp_path, images):
    from timm_tokcomp.deployment.specs import method_spec
    from timm_tokcomp.deployment.presets import write_preset

    model = _small(macs_target=0.5).eval()
    with torch.no_grad():
        expected = model(images)
    write_preset(tmp_path / "diffrate.json", "diffrate", {"schedule": model.tokcomp["diffrate"].schedule()})
    method, params = method_spec(str(tmp_path / "diffrate.json"))
    torch.manual_seed(0)
    again = timm_tokcomp.apply(make_model("cls"), method, **params).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(images), expected)
