"""ToCom self-distillation trainer: plugin forward, pair sampling, schedule, loss, end-to-end runs,
resume, and a 2-process torchrun run on CPU."""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image

import timm_tokcomp
from timm_tokcomp.tocom import attach, compensate, load
from timm_tokcomp.training.mosaic import Mosaic, heldout_indices, split_images
from timm_tokcomp.tocom.plugins import Plugins
from timm_tokcomp.training.tocom import TrainConfig, draw_pair, train_tocom, warmup_steps
from timm_tokcomp.training.engine import SeededAugment, distill_loss, epoch_batches, warmup_cosine_lr
from conftest import make_model, _random_compensator

pytestmark = [pytest.mark.slow]  # training runs

TINY = dict(steps=4, batch_size=4, holdout=4, checkpoint_every=2, scale_grid=(0.05, 0.1), scale_targets=(8, 16))


def _test_vit():
    torch.manual_seed(0)
    return timm.create_model("test_vit")


@pytest.mark.parametrize("pair", [(0, 16), (9, 3), (4, 5)])
def test_unmerged_plugins_equal_the_merged_weights(pair, images):
    """The training forward (x A^T B^T added to q / v) equals the compensated weights of switching."""
    m, n = pair
    comp = _random_compensator(seed=3)
    model = make_model("cls")
    timm_tokcomp.apply(model, "tome", r=1)
    plugins = Plugins(comp)
    plugins.install(model)
    with torch.no_grad(), plugins.active(m, n, 0.1):
        unmerged = model(images)
    with torch.no_grad():
        plain = model(images)
    plugins.remove()
    attach(model, comp, source_r=m)
    compensate(model, n)
    with torch.no_grad():
        merged = model(images)
    torch.testing.assert_close(unmerged, merged, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(unmerged, plain, atol=1e-3)


def test_pairs_are_uniform_over_unequal_pairs_and_reproducible():
    pairs = [draw_pair(step, seed=0, groups=16) for step in range(20000)]
    assert all(m != n and 0 <= m <= 16 and 0 <= n <= 16 for m, n in pairs)
    counts = {p: pairs.count(p) for p in set(pairs)}
    assert len(counts) == 17 * 16
    assert min(counts.values()) > 0.5 * 20000 / 272 and max(counts.values()) < 1.5 * 20000 / 272
    assert pairs[:50] == [draw_pair(step, seed=0, groups=16) for step in range(50)]
    assert pairs[:50] != [draw_pair(step, seed=1, groups=16) for step in range(50)]


def test_lr_warms_up_then_decays_to_zero():
    config = TrainConfig(steps=100, warmup_steps=10)
    lrs = [warmup_cosine_lr(s, config.steps, warmup_steps(config), 1.0) for s in range(100)]  # as the engine does
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] < 0.001


def test_epoch_batches_split_global_batches_between_ranks():
    one = epoch_batches(22, epoch=3, seed=0, batch_size=8, rank=0, world=1)
    two = [epoch_batches(22, epoch=3, seed=0, batch_size=4, rank=r, world=2) for r in range(2)]
    assert len(one) == 2 and all(len(b) == 8 for b in one)  # the incomplete last batch is dropped
    assert [a + b for a, b in zip(*two)] == one
    assert epoch_batches(22, epoch=4, seed=0, batch_size=8, rank=0, world=1) != one


def test_mosaic_tiles_image_i_first_then_random_images():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)]
    images = [(Image.new("RGB", (40, 40), c), -1) for c in colours]
    model = _test_vit()  # 160 x 160 inputs
    mosaic = SeededAugment(Mosaic(images, model, grids=(2,), crop_scale=(0.5, 1.0)), seed=0)
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(3, 1, 1)
    for i in range(5):
        x, label = mosaic[i]
        assert x.shape == (3, 160, 160) and label == -1
        rgb = ((x * std + mean) * 255).round()
        tiles = [rgb[:, r:r + 80, c:c + 80] for r in (0, 80) for c in (0, 80)]
        for t in tiles:  # each tile is one whole image: one colour
            assert (t - t[:, :1, :1]).abs().max() <= 1
        assert tuple(tiles[0][:, 0, 0].tolist()) == colours[i]
        assert torch.equal(x, mosaic[i][0])  # seeded: the same mosaic every time in an epoch
    mosaic.epoch = 1
    assert any(not torch.equal(mosaic[i][0], SeededAugment(mosaic.dataset, 0)[i][0]) for i in range(5))


def test_distill_loss_is_kl_times_t_squared_or_l1():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 10, generator=g), torch.randn(5, 10, generator=g)
    assert distill_loss(t, t, 1.0, True).item() == pytest.approx(0.0, abs=1e-6)
    p = F.softmax(t / 2, -1)
    expected = (p * (p.log() - F.log_softmax(s / 2, -1))).sum(-1).mean() * 4
    assert distill_loss(s, t, 2.0, True).item() == pytest.approx(expected.item(), rel=1e-5)
    assert distill_loss(s, t, 1.0, False).item() == pytest.approx((s - t).abs().mean().item(), rel=1e-6)


@pytest.mark.parametrize("bad, flag", [(dict(steps=0), "--steps"), (dict(lr=0), "--lr-base"),
                                       (dict(crop_scale=(0.5, 0.2)), "--crop-min"), (dict(method="atm"), "--method"),
                                       (dict(mosaic=(0,)), "--mosaic"), (dict(scale_targets=(17,)), "--scale-targets"),
                                       (dict(warmup_steps=5000), "--warmup-steps"), (dict(holdout=-1), "--holdout"),
                                       (dict(lr=float("inf")), "--lr-base"),
                                       (dict(temperature=float("nan")), "--temperature"),
                                       (dict(steps=2.5), "--steps")])
def test_bad_settings_are_refused_naming_the_flag(bad, flag):
    with pytest.raises(ValueError, match=flag):
        TrainConfig(**bad).validate()


def test_training_writes_a_loadable_repository_and_leaves_the_model_untouched(image_folder, tmp_path):
    model = _test_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    comp, report = train_tocom(model, str(image_folder), str(tmp_path / "out"), "test_vit",
                               TrainConfig(**TINY), show_progress=False, num_workers=0)
    assert not timm_tokcomp.is_reduced(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert comp.lora_b.abs().sum() > 0  # B left zero-init: the plugins learned something
    loaded, config = load(str(tmp_path / "out"))
    assert torch.equal(loaded.lora_a, comp.lora_a) and torch.equal(loaded.lora_b, comp.lora_b)
    assert config["scale"] == report.chosen_scale in (0.05, 0.1)
    log = (tmp_path / "out" / "training" / "loss_log.csv").read_text().splitlines()
    assert log[0] == "step,r_src,r_tgt,loss,lr,seconds" and len(log) == 5
    assert set(report.loss) == {(0, 8), (0, 16)} and report.images == 4
    assert "Distillation loss on 4 held-out images" in (tmp_path / "out" / "README.md").read_text()


def test_a_second_process_on_the_same_folder_is_refused(image_folder, tmp_path):
    """A run in progress holds out/.lock: another train-tocom on that folder (even with --overwrite, which would
    delete the running run's files) is refused; a lock whose process is gone is taken over."""
    out = tmp_path / "busy"
    out.mkdir()
    (out / "training").mkdir()
    (out / "training" / "checkpoint.pt").write_text("the running run's")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ".lock").write_text(str(holder.pid))
        with pytest.raises(FileExistsError, match=f"in use by another run \\(process {holder.pid}\\)"):
            train_tocom(_test_vit(), str(image_folder), str(out), "test_vit", TrainConfig(**TINY), overwrite=True,
                        show_progress=False, num_workers=0)
        assert (out / "training" / "checkpoint.pt").read_text() == "the running run's"
    finally:
        holder.kill()
        holder.wait()
    train_tocom(_test_vit(), str(image_folder), str(out), "test_vit", TrainConfig(**TINY), overwrite=True,
                show_progress=False, num_workers=0)  # its process is gone: the lock is stale and taken over
    assert load(str(out))[0] is not None and not (out / ".lock").exists()


def test_heldout_batches_are_shared_out_between_ranks(image_folder):
    """10 held-out images in batches of 4: rank 0 of 2 takes batches 0 and 2 (6 images), rank 1 batch 1;
    without an initialised process group nothing is summed, so each report counts its own share."""
    from timm_tokcomp.training.tocom_heldout import choose_scale

    model = timm_tokcomp.apply(_test_vit().eval(), "tome", r=0)
    config = TrainConfig(**{**TINY, "holdout": 10})
    plugins = Plugins(_random_compensator(depth=6, dim=64, attn_dim=64))
    plugins.install(model)
    _, heldout = split_images(str(image_folder), model, config)
    shares = [choose_scale(model, plugins, heldout, config, True, contextlib.nullcontext, "cpu", False, rank, 2)[0]
              for rank in (0, 1)]
    assert [r.images for r in shares] == [6, 4]
    whole, _ = choose_scale(model, plugins, heldout, config, True, contextlib.nullcontext, "cpu", False, 0, 1)
    assert whole.images == 10
    mixed = (6 * shares[0].loss[(0, 16)] + 4 * shares[1].loss[(0, 16)]) / 10
    assert whole.loss[(0, 16)] == pytest.approx(mixed, rel=1e-6)


def test_headless_models_train_on_feature_l1(image_folder, tmp_path):
    model = _test_vit()
    model.reset_classifier(0)
    comp, report = train_tocom(model, str(image_folder), str(tmp_path / "out"), "test_vit",
                               TrainConfig(**TINY), show_progress=False, num_workers=0)
    assert comp.lora_b.abs().sum() > 0 and report.loss[(0, 16)] > 0


def test_amp_trains_fp32_plugins_under_bf16_autocast(image_folder, tmp_path):
    """--amp (the default on CUDA) forced on CPU: bf16 autocast forward, fp32 plugins and optimizer."""
    model = _test_vit()
    comp, report = train_tocom(model, str(image_folder), str(tmp_path / "out"), "test_vit",
                               TrainConfig(**TINY, amp=True), show_progress=False, num_workers=0)
    assert comp.lora_b.dtype == torch.float32 and comp.lora_b.abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in report.loss.values())
    assert next(model.parameters()).dtype == torch.float32
    train_tocom(_test_vit(), str(image_folder), str(tmp_path / "fp32"), "test_vit", TrainConfig(**TINY),
                show_progress=False, num_workers=0)

    def losses(run):
        rows = (tmp_path / run / "training" / "loss_log.csv").read_text().splitlines()[1:]
        return torch.tensor([float(row.split(",")[3]) for row in rows])

    assert not torch.equal(losses("out"), losses("fp32"))  # the forward did run in bf16
    torch.testing.assert_close(losses("out"), losses("fp32"), rtol=0.1, atol=1e-3)


def test_resume_continues_to_the_same_plugins(image_folder, tmp_path):
    config = TrainConfig(**TINY)
    straight, _ = train_tocom(_test_vit(), str(image_folder), str(tmp_path / "a"), "test_vit", config,
                              show_progress=False, num_workers=0)
    _, report = train_tocom(_test_vit(), str(image_folder), str(tmp_path / "b"), "test_vit", config,
                            show_progress=False, num_workers=0, stop_after=3)
    assert report is None and not (tmp_path / "b" / "tocom_config.json").exists()
    resumed, _ = train_tocom(_test_vit(), str(image_folder), str(tmp_path / "b"), "test_vit", config, resume=True,
                             show_progress=False, num_workers=0)
    assert torch.equal(resumed.lora_b, straight.lora_b) and torch.equal(resumed.lora_a, straight.lora_a)
    log = (tmp_path / "b" / "training" / "loss_log.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in log[1:]] == ["1", "2", "3", "4"]
    with pytest.raises(ValueError, match="other settings"):
        train_tocom(_test_vit(), str(image_folder), str(tmp_path / "b"), "test_vit", TrainConfig(**{**TINY, "lr": 1.0}),
                    resume=True, show_progress=False, num_workers=0)


def test_resume_on_another_model_of_the_same_architecture_is_refused(image_folder, tmp_path):
    config = TrainConfig(**TINY)
    train_tocom(_test_vit(), str(image_folder), str(tmp_path / "b"), "test_vit", config, show_progress=False,
                num_workers=0, stop_after=2)
    torch.manual_seed(1)
    with pytest.raises(ValueError, match="another weights_sha256"):
        train_tocom(timm.create_model("test_vit"), str(image_folder), str(tmp_path / "b"), "test_vit", config,
                    resume=True, show_progress=False, num_workers=0)


def test_the_callers_model_is_left_as_it_came(image_folder, tmp_path):
    """Its method (ToMe r=8), training mode, requires_grad flags and weights, whether the run ends or stops."""
    model = timm_tokcomp.apply(_test_vit().train(), "tome", r=8)
    model.blocks[0].requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for out, stop in (("a", None), ("b", 2)):
        train_tocom(model, str(image_folder), str(tmp_path / out), "test_vit", TrainConfig(**TINY), show_progress=False,
                    num_workers=0, stop_after=stop)
        assert timm_tokcomp.get_reducer(model).params["r"] == 8 and model.training
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_heldout_images_are_spread_through_a_sorted_folder_or_taken_from_its_end():
    """3,000 photos sorted by class (150 per class): 'spread' holds out 15 of every class, 'end' the last two."""
    spread = heldout_indices(3000, 300, "spread")
    assert len(set(spread)) == 300 and all(0 <= i < 3000 for i in spread)
    assert [sum(c * 150 <= i < (c + 1) * 150 for i in spread) for c in range(20)] == [15] * 20
    assert heldout_indices(3000, 300, "end") == list(range(2700, 3000))
    assert len(set(heldout_indices(10, 9, "spread"))) == 9
    with pytest.raises(ValueError, match="--holdout-pick"):
        TrainConfig(holdout_pick="first").validate()


def test_split_images_trains_on_every_image_it_does_not_hold_out(image_folder):
    model = timm_tokcomp.apply(_test_vit().eval(), "tome", r=0)
    for pick in ("spread", "end"):
        train, heldout = split_images(str(image_folder), model, TrainConfig(**{**TINY, "holdout": 5, "holdout_pick": pick}))
        assert list(heldout.indices) == heldout_indices(20, 5, pick)
        assert sorted([*train.dataset.images.indices, *heldout.indices]) == list(range(20))


def test_a_checkpoint_from_before_holdout_pick_resumes_as_holding_out_the_end(image_folder, tmp_path):
    """Checkpoints written before the option held out the last images: they resume with 'end' and are
    refused with 'spread' (the split would change under the run)."""
    end = TrainConfig(**{**TINY, "holdout_pick": "end"})
    train_tocom(_test_vit(), str(image_folder), str(tmp_path / "b"), "test_vit", end, show_progress=False,
                num_workers=0, stop_after=2)
    path = tmp_path / "b" / "training" / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    del state["config"]["holdout_pick"]
    torch.save(state, path)
    with pytest.raises(ValueError, match="other settings"):
        train_tocom(_test_vit(), str(image_folder), str(tmp_path / "b"), "test_vit", TrainConfig(**TINY), resume=True,
                    show_progress=False, num_workers=0)
    comp, _ = train_tocom(_test_vit(), str(image_folder), str(tmp_path / "b"), "test_vit", end, resume=True,
                          show_progress=False, num_workers=0)
    assert comp.lora_b.abs().sum() > 0


def test_torchrun_two_processes_match_one_process(image_folder, tmp_path):
    """DDP on gloo: 2 processes x 4 images train the same plugins as 1 process x 8 images, and share
    the 8 held-out images (a batch each) to the same held-out report."""
    args = ["train-tocom", "test_vit", "--data", str(image_folder), "--steps", "3", "--holdout", "8",
            "--scale-grid", "0.1", "--scale-targets", "16", "--no-progress", "--num-workers", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29517",
                          "-m", "timm_tokcomp.cli", *args, "--batch-size", "4", "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "timm_tokcomp.cli", *args, "--batch-size", "8",
                          "--out", str(tmp_path / "one")], env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "without ToCom" in one.stdout and "-> r = 16:" in one.stdout

    def layout(root: Path):
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "training" not in p.parts)

    assert layout(tmp_path / "two") == layout(tmp_path / "one")
    comp_two, config_two = load(str(tmp_path / "two"))
    comp_one, _ = load(str(tmp_path / "one"))
    assert comp_two.lora_b.abs().sum() > 0
    torch.testing.assert_close(comp_two.lora_b, comp_one.lora_b, rtol=1e-3, atol=1e-6)
    assert config_two["base_model"] == "test_vit"
    assert "2 processes" in (tmp_path / "two" / "README.md").read_text()
    report_two, report_one = (json.loads((tmp_path / run / "training" / "heldout.json").read_text())
                              for run in ("two", "one"))
    assert report_two["heldout_images"] == report_one["heldout_images"] == 8
    assert report_two["chosen_scale"] == report_one["chosen_scale"]
    assert report_two["compensated"].keys() == report_one["compensated"].keys() == {"0.1"}
    assert report_two["uncompensated"]["0->16"] == pytest.approx(report_one["uncompensated"]["0->16"], rel=1e-4)
    assert report_two["compensated"]["0.1"]["0->16"] == pytest.approx(report_one["compensated"]["0.1"]["0->16"],
                                                                       rel=1e-3)


def test_cli_refuses_bad_arguments(image_folder, tmp_path, capsys):
    from timm_tokcomp.cli import main

    assert main(["train-tocom", "test_vit", "--data", str(image_folder), "--out", str(tmp_path),
                 "--steps", "0"]) == 2
    assert "argument --steps: must be an integer >= 1" in capsys.readouterr().err
    assert main(["train-tocom", "test_vit", "--data", str(image_folder), "--out", str(tmp_path),
                 "--holdout", "18", "--batch-size", "4", "--no-progress"]) == 2
    assert "fewer than one global batch" in capsys.readouterr().err

