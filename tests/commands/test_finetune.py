"""tokcomp finetune: the saved folder (standard peft adapter + the method's parameters) reloads to the same
predictions, a resumed run equals an uninterrupted one, bad settings are refused naming the flag, and the
folder loads from a Hugging Face cache offline."""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import timm_tokcomp
from timm_tokcomp.cli import main
from timm_tokcomp.training import FinetuneConfig, finetune, load_finetuned
from conftest import _hub_cache

pytestmark = [pytest.mark.slow]  # training runs, torchrun

MODEL = "deit_tiny_patch16_224"  # random weights: the tests check the machinery, not accuracy


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """3 classes x 6 random images (each class its own colour cast), as a labels.csv folder."""
    root = tmp_path_factory.mktemp("labelled")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(18):
        label = i % 3
        pixels = torch.rand(40, 40, 3, generator=g) * 0.5
        pixels[..., label] += 0.5
        Image.fromarray((pixels * 255).to(torch.uint8).numpy()).save(root / f"img_{i:02d}.png")
        rows.append((f"img_{i:02d}.png", label))
    with open(root / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([("file", "label"), *rows])
    return root


def _config(**changes):
    return FinetuneConfig(**{**dict(method="pyra_r8", epochs=2, batch_size=6, warmup_epochs=1, eval_batch_size=9,
                                    lr=3e-3), **changes})


def _predictions_are_the_models(model, images, out):
    """The predictions.csv a finetune run wrote in out are model's top-1 on the images folder (every image, through
    the model's eval transform); returns (those images (n, 3, H, W), the CSV rows)."""
    import timm

    from timm_tokcomp.files.data import open_images

    with open(out / "training" / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    data = open_images(images, timm.data.create_transform(**timm.data.resolve_model_data_config(model)))
    x = torch.stack([data[i][0] for i in range(len(data))])
    with torch.no_grad():
        assert model(x).argmax(-1).tolist() == [int(r["prediction"]) for r in rows]
    return x, rows


def _run(labelled, out, **kwargs):
    return finetune(MODEL, str(labelled), str(out), config=kwargs.pop("config", _config()), show_progress=False,
                    num_workers=0, **kwargs)


@pytest.fixture(scope="module")
def trained(labelled, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "pyra"
    return out, _run(labelled, out)


def test_the_folder_is_a_peft_adapter_that_reloads_to_the_same_predictions(trained, labelled):
    from peft import LoraConfig

    out, result = trained
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "pyra.safetensors", "pyra_config.json",
        "tokcomp_finetune.json", "training"]
    lora = LoraConfig.from_pretrained(str(out))
    assert lora.r == 8 and set(lora.target_modules) == {"qkv"} and lora.modules_to_save == ["head"]
    assert lora.base_model_name_or_path == MODEL
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert any("lora_A" in k for k in weights) and any(".head." in k for k in weights)

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    model = load_finetuned(str(out))
    assert torch.equal(torch.rand(4), expected)  # loading seeds its own draws, not the caller's stream
    assert type(model).__name__ == "ReducingVisionTransformer" and model.head.out_features == 3
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged
    _predictions_are_the_models(model, labelled, out)
    assert result.method_parameters == 12 * 3 * 192 + 12 * 8  # PYRA at r = 8: LayerNorm, W_D, 8 rank weights
    assert result.images == 18 and result.epochs == 2 and 0 < result.gmacs < 1.26 and result.images_per_second > 0
    saved = json.loads((out / "tokcomp_finetune.json").read_text())
    assert saved["results"]["top1"] == pytest.approx(result.top1) and saved["recipe"]["method"] == "pyra_r8"
    log = (out / "training" / "log.csv").read_text().splitlines()
    assert log[0].startswith("epoch,") and len(log) == 3
    assert "| 18 (" in (out / "README.md").read_text()


def test_distill_learns_the_unreduced_model_on_unlabelled_images_and_keeps_the_head(image_folder, tmp_path, capsys):
    """--distill on a plain image folder with PatchMerger: the head is the base model's, the adapter has no
    modules_to_save, the merger's queries are saved and trained, the results carry agreement and no top-1, and
    the reloaded model gives the saved predictions."""
    from peft import LoraConfig
    import timm

    out = tmp_path / "distilled"
    assert main(["finetune", MODEL, "--data", str(image_folder), "--out", str(out), "--method", "patchmerger_k70",
                 "--distill", "--epochs", "2", "--warmup-epochs", "1", "--batch-size", "5", "--lr", "1e-2",
                 "--num-workers", "0", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "agreement with the unreduced model" in printed and "top-1" not in printed
    assert not LoraConfig.from_pretrained(str(out)).modules_to_save
    saved = json.loads((out / "tokcomp_finetune.json").read_text())
    assert saved["results"]["top1"] is None and 0 <= saved["results"]["agreement"] <= 100
    assert saved["num_classes"] == 1000 and saved["recipe"]["distill"] is True
    untrained = timm_tokcomp.apply(timm.create_model(MODEL), "patchmerger", keep_rate=0.7).tokcomp["patchmerger"]
    trained = load_file(str(out / "patchmerger.safetensors"))
    assert not torch.equal(trained["layers.2.queries"], untrained.layers["2"].queries.detach())

    model = load_finetuned(str(out))
    torch.manual_seed(0)
    base = timm.create_model(MODEL)
    assert torch.equal(model.head.weight, base.head.weight)
    x, rows = _predictions_are_the_models(model, image_folder, out)
    with torch.no_grad():
        assert base.eval()(x).argmax(-1).tolist() == [int(r["unreduced_prediction"]) for r in rows]
    log = (out / "training" / "log.csv").read_text().splitlines()
    assert log[0] == "epoch,train_loss,eval_top1,eval_agreement,last_lr,seconds"
    assert all(line.split(",")[2] == "" and float(line.split(",")[3]) >= 0 for line in log[1:])


def test_a_resumed_run_equals_an_uninterrupted_one(trained, labelled, tmp_path):
    out, _ = trained
    assert _run(labelled, tmp_path / "cut", stop_after_epoch=1) is None
    assert not (tmp_path / "cut" / "adapter_model.safetensors").exists()
    _run(labelled, tmp_path / "cut", resume=True)
    for name in ("adapter_model.safetensors", "pyra.safetensors"):
        whole, resumed = load_file(str(out / name)), load_file(str(tmp_path / "cut" / name))
        assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole), name
    with pytest.raises(FileExistsError, match="--resume"):
        _run(labelled, tmp_path / "cut")
    with pytest.raises(ValueError, match="other settings"):
        _run(labelled, tmp_path / "cut", resume=True, config=_config(lr=1e-2))


def test_resume_knows_the_data_by_content_and_checks_it_before_reading_images(labelled, tmp_path, monkeypatch):
    """Another folder behind the same relative path, or another checkpoint, is refused before any image is read;
    the same folder spelled another way (relative; its labels.csv named) resumes."""
    import importlib

    finetune_module = importlib.import_module("timm_tokcomp.training.finetune")

    config = _config(epochs=2)
    _run(labelled, tmp_path / "cut", stop_after_epoch=1, config=config)
    other = tmp_path / "elsewhere" / labelled.name
    other.mkdir(parents=True)
    for file in labelled.iterdir():
        (other / file.name).write_bytes(file.read_bytes() + (b"\0" if file.suffix == ".png" else b""))
    real = finetune_module.open_dataset
    monkeypatch.setattr(finetune_module, "open_dataset", lambda *a, **k: pytest.fail("images read before the check"))
    monkeypatch.chdir(other.parent)
    with pytest.raises(ValueError, match=r"another data_sha256, eval_data_sha256"):
        _run(labelled.name, tmp_path / "cut", resume=True, config=config)
    monkeypatch.chdir(labelled.parent)
    checkpoint = tmp_path / "other.pth"
    torch.manual_seed(5)
    torch.save(__import__("timm").create_model(MODEL).state_dict(), checkpoint)
    with pytest.raises(ValueError, match=r"another weights_sha256"):
        _run(labelled.name, tmp_path / "cut", resume=True, config=config, checkpoint=str(checkpoint))
    monkeypatch.setattr(finetune_module, "open_dataset", real)
    result = finetune(MODEL, f"{labelled.name}/labels.csv", str(tmp_path / "cut"), eval_data=labelled.name,
                      config=config, resume=True, show_progress=False, num_workers=0, stop_after_epoch=1)
    assert result is None  # accepted: already past epoch 1, it stops again at once


def test_overwrite_keeps_the_earlier_run_when_the_new_one_cannot_open_its_data(trained, labelled, tmp_path):
    import shutil

    out = tmp_path / "earlier"
    shutil.copytree(trained[0], out)
    before = sorted(p.name for p in out.rglob("*"))
    with pytest.raises(FileNotFoundError, match="missing"):
        _run(labelled, out, overwrite=True, eval_data=str(tmp_path / "missing"))
    assert sorted(p.name for p in out.rglob("*")) == before


@pytest.mark.parametrize("changes, match", [
    (dict(epochs=0), "--epochs must be an integer >= 1"),
    (dict(warmup_epochs=2), r"--warmup-epochs must be in \[0, epochs=2\)"),
    (dict(method="pyra_x"), "--method: unknown token-reduction tag"),
    (dict(method_args={"pyra_params": 1}), "--method-arg pyra_params cannot be given"),
    (dict(method_args={"shape": 1}), r"--method-arg: unknown parameter\(s\) \['shape'\]"),
    (dict(method="none", method_args={"form": "pooled"}), "--method-arg needs a --method"),
    (dict(augment="heavy"), "--augment must be one of"),
    (dict(method_args={"form": "wide"}), "--method-arg: form must be one of"),
    (dict(crop_scale=(0.0, 1.0)), r"--crop-min must be in \(0, 1\]"),
    (dict(crop_scale=(0.6, 0.5)), r"--crop-min must be in \(0, 1\]"),
])
def test_bad_settings_are_refused_naming_the_flag(changes, match, labelled, tmp_path):
    with pytest.raises(ValueError, match=match):
        _run(labelled, tmp_path / "out", config=_config(**changes))
    assert not (tmp_path / "out").exists()


def test_cli_runs_pooled_pyra_without_reduction_at_eval(labelled, tmp_path, capsys):
    code = main(["finetune", MODEL, "--data", str(labelled), "--out", str(tmp_path / "cli"), "--method", "pyra_r4",
                 "--method-arg", "form=pooled", "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "9",
                 "--num-workers", "0", "--no-progress"])
    assert code == 0 and "saved" in capsys.readouterr().out
    assert json.loads((tmp_path / "cli" / "pyra_config.json").read_text())["form"] == "pooled"
    assert main(["finetune", MODEL, "--data", str(labelled), "--out", str(tmp_path / "bad"), "--method-arg", "x"]) == 2


def test_load_from_the_hub_cache_offline(trained, tmp_path):
    out, _ = trained
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    _hub_cache(tmp_path / "cache", "someone/deit-pyra", out, commit)
    script = ("import sys, torch; from timm_tokcomp.training import load_finetuned\n"
              "torch.manual_seed(0); x = torch.randn(2, 3, 224, 224)\n"
              "with torch.no_grad(): torch.save(load_finetuned('someone/deit-pyra')(x), sys.argv[1])\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "hub.pt")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    torch.manual_seed(0)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "hub.pt"), load_finetuned(str(out))(x))


def test_a_second_process_on_the_same_folder_is_refused(labelled, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".lock").write_text(str(holder.pid))
        with pytest.raises(FileExistsError, match=f"in use by another run \\(process {holder.pid}\\)"):
            _run(labelled, out, resume=True)
    finally:
        holder.kill()
        holder.wait()
    assert _run(labelled, out, resume=True, config=_config(epochs=1, warmup_epochs=0)) is not None  # stale: taken over
    assert not (out / ".lock").exists()


def test_the_methods_own_loss_is_added_to_the_training_loss(image_folder, tmp_path, monkeypatch):
    """DynamicViT's ratio loss reaches the optimiser: a method loss of 100 shows in every logged training loss."""
    from timm_tokcomp.methods.dynamicvit import DynamicViT

    calls = []

    def constant(self):
        calls.append(1)
        return torch.tensor(100.0, requires_grad=True)

    monkeypatch.setattr(DynamicViT, "method_loss", constant)
    config = FinetuneConfig(method="dynamicvit_k70", epochs=1, warmup_epochs=0, batch_size=10, distill=True)
    finetune(MODEL, str(image_folder), str(tmp_path / "dvit"), config=config, show_progress=False, num_workers=0)
    assert len(calls) == 2  # 20 images, batches of 10
    log = (tmp_path / "dvit" / "training" / "log.csv").read_text().splitlines()
    assert float(log[1].split(",")[1]) >= 100


def test_lora_rank_0_trains_only_the_methods_parameters(image_folder, tmp_path):
    """--lora-rank 0 --distill: no adapter files, the backbone's weights untouched, the predictors trained, and
    the folder reloads to the saved predictions; without --distill it is refused naming the flag."""
    import timm

    out = tmp_path / "frozen"
    config = FinetuneConfig(method="dynamicvit_k70", epochs=1, warmup_epochs=0, batch_size=10, distill=True, lora_rank=0)
    finetune(MODEL, str(image_folder), str(out), config=config, show_progress=False, num_workers=0)
    assert not (out / "adapter_config.json").exists() and (out / "dynamicvit.safetensors").is_file()
    model = load_finetuned(str(out))
    torch.manual_seed(0)
    base = timm.create_model(MODEL)
    assert torch.equal(model.blocks[5].attn.qkv.weight, base.blocks[5].attn.qkv.weight)
    torch.manual_seed(0)  # the start finetune drew: the base model from the seed, then the method's from the seed
    untrained = timm_tokcomp.apply(base, "dynamicvit", keep_rate=0.7).tokcomp["dynamicvit"]
    trained = model.tokcomp["dynamicvit"].predictors["0"]
    moved = (trained.proj.weight - untrained.predictors["0"].proj.weight).abs().max()
    assert 0 < moved < 0.1  # trained, from that start
    assert "no LoRA" in (out / "README.md").read_text()
    with pytest.raises(ValueError, match="--lora-rank 0"):
        FinetuneConfig(method="dynamicvit_k70", lora_rank=0).validate()


@pytest.mark.parametrize("damage, match", [
    (lambda root: (root / "adapter_model.safetensors").write_bytes(
        (root / "adapter_model.safetensors").read_bytes()[:300]), "adapter_model.safetensors cannot be read"),
    (lambda root: (root / "adapter_config.json").unlink(), "adapter_config.json is missing"),
    (lambda root: (root / "adapter_config.json").write_text(
        json.dumps({**json.loads((root / "adapter_config.json").read_text()), "r": 4})), "r = 4.*lora_rank 8"),
    (lambda root: (root / "pyra.safetensors").write_bytes(b"\x00" * 16), "pyra.safetensors cannot be read"),
])
def test_a_saved_folder_that_disagrees_with_its_config_is_refused(trained, tmp_path, damage, match):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(trained[0], out)
    damage(out)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_finetuned(str(out))


def test_torchrun_two_processes_match_one_process(labelled, tmp_path):
    """DDP on gloo: 2 processes x 3 images fine-tune the same LoRA adapter and PYRA parameters as 1 process x 6
    images (within 5e-5: the all-reduce sums the two halves' gradients in another order than one batch does, and
    Adam's normalisation magnifies that rounding where a parameter's second moment is tiny; 1.1e-5 on one element of
    4,608 on a 2-core x86 CPU), evaluate to the same per-epoch log, and only rank 0 writes and prints."""
    args = ["finetune", MODEL, "--method", "pyra_r8", "--data", str(labelled), "--epochs", "2", "--warmup-epochs", "1",
            "--eval-batch-size", "4", "--no-progress", "--num-workers", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29519",
                          "-m", "timm_tokcomp.cli", *args, "--batch-size", "3", "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("saved ") == 1
    one = subprocess.run([sys.executable, "-m", "timm_tokcomp.cli", *args, "--batch-size", "6",
                          "--out", str(tmp_path / "one")], env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    for name in ("adapter_model.safetensors", "pyra.safetensors"):
        a, b = load_file(str(tmp_path / "two" / name)), load_file(str(tmp_path / "one" / name))
        assert a.keys() == b.keys() and any(not torch.equal(v, torch.zeros_like(v)) for v in a.values())
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-5)

    def epochs(run):  # every column but the wall time
        return [line.split(",")[:-1] for line in (tmp_path / run / "training" / "log.csv").read_text().splitlines()]

    assert len(epochs("two")) == 3 and [row[2:] for row in epochs("two")] == [row[2:] for row in epochs("one")]
    for row_two, row_one in zip(epochs("two")[1:], epochs("one")[1:]):
        assert float(row_two[1]) == pytest.approx(float(row_one[1]), abs=1e-4)  # train loss


def test_a_new_method_trains_through_the_engine_with_its_own_training_step(toy_method, labelled, tmp_path):
    """conftest's toy method, declared as the recipe says (its class, its plan kinds, its line in METHODS): a
    fine-tuning run applies its training step in every training forward (tokens kept in place, sizes dropped softly),
    its eval plan at evaluation (tokens removed), and the saved folder reloads to its predictions."""
    from conftest import KeepLastStepPlan

    KeepLastStepPlan.applied = 0
    out = tmp_path / "toy"
    result = _run(labelled, out, config=_config(method="toykeep_r4", epochs=1, warmup_epochs=0))
    assert KeepLastStepPlan.applied == 3 * 12  # 3 batches of 6 images, every block reducing
    assert result.method_parameters == 0 and result.images == 18 and result.gmacs < 1.26
    model = load_finetuned(str(out))
    assert timm_tokcomp.get_reducer(model).name == "toykeep"
    with torch.no_grad():
        model(torch.randn(2, 3, 224, 224))
    assert timm_tokcomp.last_stats(model).tokens_per_block[-1] == 197 - 4 * 11
    _predictions_are_the_models(model, labelled, out)
