"""Recording (the notes' depth check values, assignments equal to the model's own source map), the overlay
picture, and `tokcomp analyze` end to end: files, resume reusing recordings, refusals."""
import csv

import numpy as np
import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.commands.analyze.plots import DROPPED_GREY, overlay
from timm_tokcomp.commands.analyze.record import record
from timm_tokcomp.commands.analyze.report import run_analysis
from timm_tokcomp.cli import main

pytestmark = [pytest.mark.slow]  # analyze runs


@pytest.fixture(scope="module")
def deit_tiny():
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224").eval()


@pytest.fixture(scope="module")
def photos():
    return torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("keep_rate, mean_depth", [(0.9, 10.29), (0.7, 7.59), (0.5, 5.62), (0.25, 3.98)])
def test_depth_of_a_fixed_count_pruner_matches_the_notes(deit_tiny, photos, keep_rate, mean_depth):
    timm_tokcomp.apply(deit_tiny, "topk", keep_rate=keep_rate)
    rec = record(deit_tiny, "topk", [photos])
    assert rec.depth.mean() == pytest.approx(mean_depth, abs=0.005)
    assert (rec.depth.mean(axis=1) == rec.depth.mean()).all()  # a fixed count: the same in every image


def test_assignments_follow_the_models_own_source_map(deit_tiny, photos):
    timm_tokcomp.apply(deit_tiny, "tome", r=16, trace_source=True)
    rec = record(deit_tiny, "tome", [photos])
    with torch.no_grad():
        deit_tiny(photos)
    source = timm_tokcomp.last_stats(deit_tiny).source[:, :, 1:]  # (B, tokens, patches): which token holds each patch
    assert np.array_equal(rec.assign[:, -1], source.argmax(dim=1).numpy())
    assert rec.features.shape == (2, 192) and rec.assign.shape == (2, 12, 196)
    timm_tokcomp.apply(deit_tiny, "tome", r=0)
    assert (record(deit_tiny, "tome", [photos]).depth == 12).all()


def test_own_patches_of_a_block_that_reduced_nothing(deit_tiny, photos):
    """After a block that reduced nothing every patch is its own token, held by token 1 .. P (the prefix counted):
    `own` once indexed past its count there (MCTF reduces at the start of the next block, so `tokcomp analyze`
    compared such a block against ToMe's)."""
    timm_tokcomp.apply(deit_tiny, "mctf", keep_rate=0.7)
    rec = record(deit_tiny, "mctf", [photos])
    assert rec.assign[:, 2].max() == 196 and rec.own(2).all()  # block 3 (1-based) has not reduced yet
    assert not rec.own(3).all()


def test_overlay_colours_groups_greys_dropped_and_keeps_single_patches():
    image = np.full((4, 4, 3), 0.5)
    assign = np.array([0, 0, 1, -1])  # 2 x 2 grid of 2 x 2 pixel patches: a group of two, a single, a dropped one
    out = overlay(image, assign, (2, 2))
    assert not np.allclose(out[0:2, 0:1], 0.5)  # the group is painted
    assert np.allclose(out[2, 0], 0.5)  # the single patch's interior pixel is untouched
    assert np.allclose(out[2:4, 2:4], DROPPED_GREY + 0.25 * 0.5)


def _run(folder, out, **kwargs):
    kwargs = {"limit": 6, "batch_size": 3, "overlays": 1, "show_progress": False, **kwargs}
    return run_analysis("deit_tiny_patch16_224", kwargs.pop("methods", ["tome_r8", "evit_r8", "topk_k70"]),
                        str(folder), str(out), **kwargs)


def test_analyze_writes_the_report_and_resumes_from_its_recordings(image_folder, tmp_path, monkeypatch):
    """A resume reuses the recordings made on the same weights and images (by content: other weights, here the
    random ones of a run without --checkpoint, are recorded again)."""
    import timm

    out, weights = tmp_path / "report", tmp_path / "weights.pth"
    torch.manual_seed(1)  # not build_base_model's seed for random weights
    torch.save(timm.create_model("deit_tiny_patch16_224").state_dict(), weights)
    rows = _run(image_folder, out, checkpoint=str(weights))
    names = sorted(p.name for p in out.iterdir())
    assert names == ["depth_maps.png", "metric_matrices.png", "metrics.csv", "overlay_evit_r8.png",
                     "overlay_tome_r8.png", "overlay_topk_k70.png", "records", "report.md"]
    with open(out / "metrics.csv") as f:
        saved = list(csv.DictReader(f))
    assert len(saved) == len(rows) == 3 * (4 * 5 + 4 + 2)  # 3 pairs: 4 blocks x 5 per-image metrics, depth, features
    assert {r["metric"] for r in saved} >= {"nmi", "iou", "depth_emd", "cka", "procrustes"}
    report = (out / "report.md").read_text()
    assert "![depth maps](depth_maps.png)" in report and "`tome_r8` / `evit_r8`" in report

    with pytest.raises(FileExistsError, match="--resume"):
        _run(image_folder, out)
    real_record = __import__("timm_tokcomp.commands.analyze.report", fromlist=["record"]).record
    monkeypatch.setattr("timm_tokcomp.commands.analyze.report.record", lambda *a, **k: pytest.fail("recorded again"))
    again = _run(image_folder, out, resume=True, overlays=0, checkpoint=str(weights))
    assert [r.value for r in again] == [r.value for r in rows]
    assert not list(out.glob("overlay_*.png"))  # not drawn this time, so none of the last run's is left
    recorded = []
    monkeypatch.setattr("timm_tokcomp.commands.analyze.report.record", lambda model, name, *a: recorded.append(name) or
                        real_record(model, name, *a))
    _run(image_folder, out, resume=True, overlays=0)  # random weights: other ones than the checkpoint's
    assert sorted(recorded) == ["evit_r8", "tome_r8", "topk_k70"]


@pytest.mark.parametrize("methods, match", [
    (["tome_r8"], "two or more different methods"),
    (["tome_r8", "none"], "'none' reduces nothing"),
    (["tome_r8", "tome_x"], "--methods: unknown token-reduction tag"),
    (["tome_r8", "dense_tome_r8"], "keeps every token"),
])
def test_analyze_refuses_bad_methods(image_folder, tmp_path, methods, match):
    with pytest.raises(ValueError, match=match):
        _run(image_folder, tmp_path / "out", methods=methods)
    assert not (tmp_path / "out").exists()


def test_cli_analyze(image_folder, tmp_path, capsys):
    code = main(["analyze", "deit_tiny_patch16_224", "--data", str(image_folder), "--limit", "4", "--methods",
                 "tome_r4,evit_r4", "--overlays", "0", "--out", str(tmp_path / "cli"), "--no-progress"])
    assert code == 0 and "report.md" in capsys.readouterr().out
    assert main(["analyze", "deit_tiny_patch16_224", "--data", str(image_folder), "--methods", "tome_r4",
                 "--out", str(tmp_path / "bad")]) == 2

