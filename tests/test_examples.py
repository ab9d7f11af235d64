"""The example scripts run, and the segmentation example's mIoU is right on hand-made maps."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow]  # the examples run

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mean_iou_on_hand_made_maps():
    seg = _load("segmentation")
    target = torch.tensor([[[0, 0, 1, 1]]])
    assert seg.mean_iou(target.clone(), target, 3) == 1.0
    pred = torch.tensor([[[0, 1, 1, 1]]])  # class 0: 1/2, class 1: 2/3, class 2 absent from both
    assert seg.mean_iou(pred, target, 3) == pytest.approx((1 / 2 + 2 / 3) / 2)


def test_segmentation_example_trains_one_step(capsys):
    _load("segmentation").main(["--size", "64", "--steps", "1", "--r", "1"])
    out = capsys.readouterr().out
    assert "step 0: loss" in out and "logits (2, 4, 64, 64)" in out


def test_dense_benchmark_runs_on_a_small_model(capsys):
    _load("bench_dense").main(["--model", "vit_tiny_patch16_224", "--img-size", "64", "--batch-size", "1",
                               "--rounds", "1", "--rs", "0,1"])
    out = capsys.readouterr().out
    assert "f_mlp" in out and "r=1 torch" in out and "eta" in out


def test_tocom_deployment_example_switches_and_restores(capsys):
    _load("tocom_deploy").main(["--limit", "2", "--batch-size", "2", "--loads", "0.4,1.6"])
    out = capsys.readouterr().out
    assert "with ToCom" in out and "without ToCom" in out
    assert "bit-identical to the original" in out


def test_dense_backbone_example_builds_the_pyramid_and_counts_fewer_macs(capsys):
    _load("dense_backbone").main(["--model", "vit_tiny_patch16_224", "--size", "128", "--r", "1"])
    out = capsys.readouterr().out
    assert "(192, 32, 32) (stride 4)" in out and "(192, 4, 4) (stride 32)" in out
    plain, dense = map(float, re.search(r"plain ([\d.]+), dense_tome_r1 ([\d.]+)", out).groups())
    assert dense < plain


def test_learned_methods_example_trains_and_compares_with_the_untrained_start(tmp_path, capsys):
    """A stand-in data folder (random DeiT-Tiny weights, 10 photos, two labelled sets of 3 images): the run
    trains, the untrained start is rebuilt, and the table and paired notes are written."""
    import csv

    import timm
    from PIL import Image
    from safetensors.torch import save_file

    data = tmp_path / "data"
    torch.manual_seed(0)
    save_file(timm.create_model("deit_tiny_patch16_224").state_dict(), str(data.mkdir() or data / "deit_tiny_patch16_224.safetensors"))
    g = torch.Generator().manual_seed(0)
    (data / "photos-3000").mkdir()
    for i in range(10):
        pixels = (torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels).save(data / "photos-3000" / f"p{i:02d}.jpg")
    for name in ("imagenet-val-1300", "nips17-1000"):
        (data / name / "images").mkdir(parents=True)
        for i in range(3):
            Image.fromarray((torch.rand(48, 48, 3, generator=g) * 255).to(torch.uint8).numpy()).save(
                data / name / "images" / f"{i}.jpg")
        with open(data / name / "labels.csv", "w", newline="") as f:
            csv.writer(f).writerows([("file", "label"), *((f"{i}.jpg", i) for i in range(3))])
    argv = ["--data", str(data), "--out", str(tmp_path / "out"), "--methods", "patchmerger_k70,dynamicvit_k70", "--epochs", "1",
            "--batch-size", "4", "--holdout", "2"]
    assert _load("learned_methods").main(argv) == 0
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| `patchmerger_k70` | untrained |" in text and "| `patchmerger_k70` | trained |" in text
    assert "pooled: trained vs untrained, top-1 +" in text and "| `dynamicvit_k70` | trained |" in text
    assert len(list((tmp_path / "out" / "photos" / "heldout").iterdir())) == 2


def test_kernel_paths_example_compares_both_paths_image_by_image(capsys):
    from conftest import require_data

    data = require_data()
    _load("kernel_paths_agree").main(["--checkpoint", str(data / "deit_tiny_patch16_224.safetensors"), "--data",
                                      str(data / "imagenet-val-1300"), "--method", "evit", "--r", "8", "--limit", "2",
                                      "--batch-size", "2"])
    out = capsys.readouterr().out
    assert "same top-1: 2/2" in out and "images with one above 1e-3: 0" in out
    torch_right, triton_right = map(int, re.search(r"top-1 right: torch (\d+), triton (\d+)", out).groups())
    assert torch_right == triton_right


def test_study_paired_example_counts_images_gained_and_lost_per_set_and_pooled():
    from timm_tokcomp.measure.stats import mcnemar_exact_p

    study = _load("study_paired")
    right = {"imagenet-val-1300": {"dpcknn_k50": torch.tensor([1, 1, 1, 0], dtype=torch.bool),
                                   "topk_k50": torch.tensor([1, 0, 0, 1], dtype=torch.bool)},
             "nips17-1000": {"dpcknn_k50": torch.tensor([1, 0], dtype=torch.bool),
                             "topk_k50": torch.tensor([0, 0], dtype=torch.bool)}}
    rows = study.paired_rows(right, [("dpcknn", "topk")], [0.5])
    by_set = {r["set"]: r for r in rows}
    assert (by_set["imagenet-val-1300"]["gained"], by_set["imagenet-val-1300"]["lost"]) == (2, 1)
    assert (by_set["nips17-1000"]["gained"], by_set["nips17-1000"]["lost"]) == (1, 0)
    pooled = by_set["pooled"]
    assert (pooled["images"], pooled["gained"], pooled["lost"]) == (6, 3, 1)
    assert pooled["top1_first"] == pytest.approx(400 / 6) and pooled["p"] == mcnemar_exact_p(3, 1)


def test_fpet_example_reports_both_arms_image_by_image(tmp_path, monkeypatch):
    """Two stand-in finished runs: the table shows each arm and the paired count of images only one gets right."""
    import json
    import sys

    monkeypatch.syspath_prepend(str(EXAMPLES))  # the example imports pyra_downstream beside it
    fpet = _load("fpet_downstream")
    labels = [0, 1, 2, 3]
    for arm, preds, top1 in (("g_fpet", [0, 1, 2, 0], 75.0), ("h_fpet_norefine", [0, 0, 0, 3], 50.0)):
        folder = tmp_path / f"{arm}_seed0"
        (folder / "training").mkdir(parents=True)
        (folder / "tokcomp_finetune.json").write_text(json.dumps(
            {"results": {"top1": top1, "gmacs": 0.9, "train_seconds": 60.0}}))
        rows = "".join(f"img{i}.jpg,{y},{p}\n" for i, (y, p) in enumerate(zip(labels, preds)))
        (folder / "training" / "predictions.csv").write_text("file,label,prediction\n" + rows)
    table = fpet.report(tmp_path)
    assert "| g_fpet | fpet | 0 | 75.00 | 0.9000 | 1.0 |" in table
    assert "2 test images right only with the adapter, 1 only without it" in table
    assert "pyra_downstream" in sys.modules
