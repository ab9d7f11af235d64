"""ONNX export (`tokcomp export`, timm_tokcomp.deployment.onnx) checked in onnxruntime, and `tokcomp bench --modes`."""
import csv

import pytest
import timm
import torch

import timm_tokcomp
from conftest import reducing_setting
from timm_tokcomp.methods import METHODS
from timm_tokcomp.cli import main
from timm_tokcomp.deployment.onnx import compare_onnxruntime, export_onnx
from conftest import SMALL, real_model_and_images, require_data

pytestmark = [pytest.mark.slow]  # ONNX export per method

for module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(module, reason=f"{module} is not installed (pip install 'timm-tokcomp[export]')")


@pytest.mark.realdata
def test_export_real_deit_tiny_tome_r16_matches_pytorch_on_real_images_at_any_batch(tmp_path, capsys):
    data = require_data()
    out = tmp_path / "tome_r16.onnx"
    weights = str(data / "deit_tiny_patch16_224.safetensors")
    assert main(["export", "deit_tiny_patch16_224.tome_r16", "--checkpoint", weights, "--out", str(out)]) == 0
    assert "max |ONNX - PyTorch|" in capsys.readouterr().out
    model, images = real_model_and_images("deit_tiny_patch16_224.tome_r16", 16)
    for batch in (images, images[:1]):  # exported with a batch of 2: the batch dimension is dynamic
        diff, shape = compare_onnxruntime(model, str(out), batch)
        assert shape == (len(batch), 1000) and diff < 1e-4


STAGES = {"keep_rate": 0.5, "stages": (2, 3)}


def _exportable_settings():
    """Every method that declares itself exportable (a new one included): its study form where it has one, else
    r; and the r forms and variants of their own."""
    settings = [(name, reducing_setting(cls, 2 if cls.spec.dense else 4, STAGES))
                for name, cls in METHODS.items() if cls.exportable()]
    return settings + [("evit", {"r": 3}), ("dense_tome", {"k": 8}), ("pyra", {"r": 4, "form": "pooled"}),
                       *[(name, {"r": 4}) for name in ("tome", "pyra", "tofu", "pitome", "dct", "atc", "mctf")],
                       ("repshift", {"r": 4, "shift_at": "attn"})]


@pytest.mark.parametrize("method, params", _exportable_settings())
def test_fixed_setting_methods_export(tmp_path, method, params):
    torch.manual_seed(0)
    model = timm_tokcomp.apply(timm.models.vision_transformer.VisionTransformer(**SMALL).eval(), method, **params)
    for name, p in model.named_parameters():
        if name.startswith("tokcomp."):  # learned parameters away from their init (PYRA's would equal ToMe)
            p.data.normal_(0, 0.5)
    with torch.no_grad():  # as a deployment script exports: the plan, not the compiled step's operators
        path = export_onnx(model, str(tmp_path / "m.onnx"), torch.randn(2, 3, 32, 32))
    diff, shape = compare_onnxruntime(model, path, torch.randn(5, 3, 32, 32))
    assert shape == (5, 10) and diff < 1e-4
    assert not any(blk.attn.fused_attn is False for blk in model.blocks)  # the caller's model is unchanged


def test_export_refuses_what_it_cannot_do(tmp_path, capsys):
    model = timm.create_model("deit_tiny_patch16_224.atm")
    with pytest.raises(ValueError, match="'atm' cannot be exported.*counted from the data.*tome, evit"):
        export_onnx(model, str(tmp_path / "a.onnx"), torch.randn(2, 3, 224, 224))
    for tag in ("ats_k70", "kmedoids_k70"):
        with pytest.raises(ValueError, match=f"'{tag[:-4]}' cannot be exported"):
            export_onnx(timm.create_model(f"deit_tiny_patch16_224.{tag}"), str(tmp_path / "a.onnx"),
                        torch.randn(2, 3, 224, 224))
    with pytest.raises(ValueError, match="B >= 2"):
        export_onnx(timm.create_model("deit_tiny_patch16_224.tome_r8"), str(tmp_path / "a.onnx"), torch.randn(1, 3, 224, 224))
    (tmp_path / "taken.onnx").write_text("keep")
    assert main(["export", "deit_tiny_patch16_224", "--method", "tome_r8", "--out", str(tmp_path / "taken.onnx")]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "taken.onnx").read_text() == "keep"
    assert main(["export", "deit_tiny.tome_r8", "--method", "tome_r4", "--out", str(tmp_path / "b.onnx")]) == 2
    assert "already carries a method tag" in capsys.readouterr().err


def test_bench_onnx_backend_reports_throughput_and_latency(tmp_path, capsys):
    out = tmp_path / "r.csv"
    assert main(["bench", "test_vit", "--methods", "tome_r8", "--modes", "onnx", "--batch-size", "2",
                 "--rounds", "1", "--latency-runs", "3", "--no-progress", "--out", str(out)]) == 0
    assert "mode onnx, latency: 3 single-image forwards" in capsys.readouterr().out
    rows = list(csv.DictReader(open(out)))
    assert [r["backend"] for r in rows] == ["onnx", "onnx"]
    assert float(rows[0]["latency_speedup"]) == 1.0
    assert float(rows[1]["latency_ms"]) > 0 and float(rows[1]["latency_p90_ms"]) >= float(rows[1]["latency_ms"])
    assert main(["bench", "deit_tiny_patch16_224", "--methods", "atm", "--modes", "onnx"]) == 2
    assert "atm cannot be exported" in capsys.readouterr().err
    assert main(["bench", "deit_tiny_patch16_224", "--modes", "onnx", "--dtype", "bf16"]) == 2
    assert "--modes onnx runs fp32" in capsys.readouterr().err


@pytest.mark.parametrize("name, method, params", [("pe_core_rope_map", "tome", {"r": 3}),
                                                  ("ropevit_mixed", "tome", {"r": 3, "rope_merge": "centroid"}),
                                                  ("siglip_map", "tome", {"r": 3}),
                                                  ("dinov3_registers", "dense_tome", {"k": 4})])
def test_the_newer_families_export(tmp_path, name, method, params):
    """Rope rows recomputed from travelling coordinates, the sized attention pool and the dense Eva block export."""
    from conftest import family_model

    model = timm_tokcomp.apply(family_model(name), method, **params)
    with torch.no_grad():  # as a deployment script exports: the plan, not the compiled step's operators
        path = export_onnx(model, str(tmp_path / "m.onnx"), torch.randn(2, 3, 32, 32))
    diff, shape = compare_onnxruntime(model, path, torch.randn(5, 3, 32, 32))
    assert shape == (5, 10) and diff < 1e-4


@pytest.mark.parametrize("method, params", [("cubist", {"r_rows": 2, "r_cols": 3}), ("dense_tome", {"k": 8})])
def test_sam_encoders_export(tmp_path, method, params):
    """SAM's windows, padding and relative positions on the merged grid, and the cells spread back before the neck."""
    torch.manual_seed(0)
    model = timm.create_model("samvit_base_patch16", img_size=224, embed_dim=32, depth=4, num_heads=2,
                              global_attn_indexes=(1, 3), neck_chans=16, num_classes=10)
    model = timm_tokcomp.apply(model, method, **params)
    path = export_onnx(model, str(tmp_path / "m.onnx"), torch.randn(2, 3, 224, 224))
    diff, shape = compare_onnxruntime(model, path, torch.randn(3, 3, 224, 224))
    assert shape == (3, 10) and diff < 1e-4


def test_an_open_clip_tower_exports(tmp_path):
    """open_clip's MultiheadAttention run through SDPA with the log-size bias, the class-token pool and proj."""
    pytest.importorskip("open_clip", reason="open_clip is not installed (pip install 'timm-tokcomp[openclip]')")
    from open_clip.transformer import VisionTransformer

    torch.manual_seed(0)
    visual = VisionTransformer(image_size=64, patch_size=16, width=32, layers=3, heads=2, mlp_ratio=4., output_dim=24)
    model = timm_tokcomp.apply(visual, "tome", r=3)
    path = export_onnx(model, str(tmp_path / "m.onnx"), torch.randn(2, 3, 64, 64))
    diff, shape = compare_onnxruntime(model, path, torch.randn(3, 3, 64, 64))
    assert shape == (3, 24) and diff < 1e-4
