"""The example scripts run, and the segmentation example's mIoU is right on hand-made maps."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch

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
