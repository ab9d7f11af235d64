"""Files a user was sent (docs/guarantees.md, "Files you did not make"): each attack is a file the test makes. Names
in a file stay inside its folder; a few bytes of config are refused before they allocate what no file holds (run
in a subprocess whose address space is capped far below what the attack asks); only what the package writes is
read back; every bad file is one line. Code-running torch files: tests/cli/test_doors.py; links in run folders:
tests/cli/test_run_folders.py."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from test_doors import _RunsCode
from timm_tokcomp import cli
from timm_tokcomp.files.data import open_dataset
from timm_tokcomp.files.userfiles import UserFileError, read_json

pytestmark = [pytest.mark.slow]  # hostile files through every command

REPO = Path(__file__).resolve().parents[2]
PYRA = REPO / "hub_cards" / "deit_tiny_patch16_224-caltech101-pyra-high"
TOCOM = REPO / "hub_cards" / "deit_tiny_patch16_224-tocom"
ALLOWED_GIB = 1.0  # what the capped subprocess may allocate beyond its imports; each attack asks for 3 GB or more


def _capped(code: str) -> str:
    """Run code in a fresh interpreter whose address space is capped ALLOWED_GIB above what its imports took;
    returns the message of the exception it raises (which must be a ValueError / FileNotFoundError)."""
    script = textwrap.dedent("""
        import resource, sys, torch
        torch.set_num_threads(1)
        import timm_tokcomp, timm_tokcomp.training, timm_tokcomp.tocom, timm_tokcomp.commands.analyze.report, transformers
        pages = int(open("/proc/self/statm").read().split()[0])
        limit = pages * resource.getpagesize() + int({gib} * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
        {code}
        except (ValueError, FileNotFoundError) as e:
            print("REFUSED:", e)
        else:
            print("ACCEPTED")
    """).format(gib=ALLOWED_GIB, code=textwrap.indent(textwrap.dedent(code), "    "))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and "REFUSED:" in done.stdout, (done.stdout, done.stderr[-3000:])
    return done.stdout.split("REFUSED:", 1)[1].strip()


def _edit_json(path: Path, **changes) -> None:
    data = read_json(path)
    data.update(changes)
    path.write_text(json.dumps(data))


def _images(folder: Path, names) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(folder / name)
    return folder


# ------------------------------------------------------------------ names that lead outside their folder


@pytest.mark.parametrize("name", ["../secret.jpg", "ABSOLUTE", "link/secret.jpg"])
def test_a_labels_file_names_nothing_outside_its_folder(tmp_path, capsys, name):
    secret = _images(tmp_path / "server", ["secret.jpg"]) / "secret.jpg"
    data = _images(tmp_path / "data", ["a.jpg"])
    (data / "link").symlink_to(secret.parent, target_is_directory=True)
    name = str(secret) if name == "ABSOLUTE" else name
    (data / "labels.csv").write_text(f"file,label\na.jpg,0\n{name},1\n")
    with pytest.raises(UserFileError, match="outside"):
        open_dataset(data, lambda image: image)
    code = cli.main(["bench", "deit_tiny_patch16_224", "--data", str(data), "--methods", "none", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "labels.csv" in err[0] and name in err[0], err


def test_a_tocom_folder_names_no_step_outside_it(tmp_path):
    from timm_tokcomp import tocom

    folder = tmp_path / "tocom"
    shutil.copytree(TOCOM, folder)
    outside = tmp_path / "elsewhere"
    shutil.copytree(folder / "step_00", outside)
    for step in folder.glob("step_*"):
        shutil.rmtree(step)
    config = read_json(folder / "tocom_config.json")
    _edit_json(folder / "tocom_config.json", subfolders=["../elsewhere"] * config["groups"])
    with pytest.raises(UserFileError, match=r"'\.\./elsewhere', outside"):
        tocom.load(str(folder))


@pytest.mark.parametrize("base", ["hf-hub:someone/model", "local-dir:/tmp/model", "/tmp/model", "someone/model"])
def test_a_fine_tuned_folder_names_its_base_by_timm_name_only(tmp_path, base):
    from timm_tokcomp.training import load_finetuned

    folder = tmp_path / "ft"
    shutil.copytree(PYRA, folder)
    _edit_json(folder / "tokcomp_finetune.json", base_model=base)
    with pytest.raises(UserFileError, match="is not a timm model name"):
        load_finetuned(str(folder))


# ------------------------------------------------------------------ sizes checked before allocation


def test_a_tocom_rank_larger_than_its_files_is_refused_before_allocating(tmp_path):
    folder = tmp_path / "tocom"
    shutil.copytree(TOCOM, folder)
    _edit_json(folder / "tocom_config.json", rank_per_projection=200_000)  # ~8 GB of zeros before the fix
    message = _capped(f"timm_tokcomp.tocom.load({str(folder)!r})")
    assert "step_00" in message and "expected" in message


def test_a_pyra_config_larger_than_its_weights_is_refused_before_allocating(tmp_path):
    from timm_tokcomp.methods.learned import load_learned

    folder = tmp_path / "pyra"
    shutil.copytree(PYRA, folder)
    _edit_json(folder / "pyra_config.json", dim=200_000, ranks=[2_000] * 12)  # ~4 GB of parameters
    message = _capped(f"timm_tokcomp.methods.learned.load_learned('pyra', {str(folder)!r})")
    assert "does not match" in message and "pyra_config.json" in message
    assert load_learned("pyra", PYRA) is not None  # the shipped folder still loads


def test_a_fine_tuned_head_larger_than_its_adapter_is_refused_before_building(tmp_path):
    folder = tmp_path / "ft"
    shutil.copytree(PYRA, folder)
    _edit_json(folder / "tokcomp_finetune.json", num_classes=20_000_000)  # a 15 GB head
    message = _capped(f"timm_tokcomp.training.load_finetuned({str(folder)!r})")
    assert "num_classes 20000000" in message and "101 rows" in message


def test_an_hf_config_larger_than_its_weights_is_refused_before_building(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["ViTForImageClassification"], "model_type": "vit", "num_hidden_layers": 200,
        "hidden_size": 8192, "intermediate_size": 32768, "num_attention_heads": 64, "image_size": 32,
        "patch_size": 16}))
    save_file({"vit.embeddings.cls_token": torch.zeros(1, 1, 8192)}, str(folder / "model.safetensors"))
    message = _capped(f"timm_tokcomp.models.build.load_hf_model({str(folder)!r})")
    assert "config.json" in message and "refused before building" in message


def test_a_recording_that_unpacks_beyond_this_run_is_not_decompressed(tmp_path):
    from timm_tokcomp.commands.analyze.record import Recording

    path = tmp_path / "tome_r8.npz"
    with open(path, "wb") as f:  # 3 GB of zeros, a few MB compressed
        np.savez_compressed(f, assign=np.zeros((1500, 1000, 1000), dtype=np.int16), meta=np.array("{}"))
    settings = {"model": "m"}
    small = Recording.bytes_at_most(images=4, depth=12, patches=196, features=192)
    assert _capped(f"""
        from timm_tokcomp.commands.analyze.record import Recording
        rec = Recording.load_if({str(path)!r}, "tome_r8", {settings!r}, {small})
        raise ValueError(f"load_if gave {{rec}}")
    """) == "load_if gave None"
    rec = Recording("tome_r8", np.zeros((4, 12, 196), np.int16), np.ones((4, 196), np.uint8),
                    np.zeros((4, 192), np.float32), (14, 14))
    rec.save(path, settings)
    assert Recording.load_if(path, "tome_r8", settings, small).images == 4  # its own recording is read back
    assert Recording.load_if(path, "tome_r8", {"model": "other"}, small) is None


# ------------------------------------------------------------------ only what the package writes is read back


def test_an_adapter_config_with_a_pattern_is_refused_before_peft_sees_it(tmp_path, monkeypatch):
    import re

    from timm_tokcomp.training import load_finetuned

    folder = tmp_path / "ft"
    shutil.copytree(PYRA, folder)
    _edit_json(folder / "adapter_config.json", target_modules="(a+)+$")
    compiled = []
    real_compile = re.compile
    monkeypatch.setattr(re, "compile", lambda p, *a, **k: compiled.append(p) or real_compile(p, *a, **k))
    monkeypatch.setattr(re, "fullmatch", lambda p, *a, **k: compiled.append(p))
    with pytest.raises(UserFileError, match="target_modules"):
        load_finetuned(str(folder))
    assert "(a+)+$" not in compiled


def test_a_recipe_missing_a_field_takes_its_default_and_an_unknown_one_is_refused(tmp_path):
    from timm_tokcomp.training import load_finetuned

    folder = tmp_path / "ft"
    shutil.copytree(PYRA, folder)
    data = read_json(folder / "tokcomp_finetune.json")
    del data["recipe"]["crop_scale"]
    (folder / "tokcomp_finetune.json").write_text(json.dumps(data))
    assert load_finetuned(str(folder)) is not None
    data["recipe"]["shell"] = "rm -rf /"
    (folder / "tokcomp_finetune.json").write_text(json.dumps(data))
    with pytest.raises(UserFileError, match="fields tokcomp finetune does not write: shell"):
        load_finetuned(str(folder))


# ------------------------------------------------------------------ one line, always


def test_a_deeply_nested_preset_is_one_line(tmp_path):
    preset = tmp_path / "preset.json"
    preset.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserFileError, match="is nested 100,000 levels deep, over the 64"):
        read_json(preset, "--preset")


@pytest.mark.parametrize("side, problem", [(20_000, "decompression bomb"), (9_000, "81 megapixels")])
def test_an_image_over_the_pixel_cap_is_refused_by_name(tmp_path, capsys, side, problem):
    data = _images(tmp_path / "d", ["a.jpg"])
    Image.new("L", (side, side)).save(data / "big.png")  # a few hundred KB
    code = cli.main(["bench", "deit_tiny_patch16_224", "--data", str(data), "--methods", "none", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "big.png" in err[0] and problem in err[0], err
    assert "TOKCOMP_MAX_IMAGE_PIXELS" in err[0]


def test_a_pickled_hf_weights_file_is_one_line_and_runs_nothing(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["ViTForImageClassification"], "model_type": "vit", "num_hidden_layers": 1,
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "image_size": 32, "patch_size": 16}))
    torch.save({"w": torch.zeros(2), "note": _RunsCode(tmp_path / "ran")}, folder / "pytorch_model.bin")
    code = cli.main(["bench", "--hf-model", str(folder), "--methods", "none", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pytorch_model.bin" in err[0] and "nothing in it was run" in err[0], err
    assert not (tmp_path / "ran").exists()


def test_a_hub_download_is_asked_for_by_prefix(tmp_path, monkeypatch):
    import huggingface_hub

    from timm_tokcomp.files.hub import hub_snapshot

    fetched = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: fetched.append(repo) or str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert hub_snapshot("hf-hub:someone/model", "a fine-tuned") == tmp_path and fetched == ["someone/model"]
    with pytest.warns(FutureWarning, match="hf-hub:someone/typo"):
        hub_snapshot("someone/typo", "a fine-tuned")
