"""Every door through which a user's file enters, on every command that reads that kind of file: a bad file ends in
one `tokcomp: error:` line naming the flag and the file, exit 2, before any other work. And every command that
replaces an earlier output (--overwrite, --resume) keeps it when the new run fails."""
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from conftest import SMALL
from timm_tokcomp import cli
from timm_tokcomp.files.data import open_images
from timm_tokcomp.files.userfiles import UserFileError

pytestmark = [pytest.mark.slow]  # every command on every bad file

MODEL = "deit_tiny_patch16_224"


def _images(folder: Path, count: int = 4, labels=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"img{i}.jpg")
    if labels is not None:
        (folder / "labels.csv").write_text("file,label\n" + "".join(f"img{i}.jpg,{labels[i]}\n" for i in range(count)))
    return folder


def _run(argv, capsys):
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def _assert_refused(argv, capsys, *named):
    code, err = _run(argv, capsys)
    assert code == 2, err
    errors = [line for line in err if line.startswith("tokcomp: error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in named), err
    return errors[0]


# ------------------------------------------------------------------ image folders and labels files


# each broken file sorts first, so that it is among the images every command reads (speed reads only one batch)
def _not_an_image(tmp):
    folder = _images(tmp / "plain")
    (folder / "broken.jpg").write_text("this is not a JPEG")
    return folder, "broken.jpg"


def _class_name(tmp):
    folder = _images(tmp / "names", labels=[0, 1, 2, 3])
    (folder / "labels.csv").write_text("file,label\nimg0.jpg,0\nimg1.jpg,goldfish\nimg2.jpg,2\nimg3.jpg,3\n")
    return folder, "goldfish"


def _negative(tmp):
    return _images(tmp / "negative", labels=[0, -1, 2, 3]), "'-1'"


def _tree_with_text(tmp):
    tree = tmp / "tree"
    _images(tree / "a", 2), _images(tree / "b", 2)
    (tree / "a" / "broken.png").write_bytes(b"\x89PNG broken")
    return tree, "broken.png"


def _labels_not_text(tmp):
    folder = _images(tmp / "binary", labels=[0, 1, 2, 3])
    (folder / "labels.csv").write_bytes(bytes(range(256)) * 4)
    return folder, "labels.csv"


IMAGE_DOORS = [_not_an_image, _class_name, _negative, _tree_with_text, _labels_not_text]


def _commands(data, out):
    """Every command that reads an image folder, with data as its --data."""
    return {
        "bench": ["bench", MODEL, "--data", data, "--methods", "tome_r8", "--no-progress"],
        "calibrate": ["calibrate", MODEL, "--target-ratio", "0.8", "--data", data, "--no-progress"],
        "analyze": ["analyze", MODEL, "--methods", "tome_r8,evit_r8", "--data", data, "--out", out, "--no-progress"],
        "finetune": ["finetune", MODEL, "--data", data, "--out", out, "--no-progress", "--batch-size", "2"],
        "train-tocom": ["train-tocom", MODEL, "--data", data, "--out", out, "--no-progress"],
        "speed": ["speed", MODEL, "--data", data, "--batches", "2", "--rounds", "1", "--methods", "tome_r8",
                  "--no-progress"],
        "tune": ["tune", MODEL, "--data", data, "--out", out, "--no-progress"],
    }


@pytest.mark.parametrize("door", IMAGE_DOORS, ids=lambda d: d.__name__.strip("_"))
@pytest.mark.parametrize("command", list(_commands("", "")))
def test_a_bad_image_folder_is_refused_at_the_door_by_every_command(tmp_path, capsys, door, command):
    folder, culprit = door(tmp_path)
    if command == "finetune" and door is _not_an_image:
        folder = _images(tmp_path / "labelled", labels=[0, 1, 0, 1])
        (folder / "img1.jpg").write_text("not an image")
        culprit = "img1.jpg"
    argv = _commands(str(folder), str(tmp_path / "out"))[command]
    _assert_refused(argv, capsys, "--data", culprit)
    assert not (tmp_path / "out").exists()  # nothing written


def test_eval_data_is_named_as_eval_data(tmp_path, capsys):
    train = _images(tmp_path / "train", labels=[0, 1, 0, 1])
    bad = _images(tmp_path / "eval", labels=[0, 1, 0, 5])  # class 5: --data has classes 0..1
    _assert_refused(["finetune", MODEL, "--data", str(train), "--eval-data", str(bad), "--out", str(tmp_path / "o"),
                     "--batch-size", "2", "--no-progress"], capsys, "--eval-data", "class index 5")
    (bad / "img2.jpg").write_text("no image")
    _assert_refused(["finetune", MODEL, "--data", str(train), "--eval-data", str(bad), "--out", str(tmp_path / "o"),
                     "--batch-size", "2", "--no-progress"], capsys, "--eval-data", "img2.jpg")


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_labels_the_model_cannot_predict_are_refused(tmp_path, capsys, command):
    folder = _images(tmp_path / "d", labels=[0, 1, 2, 1000])  # DeiT has classes 0..999
    argv = _commands(str(folder), str(tmp_path / "out"))[command]
    _assert_refused(argv, capsys, "--data", "class index 1000", "1000 classes")


# ------------------------------------------------------------------ weights files (--checkpoint)


def _small_weights(path: Path) -> Path:
    torch.manual_seed(0)
    save_file(VisionTransformer(**SMALL).state_dict(), str(path))
    return path


def _truncated_safetensors(tmp):
    path = _small_weights(tmp / "w.safetensors")
    path.write_bytes(path.read_bytes()[:1000])
    return path, "cannot be read as safetensors"


def _truncated_torch(tmp):
    path = tmp / "w.pth"
    torch.save({"state_dict": {"a": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:700])
    return path, "cannot be read as a torch checkpoint"


def _another_model(tmp):
    return _small_weights(tmp / "other.safetensors"), "weights of another model"


def _not_weights(tmp):
    path = tmp / "list.pt"
    torch.save([1, 2, 3], path)
    return path, "no state dict"


class _RunsCode:
    """What a code-running .pth holds: an object whose unpickling calls os.system (here: touch a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _code_running(tmp):
    """A state dict and one object that runs a shell command when unpickled (the test checks it never ran)."""
    path = tmp / "evil.pth"
    torch.save({"state_dict": VisionTransformer(**SMALL).state_dict(), "note": _RunsCode(tmp / "ran")}, path)
    return path, "nothing in it was run"


CHECKPOINT_DOORS = [_truncated_safetensors, _truncated_torch, _another_model, _not_weights, _code_running]


@pytest.mark.parametrize("door", CHECKPOINT_DOORS, ids=lambda d: d.__name__.strip("_"))
@pytest.mark.parametrize("command", [*_commands("", ""), "export"])
def test_a_bad_checkpoint_is_refused_at_the_door_by_every_command(tmp_path, capsys, door, command):
    path, problem = door(tmp_path)
    data = _images(tmp_path / "d", labels=[0, 1, 0, 1])
    argv = {**_commands(str(data), str(tmp_path / "out")),
            "export": ["export", MODEL, "--method", "tome_r8", "--out", str(tmp_path / "m.onnx")]}[command]
    _assert_refused(argv + ["--checkpoint", str(path)], capsys, "--checkpoint", str(path), problem)
    assert not (tmp_path / "ran").exists()  # the code-running file ran nothing


def test_an_uncached_hub_model_offline_says_what_to_do(tmp_path):
    """--pretrained with no network and nothing cached: one error line that names the flag and the way out, after
    no network retries (HF_HUB_OFFLINE=1)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    run = subprocess.run([sys.executable, "-m", "timm_tokcomp.cli", "bench", MODEL, "--pretrained", "--methods",
                          "tome_r8", "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("tokcomp: error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr
    assert "--pretrained" in errors[0] and "not in the local cache" in errors[0] and "--checkpoint FILE" in errors[0]


def test_an_uncached_pretrained_name_offline_says_what_to_do_in_python(tmp_path):
    """timm.create_model(<a name this package serves>, pretrained=True) offline with nothing cached: an OSError (as
    huggingface_hub's) whose message names the cache and the local-file way out, not a bare LocalEntryNotFoundError."""
    import os
    import subprocess
    import sys

    code = ("import timm, timm_tokcomp\n"
            "from timm_tokcomp.files.hub import HubUnreachableError\n"
            "for name in ('deit_tiny_patch16_224.tome_r8', 'deit_tiny_patch16_224'):\n"
            "    try:\n"
            "        timm.create_model(name, pretrained=True)\n"
            "    except HubUnreachableError as e:\n"
            "        assert isinstance(e, OSError) and 'pretrained_cfg_overlay=dict(file=FILE)' in str(e), e\n"
            "        assert 'HF_HUB_OFFLINE=1 is set' in str(e) and 'not in the local cache' in str(e), e\n"
            "    else:\n"
            "        raise AssertionError(name)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_a_truncated_adapter_is_refused_naming_it(tmp_path, capsys):
    from timm_tokcomp.tocom import Compensator
    from timm_tokcomp.tocom.hub import save

    torch.manual_seed(0)
    save(Compensator.init(2, 12, 192, 192, 4, 1.0), str(tmp_path / "tc"), MODEL)
    weights = tmp_path / "tc" / "step_01" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:400])
    data = _images(tmp_path / "d", labels=[0, 1, 0, 1])
    _assert_refused(["bench", MODEL, "--data", str(data), "--tocom", str(tmp_path / "tc"), "--no-progress"], capsys,
                    "step_01/adapter_model.safetensors", "cannot be read as safetensors")


# ------------------------------------------------------------------ JSON files: presets, adapter configs


def test_a_preset_that_is_not_text_is_refused(tmp_path, capsys):
    preset = tmp_path / "p.json"
    preset.write_bytes(b"\xff\xfe\x00binary")
    data = _images(tmp_path / "d", labels=[0, 1, 0, 1])
    commands = _commands(str(data), str(tmp_path / "out"))
    for command in ("bench", "speed", "tune", "analyze"):  # every command whose --methods takes presets
        _assert_refused(commands[command] + ["--methods", f"tome_r8,{preset}"], capsys, str(preset), "JSON")


@pytest.mark.parametrize("command", [*_commands("", ""), "export"])
def test_an_unreachable_hub_model_is_explained_by_every_command(tmp_path, capsys, monkeypatch, command):
    """--pretrained when the Hub cannot be reached and nothing is cached (as huggingface_hub raises it): one error
    line naming --pretrained and the way out, in every command that builds a model."""
    import timm
    from huggingface_hub.errors import LocalEntryNotFoundError

    create = timm.create_model

    def offline(name, pretrained=False, **kwargs):
        if pretrained:
            raise LocalEntryNotFoundError("Cannot find the requested files in the disk cache")
        return create(name, **kwargs)

    monkeypatch.setattr(timm, "create_model", offline)
    data = _images(tmp_path / "d", labels=[0, 1, 0, 1])
    argv = {**_commands(str(data), str(tmp_path / "out")),
            "export": ["export", MODEL, "--method", "tome_r8", "--out", str(tmp_path / "m.onnx")]}[command]
    _assert_refused(argv + ["--pretrained"], capsys, "--pretrained", "not in the local cache", "--checkpoint FILE")


def test_an_adapter_config_that_is_not_text_is_refused(tmp_path, capsys):
    from timm_tokcomp.tocom.hub import CONFIG_NAME, load

    (tmp_path / "tc").mkdir()
    (tmp_path / "tc" / CONFIG_NAME).write_bytes(b"\x80\x81\x82")
    with pytest.raises(UserFileError, match="not a text file"):
        load(str(tmp_path / "tc"))
    data = _images(tmp_path / "d", labels=[0, 1, 0, 1])
    _assert_refused(["bench", MODEL, "--data", str(data), "--tocom", str(tmp_path / "tc"), "--no-progress"], capsys,
                    CONFIG_NAME, "not a text file")


# ------------------------------------------------------------------ earlier outputs kept when a new run fails


def _digest(folder: Path):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _earlier_run(folder: Path, names):
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"earlier {name}\n")
    return _digest(folder)


EARLIER = {
    "finetune": ["adapter_model.safetensors", "adapter_config.json", "finetune_config.json", "README.md",
                 "training/checkpoint.pt", "training/log.csv"],
    "train-tocom": ["tocom_config.json", "README.md", "step_00/adapter_model.safetensors", "training/checkpoint.pt"],
    "analyze": ["records/tome_r8.npz", "metrics.csv", "report.md", "depth_maps.png", "overlay_tome_r8.png"],
    "tune": ["tune.csv", "tune_config.json", "table.md", "pareto.png", "preset.json"],
}


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
@pytest.mark.parametrize("command", list(EARLIER))
def test_a_failing_run_keeps_the_earlier_run_in_its_folder(tmp_path, capsys, command, flag):
    out = tmp_path / "out"
    before = _earlier_run(out, EARLIER[command])
    bad, _ = _not_an_image(tmp_path)
    for data in (str(bad), str(tmp_path / "missing")):  # a file that is no image, a mistyped --data
        argv = _commands(data, str(out))[command] + [flag]
        code, err = _run(argv, capsys)
        assert code == 2 and err and err[-1].startswith("tokcomp: error:"), err
        assert _digest(out) == before, (command, flag, data)
        assert not [p for p in out.iterdir() if p.name.startswith(".")]  # nothing set aside left behind


@pytest.mark.parametrize("command, out_flag", [("bench", "--out"), ("bench", "--plot"), ("calibrate", "--out"),
                                               ("speed", "--out"), ("export", "--out"), ("selfcheck", "--out")])
def test_a_failing_command_keeps_the_earlier_file(tmp_path, capsys, command, out_flag):
    """Every command writing one file refuses an existing one without --overwrite, and with it replaces the file
    only once it has succeeded."""
    from timm_tokcomp.commands import selfcheck

    out = tmp_path / "earlier.csv"
    out.write_text("earlier\n")
    bad, _ = _not_an_image(tmp_path)
    weights, _ = _truncated_torch(tmp_path)
    argv = {**_commands(str(bad), ""), "export": ["export", MODEL, "--method", "tome_r8", "--checkpoint", str(weights)],
            "selfcheck": ["--device", "cpu", "--dtypes", "fp8"]}[command]
    if command == "selfcheck":
        with pytest.raises(SystemExit) as e:
            selfcheck.main(argv + [out_flag, str(out), "--overwrite"])
        code = e.value.code
    else:
        code, _ = _run(argv + [out_flag, str(out), "--overwrite"], capsys)
    assert code == 2 and out.read_text() == "earlier\n"


@pytest.mark.parametrize("command", ["finetune", "train-tocom"])
def test_a_damaged_checkpoint_to_resume_is_named_and_the_run_kept(tmp_path, capsys, command):
    out = tmp_path / "out"
    before = _earlier_run(out, EARLIER[command])  # training/checkpoint.pt holds text: not a torch checkpoint
    data = _images(tmp_path / "d", count=8, labels=[0, 1] * 4)
    argv = _commands(str(data), str(out))[command] + ["--resume"]
    if command == "train-tocom":
        argv += ["--batch-size", "2", "--holdout", "2"]
    _assert_refused(argv, capsys, "--resume", "training/checkpoint.pt", "cannot be read as a torch checkpoint")
    assert _digest(out) == before


def test_only_the_images_a_limit_reads_are_checked(tmp_path, capsys):
    """--limit N opens and checks the first N images only: a broken image after them costs nothing and stops
    nothing; one inside them is named. A limit below 1 is refused naming --limit."""
    folder = _images(tmp_path / "d", count=4, labels=[0, 1, 0, 1])
    (folder / "img3.jpg").write_text("not an image")
    assert len(open_images(folder, lambda img: img, limit=3)) == 3
    with pytest.raises(UserFileError, match="img3.jpg is not an image"):
        open_images(folder, lambda img: img, limit=4)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="--limit must be an integer >= 1"):
            open_images(folder, lambda img: img, limit=bad)
    code, err = _run(["bench", MODEL, "--data", str(folder), "--limit", "2", "--methods", "tome_r8",
                      "--rounds", "1", "--no-progress"], capsys)
    assert code == 0, err


def _writers():
    """Every public function that writes a finished output a user names: (name, write(path, overwrite))."""
    from timm_tokcomp.commands import bench, calibrate, speed, tune as tuning
    from timm_tokcomp.tocom import Compensator
    from timm_tokcomp.tocom.hub import save

    bench_rows = [bench.BenchRow("none", 1.0, 0.0, 10.0, 1.0, None, None, 197)]
    speed_rows = [speed.SpeedRow("eager", 2, "none", 1.0, 1.0, None)]
    calibrated = calibrate.CalibrationResult(MODEL, {"alpha": 0.9}, 1.0, 99.0, 1.0, 1.2, 4, 3)
    tuned = {"model": MODEL, "device": "cpu", "device_name": "CPU", "dtype": "fp32", "tf32": False, "budget": 1.0}
    return {
        "bench.write_csv": lambda path, overwrite: bench.write_csv(bench_rows, path, MODEL, overwrite=overwrite),
        "bench.plot_pareto": lambda path, overwrite: bench.plot_pareto(bench_rows, path, MODEL, overwrite=overwrite),
        "speed.write_speed_csv": lambda path, overwrite: speed.write_speed_csv(speed_rows, path, MODEL, {},
                                                                               overwrite=overwrite),
        "calibrate.save_preset": lambda path, overwrite: calibrate.save_preset(calibrated, path, overwrite=overwrite),
        "tuning.save_tuned_preset": lambda path, overwrite: tuning.save_tuned_preset(
            path, tuning.Choice(2, None, "nothing surely faster"), tuned, overwrite=overwrite),
        "tocom.hub.save": lambda path, overwrite: save(Compensator.init(2, 12, 192, 192, 2, 0.1), path, MODEL,
                                                       overwrite=overwrite),
    }


@pytest.mark.parametrize("writer", list(_writers()))
def test_every_writer_refuses_a_finished_output_unless_told(tmp_path, writer):
    """The Python API keeps the CLI's rule (outputs.new_output): a second write to the same path is refused, and
    the first output stays, until overwrite=True."""
    write = _writers()[writer]
    path = str(tmp_path / ("tocom" if writer == "tocom.hub.save" else "out.png" if "plot" in writer else "out.file"))
    write(path, False)
    finished = Path(path) / "tocom_config.json" if writer == "tocom.hub.save" else Path(path)
    before = finished.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        write(path, False)
    assert finished.read_bytes() == before
    write(path, True)
    assert finished.exists()


def test_overwriting_a_compensator_with_fewer_steps_leaves_a_loadable_folder(tmp_path):
    from timm_tokcomp.tocom import Compensator, load
    from timm_tokcomp.tocom.hub import save

    save(Compensator.init(4, 12, 192, 192, 2, 0.1), str(tmp_path / "c"), MODEL)
    save(Compensator.init(2, 12, 192, 192, 2, 0.1), str(tmp_path / "c"), MODEL, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "c").glob("step_*")) == ["step_00", "step_01"]
    assert load(str(tmp_path / "c"))[0].steps == 2
