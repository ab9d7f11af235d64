"""The measuring kit below the commands: deploy (a preset in one call), the fast-path chooser, and a new method
declared in one file plus its line in METHODS (conftest's toy method), seen by bench, speed, tune, export and
`tokcomp methods` (its training step: tests/commands/test_finetune.py)."""
import copy
import warnings

import pytest
import torch

import timm_tokcomp
from timm_tokcomp import methods
from timm_tokcomp.cli import main
from timm_tokcomp.deployment import modes
from timm_tokcomp.commands.paths import FastPath, default_path, fast_paths
from timm_tokcomp.deployment.presets import versions, write_preset
from timm_tokcomp.measure.precision import device_description
from conftest import REPO, make_model
from timm_tokcomp.deployment.specs import parse_methods


def _preset(path, method="tome", params=None, mode="eager", dtype="fp32", device="cpu"):
    tuned = {"model": "small", "device": device_description("cpu") if device == "cpu" else "NVIDIA H100 80GB HBM3",
             "torch_device": device, "dtype": dtype, "tf32": False, "batch_size": 3, "versions": versions()}
    write_preset(path, method, {"r": 2, "prop_attn": "fold"} if params is None else params,
                 execution={"mode": mode}, tuned=tuned)
    return str(path)


@torch.inference_mode()
def test_deploy_runs_the_preset_as_applied_on_its_device(tmp_path, images):
    plain = make_model("cls")
    want = timm_tokcomp.apply(copy.deepcopy(plain), "tome", r=2, prop_attn="fold")(images)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same versions, same device: nothing to warn about
        runner = timm_tokcomp.deploy(copy.deepcopy(plain), _preset(tmp_path / "p.json"))
    assert torch.equal(runner(images), want)
    assert runner.mode == "eager" and runner.device == "cpu" and not runner.model.training
    assert timm_tokcomp.get_reducer(runner.model).params["prop_attn"] == "fold"


@torch.inference_mode()
def test_deploy_of_a_no_reduction_preset_runs_the_plain_model(tmp_path, images):
    plain = make_model("cls")
    runner = timm_tokcomp.deploy(copy.deepcopy(plain), _preset(tmp_path / "p.json", method="none", params={}))
    assert not timm_tokcomp.is_reduced(runner.model)
    assert torch.equal(runner(images), plain(images))


@torch.inference_mode()
def test_deploy_runs_every_call_under_the_recorded_precision(tmp_path, images):
    plain = make_model("cls")
    reduced = timm_tokcomp.apply(copy.deepcopy(plain), "tome", r=2, prop_attn="fold")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reduced(images)
    out = timm_tokcomp.deploy(copy.deepcopy(plain), _preset(tmp_path / "p.json", dtype="bf16"))(images)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


def test_deploy_builds_the_recorded_mode_once_per_model(tmp_path, images, monkeypatch):
    built = []

    def runner(model, mode, x, workdir=None, name="model"):
        built.append(mode)
        return torch.compile(model, backend="eager", dynamic=False)  # dynamo's capture without inductor's minutes

    monkeypatch.setattr(modes, "runner", runner)
    plain = make_model("cls")
    deployed = timm_tokcomp.deploy(copy.deepcopy(plain), _preset(tmp_path / "p.json", mode="compile"))
    first, second = deployed(images), deployed(images)
    assert built == ["compile"]
    with torch.inference_mode():
        want = timm_tokcomp.apply(copy.deepcopy(plain), "tome", r=2, prop_attn="fold")(images)
    assert torch.allclose(first, want, atol=1e-6) and torch.equal(first, second)


def test_deploy_refuses_what_it_cannot_run(tmp_path):
    plain = make_model("cls")
    with pytest.raises(ValueError, match="execution mode graph needs --device cuda"):
        timm_tokcomp.deploy(copy.deepcopy(plain), _preset(tmp_path / "g.json", mode="graph"))
    with pytest.raises(ValueError, match="plain model"):
        timm_tokcomp.deploy(timm_tokcomp.apply(copy.deepcopy(plain), "tome", r=2), _preset(tmp_path / "p.json"))
    with pytest.raises(TypeError, match="model must be a timm model"):
        timm_tokcomp.deploy("deit_tiny_patch16_224", str(tmp_path / "p.json"))
    with pytest.raises(FileNotFoundError, match="missing"):
        timm_tokcomp.deploy(copy.deepcopy(plain), str(tmp_path / "nowhere.json"))
    if not torch.cuda.is_available():
        path = _preset(tmp_path / "c.json", device="cuda")
        with pytest.raises(ValueError, match=f"preset {path}: its recorded device cuda: CUDA is not available"):
            timm_tokcomp.deploy(copy.deepcopy(plain), path)
        with pytest.raises(ValueError, match="device='cuda:0': CUDA is not available"):
            timm_tokcomp.deploy(copy.deepcopy(plain), _preset(tmp_path / "d.json"), device="cuda:0")
    assert not timm_tokcomp.is_reduced(plain)


def test_bench_times_a_preset_in_its_recorded_mode(tmp_path, monkeypatch):
    from timm_tokcomp.commands.bench import format_table, run_bench

    built = []

    def runner(model, mode, x, workdir=None, name="model"):
        built.append((mode, len(x)))
        return model if mode == "eager" else torch.compile(model, backend="eager", dynamic=False)

    monkeypatch.setattr(modes, "runner", runner)
    preset = _preset(tmp_path / "p.json", params={"r": 4}, mode="compile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset was 'tuned' on a small model at batch 3
        rows = run_bench("test_vit", parse_methods(f"none,tome_r4,{preset}"), batch_size=2, timing_rounds=1,
                         latency_runs=1, show_progress=False)
    # the compiled preset is compared with plain compiled ('none@compile'), every row also with the fastest plain
    assert [(r.method, r.backend, r.plain_row) for r in rows] == [
        ("none", "eager", "none"), ("none@compile", "compile", "none@compile"), ("tome_r4", "eager", "none"),
        (preset, "compile", "none@compile")]
    assert sorted(built) == [("compile", 2), ("compile", 2), ("eager", 2), ("eager", 2)]
    assert rows[3].gmacs == pytest.approx(rows[2].gmacs) and rows[1].gmacs == rows[0].gmacs
    assert rows[0].speedup == rows[1].speedup == 1.0 and all(r.vs_fastest_plain is not None for r in rows)
    fastest = max(rows[:2], key=lambda r: r.img_per_s)
    assert fastest.vs_fastest_plain == 1.0
    table = format_table(rows)
    assert "x fastest plain [95%]" in table and "against plain in the row's mode (none, none@compile)" in table
    assert "reduced nothing" not in table


def test_the_chooser_lists_the_paths_the_device_offers():
    model = make_model("cls")
    assert fast_paths(model, "tome", {"r": 2}, "cpu") == [
        FastPath("eager", "torch", "mask"), FastPath("eager", "torch", "fold"), FastPath("eager", "torch", "fold_qkv")]
    qknorm = make_model("layerscale_qknorm")
    assert [p.prop_attn for p in fast_paths(qknorm, "tome", {"r": 2}, "cpu")] == ["mask", "fold"]
    assert {p.mode for p in fast_paths(model, "atm", {}, "cpu", ("eager", "compile"))} == {"eager"}
    assert fast_paths(model, "topk", {"r": 2}, "cpu", ("eager", "compile")) == [
        FastPath("eager", None, False), FastPath("compile", None, False)]
    compiled = fast_paths(model, "evit", {"r": 2, "prop_attn": True}, "cpu", ("compile",))
    assert {p.kernel for p in compiled} == {"torch"} and "fold" in {p.prop_attn for p in compiled}
    assert default_path(model, "tome", {"r": 2}, "cpu") == FastPath("eager", "torch", "mask")
    assert default_path(model, "topk", {"r": 2}, "cpu") == FastPath("eager", None, False)
    with pytest.raises(ValueError, match="--modes graph needs --device cuda"):
        fast_paths(model, "tome", {"r": 2}, "cpu", ("graph",))
    assert FastPath("eager", "torch", "fold").params("tome", {"r": 2}) == {"r": 2, "kernel": "torch", "prop_attn": "fold"}


def test_on_cuda_the_chooser_offers_triton_compiled_where_the_step_is_an_operator(monkeypatch):
    import timm_tokcomp.commands.paths as paths_module

    monkeypatch.setattr(paths_module, "check_device", lambda device: None)  # the paths of a CUDA machine, listed
    model = make_model("cls")
    for method in ("tome", "evit"):  # their steps are custom operators (kernels.library)
        paths = fast_paths(model, method, {"r": 2, "prop_attn": "mask"}, "cuda", ("eager", "compile"))
        assert {(p.mode, p.kernel) for p in paths} == {(m, k) for m in ("eager", "compile") for k in ("torch", "triton")}
    prop = {(p.mode, p.prop_attn) for p in fast_paths(model, "tome", {"r": 2}, "cuda", ("eager", "compile"))}
    assert ("compile", "flex") in prop and ("eager", "flex") not in prop  # flex: compiled, on CUDA
    assert ("compile", "flex") not in {(p.mode, p.prop_attn)
                                       for p in fast_paths(model, "tome", {"r": 2}, "cpu", ("eager", "compile"))}
    dense = fast_paths(model, "dense_tome", {"r": 2}, "cuda", ("eager", "compile"))
    assert {(p.mode, p.kernel) for p in dense} == {("eager", "torch"), ("eager", "triton"), ("compile", "torch")}


def test_tune_asks_the_chooser():
    from timm_tokcomp.commands.tune import candidate_paths

    model = make_model("cls")
    for method, params in (("tome", {"r": 2}), ("atm", {}), ("topk", {"r": 1})):
        paths = fast_paths(model, method, params, "cpu", ("eager", "compile"))
        assert [(c.mode, c.kwargs) for c in candidate_paths(method, params, model, "cpu", ("eager", "compile"))] == \
            [(p.mode, p.params(method, params)) for p in paths]


def test_a_new_method_is_its_class_and_its_line_in_methods(toy_method, monkeypatch, capsys):
    from timm_tokcomp.commands import speed
    from timm_tokcomp.commands.bench import run_bench
    from timm_tokcomp.deployment.onnx import check_exportable
    from timm_tokcomp.commands.tune import candidate_paths

    assert methods.parse_method_tag("toykeep_r2") == ("toykeep", {"r": 2})
    plain, tagged = run_bench("deit_tiny_patch16_224", parse_methods("none,toykeep_r2"), batch_size=2, timing_rounds=0,
                              show_progress=False)
    assert tagged.tokens_last_block == 197 - 2 * 11 and tagged.gmacs < plain.gmacs
    with pytest.raises(ValueError, match="toykeep_r2 cannot be exported to ONNX: a toy method for the tests"):
        run_bench("deit_tiny_patch16_224", parse_methods("none,toykeep_r2"), batch_size=2, backend="onnx",
                  show_progress=False)
    with pytest.raises(ValueError, match="'toykeep' cannot be exported to ONNX: a toy method for the tests"):
        check_exportable(timm_tokcomp.apply(make_model("cls"), "toykeep", r=2))
    assert "toykeep" not in methods.exportable_methods() and "tome" in methods.exportable_methods()

    monkeypatch.setattr(modes, "runner", lambda m, mode, x, *a: torch.compile(m, backend="eager", dynamic=False))
    rows = speed.run_speed("deit_tiny_patch16_224", methods=parse_methods("tome_r8,toykeep_r2"), batches=[2],
                           modes=["eager", "compile"], rounds=1, show_progress=False)
    assert [(r.mode, r.method) for r in rows if "toykeep" in r.method] == [("eager", "toykeep_r2"),
                                                                            ("eager", "toykeep_r2 limit")]

    assert ("toykeep", {"r": 2}) in methods.default_tune_space()
    assert {c.mode for c in candidate_paths("toykeep", {"r": 2}, make_model("cls"), "cpu", ("eager", "compile"))} \
        == {"eager"}

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "toykeep\n  tags: toykeep_r<k>" in out
    # its plan kind serves a rope model too: the kept tokens keep their own rotary positions
    from conftest import family_model

    rope = timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "toykeep", r=2)
    with torch.no_grad():
        assert torch.isfinite(rope(torch.randn(2, 3, 32, 32))).all()
    stats = timm_tokcomp.last_stats(rope)
    assert stats.tokens_per_block[1:] == [stats.tokens_per_block[0] - 2 * i for i in range(1, len(rope.blocks))]
    assert "token counts read from the data (eager only); no ONNX export (a toy method for the tests)" in out


def test_every_parameter_has_its_one_line_help_and_the_docs_show_the_table():
    missing = [(name, p.name) for name, cls in methods.METHODS.items() for p in cls.spec.params if not p.help]
    assert missing == []
    docs = (REPO / "docs" / "methods.md").read_text()
    assert methods.parameter_markdown() in docs


def test_a_preset_with_an_unknown_mode_or_dtype_is_refused_at_the_door(tmp_path):
    for key, value, says in (("mode", "warp", "execution mode 'warp'"), ("dtype", "int8", "dtype 'int8'")):
        path = _preset(tmp_path / f"{key}.json", **{key: value})
        with pytest.raises(ValueError, match=f"preset file .*{key}.json records {says}"):
            timm_tokcomp.load_preset(path)
        with pytest.raises(ValueError, match=f"records {says}"):
            timm_tokcomp.deploy(make_model("cls"), path)
