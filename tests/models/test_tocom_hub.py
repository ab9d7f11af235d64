"""ToCom adapters on disk and on the Hub: round trip, stock peft loads one step, offline HF cache."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from timm_tokcomp.tocom import attach, compensate, load, push_to_hub, save
from conftest import SMALL, _hub_cache, _random_compensator, make_model


def test_save_load_round_trip_is_exact(tmp_path):
    comp = _random_compensator(steps=4)
    save(comp, str(tmp_path), "test/small-vit", method_settings={"prop_attn": True}, results="none yet")
    got, config = load(str(tmp_path))
    assert torch.equal(got.lora_a, comp.lora_a) and torch.equal(got.lora_b, comp.lora_b) and got.scale == comp.scale
    assert config["groups"] == 4 and config["depth"] == SMALL["depth"] and config["method_settings"] == {"prop_attn": True}
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\nbase_model: test/small-vit\n") and "step_03" in card
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "step_00", "step_01", "step_02", "step_03",
                                                          "tocom_config.json"]


def test_stock_peft_loads_one_step_with_the_same_weights(tmp_path):
    comp = _random_compensator(steps=4)
    save(comp, str(tmp_path), "test/small-vit")
    ours = attach(make_model("cls"), comp, source_r=2)
    compensate(ours, 3)
    merged = PeftModel.from_pretrained(make_model("cls"), str(tmp_path), subfolder="step_02").merge_and_unload()
    for a, b in zip(ours.blocks, merged.blocks):
        torch.testing.assert_close(b.attn.qkv.weight, a.attn.qkv.weight, rtol=1e-6, atol=1e-6)


def test_corrupt_adapters_are_refused(tmp_path):
    save(_random_compensator(steps=2), str(tmp_path), "m")
    from safetensors.torch import load_file, save_file
    f = tmp_path / "step_01" / "adapter_model.safetensors"
    tensors = load_file(str(f))
    tensors["base_model.model.blocks.0.attn.qkv.lora_B.weight"][SMALL["embed_dim"] + 1, 0] = 1.0  # a key row
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match="not block-structured"):
        load(str(tmp_path))
    with pytest.raises(ValueError, match="no tocom_config.json"):
        load(str(tmp_path / "step_00"))


def _edit_config(folder: Path, **changes) -> None:
    import json

    path = folder / "tocom_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("damage, match", [
    (lambda root: _edit_config(root, groups=3), "groups = 3 but subfolders lists 2"),
    (lambda root: _edit_config(root, scale=float("nan")), "scale must be a finite number"),
    (lambda root: _edit_config(root, depth="4"), "depth"),
    (lambda root: (root / "step_01" / "adapter_model.safetensors").write_bytes(
        (root / "step_01" / "adapter_model.safetensors").read_bytes()[:500]), "step_01/adapter_model.safetensors cannot be read"),
    (lambda root: (root / "step_00" / "adapter_model.safetensors").unlink(), "step_00/adapter_model.safetensors is missing"),
    (lambda root: (root / "tocom_config.json").write_text("{"), "not valid JSON"),
    # a config that disagrees with its files: one block fewer than the step files hold, a step folder it omits
    (lambda root: _edit_config(root, depth=3), "depth 3\\) does not describe"),
    (lambda root: __import__("shutil").copytree(root / "step_01", root / "step_02"), "folder holds .*step_02"),
])
def test_damaged_adapters_are_refused_naming_the_file(tmp_path, damage, match):
    save(_random_compensator(steps=2), str(tmp_path), "m")
    damage(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load(str(tmp_path))


def test_a_non_finite_lora_a_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save(_random_compensator(steps=2), str(tmp_path), "m")
    f = tmp_path / "step_01" / "adapter_model.safetensors"
    tensors = load_file(str(f))
    tensors["base_model.model.blocks.2.attn.qkv.lora_A.weight"][0, 0] = float("nan")
    save_file(tensors, str(f))
    with pytest.raises(ValueError, match="step_01.* holds NaN or inf in tensor 'base_model.model.blocks.2.attn.qkv"):
        load(str(tmp_path))


def test_load_from_the_hub_cache_offline(tmp_path):
    comp = _random_compensator(steps=3)
    save(comp, str(tmp_path / "src"), "test/small-vit")
    commit = "0123456789abcdef0123456789abcdef01234567"
    _hub_cache(tmp_path / "cache", "someone/small-tocom", tmp_path / "src", commit)
    script = (
        "import sys, torch; from timm_tokcomp.tocom import load\n"
        "c, cfg = load('someone/small-tocom', cache_dir=sys.argv[1])\n"
        "c2, _ = load('someone/small-tocom', revision=sys.argv[2], cache_dir=sys.argv[1])\n"
        "torch.save((c.lora_a, c.lora_b, c2.lora_a), sys.argv[3])\n"
        "try:\n    load('someone/not-cached', cache_dir=sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = tmp_path / "out.pt"
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache"), commit, str(out)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    a, b, a2 = torch.load(out)
    assert torch.equal(a, comp.lora_a) and torch.equal(b, comp.lora_b) and torch.equal(a2, comp.lora_a)
    # an uncached repository while offline: one clear error naming it, the cache and what to do
    assert run.stdout.startswith("UserFileError someone/not-cached: no such folder (from ")
    assert "so it was read as a Hub repo id: the Hub cannot be reached" in run.stdout
    assert "not in the local cache" in run.stdout and "HF_HUB_OFFLINE=1" in run.stdout


def test_push_to_hub_uploads_the_saved_layout(monkeypatch):
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls["repo"] = repo_id

        def upload_folder(self, repo_id, folder_path, commit_message):
            calls["files"] = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
            return "https://huggingface.co/someone/x/commit/1"

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    url = push_to_hub(_random_compensator(steps=1), "someone/x", "test/small-vit")
    assert calls["repo"] == "someone/x" and url.endswith("/commit/1")
    assert calls["files"] == ["README.md", "step_00/adapter_config.json",
                              "step_00/adapter_model.safetensors", "tocom_config.json"]


def test_a_missing_local_folder_is_named(tmp_path):
    from timm_tokcomp.tocom import load

    for missing in (str(tmp_path / "nope"), "./nope", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="no such folder .*; expected a compensator folder"):
            load(missing)
