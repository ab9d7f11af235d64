"""The newest surfaces hold, one test per class of defect: data-dependent reductions keep a patch token per image,
every plan kind carries rotary positions under both rope_merge choices, DiffRate's schedule never reduces in block 0,
and the other doors of the 2023-2025 methods (see the tests' names)."""
import pytest
import torch

import timm_tokcomp
from conftest import DATA, SMALL, make_model, positions_seen, thresholds, family_model

DEPTH = SMALL["depth"]


def _prune_everything(depth):
    return thresholds(depth, merge=1.0, prune=1e6)  # importance / 1000 never reaches 1000: every slot fails


@pytest.mark.parametrize("name", ["avgpool_noclass", "cls"])
def test_ltmp_pruning_every_patch_keeps_one_per_image(name, images):
    model = timm_tokcomp.apply(make_model(name), "ltmp", threshold_params=_prune_everything(DEPTH))
    with torch.no_grad():
        logits = model(images)
    assert torch.isfinite(logits).all()
    stats = timm_tokcomp.last_stats(model)
    real = stats.size[:, model.num_prefix_tokens:, 0] > 0
    assert (real.sum(dim=1) >= 1).all()


@pytest.mark.parametrize("name", ["eva02_cat_swiglu", "siglip_map"])
def test_ltmp_pruning_every_patch_on_other_heads_stays_finite_and_per_image(name, images):
    overrides = dict(global_pool="avg") if name.startswith("eva") else {}
    model = family_model(name, **overrides)
    depth = len(model.blocks)
    model = timm_tokcomp.apply(model, "ltmp", threshold_params=_prune_everything(depth))
    with torch.no_grad():
        logits = model(images)
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[0], logits[1])  # the images are still told apart


# one method per plan kind that has destinations (a kept token, a merge's destination, a keeper, a group's lead)
DESTINATION_PLANS = {
    "MergePlan": ("tome", lambda depth: dict(r=3)),
    "KeepMergePlan": ("diffrate", lambda depth: dict(schedule={"prune": [16] + [12] * (depth - 1),
                                                                 "merge": [16] + [8] * (depth - 1)})),
    "GroupPlan": ("ltmp", lambda depth: dict(threshold_params=thresholds(depth, merge=0.0, prune=2.0))),
    "PrunePlan": ("topk", lambda depth: dict(r=3)),
}


@pytest.mark.parametrize("kind", sorted(DESTINATION_PLANS))
def test_every_plan_kind_carries_positions_under_both_rope_merge_choices(kind, images):
    """Under 'dst' every output token sits on the grid point of one of the patches it holds; under 'centroid' at the
    (size-weighted) centroid of what it holds; the two runs differ where something merged."""
    method, params = DESTINATION_PLANS[kind]
    out = {}
    for rope_merge in ("dst", "centroid"):
        model = family_model("eva02_cat_swiglu")
        model = timm_tokcomp.apply(model, method, trace_source=True, rope_merge=rope_merge,
                                   **params(len(model.blocks)))
        seen = positions_seen(model, images)
        assert seen and {k for k, _, _ in seen} == {kind}
        stats = timm_tokcomp.last_stats(model)
        assert stats.rope_merge == rope_merge
        p = model.num_prefix_tokens
        grid, final = seen[0][1], seen[-1][2]
        source = stats.source[:, p:, p:]
        if rope_merge == "dst":
            held = (grid[:, None, :, :] == final[:, :, None, :]).all(-1) & (source > 0)
            assert held.any(-1).all()
        with torch.no_grad():
            out[rope_merge] = (final, model(images))
    if kind != "PrunePlan":  # a pruned token is its own destination and centroid: both choices agree
        assert not torch.equal(out["dst"][0], out["centroid"][0])
        assert not torch.equal(out["dst"][1], out["centroid"][1])
    else:
        assert torch.equal(out["dst"][1], out["centroid"][1])


def test_a_diffrate_schedule_reducing_in_block_0_is_refused():
    n = (SMALL["img_size"] // SMALL["patch_size"]) ** 2
    with pytest.raises(ValueError, match="reduce in block 0, which DiffRate never does; give this model's 64 patch"):
        timm_tokcomp.apply(make_model("cls"), "diffrate", schedule={"prune": [n - 8] * DEPTH, "merge": [n - 8] * DEPTH})
    timm_tokcomp.apply(make_model("cls"), "diffrate", schedule={"prune": [n] + [n - 8] * (DEPTH - 1),
                                                                "merge": [n] * DEPTH})


@pytest.mark.parametrize("method, params", [("diffrate", {}), ("ltmp", {}), ("dtem", dict(r=4))])
def test_in_place_training_steps_are_refused_on_rope_models_with_a_message(method, params, images):
    """DiffRate's search, LTMP and DTEM train with every token in place: on a rope model the forward says so, and
    `tokcomp finetune` refuses before it makes its run folder; their eval models run."""
    model = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), method, **params)
    with pytest.raises(NotImplementedError, match="train it on a model without rotary embeddings"):
        model.train()(images)
    with torch.no_grad():
        assert torch.isfinite(model.eval()(images)).all()


def test_finetune_refuses_in_place_training_on_a_rope_model_before_its_folder(image_folder, tmp_path):
    from timm_tokcomp.training import FinetuneConfig, finetune

    out = tmp_path / "run"
    config = FinetuneConfig(method="dtem_r8", epochs=1, batch_size=4, distill=True, lora_rank=0)
    with pytest.raises(ValueError, match="dtem trains with every token in place .* Eva has rotary embeddings"):
        finetune("eva02_tiny_patch14_224", str(image_folder), str(out), config=config, show_progress=False,
                 num_workers=0)
    assert not out.exists()


def test_fpet_and_radial_patterns_read_the_models_patch_grid_not_the_square_root_of_the_count():
    """A 4 x 16 grid (64 patch tokens, whose square root would say 8 x 8): every FPET merge joins cells of different
    colours of the real checkerboard (each token holds one B cell), and the l-infinity pattern keeps the middle
    columns."""
    from timm.models.vision_transformer import VisionTransformer

    def wide():
        torch.manual_seed(0)
        return VisionTransformer(**{**SMALL, "img_size": (16, 64)}).eval()

    x = torch.randn(2, 3, 16, 64)
    model = timm_tokcomp.apply(wide(), "fpet", refine=False, trace_source=True, layer=0)
    with torch.no_grad():
        model(x)
    p = model.num_prefix_tokens
    source = timm_tokcomp.last_stats(model).source[:, p:, p:]  # (B, 32, 64)
    colour = torch.tensor([(i // 16 + i % 16) % 2 for i in range(64)])
    for b in range(2):
        for row in source[b]:
            held = row.nonzero().flatten()  # one B cell (odd row + column) and the A cells merged into it
            assert (colour[held] == 1).sum() == 1
    model = timm_tokcomp.apply(wide(), "linf", keep_rate=0.5, stages=(2,), trace_source=True)
    with torch.no_grad():
        model(x)
    held = timm_tokcomp.last_stats(model).source.sum(1)[0, p:].nonzero().flatten()
    assert {i % 16 for i in held.tolist()} == set(range(4, 12))  # the 8 middle of 16 columns, all 4 rows


@pytest.mark.parametrize("method, params", [("pitome", dict(r=100)), ("mctf", dict(r=100)), ("ltmp", {}),
                                            ("tome", dict(r=100))])
@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (2, 3, 8, 4), (0, 3, 32, 32)])
def test_one_patch_token_none_left_or_an_empty_batch_run_as_the_plain_model_does(method, params, shape):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    plain = VisionTransformer(**SMALL, dynamic_img_size=shape[0] > 0).eval()  # timm's dynamic size: no empty batch
    x = torch.randn(*shape)
    with torch.no_grad():
        want = plain(x)
        got = timm_tokcomp.apply(plain, method, **params)(x)
    assert got.shape == want.shape and torch.isfinite(got).all()


def test_none_means_the_default_for_every_parameter():
    model = timm_tokcomp.apply(make_model("cls"), "fpet", refine=None)
    assert timm_tokcomp.get_reducer(model).refine is True and model.tokcomp["fpet"] is not None
    model = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=2, rope_merge=None)
    assert timm_tokcomp.get_reducer(model).rope_merge == "dst"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fpet_runs_in_half_precision(dtype, images):
    for model in (timm_tokcomp.apply(make_model("cls"), "fpet").to(dtype),
                  timm_tokcomp.apply(make_model("cls").to(dtype), "fpet")):
        with torch.no_grad():
            out = model(images.to(dtype))
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_a_diffrate_model_pickles_and_saves_whole(images):
    import io

    model = timm_tokcomp.apply(make_model("cls"), "diffrate")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(again(images), model(images))


@pytest.mark.parametrize("method, params, new", [
    ("fpet", {}, dict(trace_source=True)),
    ("fpet", {}, dict(refine=False)),
    ("ltmp", dict(thresholds={"merge": [0.5] * DEPTH, "prune": [0.0] * DEPTH}), dict(trace_source=True)),
    ("diffrate", {}, dict(trace_source=True)),
    ("diffrate", {}, dict(schedule={"prune": [64] + [40] * (DEPTH - 1), "merge": [64] + [30] * (DEPTH - 1)})),
])
def test_set_params_does_not_blame_learned_parameters_the_user_never_gave(method, params, new):
    model = timm_tokcomp.apply(make_model("cls"), method, **params)
    timm_tokcomp.set_params(model, trace_source=True)  # twice: the made parameters stay marked as made
    timm_tokcomp.set_params(model, **new)
    for key, value in new.items():
        assert getattr(timm_tokcomp.get_reducer(model), key) == value


@pytest.mark.parametrize("method, params", [("ltmp", {}), ("dtem", dict(r=4)), ("fpet", {}), ("diffrate", {})])
def test_a_saved_learned_tensor_with_nan_is_refused_naming_the_file_and_the_tensor(method, params, tmp_path):
    from safetensors.torch import load_file, save_file

    from timm_tokcomp.methods.learned import load_learned, save_learned, weights_file

    model = timm_tokcomp.apply(make_model("cls"), method, **params)
    save_learned(model.tokcomp[method], method, tmp_path)
    path = tmp_path / weights_file(method)
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=f"{path}.* holds NaN or inf in tensor '{name}'"):
        load_learned(method, tmp_path)


def _preset(tmp_path, doc, name="preset.json"):
    import json

    path = tmp_path / name
    path.write_text(json.dumps({"format": 1, "method": "tome", "params": {"r": 2}, **doc}))
    return str(path)


@pytest.mark.parametrize("doc, match", [
    (dict(method=["tome"]), r"key 'method' must be a method name \(a string\), got \[\"tome\"\]"),
    (dict(method={"a": 1}), r"key 'method' must be a method name"),
    (dict(params=["r"]), r"key 'params' must be an object"),
    (dict(execution="compile"), r"key 'execution' must be an object with the keys mode"),
    (dict(execution={"mode": ["eager"]}), r"key 'execution.mode' must be an execution mode"),
    (dict(execution={"modes": "compile"}), r"key 'execution.modes' is not one of execution.mode"),
    (dict(tuned={"versions": "0.2.0"}), r"key 'tuned.versions' must be an object of version strings"),
    (dict(tuned={"dtype": ["bf16"]}), r"key 'tuned.dtype' must be a dtype name"),
    (dict(tuned={"batch_size": True}), r"key 'tuned.batch_size' must be an integer"),
    (dict(method="none", params={"r": 2}), r"key 'params' must be empty for method 'none'"),
])
def test_the_preset_schema_is_checked_once_at_the_door_naming_the_file_and_the_key(doc, match, tmp_path):
    from timm_tokcomp.deployment.specs import parse_methods
    from timm_tokcomp.deployment.presets import read_preset

    path = _preset(tmp_path, doc)
    with pytest.raises(ValueError, match=f"preset file {path}.*{match}"):
        read_preset(path)
    with pytest.raises(ValueError, match=match):  # through bench's / speed's --methods too
        parse_methods(f"none,{path}")
    with pytest.raises(ValueError, match=match):
        timm_tokcomp.deploy(make_model("cls"), path)


def test_deploy_leaves_the_model_as_it_was_when_the_preset_does_not_apply(tmp_path):
    model = make_model("cls").train()
    classes = [type(m) for m in model.modules()]
    path = _preset(tmp_path, dict(params={"r": 2, "alpha": 0.5}))
    with pytest.raises(TypeError, match="unknown parameter"):
        timm_tokcomp.deploy(model, path)
    assert model.training and [type(m) for m in model.modules()] == classes
    assert not timm_tokcomp.is_reduced(model)


def test_bench_names_the_methods_item_whose_preset_fails_to_apply(tmp_path):
    from timm_tokcomp.commands.bench import build_method_models
    from timm_tokcomp.deployment.specs import parse_methods

    path = _preset(tmp_path, dict(params={"r": -3}))
    with pytest.raises(ValueError, match=f"--methods {path}: "):
        build_method_models(make_model("cls"), parse_methods(f"none,tome_r2,{path}"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize("command", [["speed", "deit_tiny_patch16_224", "--batches", "1"],
                                     ["bench", "deit_tiny_patch16_224"],
                                     ["tune", "deit_tiny_patch16_224", "--data", str(DATA), "--out", "unused"]])
def test_every_command_checks_its_device_at_the_door_with_one_line(command, capsys, tmp_path, monkeypatch):
    from timm_tokcomp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*command, "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tokcomp: error: --device cuda: CUDA is not available on this machine (no CUDA device or driver, "
                   "or a torch built without CUDA)"]
    assert not (tmp_path / "unused").exists()


def test_tune_resume_of_a_run_on_random_weights_says_why_and_what_to_give(tmp_path):
    import json

    from timm_tokcomp.commands.tune.store import resume_rows

    saved = {"model": "deit_tiny_patch16_224", "weights_sha256": "a", "data_sha256": "d", "random_weights": True}
    (tmp_path / "tune_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"random weights \(no --checkpoint or --pretrained\), drawn from a fixed "
                                         r"seed, and this run's differ.*--checkpoint FILE or --pretrained"):
        resume_rows(str(tmp_path), {**saved, "weights_sha256": "b"})
    saved["random_weights"] = False
    (tmp_path / "tune_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"other weights \(--checkpoint / --pretrained"):
        resume_rows(str(tmp_path), {**saved, "weights_sha256": "b"})


def test_a_compensator_trained_under_a_short_name_fits_the_same_architecture_by_its_full_name():
    import timm

    from timm_tokcomp.tocom import Compensator, attach

    def compensator(base_model):
        return Compensator(torch.zeros(4, 12, 2, 2, 192), torch.zeros(4, 12, 2, 192, 2), base_model=base_model)

    for trained, served in (("deit_tiny", "deit_tiny_patch16_224"), ("deit_tiny_patch16_224.fb_in1k", "deit_tiny"),
                            ("deit_tiny.fb_in1k", "deit_tiny_patch16_224.fb_in1k")):
        attach(timm.create_model(served), compensator(trained))
    with pytest.raises(ValueError, match="trained for 'deit_small'"):
        attach(timm.create_model("deit_tiny_patch16_224"), compensator("deit_small"))


def test_random_weights_are_the_same_on_every_call_so_a_resume_meets_them_again(tmp_path, image_folder):
    """Without --checkpoint / --pretrained, build_base_model draws timm's random init from a fixed seed (the caller's
    random stream untouched): `analyze --resume` reuses its recordings and writes the same metrics."""
    from timm_tokcomp.cli import main
    from timm_tokcomp.models.build import build_base_model

    state = torch.random.get_rng_state()
    a = build_base_model("deit_tiny_patch16_224", None, False, "cpu").state_dict()
    b = build_base_model("deit_tiny_patch16_224", None, False, "cpu").state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    out = tmp_path / "an"
    args = ["analyze", "test_vit", "--data", str(image_folder), "--methods", "tome_r2,evit_r2", "--limit", "4",
            "--overlays", "0", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    records = {p.name: p.stat().st_mtime_ns for p in (out / "records").iterdir()}
    metrics = (out / "metrics.csv").read_text()
    assert main(args + ["--resume"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "records").iterdir()} == records
    assert (out / "metrics.csv").read_text() == metrics


def test_rope_grid_coordinates_are_made_once_per_module_grid_and_device(images):
    """The reduced Eva forward copies nothing from the host per call (a CUDA graph cannot capture such a copy): the
    grid coordinates are made once and reused."""
    from timm_tokcomp.ops.rope import grid_coords

    model = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=2)
    with torch.no_grad():
        first = model(images)
        grid = grid_coords(model.rope, tuple(model.patch_embed.grid_size), images.device)
        assert grid_coords(model.rope, tuple(model.patch_embed.grid_size), images.device) is grid
        torch.testing.assert_close(model(images), first, rtol=0, atol=0)


def test_dynamicvit_trains_on_a_rope_model_its_masks_moving_no_position(images):
    """DynamicViT's training step masks tokens in place (sizes, no merge): the positions travel unchanged, and it
    trains on EVA02 (it crashed there before, on a plan without the fields a prune reads)."""
    model = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "dynamicvit", keep_rate=0.5, stages=(2, 3)).train()
    seen = positions_seen(model, images)
    assert seen and all(kind == "MaskPlan" and after is before for kind, before, after in seen)
    out = model(images)
    out.sum().backward()
    assert torch.isfinite(out).all()


def test_rope_grid_coordinates_follow_a_change_of_the_rope_modules_grid_settings(images):
    from timm_tokcomp.ops.rope import grid_coords

    model = family_model("eva02_cat_swiglu")
    shape = tuple(model.patch_embed.grid_size)
    before = grid_coords(model.rope, shape, images.device)
    model.rope.grid_offset = model.rope.grid_offset + 1.0
    assert not torch.equal(grid_coords(model.rope, shape, images.device), before)
