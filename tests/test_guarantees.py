"""docs/guarantees.md: runs never overwrite runs, a killed run leaves complete files and
resumes to the uninterrupted result, features carry their own token sizes, calibration refuses a reduced
reference, training refuses non-finite settings and stops before saving non-finite weights, parameters are
checked when given, compensator switching is transactional, and command-line errors exit 2 with one line."""
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import timm_tokcomp
from timm_tokcomp.cli import main
from timm_tokcomp.files.outputs import replacing
from timm_tokcomp.tocom import load
from conftest import make_model

pytestmark = [pytest.mark.slow]  # killed and resumed runs

TRAIN = ["train-tocom", "test_vit", "--batch-size", "4", "--holdout", "4", "--scale-grid", "0.05,0.1",
         "--scale-targets", "8,16", "--no-progress", "--num-workers", "0"]


def _train(image_folder, out, *extra):
    return main([*TRAIN, "--data", str(image_folder), "--out", str(out), *extra])


# 1. a second run does not destroy the first

def test_a_second_run_into_the_same_folder_is_refused(image_folder, tmp_path, capsys):
    out = tmp_path / "o"
    assert _train(image_folder, out, "--steps", "50", "--stop-after-steps", "12", "--checkpoint-every", "4") == 0
    log_before = (out / "training" / "loss_log.csv").read_text()
    assert torch.load(out / "training" / "checkpoint.pt", weights_only=True)["step"] == 12
    capsys.readouterr()
    assert _train(image_folder, out, "--steps", "50", "--stop-after-steps", "2") == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--resume" in err and "--overwrite" in err and "Traceback" not in err
    assert torch.load(out / "training" / "checkpoint.pt", weights_only=True)["step"] == 12
    assert (out / "training" / "loss_log.csv").read_text() == log_before
    assert _train(image_folder, out, "--steps", "50", "--stop-after-steps", "2", "--overwrite") == 0
    assert torch.load(out / "training" / "checkpoint.pt", weights_only=True)["step"] == 2
    assert len((out / "training" / "loss_log.csv").read_text().splitlines()) == 3


def test_overwrite_deletes_only_the_previous_runs_files(image_folder, tmp_path):
    out = tmp_path / "o"
    assert _train(image_folder, out, "--steps", "2") == 0
    (out / "notes.txt").write_text("mine")
    assert _train(image_folder, out, "--steps", "2", "--stop-after-steps", "1", "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "tocom_config.json").exists() and not list(out.glob("step_*"))


def test_overwrite_keeps_the_earlier_run_when_the_new_one_cannot_open_its_data(image_folder, tmp_path, capsys):
    out = tmp_path / "o"
    assert _train(image_folder, out, "--steps", "2") == 0
    before = sorted(p.name for p in out.rglob("*"))
    assert main([*TRAIN, "--data", str(tmp_path / "missing"), "--out", str(out), "--steps", "2", "--overwrite"]) != 0
    assert "missing" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == before


def test_bench_and_calibrate_refuse_to_replace_an_output_file(tmp_path, capsys):
    csv = tmp_path / "r.csv"
    csv.write_text("keep")
    fast = ["--batch-size", "2", "--rounds", "1", "--no-progress"]
    assert main(["bench", "test_vit", "--methods", "tome_r2", "--out", str(csv), *fast]) == 2
    assert "--out" in capsys.readouterr().err and csv.read_text() == "keep"
    assert main(["bench", "test_vit", "--methods", "tome_r2", "--out", str(csv), "--overwrite", *fast]) == 0
    assert csv.read_text().startswith("model,")
    preset = tmp_path / "p.json"
    preset.write_text("keep")
    assert main(["calibrate", "test_vit", "--target-ratio", "0.8", "--data", str(tmp_path), "--out", str(preset)]) == 2
    assert "--out" in capsys.readouterr().err and preset.read_text() == "keep"


def test_an_interrupted_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with replacing(target) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


# 2. features carry their own token sizes

def test_forward_head_uses_the_sizes_of_its_own_features():
    model = timm_tokcomp.apply(make_model("avgpool_noclass"), "tome", r=8)
    torch.manual_seed(0)
    a, b = torch.randn(2, 3, 32, 32), 3 * torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fa = model.forward_features(a)
        model.forward_features(b)
        assert torch.equal(model.forward_head(fa), model(a))
        assert timm_tokcomp.last_stats(model, fa).size.shape[:2] == fa.shape[:2]
        with pytest.raises(RuntimeError, match="not a tensor returned by forward_features"):
            model.forward_head(fa.clone())
        timm_tokcomp.set_params(model, r=4)  # set_params keeps what earlier features carry
        assert torch.equal(model.forward_head(fa), timm_tokcomp.set_params(model, r=8)(a))


def test_unreduced_features_pool_plainly_without_a_record():
    model = timm_tokcomp.apply(make_model("avgpool_noclass"), "tome", r=0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert torch.equal(model.forward_head(feats.clone()), model(x))


# 3. calibration refuses a reduced reference

def test_calibrate_refuses_a_reduced_model():
    from timm_tokcomp.commands.calibrate import calibrate

    model = timm_tokcomp.apply(make_model("cls"), "tome", r=4)
    with pytest.raises(ValueError, match="unmodified model as its reference"):
        calibrate(model, [torch.randn(2, 3, 32, 32)], "cls", target_ratio=0.8)


# 4. training guards

@pytest.mark.parametrize("flag, value", [("--lr-base", "inf"), ("--lr-base", "nan"), ("--temperature", "inf"),
                                         ("--scale", "-1"), ("--weight-decay", "nan"), ("--scale-grid", "0.1,inf"),
                                         ("--mosaic", "a,b")])
def test_non_finite_or_out_of_range_settings_are_refused_before_any_work(image_folder, tmp_path, capsys, flag, value):
    assert _train(image_folder, tmp_path / "o", "--steps", "2", flag, value) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_diverging_run_stops_and_saves_nothing_non_finite(image_folder, tmp_path, capsys):
    out = tmp_path / "o"
    assert _train(image_folder, out, "--steps", "30", "--checkpoint-every", "1", "--lr-base", "1e30") == 1
    assert "training diverged" in capsys.readouterr().err
    assert not (out / "tocom_config.json").exists()
    checkpoint = out / "training" / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        assert all(torch.isfinite(t).all() for t in state["trainable"].values())


# kills at several points, then --resume

def _folder_is_consistent(out: Path, every: int, steps: int) -> int:
    """Every file in `out` is complete: the checkpoint loads and is finite at a checkpoint step, the log has
    consecutive steps at least up to it, a written adapter loads. Returns the checkpoint's step (0: none)."""
    step = 0
    checkpoint = out / "training" / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        step = state["step"]
        assert step % every == 0 or step == steps
        assert all(torch.isfinite(t).all() for t in state["trainable"].values())
    log = out / "training" / "loss_log.csv"
    if log.exists():
        rows = log.read_text().splitlines()
        assert rows[0].startswith("step,") and [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, len(rows)))
        assert len(rows) - 1 >= step
    if (out / "tocom_config.json").exists():
        load(str(out))
    return step


def _default_sigint() -> None:
    """A child started from a background job inherits SIGINT ignored (and Python then installs no
    KeyboardInterrupt handler): give it the default, as a terminal's Ctrl-C meets it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    start = time.time()
    while not path.exists() and proc.poll() is None and time.time() - start < timeout:
        time.sleep(0.005)


def test_killed_runs_leave_complete_files_and_resume_to_the_uninterrupted_result(image_folder, tmp_path):
    steps, every = 24, 4
    args = [sys.executable, "-m", "timm_tokcomp.cli", *TRAIN, "--data", str(image_folder), "--steps", str(steps),
            "--checkpoint-every", str(every)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = subprocess.run([*args, "--out", str(tmp_path / "straight")], env=env, capture_output=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-2000:]

    out = tmp_path / "killed"
    # (what to wait for, signal): during training, after a checkpoint, while the adapter is being written
    kills = [(out / "training" / "loss_log.csv", signal.SIGKILL), (out / "training" / "checkpoint.pt", signal.SIGINT),
             (out / "training" / "checkpoint.pt", signal.SIGKILL), (out / "step_00", signal.SIGKILL)]
    steps_seen, codes = [], []
    for i, (trigger, sig) in enumerate(kills):
        proc = subprocess.Popen([*args, "--out", str(out)] + (["--resume"] if i else []), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_default_sigint)
        _wait_for(trigger, proc)
        proc.send_signal(sig)
        codes.append(proc.wait(timeout=600))
        steps_seen.append(_folder_is_consistent(out, every, steps))
    assert steps_seen == sorted(steps_seen) and steps_seen[0] < steps
    assert codes[0] == -signal.SIGKILL and codes[1] != 0  # the training-time kills did land (SIGINT: exit 1 or -2)
    resumed = subprocess.run([*args, "--out", str(out), "--resume"], env=env, capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _folder_is_consistent(out, every, steps) == steps
    assert not list(out.rglob(".*.tmp"))
    (a, _), (b, _) = load(str(out)), load(str(tmp_path / "straight"))
    torch.testing.assert_close(a.lora_a, b.lora_a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.lora_b, b.lora_b, rtol=1e-6, atol=1e-7)
    losses = [r.split(",")[3] for r in (out / "training" / "loss_log.csv").read_text().splitlines()[1:]]
    assert losses == [r.split(",")[3] for r in (tmp_path / "straight" / "training" / "loss_log.csv").read_text().splitlines()[1:]]
    assert all(math.isfinite(float(v)) for v in losses)


# ToCom switching state that outlives the weights it was computed from

def _deit_like_with_compensator():
    from conftest import _random_compensator
    from timm_tokcomp.tocom import attach

    model = make_model("cls")
    comp = _random_compensator(seed=3)
    return attach(model, comp), comp


def test_detach_after_load_state_dict_refuses_to_discard_the_loaded_weights():
    from timm_tokcomp.tocom import detach, set_compression

    model, _ = _deit_like_with_compensator()
    set_compression(model, r=8)
    loaded = make_model("cls", seed=5).state_dict()
    model.load_state_dict(loaded)
    with pytest.raises(ValueError, match="changed since the compensator set it"):
        detach(model)
    with pytest.raises(ValueError, match="changed since the compensator set it"):
        set_compression(model, r=4)
    assert timm_tokcomp.get_reducer(model).r == 8  # refused before anything changed
    detach(model, restore=False)
    assert all(torch.equal(v, loaded[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.1", "abc", True])
def test_a_bad_scale_changes_nothing(scale):
    from timm_tokcomp.tocom import attach, set_compression

    model, comp = _deit_like_with_compensator()
    set_compression(model, r=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="scale must be a finite number"):
        set_compression(model, r=8, scale=scale)
    assert timm_tokcomp.get_reducer(model).r == 16
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="scale must be a finite number"):
        attach(make_model("cls"), comp, scale=scale)


# parameters checked when given, not at the first forward

@pytest.mark.parametrize("ratio", [float("nan"), float("inf"), 1000.0])
def test_a_flops_ratio_out_of_range_or_reach_is_refused_at_apply(ratio):
    model = make_model("cls")
    with pytest.raises(ValueError, match="flops_ratio"):
        timm_tokcomp.apply(model, "tome", flops_ratio=ratio)
    assert not timm_tokcomp.is_reduced(model)


@pytest.mark.parametrize("method", ["atm", "tome", "evit", "dense_tome"])
def test_an_empty_batch_gives_an_empty_output(method):
    model = timm_tokcomp.apply(make_model("cls"), method, **({} if method == "atm" else {"r": 2}))
    with torch.no_grad():
        assert model(torch.zeros(0, 3, 32, 32)).shape == (0, 10)


def test_a_compensator_for_another_model_is_refused_by_name():
    from timm_tokcomp.tocom import attach
    from conftest import _random_compensator

    import timm

    comp = _random_compensator(depth=6, dim=64, attn_dim=64)
    comp.base_model = "some_other_vit"
    with pytest.raises(ValueError, match="trained for 'some_other_vit'.*not this 'test_vit'"):
        attach(timm.create_model("test_vit"), comp)
    comp.base_model = "test_vit.r160_in1k"  # the same architecture with a pretrained tag: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach(timm.create_model("test_vit"), comp)


def _tiny_adapter(folder: Path) -> Path:
    from conftest import _random_compensator
    from timm_tokcomp.tocom import save

    save(_random_compensator(depth=6, dim=64, attn_dim=64), str(folder), "test_vit")
    return folder


NO_CUDA = [] if torch.cuda.is_available() else [(["bench", "test_vit", "--device", "cuda"], "--device cuda: CUDA is not")]


@pytest.mark.parametrize("args, match", NO_CUDA + [
    (["bench", "nonexistent_model"], "MODEL 'nonexistent_model' is not a timm model"),
    (["bench", "test_vit", "--device", "banana"], "--device 'banana'"),
    (["bench", "test_vit", "--checkpoint", "/nonexistent.safetensors"], "--checkpoint /nonexistent.safetensors not found"),
])
def test_cli_user_errors_exit_2_with_one_line(args, match, capsys):
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("tokcomp: error:")]
    assert len(errors) == 1 and match in errors[0] and "Traceback" not in err


def test_a_model_whose_features_are_tracked_still_pickles_and_copies():
    import copy
    import io

    model = timm_tokcomp.apply(make_model("avgpool_noclass"), "tome", r=4)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model.forward_features(x)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        assert torch.equal(torch.load(buffer, weights_only=False)(x), model(x))
        assert torch.equal(copy.deepcopy(model)(x), model(x))


def test_cli_names_a_truncated_adapter_file_and_refuses_a_non_finite_scale(tmp_path, capsys):
    folder = _tiny_adapter(tmp_path / "adapter")
    fast = ["bench", "test_vit", "--methods", "tome_r2", "--batch-size", "2", "--rounds", "1", "--no-progress"]
    assert main([*fast, "--tocom", str(folder), "--tocom-scale", "nan"]) == 2
    assert "scale must be a finite number" in capsys.readouterr().err
    weights = folder / "step_03" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    assert main([*fast, "--tocom", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "step_03/adapter_model.safetensors cannot be read" in err and "Traceback" not in err


def test_training_an_unsupported_model_leaves_no_folder(image_folder, tmp_path, capsys):
    assert main(["train-tocom", "resnet18", "--data", str(image_folder), "--out", str(tmp_path / "o"),
                 "--steps", "2", "--no-progress", "--num-workers", "0"]) == 2
    assert "VisionTransformer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_unreduced_forward_at_another_input_size_pools_plainly():
    """r = 0 on a dynamic-size avg-pooled model: no sizes, and the token count is not the default one."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=4, embed_dim=48, depth=2, num_heads=3, num_classes=10,
                              class_token=False, global_pool="avg", dynamic_img_size=True).eval()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        plain = model(x)
        assert torch.equal(timm_tokcomp.apply(model, "tome", r=0)(x), plain)
