"""The shipped PYRA-high Caltech-101 adapter loads with stock peft and scores what its card says."""
import json

import pytest
import timm
import torch

from timm_tokcomp.files.data import open_dataset
from timm_tokcomp.training import load_finetuned
from timm_tokcomp.training.finetune import predict
from conftest import REPO, require_data

SHIPPED = REPO / "hub_cards" / "deit_tiny_patch16_224-caltech101-pyra-high"
pytestmark = [pytest.mark.slow, pytest.mark.realdata]


def test_shipped_adapter_reproduces_its_test_top1():
    data = require_data()
    model = load_finetuned(str(SHIPPED), checkpoint=str(data / "deit_tiny_patch16_224.safetensors"))
    assert type(model).__name__ == "ReducingVisionTransformer" and model.head.out_features == 101
    assert sum(p.numel() for p in model.tokcomp.parameters()) == 7104
    test = open_dataset(data / "caltech101-vtab" / "test" / "labels.csv",
                        timm.data.create_transform(**timm.data.resolve_model_data_config(model)))
    y, pred = predict(model, torch.utils.data.DataLoader(test, batch_size=101), "cpu", False, "")
    card = json.loads((SHIPPED / "tokcomp_finetune.json").read_text())["results"]
    assert 100.0 * (pred == y).float().mean().item() == pytest.approx(card["top1"], abs=1e-6)
    assert "80.10%" in (SHIPPED / "README.md").read_text()
