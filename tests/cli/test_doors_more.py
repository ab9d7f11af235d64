"""The doors of issue 44, one test per door: output paths checked before any work and every OSError one error line
naming the flag; bad values named at the door; errors that say what fits the case; tune's candidates checked before
anything is written."""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from test_doors import MODEL, _assert_refused, _commands, _images
from timm_tokcomp.files import outputs
from timm_tokcomp.deployment.specs import parse_methods

pytestmark = [pytest.mark.slow]  # every command on every bad file

FILE_COMMANDS = {  # every command writing one file, with the flag naming it
    "bench": ["bench", MODEL, "--methods", "tome_r8", "--no-timing", "--no-progress"],
    "speed": ["speed", MODEL, "--methods", "tome_r8", "--batches", "1", "--rounds", "1", "--no-progress"],
    "calibrate": None,  # needs data: filled in by _file_commands
    "export": ["export", MODEL, "--method", "tome_r8"],
}
FOLDER_COMMANDS = ("tune", "finetune", "train-tocom", "analyze")


def _file_commands(data: Path):
    return {**FILE_COMMANDS, "calibrate": ["calibrate", MODEL, "--target-ratio", "0.8", "--data", str(data),
                                           "--no-progress"]}


def _all_with_out(tmp_path: Path, out: str):
    data = _images(tmp_path / "d", count=8, labels=[0, 1] * 4)
    argv = {name: a + ["--out", out] for name, a in _file_commands(data).items()}
    argv.update({name: _commands(str(data), out)[name] for name in FOLDER_COMMANDS})
    return argv


@pytest.mark.parametrize("command", [*FILE_COMMANDS, *FOLDER_COMMANDS])
def test_an_output_under_a_regular_file_is_refused_before_any_work(tmp_path, capsys, command):
    (tmp_path / "afile").write_text("a file\n")
    argv = _all_with_out(tmp_path, str(tmp_path / "afile" / "sub"))[command]
    line = _assert_refused(argv, capsys, "--out", "afile is a file, not a folder")
    assert (tmp_path / "afile").read_text() == "a file\n"
    assert "Traceback" not in line


@pytest.mark.parametrize("command", [*FILE_COMMANDS, *FOLDER_COMMANDS])
def test_a_read_only_output_location_is_refused_before_any_work(tmp_path, capsys, monkeypatch, command):
    """A read-only file system (whose permission bits say nothing to root): the probe file cannot be made."""
    argv = _all_with_out(tmp_path, str(tmp_path / "o" / "out"))[command]

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(outputs.tempfile, "mkstemp", read_only)
    _assert_refused(argv, capsys, "--out", "Read-only file system")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["bench", "speed", "calibrate", "export"])
def test_a_file_output_that_is_a_folder_is_refused_before_any_work_even_with_overwrite(tmp_path, capsys, command):
    (tmp_path / "here").mkdir()
    argv = _all_with_out(tmp_path, str(tmp_path / "here"))[command] + ["--overwrite"]
    _assert_refused(argv, capsys, "--out", "is a folder; name a file")


def _disk_full_on_rename(monkeypatch):
    real = os.replace

    def full(src, dst, *args, **kwargs):
        if Path(str(src)).name.endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(outputs.os, "replace", full)


def test_a_full_disk_is_one_error_line_naming_the_flag_and_the_earlier_file_stays(tmp_path, capsys, monkeypatch):
    out = tmp_path / "rows.csv"
    out.write_text("earlier\n")
    _disk_full_on_rename(monkeypatch)
    _assert_refused(FILE_COMMANDS["bench"] + ["--out", str(out), "--overwrite"], capsys, "--out", str(out),
                    "No space left on device")
    assert out.read_text() == "earlier\n" and sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv"]


def test_a_full_disk_in_a_run_folder_names_the_folder_flag(tmp_path, capsys, monkeypatch):
    data = _images(tmp_path / "d", count=6, labels=[0, 1] * 3)
    _disk_full_on_rename(monkeypatch)
    _assert_refused(["tune", MODEL, "--data", str(data), "--out", str(tmp_path / "t"), "--limit", "6",
                     "--prune-images", "3", "--no-progress"], capsys, "--out", "No space left on device")


def test_check_output_rules(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileExistsError, match="--plot .* already exists"):
        outputs.check_output(tmp_path / "f", "--plot")
    outputs.check_output(tmp_path / "f", "--plot", overwrite=True)
    outputs.check_output(tmp_path / "new" / "deeper" / "f.csv", "--out")  # folders are made when writing
    with pytest.raises(outputs.OutputError, match="is a file, not a folder"):
        outputs.check_output(tmp_path / "f", "--out", folder=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the probe is gone


def test_saved_files_are_readable_by_everyone_like_every_other_output(tmp_path):
    from timm_tokcomp.tocom import Compensator
    from timm_tokcomp.tocom.hub import save

    save(Compensator.init(2, 12, 192, 192, 2, 0.1), str(tmp_path / "c"), MODEL)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "c").rglob("*")
             if p.is_file()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o644}, modes


# ------------------------------------------------------------------ values at the door


def test_bench_plot_format_is_checked_before_any_work(tmp_path, capsys):
    out = tmp_path / "rows.csv"
    _assert_refused(FILE_COMMANDS["bench"] + ["--out", str(out), "--plot", str(tmp_path / "p.xyz")], capsys,
                    "--plot", ".xyz", ".png")
    assert not out.exists()


@pytest.mark.parametrize("flags, named", [(["--rounds", "0"], "--rounds"),
                                          (["--no-timing", "--latency-runs", "-1"], "--latency-runs"),
                                          (["--latency-runs", "-1"], "--latency-runs")])
def test_bench_timing_flags_are_named(capsys, flags, named):
    _assert_refused(["bench", MODEL, "--no-progress"] + flags, capsys, named)


def test_tune_device_batches_and_data_are_named(tmp_path, capsys):
    import timm_tokcomp

    data = _images(tmp_path / "d", count=4)
    _assert_refused(["tune", MODEL, "--data", str(data), "--out", str(tmp_path / "t"), "--device", "gpu"], capsys,
                    "--device", "gpu")
    with pytest.raises(ValueError, match="--batches must be a non-empty list of batch sizes >= 1, got 64"):
        timm_tokcomp.tune(MODEL, str(data), batches=64)
    with pytest.raises(TypeError, match="data must be the path of a folder of images"):
        timm_tokcomp.tune(MODEL, None)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x01binary", b"batch,mode\n1,2,3,4\n"])
def test_a_garbage_tune_csv_on_resume_names_the_file(tmp_path, content):
    from timm_tokcomp.commands.tune import read_rows
    from timm_tokcomp.files.userfiles import UserFileError

    path = tmp_path / "tune.csv"
    path.write_bytes(content)
    with pytest.raises(UserFileError, match=f"--resume {path} (cannot be read as tune's CSV|is not a text file)"):
        read_rows(path)


def test_a_preset_without_a_method_names_the_file(tmp_path, capsys):
    from timm_tokcomp import load_preset
    from timm_tokcomp.files.userfiles import UserFileError

    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"format": 1, "params": {}}))
    with pytest.raises(UserFileError, match=f"preset file {preset} is not a tokcomp preset"):
        load_preset(str(preset))
    _assert_refused(["bench", MODEL, "--methods", str(preset), "--no-timing"], capsys, str(preset), "'method'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the door is a machine without CUDA")
def test_a_preset_for_cuda_on_a_machine_without_it_names_the_device(tmp_path):
    from timm_tokcomp import load_preset

    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"format": 1, "method": "tome", "params": {"r": 4}, "tuned": {"device": "H100"}}))
    with pytest.raises(ValueError, match="device='cuda': CUDA is not available"):
        load_preset(str(preset), device="cuda")


def test_finetune_kernel_triton_is_refused_before_its_run_folder(tmp_path, capsys):
    data = _images(tmp_path / "d", count=4, labels=[0, 1, 0, 1])
    _assert_refused(["finetune", MODEL, "--method", "tome_r8", "--method-arg", "kernel=triton", "--data", str(data),
                     "--out", str(tmp_path / "ft"), "--no-progress"], capsys, "--method-arg kernel=triton")
    assert not (tmp_path / "ft").exists()


def test_a_run_that_fails_before_writing_leaves_no_empty_folders(tmp_path):
    with pytest.raises(RuntimeError):
        with outputs.run_folder(tmp_path / "run"):
            (tmp_path / "run" / "training" / "deeper").mkdir(parents=True)
            raise RuntimeError("failed before writing")
    assert not (tmp_path / "run").exists()


def test_finetunes_default_warm_up_fits_a_single_epoch():
    from timm_tokcomp.training import FinetuneConfig

    one = FinetuneConfig(method="tome_r8", epochs=1)
    one.validate()
    assert one.warmup_epochs == 0 and FinetuneConfig(epochs=10).warmup_epochs == 1


def test_selfcheck_on_the_cpu_without_the_interpreter_says_how(monkeypatch, capsys):
    from timm_tokcomp.commands import selfcheck

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        selfcheck.main(["--device", "cpu", "--no-timing"])
    assert e.value.code == 2 and "TRITON_INTERPRET=1 python -m timm_tokcomp.commands.selfcheck" in \
        capsys.readouterr().err


def test_applys_refusal_fits_the_model_it_refuses():
    import timm

    import timm_tokcomp

    gemma4 = timm.create_model("gemma4_vit_167m_enc", pretrained=False, depth=1)
    with pytest.raises(TypeError) as e:
        timm_tokcomp.apply(gemma4, "tome", r=1)
    assert "Gemma 4" in str(e.value) and "features_only" not in str(e.value)
    features = timm.create_model("vit_tiny_patch16_224", pretrained=False, features_only=True, depth=3)
    with pytest.raises(TypeError, match="features_only wrapper"):
        timm_tokcomp.apply(features, "tome", r=1)


# ------------------------------------------------------------------ the Hub


def test_an_unreachable_hub_fails_in_one_line_without_retries(tmp_path):
    """No HF_HUB_OFFLINE, an endpoint that refuses connections, nothing cached: one error line, no retry logs."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")
    run = subprocess.run([sys.executable, "-m", "timm_tokcomp.cli", "bench", MODEL, "--pretrained", "--no-timing",
                          "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "did not answer" in lines[0] and "--pretrained" in lines[0] and "Retry" not in run.stderr


def test_a_local_looking_compensator_path_says_no_such_folder_with_python_advice(tmp_path, monkeypatch):
    from timm_tokcomp import tocom
    from timm_tokcomp.files.userfiles import UserFileError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(UserFileError) as e:
        tocom.load("hub_cards/deit_tiny_tocom")
    assert str(e.value).startswith(f"hub_cards/deit_tiny_tocom: no such folder (from {tmp_path})")
    assert "a local folder path" in str(e.value) and "--checkpoint" not in str(e.value)


# ------------------------------------------------------------------ tune's candidates before any output


def _small(**kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=4, num_heads=3, num_classes=10,
                              **kwargs).eval()
    model.pretrained_cfg = {"input_size": (3, 32, 32), "crop_pct": 1.0}
    return model


def test_tune_on_a_model_without_class_token_notes_evit_and_runs(tmp_path):
    import timm_tokcomp

    data = _images(tmp_path / "d", count=10)
    result = timm_tokcomp.tune(_small(class_token=False, global_pool="avg"), str(data), batches=[2],
                               space=[("tome", {"r": 1}), ("evit", {"r": 1})], limit=10, prune_images=4, max_rounds=3,
                               out=str(tmp_path / "t"), show_progress=False)
    assert any(n.startswith("evit r=1: not applicable") and "class token" in n for n in result.settings["notes"])
    assert {r.method for r in result.rows} == {"tome"}


@pytest.mark.parametrize("methods, named", [(",", "no candidate setting given"),
                                            ("evit_r1", "no candidate applies to this model")])
def test_tune_refuses_an_empty_or_inapplicable_space_before_writing(tmp_path, methods, named):
    import timm_tokcomp

    data = _images(tmp_path / "d", count=10)
    space = [] if methods == "," else [("evit", {"r": 1})]
    with pytest.raises(ValueError, match=named):
        timm_tokcomp.tune(_small(class_token=False, global_pool="avg"), str(data), batches=[2], space=space,
                          limit=10, prune_images=4, out=str(tmp_path / "t"), show_progress=False)
    assert not (tmp_path / "t").exists()


def test_tune_cli_empty_methods_is_refused(tmp_path, capsys):
    data = _images(tmp_path / "d", count=10)
    _assert_refused(["tune", MODEL, "--data", str(data), "--out", str(tmp_path / "t"), "--methods", ","], capsys,
                    "--methods", "no candidate setting given")
    assert not (tmp_path / "t").exists()


def test_tune_refuses_the_dense_variant_which_reduces_no_token(tmp_path):
    import timm_tokcomp

    data = _images(tmp_path / "d", count=10)
    with pytest.raises(ValueError, match="dense_tome is refused by tune: the dense variant keeps every token"):
        timm_tokcomp.tune(_small(), str(data), batches=[2], space=[("dense_tome", {"r": 1})], limit=10,
                          prune_images=4, max_rounds=3, out=str(tmp_path / "t"), show_progress=False)
    assert not (tmp_path / "t").exists()


def test_bench_explains_a_none_preset_as_the_plain_model(tmp_path):
    from timm_tokcomp.commands.bench import format_table, run_bench

    preset = tmp_path / "none.json"
    preset.write_text(json.dumps({"format": 1, "method": "none", "params": {}}))
    rows = run_bench("deit_tiny_patch16_224", methods=parse_methods(f"none,{preset},tome_r8"), batch_size=1, timing_rounds=0,
                     show_progress=False)
    assert [r.plain_preset for r in rows] == [False, True, False]
    table = format_table(rows)
    assert f"note: {preset}: a preset of method 'none'" in table
    assert "reduced nothing" not in table  # the plain preset is explained as such (test_bench: an idle ATM row)


def test_a_failing_overwrite_that_made_only_folders_puts_the_earlier_run_back(tmp_path):
    run = tmp_path / "run"
    (run / "training").mkdir(parents=True)
    (run / "training" / "log.csv").write_text("earlier\n")
    with pytest.raises(RuntimeError):
        with outputs.run_folder(run, overwrite=True):
            (run / "training" / "deeper").mkdir(parents=True)
            raise RuntimeError("failed before writing")
    assert (run / "training" / "log.csv").read_text() == "earlier\n"
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == ["training", "training/log.csv"]


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224.atm", "deit_tiny_patch16_224.tome_r8"])
def test_forward_intermediates_final_output_is_forward_features_to_the_bit(name):
    """timm's own check asserts allclose with default tolerances; the last block now runs the same computation in
    both paths (its MLP on the prefix tokens alone), so the two are equal, not just close."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, depth=3).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        features = model.forward_features(x)
        final, intermediates = model.forward_intermediates(x)
        only = model.forward_intermediates(x, intermediates_only=True)
    assert torch.equal(final, features)
    assert len(intermediates) == len(only) == 3 and all(torch.equal(a, b) for a, b in zip(intermediates, only))
    assert intermediates[-1].shape == (2, 192, 14, 14)  # the last block's map still holds every patch


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_format_number_that_is_not_the_integer_is_refused_by_every_versioned_file(version, tmp_path):
    """JSON true == 1 in Python: every reader of a versioned file (presets, learned parameters, versioned folders)
    checks its format number as an integer, as the schema does its other integers."""
    from timm_tokcomp import load_preset
    from timm_tokcomp.utils.checks import is_version
    from timm_tokcomp.deployment.presets import PRESET_FORMAT
    from timm_tokcomp.methods.learned import config_file, load_learned, save_learned
    from timm_tokcomp.files.userfiles import UserFileError, read_versioned_json

    assert PRESET_FORMAT == 1 and not is_version(version, 1) and is_version(1, 1)
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"format": version, "method": "tome", "params": {"r": 8}}))
    with pytest.raises(UserFileError, match="is not a tokcomp preset"):
        load_preset(str(preset))
    (tmp_path / "v.json").write_text(json.dumps({"format_version": version}))
    with pytest.raises(UserFileError, match="format_version .* is not supported"):
        read_versioned_json(tmp_path, "v.json", 1, "a folder")
    import timm_tokcomp
    from conftest import make_model

    learned = tmp_path / "learned"
    model = timm_tokcomp.apply(make_model("cls"), "patchmerger", keep_rate=0.6, stages=(2, 3))
    save_learned(model.tokcomp["patchmerger"], "patchmerger", learned)
    config = json.loads((learned / config_file("patchmerger")).read_text())
    (learned / config_file("patchmerger")).write_text(json.dumps({**config, "format_version": version}))
    with pytest.raises(ValueError, match="expected format_version"):
        load_learned("patchmerger", learned)


def test_a_method_without_tags_names_its_route_at_every_door(tmp_path, capsys):
    """DyMU's thresholds belong to one model: `vit_tiny_patch16_224.dymu_r2` and `--methods dymu_r2` name `tokcomp
    calibrate --method dymu`, not the list of tag forms; a bad --r is named as the flag."""
    import timm

    from timm_tokcomp.cli import main

    with pytest.raises(ValueError, match=r"unknown tag 'dymu_r2' for vit_tiny_patch16_224: dymu has no tag: .*"
                                         r"`tokcomp calibrate MODEL --method dymu --r R`"):
        timm.create_model("vit_tiny_patch16_224.dymu_r2")
    with pytest.raises(ValueError, match="dymu has no tag"):
        parse_methods("none,dymu_r2")
    assert main(["calibrate", MODEL, "--method", "dymu", "--r", "-1", "--data", str(_images(tmp_path / "i")),
                 "--out", str(tmp_path / "c.json"), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == "tokcomp: error: argument --r: must be an integer >= 0, got -1"
