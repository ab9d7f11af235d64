"""DyMU: merging every A token above the block's threshold (each image its own count, the batch padded with size-0
tokens and equal image by image), calibration merging a batch's B * r best edges, and the doors' refusals."""
import pytest
import torch

import timm_tokcomp
from timm_tokcomp.commands.calibrate import calibrate_dymu
from timm_tokcomp.cli import main
from timm_tokcomp.ops.matching import alternate_matches
from conftest import SMALL, make_model


def test_each_image_merges_its_own_count_and_the_batch_equals_its_images(images):
    plain = make_model("cls")
    x = plain.norm_pre(plain._pos_embed(plain.patch_embed(images)))
    with torch.no_grad():
        keys = plain.blocks[0].attn.qkv(plain.blocks[0].norm1(x)).view(3, 65, 3, 3, 16)[:, :, 1].mean(dim=2)
        _, _, best = alternate_matches(keys, torch.ones(3, 64, dtype=torch.bool), 1)
        threshold = float(best[best > -1].median())
        model = timm_tokcomp.apply(make_model("cls"), "dymu", thresholds=[threshold, None, threshold, None])
        out = model(images)
    real = timm_tokcomp.last_stats(model).real_tokens_per_block
    assert real[1].tolist() == (65 - (best > threshold).sum(dim=1)).tolist()  # block 0: each image's own count
    assert len(set(real[1].tolist())) > 1  # the images differ
    for i in range(3):
        with torch.no_grad():
            torch.testing.assert_close(model(images[i:i + 1]), out[i:i + 1], atol=1e-5, rtol=1e-5)


def test_calibration_merges_the_batch_best_edges_and_records_the_first_not_taken(images):
    base = make_model("cls")
    result = calibrate_dymu(base, [images], "small", [2, 0, 0, 0])
    assert result.params["thresholds"][1:] == [None, None, None] and 0 <= result.params["thresholds"][0] <= 1
    model = timm_tokcomp.apply(make_model("cls"), "dymu", **result.params)
    with torch.no_grad():
        model(images)
    real = timm_tokcomp.last_stats(model).real_tokens_per_block[1]
    assert int(real.sum()) == 3 * 65 - 3 * 2  # one batch: its threshold merges exactly its 3 * 2 best edges
    assert result.method == "dymu" and result.target_gmacs is None and result.gmacs < result.baseline_gmacs


def test_thresholds_are_checked():
    with pytest.raises(ValueError, match=r"thresholds must be a non-empty list .* number in \[0, 1\] or None"):
        timm_tokcomp.apply(make_model("cls"), "dymu", thresholds=[1.5] * SMALL["depth"])
    with pytest.raises(ValueError, match=r"thresholds must have one entry per block \(4\), got 2"):
        timm_tokcomp.apply(make_model("cls"), "dymu", thresholds=[0.5, 0.5])
    with pytest.raises(ValueError, match="--r must merge in at least one block"):
        calibrate_dymu(make_model("cls"), [torch.zeros(1, 3, 32, 32)], "small", 0)


@pytest.mark.parametrize("args, message", [
    (["--method", "dymu"], "--r is needed with --method dymu"),
    (["--r", "4"], "--r is for --method dymu"),
    ([], "give one of --target-gmacs and --target-ratio"),
    (["--method", "dymu", "--r", "4", "--alpha", "1", "--split-layer", "3"],
     "--alpha, --split-layer: ATM's calibration flags (--method atm); --method dymu takes --r"),
    (["--method", "dymu", "--r", "4", "--tolerance", "0.02"], "--tolerance: ATM's calibration flags"),
])
def test_calibrate_command_names_the_flags_a_method_needs(tmp_path, capsys, args, message):
    code = main(["calibrate", "deit_tiny_patch16_224", "--data", str(tmp_path), "--out", str(tmp_path / "p.json"),
                 *args])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_tokcomp_methods_lists_a_method_without_tags(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "\ndymu\n  tags: none\n  legend: dymu has no tag" in out
    from timm_tokcomp.methods import METHODS

    assert all(f"{name}\n  tags: " in out for name in METHODS)
