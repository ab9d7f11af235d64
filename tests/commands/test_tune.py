"""`tokcomp tune` / timm_tokcomp.tune: the outputs and resume on a small model, and the real DeiT-Tiny checks of the
issue (re-timed in a separate bench run, agreement on images tune never saw). The choice on recorded timing tables:
test_tune_choice.py."""
import json
import warnings

import pytest
import torch

import timm_tokcomp
from timm_tokcomp.commands import tune as tuning
from timm_tokcomp.commands.tune import run as tuning_run, timing as tuning_timing
from timm_tokcomp.deployment import modes
from timm_tokcomp.commands.bench import run_bench
from timm_tokcomp.cli import main
from timm_tokcomp.commands.tune import choose, read_rows
from conftest import DATA, make_model, require_data
from timm_tokcomp.deployment.specs import parse_methods

pytestmark = [pytest.mark.slow]  # tune runs, real DeiT-Tiny

scipy_stats = pytest.importorskip("scipy.stats")


def _small_model():
    model = make_model("cls")
    model.pretrained_cfg = {"input_size": (3, 32, 32), "crop_pct": 1.0}
    return model


def recorded_times(times):
    """A time_runs returning recorded per-forward times: plain 1.0, a candidate times[its method] with a 1 % spread
    (each model still runs once, as timing.time_runs runs it)."""
    @torch.inference_mode()
    def time_runs(models, x, rounds=5, warmup=1, progress=None, stop=None):
        for model in models.values():
            model(x)
        return {name: [1.0 if name == tuning.NO_REDUCTION else times[name.split()[0]] * (1 + 0.01 * (-1) ** i)
                       for i in range(rounds)] for name in models}
    return time_runs


@pytest.fixture(scope="module")
def tuned(image_folder, tmp_path_factory):
    """A tune run of the small model at batches 1 and 8, budget 100 (speed decides: ToMe at a recorded 0.6 of plain's
    time, EViT at 0.8), into a folder."""
    out = tmp_path_factory.mktemp("tune") / "run"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tuning_timing, "time_runs", recorded_times({"tome": 0.6, "evit": 0.8}))
        result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[1, 8], budget=100.0,
                                   space=[("tome", {"r": 4}), ("evit", {"r": 3})], limit=20, prune_images=8,
                                   max_rounds=6, out=str(out), show_progress=False)
    return result, out


def test_outputs_and_presets(tuned):
    result, out = tuned
    assert {p.name for p in out.iterdir()} == {"tune.csv", "tune_config.json", "table.md", "pareto.png",
                                               "preset_b1.json", "preset_b8.json", "candidates"}
    rows = read_rows(out / "tune.csv")
    assert len(rows) == 2 * 4  # tome: 3 paths, evit: 1; per batch
    # ToMe, the faster, is checked first and keeps the budget: EViT is never checked
    assert all(r.status == "timed" or r.status.startswith("pruned: MACs") for r in rows if r.method == "tome")
    assert all(r.status.startswith("not checked: slower than tome") and r.screen_n is None
               for r in rows if r.method == "evit")
    # held out until surely within the budget (100 %: after the first batch of 8) or to the last of the 12 images
    assert all(r.agree_n in (8, 12) and r.screen_n == 8 for r in rows if r.method == "tome")
    # a preset per re-timed finalist and batch size
    assert len(list((out / "candidates").iterdir())) == sum(r.status == "timed" for r in rows) >= 2
    for choice in result.choices:
        doc = json.loads((out / f"preset_b{choice.batch}.json").read_text())
        tuned_with = doc["tuned"]
        assert tuned_with["batch_size"] == choice.batch and tuned_with["dtype"] == "fp32"
        assert tuned_with["device"].startswith("CPU") and tuned_with["versions"]["torch"] == torch.__version__
        assert tuned_with["reason"] == choice.reason
        method, params = timm_tokcomp.load_preset(str(out / f"preset_b{choice.batch}.json"))
        model = timm_tokcomp.apply(_small_model(), method, **params)
        if choice.row is None:
            assert method == "none" and not timm_tokcomp.is_reduced(model)
        else:
            assert choice.row.chosen and doc["execution"]["mode"] == choice.row.mode
            assert timm_tokcomp.get_reducer(model).params["prop_attn"] == json.loads(choice.row.params)["prop_attn"]
    assert "### batch 1" in (out / "table.md").read_text()


def test_apply_none_leaves_or_makes_the_model_plain():
    model = timm_tokcomp.apply(_small_model(), "tome", r=2)
    assert timm_tokcomp.apply(model, "none") is model and not timm_tokcomp.is_reduced(model)
    assert not timm_tokcomp.is_reduced(timm_tokcomp.apply(model, "none"))
    with pytest.raises(ValueError, match=r"method 'none' takes no parameters, got \['r'\]"):
        timm_tokcomp.apply(model, "none", r=2)


def test_loading_a_preset_elsewhere_warns(tuned):
    _, out = tuned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timm_tokcomp.load_preset(str(out / "preset_b8.json"), device="cpu", dtype="fp32", batch_size=8)
    with pytest.warns(UserWarning, match=r"tuned under other conditions: dtype fp32 \(now bf16\); batch size 8 "
                                         r"\(now 64\)"):
        timm_tokcomp.load_preset(str(out / "preset_b8.json"), device="cpu", dtype="bf16", batch_size=64)


def test_bench_runs_a_no_reduction_preset_as_the_plain_model(tmp_path):
    from timm_tokcomp.commands.tune import save_tuned_preset

    path = tmp_path / "preset.json"
    settings = {"model": "deit_tiny_patch16_224", "device_name": "elsewhere", "dtype": "bf16", "tf32": False,
                "budget": 1.0}
    save_tuned_preset(path, tuning.Choice(2, None, "nothing surely faster"), settings)
    assert json.loads(path.read_text())["tuned"]["reason"] == "nothing surely faster"
    with pytest.warns(UserWarning, match=r"device elsewhere \(now CPU.*dtype bf16 \(now fp32\)"):
        rows = run_bench("deit_tiny_patch16_224", parse_methods(f"none,{path}", "cpu", "fp32", 2), batch_size=2, timing_rounds=1, latency_runs=0,
                         show_progress=False)
    plain, preset = rows
    assert preset.gmacs == plain.gmacs and preset.tokens_last_block == plain.tokens_last_block == 197


def test_resume_measures_nothing_again_and_refuses_other_settings(tuned, image_folder, monkeypatch):
    result, out = tuned
    def no_timing(*args, **kwargs):
        raise AssertionError("a resumed run timed again")

    monkeypatch.setattr(tuning_timing, "time_runs", no_timing)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()}
    again = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[1, 8], budget=100.0,
                              space=[("tome", {"r": 4}), ("evit", {"r": 3})], limit=20, prune_images=8, max_rounds=6,
                              out=str(out), resume=True, show_progress=False)
    assert [(c.batch, c.row and c.row.candidate) for c in again.choices] == \
        [(c.batch, c.row and c.row.candidate) for c in result.choices]
    # a finished run: its stored answer, nothing measured or written (tune.csv, candidates/ and presets as they were)
    assert again.answer == result.answer and again.table() == result.table()
    assert again.settings["notes"] == [f"--resume: {out} holds a finished run (every setting decided); nothing was "
                                       "measured or written"]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()} == before
    with pytest.raises(ValueError, match=r"other settings \(budget\)"):
        timm_tokcomp.tune(_small_model(), str(image_folder), batches=[1, 8], budget=2.0,
                          space=[("tome", {"r": 4}), ("evit", {"r": 3})], limit=20, prune_images=8, max_rounds=6,
                          out=str(out), resume=True, show_progress=False)
    with pytest.raises(FileExistsError, match="--resume"):
        timm_tokcomp.tune(_small_model(), str(image_folder), out=str(out), limit=20, prune_images=8,
                          show_progress=False)


def _resume_tuned(model, data, out):
    return timm_tokcomp.tune(model, str(data), batches=[1, 8], budget=100.0,
                             space=[("tome", {"r": 4}), ("evit", {"r": 3})], limit=20, prune_images=8, max_rounds=6,
                             out=str(out), resume=True, show_progress=False)


def test_resume_knows_inputs_by_content_not_by_spelling(tuned, image_folder, tmp_path, monkeypatch):
    """The same folder by a relative path resumes; another module of the same architecture, or other images behind
    the same relative path, are refused, and before any image is read."""
    _, out = tuned
    monkeypatch.setattr(tuning_timing, "time_runs", lambda *a, **k: pytest.fail("a resumed run timed again"))
    monkeypatch.chdir(image_folder.parent)
    _resume_tuned(_small_model(), image_folder.name, out)  # relative now, absolute when the run was made

    real_load = tuning_run._load_images
    monkeypatch.setattr(tuning_run, "_load_images", lambda *a, **k: pytest.fail("images read before the check"))
    other_weights = _small_model()
    other_weights.load_state_dict(make_model("cls", seed=1).state_dict())
    with pytest.raises(ValueError, match=r"other settings \(other weights"):
        _resume_tuned(other_weights, image_folder, out)

    other = tmp_path / "elsewhere" / image_folder.name  # the same relative name, in another directory
    other.mkdir(parents=True)
    for i, image in enumerate(sorted(image_folder.iterdir())):
        (other / image.name).write_bytes(image.read_bytes() + b"\0" * i)  # other bytes, one more per file
    monkeypatch.chdir(other.parent)
    with pytest.raises(ValueError, match=r"other settings \(other images in --data\)"):
        _resume_tuned(_small_model(), image_folder.name, out)
    monkeypatch.setattr(tuning_run, "_load_images", real_load)


def test_resume_with_overwrite_is_refused_naming_both(tmp_path, image_folder, capsys):
    with pytest.raises(ValueError, match="--resume and --overwrite exclude each other"):
        timm_tokcomp.tune(_small_model(), str(image_folder), out=str(tmp_path / "run"), resume=True, overwrite=True,
                          limit=20, prune_images=8, show_progress=False)
    assert main(["finetune", "deit_tiny_patch16_224", "--data", str(image_folder), "--out", str(tmp_path / "ft"),
                 "--resume", "--overwrite"]) != 0
    assert "--resume and --overwrite exclude each other" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "ft").exists()


def test_the_choice_is_the_one_its_recorded_table_gives(tuned):
    """Whatever the timings came out as (they depend on the machine's load), each batch size's choice is what
    choose() makes of the rows tune recorded, and a choice's recorded interval lies above 1."""
    result, out = tuned
    recorded = read_rows(out / "tune.csv")
    for choice in result.choices:
        again = choose(recorded, choice.batch, budget=100.0)
        assert (again.row and again.row.candidate) == (choice.row and choice.row.candidate) and \
            again.reason == choice.reason
        assert choice.row.speedup_lo > 1.0 and choice.row.method == "tome"


def test_screening_prunes_what_breaks_the_budget(image_folder, monkeypatch):
    monkeypatch.setattr(tuning_timing, "time_runs", lambda models, x, rounds=5, **kw: {  # r = 12 screened faster
        name: [1.0 if name == tuning.NO_REDUCTION else 0.5 if "r=12" in name else 0.9] * rounds for name in models})
    real = tuning_run._predictions

    def predictions(model, images, batch):  # r = 12 changes every image's class; r = 0 none
        preds = real(model, images, batch)
        reduced = timm_tokcomp.is_reduced(model) and timm_tokcomp.get_reducer(model).params["r"] == 12
        return (preds + 1) % 10 if reduced else preds

    monkeypatch.setattr(tuning_run, "_predictions", predictions)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=30.0,
                               space=[("tome", {"r": 12}), ("tome", {"r": 0})], limit=20, prune_images=8,
                               max_rounds=3, show_progress=False)
    statuses = {r.setting: r.status for r in result.rows}
    # stopped after its first batch of 4: 4 of 4 changed is above 30 % even at the 99 % lower bound (31.6 %)
    assert statuses["tome prop_attn=True r=12"].startswith("pruned: budget (screening changed 4 of 4 images")
    line = next(line for line in result.settings["stages"] if line.startswith("accuracy, fastest first"))
    assert "2 settings checked (1 within the budget, 1 above it, 1 decided before their last image)" in line
    kept = [r for r in result.rows if r.setting == "tome prop_attn=True r=0"]
    # (its other paths save no MACs: 1.11x faster, the default path prunes them)
    assert kept[0].status == "timed" and result.choices[0].row.setting == "tome prop_attn=True r=0"
    assert all(r.status.startswith("pruned: MACs (at most 1.00x") for r in kept[1:])


def test_overwrite_with_a_bad_data_folder_keeps_the_earlier_run(tuned, tmp_path):
    _, out = tuned
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(FileNotFoundError, match="--data"):
        timm_tokcomp.tune(_small_model(), str(tmp_path / "missing"), out=str(out), overwrite=True, limit=20,
                          prune_images=8, show_progress=False)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@torch.inference_mode()
def _even_times(models, x, rounds=5, warmup=1, progress=None, stop=None):
    """Recorded timings (each model still runs once, as timing.time_runs runs it): every candidate as fast as
    plain, a contender never settled."""
    for model in models.values():
        model(x)
    return {name: [1.0] * rounds for name in models}


def test_a_path_that_fails_is_recorded_and_the_rest_go_on(image_folder, monkeypatch):
    real = modes.runner

    def runner(model, mode, x):
        if timm_tokcomp.is_reduced(model) and timm_tokcomp.get_reducer(model).params["prop_attn"] == "fold":
            raise RuntimeError("no kernel for this head dimension")
        return real(model, mode, x)

    monkeypatch.setattr(modes, "runner", runner)
    monkeypatch.setattr(tuning_timing, "time_runs", _even_times)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[2], budget=100.0,
                               space=[("tome", {"r": 2})], limit=20, prune_images=8, max_rounds=3, show_progress=False)
    statuses = {r.path: r.status for r in result.rows}
    assert statuses == {"torch, fold": "failed: RuntimeError: no kernel for this head dimension",
                        "torch, mask": "timed", "torch, fold_qkv": "timed"}
    assert result.choices[0].row is None or result.choices[0].row.path != "torch, fold"


def test_candidates_run_in_inference_mode_from_their_first_call(image_folder, monkeypatch):
    """As timed: a Triton path refuses a forward that records gradients, and a compiled one would compile twice."""
    real = modes.runner

    def runner(model, mode, x):
        run = real(model, mode, x)

        def checked(images):
            if not torch.is_inference_mode_enabled():
                raise RuntimeError("called outside inference mode")
            return run(images)
        return checked

    monkeypatch.setattr(modes, "runner", runner)
    monkeypatch.setattr(tuning_timing, "time_runs", _even_times)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[2], budget=100.0,
                               space=[("tome", {"r": 2})], limit=20, prune_images=8, max_rounds=3, show_progress=False)
    assert {r.status for r in result.rows} == {"timed"}


def test_a_faster_setting_above_the_budget_never_prunes_a_slower_one_within(image_folder, monkeypatch):
    """r = 3 saves the most MACs and runs at a recorded 2x, r = 1 without proportional attention (another axis) at
    1.4x: r = 3 is checked first and breaks the budget on the held-out images, so r = 1 is checked, re-timed and
    chosen (a setting outside the budget never prunes one that may be inside it, however well it screened)."""
    def fake_times(models, x, rounds=5, warmup=1, progress=None, stop=None):
        return {name: [1.0 if name == tuning.NO_REDUCTION else 0.5 if "r=3" in name else 0.7] * rounds
                for name in models}

    real, real_paired, stage = tuning_run._predictions, tuning_run._Tuner._paired, {}

    def paired(self, *args, sequential, **kwargs):
        stage["held out"] = sequential
        return real_paired(self, *args, sequential=sequential, **kwargs)

    def predictions(model, images, batch):
        preds = real(model, images, batch)
        r = timm_tokcomp.get_reducer(model).params["r"] if timm_tokcomp.is_reduced(model) else 0
        if r >= 2 and stage["held out"]:  # the held-out images only
            preds = (preds + 1) % 10
        return preds

    monkeypatch.setattr(tuning_run._Tuner, "_paired", paired)
    monkeypatch.setattr(tuning_timing, "time_runs", fake_times)
    monkeypatch.setattr(tuning_run, "_predictions", predictions)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=50.0,
                               space=[("tome", {"r": 3}), ("tome", {"r": 1, "prop_attn": False})], limit=20,
                               prune_images=8, max_rounds=3, show_progress=False)
    status = {r.setting.split()[-1]: r.status for r in result.rows if r.path in ("torch", "torch, mask")}
    assert status["r=3"].startswith("pruned: held-out (100.00 % of the plain model's predictions changed, 95 % "
                                    "upper bound")
    assert status["r=1"] == "timed" and result.choices[0].row.setting.endswith("r=1")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(space=[("tomee", {"r": 4})]), ValueError, "method must be one of"),
    (dict(space=[("tome", {"rr": 4})]), TypeError, r"unknown parameter\(s\) \['rr'\] for method 'tome'"),
    (dict(space=[("tome",)]), TypeError, "space must hold"),
    (dict(min_speedup=True), ValueError, "--min-speedup must be a finite number >= 1"),
    (dict(prune_images=True), ValueError, "--prune-images must be an integer >= 1"),
    (dict(max_rounds=float("nan")), ValueError, "--rounds must be an integer >= 3"),
])
def test_python_arguments_are_checked_before_any_work(kwargs, error, match, tmp_path):
    args = {**dict(limit=20, prune_images=8, out=str(tmp_path / "o"), show_progress=False), **kwargs}
    with pytest.raises(error, match=match):
        timm_tokcomp.tune(_small_model(), str(tmp_path / "no images yet"), **args)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args,match", [
    (["--budget", "-1"], "argument --budget: must be a finite number in [0, 100] (percentage points)"),
    (["--limit", "8", "--prune-images", "8"], "--limit must be an integer above --prune-images"),
    (["--min-speedup", "0.5"], "argument --min-speedup: must be a finite number >= 1"),
    (["--modes", "graph"], "--modes graph needs --device cuda"),
    (["--batches", "0"], "argument --batches: must be a non-empty list of batch sizes >= 1"),
    (["--methods", "tome_q3"], "--methods: "),
    (["--methods", "tome_r8,dense_tome_r1"], "dense_tome is refused by tune: the dense variant keeps every token"),
])
def test_cli_errors_name_the_flag(args, match, image_folder, tmp_path, capsys):
    code = main(["tune", "deit_tiny_patch16_224", "--data", str(image_folder), "--out", str(tmp_path / "o"),
                 "--no-progress"] + args)
    assert code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def real_split_bench(tmp_path_factory):
    """bench's none / tome_r8 rows on tune's held-out images (128-383 of imagenet-val-1300) and on images 384-1151,
    which tune never sees: {'heldout.csv' | 'unseen.csv': {method: row}}, one run for both measures."""
    data = require_data()
    folder = tmp_path_factory.mktemp("split")
    (folder / "images").symlink_to(data / "imagenet-val-1300" / "images")
    labels = (data / "imagenet-val-1300" / "labels.csv").read_text().splitlines()
    for name, first, last in (("heldout.csv", 128, 384), ("unseen.csv", 384, 1152)):
        (folder / name).write_text("\n".join([labels[0]] + labels[1 + first:1 + last]) + "\n")
    weights = str(DATA / "deit_tiny_patch16_224.safetensors")
    return {name: {r.method: r for r in run_bench("deit_tiny_patch16_224", parse_methods("none,tome_r8"), checkpoint=weights,
                                                   data=str(folder / name), batch_size=64, timing_rounds=0,
                                                   num_workers=0, show_progress=False, latency_runs=0)}
            for name in ("heldout.csv", "unseen.csv")}


@pytest.mark.realdata
@pytest.mark.parametrize("measure, budget", [("agreement", 5.0), ("top1", 1.0)])
def test_real_deit_tiny_choice_follows_its_table_and_holds_on_unseen_images(tmp_path, measure, budget,
                                                                          real_split_bench, monkeypatch, capsys):
    """The issue's check at batch 64, with nothing resting on a timing: tune on the first 384 images of
    imagenet-val-1300; its choice is what its recorded table gives; ToMe r = 8's held-out figure in the budget's
    measure is what a separate bench run measures on the same 256 images; and on images 384-1151 (never seen by
    tune) its loss is within the budget. (ToMe r = 8 changes 11 of the 256 held-out images' top-1 and 29 of those
    768: 4.3 and 3.8 points.) 256 held-out images are too few to promise either budget at the one-sided 95 % upper
    bound (11 of 256 changed: up to 7.0 %), so tune declines and says how many images would do."""
    data = require_data()
    weights = str(DATA / "deit_tiny_patch16_224.safetensors")
    out = tmp_path / "tune"
    monkeypatch.setattr(tuning_timing, "time_runs", recorded_times({"tome": 0.7}))  # accuracy is what is tested
    code = main(["tune", "deit_tiny_patch16_224", "--checkpoint", weights, "--data", str(data / "imagenet-val-1300"),
                 "--out", str(out), "--batches", "64", "--budget", str(budget), "--methods", "tome_r8",
                 "--limit", "384", "--prune-images", "128", "--rounds", "4", "--no-progress",
                 "--budget-on", measure])
    assert code == 0
    rows = read_rows(out / "tune.csv")
    doc = json.loads((out / "preset.json").read_text())
    assert doc["tuned"]["budget_measure"] == measure
    again = choose(rows, 64, budget, measure=measure)
    assert doc["method"] == (again.row.method if again.row else "none"), doc["tuned"]["reason"]
    tome = next(r for r in rows if r.method == "tome")
    assert tome.agree_n == 256 and tome.changed == 11  # the held-out images 128-383
    assert tome.loss_upper(measure) > budget
    assert doc["method"] == "none" and "too few for a promise: about" in doc["tuned"]["reason"]
    if tome.loss(measure) < budget:  # a finalist: re-timed, named as the best measured, with its preset
        assert tome.status == "timed" and "best measured: tome" in capsys.readouterr().out
        assert list((out / "candidates").iterdir())

    bench = real_split_bench

    def loss(rows):
        return (rows["none"].top1 - rows["tome_r8"].top1 if measure == "top1" else 100.0 - rows["tome_r8"].agreement)

    assert loss(bench["heldout.csv"]) == pytest.approx(tome.loss(measure), abs=1e-6)
    assert loss(bench["unseen.csv"]) <= budget


def test_max_rounds_is_an_upper_bound_and_progress_shows_each_phase(image_folder, monkeypatch, capsys):
    """Timings that never settle run exactly --rounds rounds (not the next step above it); the progress bar
    names the phase it is in."""
    calls = []

    def noisy(models, x, rounds=5, warmup=1, progress=None, stop=None):
        calls.append(rounds)
        start = sum(calls) - rounds  # the rounds alternate across calls (the screen times one round a call)
        return {name: [1.0 if name == tuning.NO_REDUCTION else 1.0 + (-0.5) ** (start + i) for i in range(rounds)]
                for name in models}

    monkeypatch.setattr(tuning_timing, "time_runs", noisy)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[2], budget=100.0, space=[("tome", {"r": 1})],
                               limit=12, prune_images=6, max_rounds=10, show_progress=True)
    # the screen (the default path, 3 rounds one at a time), then the re-timing (10): the default path's chunk,
    # then (its default a contender) the other paths' chunk
    assert calls == [1, 1, 1, 5, 3, 2, 5, 3, 2] and all(r.rounds == 10 for r in result.rows if r.status == "timed")
    err = capsys.readouterr().err
    phases = ("tune: timing screen, batch 2, eager", "tune: accuracy: tome prop_attn=True r=1",
              "tune: re-timing the finalists, batch 2, eager", "tune: checking the choice, batch 2")
    for phase in phases:
        assert phase in err, phase


def test_tune_states_its_budget_and_notes_a_missing_plot_extra(image_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(tuning.report, "available", lambda module: False)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[2], budget=2.0, space=[("tome", {"r": 1})],
                               limit=12, prune_images=6, max_rounds=3, out=str(tmp_path / "t"), show_progress=False)
    assert any("pareto.png not drawn" in n and "[plot]' (this checkout's plot extra)" in n for n in result.settings["notes"])
    assert not (tmp_path / "t" / "pareto.png").exists()
    text = result.budget_text()
    assert text.startswith("budget: at most 2.0 % of the plain model's predictions changed") and "no labels" in text
    assert text in (tmp_path / "t" / "table.md").read_text()
    assert json.loads((tmp_path / "t" / "preset.json").read_text())["tuned"]["budget_measure"] == "agreement"


def test_a_top1_budget_needs_labels(image_folder):
    with pytest.raises(ValueError, match="--budget-on top1 needs labelled --data"):
        timm_tokcomp.tune(_small_model(), str(image_folder), batches=[2], budget_on="top1", limit=12, prune_images=6,
                          show_progress=False)
