"""The doors of --hf-model and of weights files, as a user meets them at the command line: a broken folder or file
is one error line naming the flag and the file (exit 2), MODEL and --hf-model are not taken together, a folder named
like a timm architecture never shadows it, a refused run leaves no --out behind, and weights holding NaN are refused
instead of giving 100 % agreement."""
import json

import pytest
import torch

from timm_tokcomp.cli import main
from timm_tokcomp.models.build import HFFolder, build_base_model, is_hf_folder
from test_hf import hf_model, transformers  # noqa: F401 (transformers: the module skips without it)

SPEED = ["--batches", "1", "--rounds", "1", "--methods", "tome_r8", "--no-progress"]


@pytest.fixture
def classifier_folder(tmp_path):
    folder = tmp_path / "vit"
    hf_model("vit_classifier").save_pretrained(folder)
    return folder


def _refused(argv, capsys, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(n in err for n in needles), err


def test_a_truncated_safetensors_or_a_config_of_another_width_is_one_error_line(classifier_folder, capsys):
    weights = classifier_folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:len(whole) // 2])
    _refused(["speed", "--hf-model", str(classifier_folder), *SPEED], capsys,
             f"--hf-model {weights} cannot be read as safetensors")
    weights.write_bytes(whole)
    config = json.loads((classifier_folder / "config.json").read_text())
    (classifier_folder / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    _refused(["speed", "--hf-model", str(classifier_folder), *SPEED], capsys,
             f"--hf-model {classifier_folder}: its weights do not fit the ViTForImageClassification")


@pytest.mark.parametrize("command", ["bench", "speed", "tune"])
def test_model_and_hf_model_together_are_refused(command, classifier_folder, tmp_path, capsys):
    more = ["--data", str(tmp_path), "--out", str(tmp_path / "out")] if command == "tune" else []
    _refused([command, "deit_tiny_patch16_224", "--hf-model", str(classifier_folder), *more, "--no-progress"], capsys,
             "give MODEL or --hf-model FOLDER, not both")


def test_a_folder_named_like_a_timm_architecture_does_not_shadow_it(classifier_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    classifier_folder.rename(tmp_path / "deit_tiny_patch16_224")
    assert not is_hf_folder("deit_tiny_patch16_224") and is_hf_folder(HFFolder("deit_tiny_patch16_224"))
    assert type(build_base_model("deit_tiny_patch16_224", None, False, "cpu")).__name__ == "VisionTransformer"
    hf = build_base_model(HFFolder("deit_tiny_patch16_224"), None, False, "cpu")
    assert type(hf).__name__ == "ViTForImageClassification"


def test_tune_on_a_feature_model_is_refused_before_its_out_folder_exists(tmp_path, capsys):
    from PIL import Image

    folder, data, out = tmp_path / "features", tmp_path / "images", tmp_path / "tuned"
    hf_model("vit").save_pretrained(folder)
    data.mkdir()
    for i in range(12):
        Image.fromarray((torch.rand(40, 40, 3) * 255).to(torch.uint8).numpy()).save(data / f"{i}.jpg")
    with pytest.warns(UserWarning, match="no preprocessor_config.json"):
        _refused(["tune", "--hf-model", str(folder), "--data", str(data), "--out", str(out), "--limit", "12",
                  "--prune-images", "4", "--no-progress"], capsys, "features, no class scores")
    assert not out.exists()


def test_weights_holding_nan_are_refused_naming_the_file(classifier_folder, tmp_path, capsys):
    import timm
    from safetensors.torch import save_file

    state = timm.create_model("deit_tiny_patch16_224").state_dict()
    state["blocks.3.mlp.fc1.weight"][0, 0] = float("nan")
    checkpoint = tmp_path / "nan.safetensors"
    save_file(state, str(checkpoint))
    for command in (["bench", "deit_tiny_patch16_224", "--no-timing"], ["speed", "deit_tiny_patch16_224", *SPEED]):
        _refused(command + ["--checkpoint", str(checkpoint), "--no-progress"], capsys,
                 f"--checkpoint {checkpoint}: parameter 'blocks.3.mlp.fc1.weight' holds NaN or inf")
    model = hf_model("vit_classifier")
    with torch.no_grad():
        model.classifier.weight[0, 0] = float("nan")
    model.save_pretrained(classifier_folder)
    _refused(["speed", "--hf-model", str(classifier_folder), *SPEED], capsys,
             f"--hf-model {classifier_folder}: parameter 'classifier.weight' holds NaN or inf")


def test_class_scores_holding_nan_are_refused():
    from timm_tokcomp.measure.agreement import class_scores

    with pytest.raises(ValueError, match="class scores hold NaN or inf on a batch of 2 images"):
        class_scores(torch.tensor([[0.0, float("nan")], [1.0, 2.0]]))


def test_class_scores_holding_nan_at_the_first_batch_name_the_weights(tmp_path, capsys, monkeypatch):
    """Finite weights whose plain outputs are NaN on real images (an overflowing precision, say): bench and tune stop
    at the first batch, naming the weights' file."""
    import timm
    from PIL import Image
    from safetensors.torch import save_file

    checkpoint = tmp_path / "w.safetensors"
    save_file(timm.create_model("deit_tiny_patch16_224").state_dict(), str(checkpoint))
    data = tmp_path / "images"
    data.mkdir()
    for i in range(6):
        Image.fromarray((torch.rand(40, 40, 3) * 255).to(torch.uint8).numpy()).save(data / f"{i}.jpg")
    monkeypatch.setattr(timm.models.vision_transformer.VisionTransformer, "forward_head",
                        lambda self, x, pre_logits=False: torch.full((x.shape[0], 1000), float("nan")))
    common = ["deit_tiny_patch16_224", "--checkpoint", str(checkpoint), "--data", str(data), "--no-progress"]
    _refused(["bench", *common, "--no-timing", "--methods", "none", "--num-workers", "0"], capsys,
             f"--checkpoint {checkpoint}: the model's class scores hold NaN or inf")
    _refused(["tune", *common, "--out", str(tmp_path / "t"), "--limit", "6", "--prune-images", "2",
              "--methods", "tome_r8"], capsys, f"--checkpoint {checkpoint}: the model's class scores hold NaN or inf")
