"""open_clip models as the commands' MODEL ('open_clip:ARCH', timm_tokcomp.models.open_clip): the image tower with
CLIP's zero-shot ImageNet head, its weights from --checkpoint, through bench, speed, tune and export; a small
architecture registered with open_clip for the tests."""
import json
import logging
import sys

import pytest
import torch

from conftest import require_data

pytestmark = [pytest.mark.slow]  # commands on open_clip towers

open_clip = pytest.importorskip("open_clip")

ARCH = "tokcomp-test-tiny-ViT"
NAME = f"open_clip:{ARCH}"
CONFIG = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8},
          "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module", autouse=True)
def tiny_arch(tmp_path_factory):
    path = tmp_path_factory.mktemp("open_clip_config") / f"{ARCH}.json"
    path.write_text(json.dumps(CONFIG))
    open_clip.add_model_config(path)


def clip_model(seed=0):
    torch.manual_seed(seed)
    return open_clip.create_model(ARCH).eval()


def images(n=3, seed=1):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_the_tower_scores_imagenet_classes_zero_shot_with_its_own_text_tower():
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from timm_tokcomp.models.build import build_base_model

    tower = build_base_model(NAME, None, False, "cpu")
    clip = clip_model()
    x = images()
    with torch.no_grad():
        scores = tower(x)
        texts = open_clip.get_tokenizer(ARCH)([f"a photo of a {IMAGENET_CLASSNAMES[c]}." for c in (0, 999)])
        expected = clip.logit_scale.exp() * clip.encode_image(x, normalize=True) @ \
            clip.encode_text(texts, normalize=True).T
    assert scores.shape == (3, 1000) and tower.num_classes == 1000
    torch.testing.assert_close(scores[:, [0, 999]], expected, atol=1e-5, rtol=1e-5)
    cfg = tower.pretrained_cfg
    assert cfg["input_size"] == (3, 32, 32) and cfg["interpolation"] == "bicubic" and cfg["crop_pct"] == 1.0
    assert cfg["mean"] == pytest.approx(open_clip.OPENAI_DATASET_MEAN)


def test_the_head_stays_through_apply_and_remove():
    import timm_tokcomp
    from timm_tokcomp.models.build import build_base_model

    tower = build_base_model(NAME, None, False, "cpu")
    x = images()
    with torch.no_grad():
        plain = tower(x)
        reduced = timm_tokcomp.apply(tower, "tome", r=2)(x)
        assert reduced.shape == (3, 1000) and not torch.equal(reduced, plain)
        assert timm_tokcomp.last_stats(tower).tokens_per_block == [17, 15]
        timm_tokcomp.remove(tower)
        torch.testing.assert_close(tower(x), plain, atol=0, rtol=0)


def test_weights_come_from_the_checkpoint(tmp_path, caplog):
    from timm_tokcomp.models.build import build_base_model

    trained = clip_model(seed=5)
    torch.save(trained.state_dict(), tmp_path / "clip.pt")
    caplog.clear()  # open_clip said it of the model just made
    with caplog.at_level(logging.WARNING):
        tower = build_base_model(NAME, str(tmp_path / "clip.pt"), False, "cpu")
        assert "No pretrained weights loaded" not in caplog.text  # open_clip's note, untrue once they are loaded
        build_base_model(NAME, None, False, "cpu")
        assert "No pretrained weights loaded" in caplog.text  # random weights: open_clip says so
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(tower.zero_shot.scale * torch.nn.functional.normalize(trained.encode_image(x))
                                   @ tower.zero_shot.class_embeddings.T, tower(x))
    assert not torch.equal(tower.proj, build_base_model(NAME, None, False, "cpu").proj)
    torch.save({"visual.proj": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="--checkpoint .*other.pt.*holds weights of another model"):
        build_base_model(NAME, str(tmp_path / "other.pt"), False, "cpu")
    state = trained.state_dict()
    state["text_projection"] = torch.full_like(state["text_projection"], float("nan"))  # the tower itself finite
    torch.save(state, tmp_path / "nan_text.pt")
    with pytest.raises(ValueError, match="--checkpoint .*nan_text.pt: the text tower's class embeddings"):
        build_base_model(NAME, str(tmp_path / "nan_text.pt"), False, "cpu")
    state = trained.state_dict()
    state["visual.proj"] = torch.full_like(state["visual.proj"], float("inf"))
    torch.save(state, tmp_path / "inf_image.pt")
    with pytest.raises(ValueError, match="--checkpoint .*inf_image.pt: parameter 'proj' holds NaN or inf"):
        build_base_model(NAME, str(tmp_path / "inf_image.pt"), False, "cpu")


def test_what_the_door_cannot_serve_is_refused_by_name(tmp_path, capsys, monkeypatch):
    from timm_tokcomp.cli import main

    assert main(["speed", "open_clip:ViT-Nope", "--no-progress"]) == 2
    assert "MODEL 'open_clip:ViT-Nope': open_clip has no architecture 'ViT-Nope'" in capsys.readouterr().err
    assert main(["speed", NAME, "--pretrained", "--no-progress"]) == 2
    assert f"MODEL '{NAME}' takes its weights from --checkpoint FILE, not --pretrained" in capsys.readouterr().err
    assert main(["speed", "open_clip:RN50", "--no-progress"]) == 2
    assert "its image tower is open_clip's ModifiedResNet" in capsys.readouterr().err
    assert main(["finetune", NAME, "--data", str(tmp_path), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert f"MODEL {NAME}: tokcomp finetune does not train open_clip towers" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "open_clip", None)
    assert main(["speed", NAME, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"MODEL {NAME} needs open-clip-torch" in err and "[openclip]" in err


def test_speed_bench_tune_and_export_take_an_open_clip_name(tmp_path, capsys, unlabelled_folder):
    from timm_tokcomp.cli import main

    assert main(["speed", NAME, "--methods", "tome_r2", "--batches", "2", "--rounds", "2", "--no-progress"]) == 0
    assert "tome_r2" in capsys.readouterr().out
    assert main(["bench", NAME, "--data", str(unlabelled_folder), "--methods", "none,tome_r2,cubist_r1",
                 "--no-timing", "--batch-size", "16", "--out", str(tmp_path / "b.csv"), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "cubist_r1" in out and "random weights" in err
    rows = (tmp_path / "b.csv").read_text()
    assert rows.count(NAME) == 3
    assert main(["tune", NAME, "--data", str(unlabelled_folder), "--out", str(tmp_path / "tune"), "--limit", "48",
                 "--prune-images", "16", "--methods", "tome_r2", "--rounds", "3", "--no-progress"]) == 0
    assert (tmp_path / "tune" / "preset.json").is_file()
    pytest.importorskip("onnxruntime")
    assert main(["export", f"{NAME}.tome_r2", "--out", str(tmp_path / "m.onnx")]) == 0
    assert (tmp_path / "m.onnx").is_file()


def test_bench_on_real_images_scores_the_imagenet_labels(tmp_path):
    """The zero-shot head predicts ImageNet-1k indices, so a labelled ImageNet folder gives a top-1 (random
    weights: near chance) and agreement with the unreduced row."""
    import csv

    from timm_tokcomp.cli import main

    assert main(["bench", NAME, "--data", str(require_data() / "nips17-1000"), "--limit", "32", "--methods",
                 "none,tome_r2", "--no-timing", "--batch-size", "16", "--out", str(tmp_path / "b.csv"),
                 "--no-progress"]) == 0
    rows = {r["method"]: r for r in csv.DictReader(open(tmp_path / "b.csv"))}
    assert float(rows["none"]["agreement"]) == 100.0 and 0 <= float(rows["tome_r2"]["top1"]) <= 100


def test_a_real_towers_fused_attention_is_counted_as_its_unfused_path():
    """ViT-B-32's real configuration (12 heads of 64): in inference nn.MultiheadAttention takes its fused fast path
    (aten._native_multi_head_attention, projections included), which the 1-head test tower never takes. The MACs
    counted through it equal those of the unfused path, and bench's count of the plain and the reduced tower runs."""
    from timm_tokcomp import apply
    from timm_tokcomp.measure.counting import MacCounter, OpCounter, forward_counting

    torch.manual_seed(0)
    tower = open_clip.create_model("ViT-B-32").visual.eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        with OpCounter() as ops, MacCounter() as fused:
            tower(x)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with MacCounter() as unfused:
                tower(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert ops.counts["aten._native_multi_head_attention.default"] == 12
    assert fused.total == unfused.total == pytest.approx(2 * 4.409e9, rel=1e-3)
    plain = forward_counting(tower, x)[1]
    reduced = forward_counting(apply(tower, "tome", r=3), x)[1]
    assert plain == fused.total and reduced < plain
