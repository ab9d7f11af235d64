"""`tokcomp bench` end to end on tiny inputs: table, CSV, plot, both dataset layouts, errors."""
import csv

import pytest
import torch
from PIL import Image

from timm_tokcomp.deployment.specs import method_spec, parse_methods
from timm_tokcomp.measure.stats import mcnemar_exact_p
from timm_tokcomp.commands.calibrate import CalibrationResult, save_preset
from timm_tokcomp.cli import main

# one timed batch and two single-image forwards per model (the default 30 would be most of a test's time in bf16)
FAST = ["--batch-size", "4", "--rounds", "1", "--latency-runs", "2", "--num-workers", "0", "--no-progress"]


def _write_images(folder, n, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    names = []
    for i in range(n):
        arr = (torch.rand(40, 48, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(arr).save(folder / f"img{i}.png")
        names.append(f"img{i}.png")
    return names


def test_bench_without_data_prints_table_csv_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "r.csv", tmp_path / "p.png"
    assert main(["bench", "deit_tiny", "--methods", "tome_r8,evit_r4", "--out", str(out), "--plot", str(plot)] + FAST) == 0
    table = capsys.readouterr().out
    assert "tome_r8" in table and "evit_r4" in table and "none" in table
    rows = list(csv.DictReader(open(out)))
    assert [r["method"] for r in rows] == ["none", "tome_r8", "evit_r4"]
    gmacs = [float(r["gmacs"]) for r in rows]
    assert abs(gmacs[0] - 1.2537) < 1e-3 and gmacs[1] < gmacs[2] < gmacs[0]
    assert [int(r["tokens_last_block"]) for r in rows] == [197, 109, 153]
    assert rows[0]["gmacs_std"] == ""  # no spread without data
    assert rows[0]["top1"] == "" and float(rows[0]["speedup"]) == 1.0
    assert plot.stat().st_size > 1000


def test_bench_with_labels_csv_folder(tmp_path, capsys):
    names = _write_images(tmp_path / "val" / "images", 5)
    with open(tmp_path / "val" / "labels.csv", "w") as f:
        f.write("file,label\n" + "".join(f"{n},{i % 3}\n" for i, n in enumerate(names)))
    out = tmp_path / "r.csv"
    assert main(["bench", "deit_tiny", "--data", str(tmp_path / "val"), "--methods", "none,tome_r0",
                 "--out", str(out)] + FAST) == 0
    rows = list(csv.DictReader(open(out)))
    assert float(rows[1]["agreement"]) == 100.0  # r=0 equals the plain model
    assert float(rows[1]["top1"]) == float(rows[0]["top1"])


def test_bench_reports_adaptive_gmacs_and_its_spread_across_batches(tmp_path):
    """ATM's cost depends on the images: a flat batch merges more than a noisy one."""
    folder = tmp_path / "imgs"
    _write_images(folder, 4)
    for i in range(4):
        Image.new("RGB", (48, 40), (120, 80, 40)).save(folder / f"flat{i}.png")
    preset = tmp_path / "p.json"
    save_preset(CalibrationResult("deit_tiny", dict(alpha=0.9, beta=0.05, theta_min=0.2, split_layer=None),
                                  0.5, 90.0, 0.5, 1.25, 8, 3), str(preset))
    out = tmp_path / "r.csv"
    assert main(["bench", "deit_tiny", "--data", str(folder), "--methods", f"atm,{preset}", "--out", str(out)]
                + FAST) == 0  # a plain folder of images: no labels needed for GMACs and agreement
    rows = {r["method"]: r for r in csv.DictReader(open(out))}
    assert rows["none"]["top1"] == "" and float(rows["none"]["agreement"]) == 100.0
    assert 0.0 <= float(rows["atm"]["agreement"]) <= 100.0
    assert float(rows["none"]["gmacs_std"]) == 0.0
    assert float(rows[str(preset)]["gmacs_std"]) > 0.0
    assert float(rows[str(preset)]["gmacs"]) < float(rows["none"]["gmacs"])


def test_bench_dtype_autocasts_every_forward_and_says_so(tmp_path, capsys):
    names = _write_images(tmp_path / "val" / "images", 4)
    (tmp_path / "val" / "labels.csv").write_text("file,label\n" + "".join(f"{n},1\n" for n in names))
    out = tmp_path / "r.csv"
    assert main(["bench", "deit_tiny", "--data", str(tmp_path / "val"), "--methods", "tome_r0,tome_r8",
                 "--dtype", "bf16", "--out", str(out)] + FAST) == 0
    assert "device cpu, bf16 autocast, batch 4" in capsys.readouterr().out
    rows = list(csv.DictReader(open(out)))
    assert {r["dtype"] for r in rows} == {"bf16"} and {r["tf32"] for r in rows} == {"False"}
    assert float(rows[1]["agreement"]) == 100.0  # r = 0 in bf16 is the plain model in bf16
    assert abs(float(rows[0]["gmacs"]) - 1.2537) < 1e-3  # autocast changes the dtype, not the MACs
    assert main(["bench", "deit_tiny", "--dtype", "fp64"] + FAST) == 2  # argparse's refusal, its exit code
    assert "--dtype" in capsys.readouterr().err


def test_precision_autocasts_and_restores_tf32():
    from timm_tokcomp.measure.precision import precision

    before = torch.backends.cuda.matmul.allow_tf32
    with precision("cpu", "bf16", tf32=not before):
        assert torch.backends.cuda.matmul.allow_tf32 is (not before)
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert torch.backends.cuda.matmul.allow_tf32 is before
    with precision("cpu", "fp32", tf32=False):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match="--dtype"):
        with precision("cpu", "int8", tf32=False):
            pass


def test_bench_with_imagefolder_tree(tmp_path):
    for cls in ("a", "b"):
        _write_images(tmp_path / "tree" / cls, 2, seed=ord(cls))
    out = tmp_path / "r.csv"
    assert main(["bench", "deit_tiny", "--data", str(tmp_path / "tree"), "--methods", "tome_r4", "--limit", "3",
                 "--out", str(out)] + FAST) == 0
    rows = list(csv.DictReader(open(out)))
    assert 0.0 <= float(rows[1]["top1"]) <= 100.0


def test_bench_errors_are_clear(tmp_path, capsys):
    assert main(["bench", "deit_tiny", "--methods", "tome_x"] + FAST) == 2
    assert "valid forms" in capsys.readouterr().err
    assert main(["bench", "deit_tiny", "--data", str(tmp_path / "missing")] + FAST) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["bench", "deit_tiny.tome_r8"] + FAST) == 2
    assert "method tag" in capsys.readouterr().err


def test_parse_methods_puts_baseline_first():
    items = parse_methods("tome_r8, none,evit_r2,tome_r8,atm_lossless")
    assert [item.name for item in items] == ["none", "tome_r8", "evit_r2", "atm_lossless"]
    assert items[0] == ("none", "none", {}, "eager") and items[1] == ("tome_r8", "tome", {"r": 8}, "eager")
    with pytest.raises(ValueError, match="--methods"):
        parse_methods("tome")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        parse_methods("none,missing.json")


def test_method_items_choose_a_kernel():
    assert method_spec("tome_r16@triton") == ("tome", {"r": 16, "kernel": "triton"})
    assert method_spec("dense_tome_r1@torch") == ("dense_tome", {"r": 1, "kernel": "torch"})
    assert [item.name for item in parse_methods("tome_r8,tome_r8@triton")] == ["none", "tome_r8", "tome_r8@triton"]
    assert method_spec("evit_r8@auto") == ("evit", {"r": 8, "kernel": "auto"})
    with pytest.raises(ValueError, match=r"topk has no kernel choice \(kernels are for tome, evit, atm, dense_tome\)"):
        method_spec("topk_k70@triton")
    with pytest.raises(ValueError, match=r"must be a kernel \(auto, torch, triton\) or a proportional-attention "
                                         r"implementation \(mask, fold, fold_qkv, flex\), got 'cuda'"):
        parse_methods("tome_r8@cuda")


def test_method_items_choose_a_proportional_attention_path():
    assert method_spec("tome_r16@fold_qkv") == ("tome", {"r": 16, "prop_attn": "fold_qkv"})
    assert method_spec("tome_r16@triton+fold") == ("tome", {"r": 16, "kernel": "triton", "prop_attn": "fold"})
    assert method_spec("kmedoids_k70@mask") == ("kmedoids", {"keep_rate": 0.7, "prop_attn": "mask"})
    with pytest.raises(ValueError, match="dense_tome has no proportional attention"):
        method_spec("dense_tome_r1@fold")


def test_bench_adds_tocom_rows_after_tome_and_evit_rows(tmp_path, capsys):
    from timm_tokcomp.tocom import Compensator, save

    names = _write_images(tmp_path / "val" / "images", 4)
    with open(tmp_path / "val" / "labels.csv", "w") as f:
        f.write("file,label\n" + "".join(f"{n},{i % 3}\n" for i, n in enumerate(names)))
    save(Compensator.init(16, 12, 192, 192), str(tmp_path / "tocom"), "deit_tiny_patch16_224")  # B = 0: no change
    out = tmp_path / "r.csv"
    assert main(["bench", "deit_tiny", "--data", str(tmp_path / "val"), "--methods", "tome_r8,evit_r4,atm",
                 "--tocom", str(tmp_path / "tocom"), "--out", str(out)] + FAST) == 0
    captured = capsys.readouterr()
    assert "no +ToCom row for atm" in captured.err
    assert "trained with tome; evit_r4+ToCom applies it to evit" in captured.err
    assert "+0 / -0 images vs tome_r8, p = 1" in captured.out
    rows = {r["method"]: r for r in csv.DictReader(open(out))}
    assert list(rows) == ["none", "tome_r8", "tome_r8+ToCom", "evit_r4", "evit_r4+ToCom", "atm"]
    for name in ("tome_r8", "evit_r4"):
        for col in ("gmacs", "agreement", "top1"):
            assert rows[name + "+ToCom"][col] == rows[name][col]
        paired = rows[name + "+ToCom"]
        assert (paired["paired_with"], paired["agree_gained"], paired["agree_lost"]) == (name, "0", "0")
        assert float(paired["agree_change_p"]) == 1.0
    assert rows["tome_r8"]["paired_with"] == "" and rows["atm"]["agree_change_p"] == ""
    assert main(["bench", "deit_tiny", "--methods", "tome_r8", "--tocom", str(tmp_path / "tocom"),
                 "--source-r", "17"] + FAST) == 2
    assert "--source-r must be an int in [0, 16]" in capsys.readouterr().err
    assert main(["bench", "deit_small", "--methods", "tome_r8", "--tocom", str(tmp_path / "tocom")] + FAST) == 2
    assert "does not match" in capsys.readouterr().err


def test_tocom_rows_count_the_images_whose_agreement_changed(tmp_path):
    from timm_tokcomp.commands.bench import run_bench
    from timm_tokcomp.tocom import Compensator, save

    names = _write_images(tmp_path / "val" / "images", 24, seed=3)
    with open(tmp_path / "val" / "labels.csv", "w") as f:
        f.write("file,label\n" + "".join(f"{n},0\n" for n in names))
    torch.manual_seed(0)
    plugins = Compensator.init(16, 12, 192, 192)
    plugins.lora_b.normal_(std=3.0)  # large enough to change predictions
    save(plugins, str(tmp_path / "tocom"), "deit_tiny_patch16_224")
    rows = {r.method: r for r in run_bench("deit_tiny_patch16_224", parse_methods("none,tome_r16"), data=str(tmp_path / "val"),
                                           batch_size=8, timing_rounds=1, latency_runs=0, num_workers=0,
                                           show_progress=False, tocom=str(tmp_path / "tocom"))}
    row, plain = rows["tome_r16+ToCom"], rows["tome_r16"]
    assert row.agree_gained + row.agree_lost > 0
    assert row.agreement - plain.agreement == pytest.approx(100 * (row.agree_gained - row.agree_lost) / 24)
    assert row.agree_change_p == mcnemar_exact_p(row.agree_gained, row.agree_lost)


def test_mcnemar_exact_p():
    assert mcnemar_exact_p(0, 0) == 1.0 and mcnemar_exact_p(3, 3) == 1.0
    assert mcnemar_exact_p(0, 6) == mcnemar_exact_p(6, 0) == 2 / 64
    assert mcnemar_exact_p(1, 9) == pytest.approx(2 * 11 / 1024)
    assert mcnemar_exact_p(16, 19) == pytest.approx(0.7359, abs=1e-4)  # scipy.stats.binomtest(16, 35).pvalue
    with pytest.raises(ValueError, match="gained and lost"):
        mcnemar_exact_p(-1, 2)


def test_no_timing_reports_gmacs_and_accuracy_only(tmp_path, capsys):
    names = _write_images(tmp_path / "val" / "images", 6)
    with open(tmp_path / "val" / "labels.csv", "w") as f:
        f.write("file,label\n" + "".join(f"{n},{i % 3}\n" for i, n in enumerate(names)))
    out, plot = tmp_path / "r.csv", tmp_path / "p.png"
    assert main(["bench", "deit_tiny", "--data", str(tmp_path / "val"), "--methods", "none,tome_r8", "--no-timing",
                 "--limit", "4", "--out", str(out), "--plot", str(plot)] + FAST) == 0
    table = capsys.readouterr().out
    assert "tput" not in table and "lat ms" not in table and "tokens@last" in table
    rows = list(csv.DictReader(open(out)))
    assert all(r["speedup"] == r["img_per_s"] == r["latency_ms"] == "" for r in rows)
    assert float(rows[1]["gmacs"]) < float(rows[0]["gmacs"]) and rows[1]["top1"] != ""
    assert plot.stat().st_size > 1000
    assert main(["bench", "deit_tiny", "--no-timing", "--plot", str(tmp_path / "q.png")] + FAST) == 2
    assert "nothing to plot" in capsys.readouterr().err and not (tmp_path / "q.png").exists()


def test_the_table_names_its_columns_and_flags_ratios_within_noise():
    from timm_tokcomp.commands.bench import BenchRow, format_table

    rows = [BenchRow("none", 1.25, None, 100.0, 1.0, None, None, 197, speedup_lo=1.0, speedup_hi=1.0),
            BenchRow("tome_r8", 0.9, None, 130.0, 1.3, None, None, 109, speedup_lo=1.2, speedup_hi=1.4),
            BenchRow("tome_r2", 1.2, None, 102.0, 1.02, None, None, 185, speedup_lo=0.95, speedup_hi=1.09)]
    table = format_table(rows)
    assert "tput img/s" in table and "tput x [95%]" in table and "1.30x [1.20, 1.40]" in table
    assert "tokens@last: tokens entering the last block" in table
    noise = [line for line in table.splitlines() if "within timing noise" in line]
    assert len(noise) == 1 and "tome_r2" in noise[0] and "tome_r8" not in noise[0]
    assert noise[0].startswith("note: tput x: within timing noise")  # names the column it means
    idle = format_table(rows + [BenchRow("atm", 1.25, 0.0, 99.0, 0.99, None, None, 197, speedup_lo=0.9,
                                         speedup_hi=1.1)])
    assert "note: reduced nothing on these inputs: atm (an adaptive method" in idle and "tome_r8 (" not in idle


def test_a_plain_preset_whose_interval_excludes_one_is_called_drift(tmp_path):
    from timm_tokcomp.commands.bench import BenchRow, format_table

    preset = str(tmp_path / "none.json")  # the row says it is a plain preset: the table reads no file
    plain = BenchRow("none", 1.25, None, 100.0, 1.0, None, None, 197, speedup_lo=1.0, speedup_hi=1.0)
    drifted = format_table([plain, BenchRow(preset, 1.25, None, 104.0, 1.04, None, None, 197, speedup_lo=1.01,
                                            speedup_hi=1.08, plain_preset=True)])
    assert f"note: {preset} 1.04x [1.01, 1.08]: the plain model against itself, yet its interval excludes 1.00x: " \
           "the machine drifted between rounds" in drifted
    steady = format_table([plain, BenchRow(preset, 1.25, None, 101.0, 1.01, None, None, 197, speedup_lo=0.97,
                                           speedup_hi=1.05, plain_preset=True)])
    assert "drifted" not in steady and "a preset of method 'none'" in steady


def test_the_evaluation_progress_counts_images(tmp_path, capsys):
    _write_images(tmp_path / "imgs", 5)
    assert main(["bench", "deit_tiny", "--data", str(tmp_path / "imgs"), "--methods", "none,tome_r8", "--no-timing",
                 "--batch-size", "2", "--num-workers", "0"]) == 0
    assert "5/5" in capsys.readouterr().err  # images, not the 3 batches


def test_a_preset_is_read_once_per_bench_run(tmp_path, monkeypatch):
    """--methods reads each preset file at the door, once: the run uses what it read (the preset's method and
    params, its recorded mode), and the file is not opened again."""
    import json

    from timm_tokcomp.commands.bench import run_bench
    from timm_tokcomp.deployment import presets

    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": 1, "method": "tome", "params": {"r": 2}, "execution": {"mode": "eager"}}))
    real, reads = presets.read_json, []
    monkeypatch.setattr(presets, "read_json", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    rows = run_bench("deit_tiny_patch16_224", parse_methods(f"none,{path}"), batch_size=2, timing_rounds=1, latency_runs=0,
                     show_progress=False)
    assert reads == [str(path)]
    assert rows[1].method == str(path) and rows[1].gmacs < rows[0].gmacs
