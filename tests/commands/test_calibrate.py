"""ATM budget calibration: hits the target on the given images, clear errors, preset files, CLI."""
import json

import pytest
import torch
from PIL import Image

import timm_tokcomp
from timm_tokcomp.commands.calibrate import calibrate, save_preset
from timm_tokcomp.deployment.presets import load_preset
from timm_tokcomp.cli import main
from timm_tokcomp.measure.counting import count_macs
from conftest import SMALL, make_model

pytestmark = [pytest.mark.slow]  # calibration searches


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.randn(16, 3, 4, 4, generator=g), size=SMALL["img_size"], mode="bilinear")
    return list((smooth + 0.3 * torch.randn(16, 3, SMALL["img_size"], SMALL["img_size"], generator=g)).split(8))


def test_calibration_hits_the_target_and_the_preset_reproduces_it(batches, tmp_path):
    base = make_model("cls")
    result = calibrate(base, batches, "small", target_ratio=0.7, tolerance=0.03)
    assert result.gmacs == pytest.approx(0.7 * result.baseline_gmacs, rel=0.03)
    assert 0.0 <= result.agreement <= 100.0 and result.images == 16
    assert not timm_tokcomp.is_reduced(base)
    path = tmp_path / "preset.json"
    save_preset(result, str(path))
    method, params = load_preset(str(path))
    model = timm_tokcomp.apply(make_model("cls"), method, **params)
    macs = sum(count_macs(model, x) for x in batches) / 16 / 1e9
    assert macs == pytest.approx(result.gmacs, rel=1e-9)
    assert json.loads(path.read_text())["calibration"]["target_gmacs"] == pytest.approx(result.target_gmacs)


def test_out_of_reach_target_names_the_reachable_range(batches):
    with pytest.raises(ValueError, match="out of reach: ATM with alpha=1.0 spans"):
        calibrate(make_model("cls"), batches, "small", target_ratio=0.05)
    with pytest.raises(ValueError, match="out of reach"):
        calibrate(make_model("cls"), batches, "small", target_ratio=0.999)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of"),
    (dict(target_ratio=0.5, target_gmacs=1.0), "exactly one of"),
    (dict(target_ratio=1.2), r"--target-ratio must be a finite number in \(0, 1\)"),
    (dict(target_gmacs=-1.0), "--target-gmacs must be a finite number > 0"),
    (dict(target_gmacs=float("inf")), "--target-gmacs must be a finite number > 0"),
    (dict(target_ratio=0.5, tolerance=0.0), "--tolerance"),
    (dict(target_ratio="0.5"), r"--target-ratio must be a finite number in \(0, 1\).*got '0.5'"),
    (dict(target_gmacs="1"), "--target-gmacs must be a finite number"),
    (dict(target_ratio=0.5, tolerance="0.1"), "--tolerance"),
    (dict(target_ratio=0.5, alpha=None), "--alpha must be a finite number"),
    (dict(target_ratio=0.5, betas="0.1"), "betas must be a non-empty list"),
    (dict(target_ratio=0.5, max_bisections=0), "max_bisections must be an integer >= 1"),
])
def test_bad_calibration_arguments(batches, kwargs, match):
    with pytest.raises(ValueError, match=match):
        calibrate(make_model("cls"), batches, "small", **kwargs)


@pytest.mark.parametrize("bad, match", [([torch.empty(0, 3, 32, 32)], r"batches\[0\] must be .*B >= 1"),
                                        ([torch.randn(3, 32, 32)], r"batches\[0\] must be a \(B, 3, H, W\)"),
                                        (["images"], r"batches\[0\] must be .*got str"),
                                        ([], "no calibration images")])
def test_batches_that_hold_no_images_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        calibrate(make_model("cls"), bad, "small", target_ratio=0.5)


def test_load_preset_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"alpha": 1}')
    with pytest.raises(ValueError, match="not a tokcomp preset"):
        load_preset(str(bad))
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_preset(str(bad))
    bad.write_text('{"format": 1, "method": "magic", "params": {}}')
    with pytest.raises(ValueError, match=f"preset file {bad} names method 'magic', which is not one of none, tome"):
        load_preset(str(bad))


def test_calibrate_cli_on_a_plain_image_folder(tmp_path, capsys):
    folder = tmp_path / "unlabeled"
    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        arr = (torch.rand(8, 8, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(arr).resize((64, 64), Image.BILINEAR).save(folder / f"img{i}.jpeg")
    out = tmp_path / "p.json"
    args = ["calibrate", "deit_tiny", "--data", str(folder), "--batch-size", "3", "--num-workers", "0",
            "--no-progress", "--out", str(out), "--tolerance", "0.05"]
    assert main(args + ["--target-ratio", "0.02"]) == 2
    assert "out of reach" in capsys.readouterr().err
    assert main(args + ["--target-ratio", "0.75"]) == 0
    printed = capsys.readouterr().out
    assert "on 6 images" in printed and str(out) in printed
    method, params = load_preset(str(out))
    assert method == "atm" and set(params) == {"alpha", "beta", "theta_min", "split_layer"}
