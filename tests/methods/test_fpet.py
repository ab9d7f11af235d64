"""FPET: the checkerboard split, the merge against a loop definition on the refined metric, the 1-bit adapter, the
training forward (hard matches) against the eval forward with the gradient reaching the adapter, `tokcomp finetune`
with LoRA, and refusals."""
import pytest
import torch
import torch.nn.functional as F

import timm_tokcomp
from conftest import SMALL, make_model
from timm_tokcomp.methods import make_reducer
from timm_tokcomp.methods.fpet import BinaryLinear, FPETParams, GridSetting, checkerboard
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned

SIDE = SMALL["img_size"] // SMALL["patch_size"]


def test_the_checkerboard_puts_top_left_and_bottom_right_of_every_2x2_cell_in_a():
    a, b = checkerboard(14, 14, torch.device("cpu"))
    assert len(a) == len(b) == 98 and sorted(a.tolist() + b.tolist()) == list(range(196))
    assert {0, 15, 2, 17}.issubset(set(a.tolist())) and {1, 14, 3, 16}.issubset(set(b.tolist()))
    a, b = checkerboard(3, 3, torch.device("cpu"))
    assert a.tolist() == [0, 2, 4, 6, 8] and b.tolist() == [1, 3, 5, 7]


@pytest.mark.parametrize("p", [1, 4])
def test_every_a_token_merges_into_its_most_similar_b_token_on_the_refined_keys(p):
    torch.manual_seed(0)
    B, n, d = 2, 36, 8
    keys, x = torch.randn(B, p + n, d), torch.randn(B, p + n, 5)
    size = torch.randint(1, 3, (B, p + n, 1)).float()
    method = make_reducer("fpet")
    method.adapter_params = FPETParams(d).eval()
    with torch.no_grad():
        method.adapter_params.up.weight.normal_()  # a refinement that changes the matches
        plan = method.plan(keys, GridSetting(6, 6), p, size)
        got_x, got_size, _ = plan.apply(x, size, None)
        refined = method.adapter_params(keys)
    a, b = checkerboard(6, 6, keys.device)
    assert got_x.shape == (B, p + len(b), 5)
    for i in range(B):
        members = {int(j): [p + int(j_pos)] for j, j_pos in enumerate(b)}
        for a_pos in a.tolist():
            sims = [float(F.cosine_similarity(refined[i, p + a_pos], refined[i, p + int(j)], dim=0)) for j in b]
            members[max(range(len(b)), key=lambda k: (sims[k], -k))].append(p + a_pos)
        want_x = torch.stack([sum(size[i, m] * x[i, m] for m in members[j]) / sum(size[i, m] for m in members[j])
                              for j in range(len(b))])
        torch.testing.assert_close(got_x[i, :p], x[i, :p])
        torch.testing.assert_close(got_x[i, p:], want_x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_size[i, p:, 0], torch.stack([sum(size[i, m, 0] for m in members[j])
                                                                    for j in range(len(b))]))


def test_the_adapter_has_1_bit_weights_and_a_straight_through_gradient():
    torch.manual_seed(0)
    layer = BinaryLinear(8, 4)
    x = torch.randn(3, 8)
    out = layer(x)
    w = layer.weight
    used = torch.where(w >= w.mean(), w.mean() + w.std(), w.mean() - w.std())
    torch.testing.assert_close(out, F.linear(x, used, layer.bias))
    out.sum().backward()
    assert layer.weight.grad.abs().sum() > 0


def test_training_merges_as_eval_does_and_the_gradient_reaches_the_adapter(images):
    torch.manual_seed(0)
    model = timm_tokcomp.apply(make_model("cls"), "fpet").eval()
    adapter = model.tokcomp["fpet"]
    with torch.no_grad():
        adapter.up.weight.normal_()
        expected = model(images)
    assert timm_tokcomp.last_stats(model).tokens_out == 1 + SIDE * SIDE // 2
    model.train()
    adapter.dropout.p = 0.0  # the same metric as in eval mode
    got = model(images)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got.logsumexp(-1).sum().backward()
    assert adapter.down.weight.grad.abs().sum() > 0 and adapter.up.weight.grad.abs().sum() > 0


def test_fpet_trains_with_lora_through_finetune_and_reloads(image_folder, tmp_path):
    out = tmp_path / "fpet"
    config = FinetuneConfig(method="fpet", epochs=1, warmup_epochs=0, batch_size=10, distill=True)
    finetune("deit_tiny_patch16_224", str(image_folder), str(out), config=config, show_progress=False, num_workers=0)
    assert (out / "adapter_config.json").is_file() and (out / "fpet.safetensors").is_file()
    model = load_finetuned(str(out)).eval()
    torch.manual_seed(0)
    start = FPETParams(64)
    assert not torch.equal(model.tokcomp["fpet"].down.weight, start.down.weight)  # trained
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    assert timm_tokcomp.last_stats(model).tokens_per_block[7] == 99


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="adapter_params needs refine=True"):
        make_reducer("fpet", refine=False, adapter_params=FPETParams(16))
    with pytest.raises(ValueError, match="layer must be a block index >= 0"):
        make_reducer("fpet", layer=-1)
    with pytest.raises(ValueError, match=r"layer must be a block of this model, 0..3, got 4"):
        timm_tokcomp.apply(make_model("cls"), "fpet", layer=4)
    with pytest.raises(ValueError, match="adapter is for keys 64 wide; the model's heads are 16 wide"):
        timm_tokcomp.apply(make_model("cls"), "fpet", adapter_params=FPETParams(64))


def test_fpet_without_its_adapter_trains_lora_and_reloads_with_no_method_files(image_folder, tmp_path):
    out = tmp_path / "plain_merge"
    config = FinetuneConfig(method="fpet_norefine", epochs=1, warmup_epochs=0, batch_size=10, distill=True)
    finetune("deit_tiny_patch16_224", str(image_folder), str(out), config=config, show_progress=False, num_workers=0)
    assert (out / "adapter_config.json").is_file() and not (out / "fpet.safetensors").exists()
    model = load_finetuned(str(out))
    assert not hasattr(model, "tokcomp") or "fpet" not in model.tokcomp
    with pytest.raises(ValueError, match="--lora-rank 0"):
        FinetuneConfig(method="fpet_norefine", lora_rank=0, distill=True).validate()
