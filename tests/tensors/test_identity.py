"""timm_tokcomp.files.identity: weights and image folders identified by content, not by how their paths are spelled."""
import copy

import pytest
import torch

from timm_tokcomp.files.identity import data_digest, weights_digest
from conftest import make_model


def test_weights_digest_follows_every_value_and_nothing_else():
    model = make_model("cls")
    assert weights_digest(model) == weights_digest(copy.deepcopy(model))
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.blocks[2].mlp.fc1.weight[3, 4] += 1e-6
    assert weights_digest(changed) != weights_digest(model)
    assert weights_digest(model.bfloat16()) != weights_digest(make_model("cls"))  # the dtype is part of it


def test_data_digest_is_the_same_for_every_spelling_and_differs_for_other_images(image_folder, tmp_path, monkeypatch):
    digest = data_digest(image_folder)
    monkeypatch.chdir(image_folder.parent)
    assert data_digest(image_folder.name) == data_digest(f"./{image_folder.name}/") == digest
    copied = tmp_path / "copy"
    copied.mkdir()
    for file in image_folder.iterdir():
        (copied / file.name).write_bytes(file.read_bytes())
    (copied / ".hidden_note.txt").write_text("not data")
    assert data_digest(copied) == digest  # moved or copied: the same images
    first = sorted(copied.iterdir())[1]
    first.write_bytes(first.read_bytes() + b"\0")
    assert data_digest(copied) != digest
    (copied / "labels.csv").write_text("file,label\n")
    assert data_digest(copied) == data_digest(copied / "labels.csv")  # what the loaders read for that folder
    with pytest.raises(FileNotFoundError, match="--eval-data: .*missing not found"):
        data_digest(tmp_path / "missing", "--eval-data")


def test_a_quantised_model_is_identified_by_its_integer_weights():
    import warnings

    quantize_dynamic = pytest.importorskip("torch.ao.quantization").quantize_dynamic
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first, again, other = (quantize_dynamic(make_model("cls", seed=s), {torch.nn.Linear}, dtype=torch.qint8)
                               for s in (0, 0, 1))
    assert weights_digest(first) == weights_digest(again) != weights_digest(other)
