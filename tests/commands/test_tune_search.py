"""tune's order of work: speed first (a setting surely slower than plain is never checked for accuracy), accuracy
fastest first (the fastest setting within the budget found with fewer checks than the space), an axis pruned both
ways, one token schedule measured once however it is named, the answer always said (the best measured setting with
what would let it be promised, a preset per finalist under candidates/), the end line's reason; the time budget held
within a round of forwards whatever its size (on a recorded clock that moves with every forward)."""
import json

import pytest

import timm_tokcomp
from timm_tokcomp.commands import tune as tuning
from timm_tokcomp.commands.tune import run as tuning_run, timing as tuning_timing
from timm_tokcomp.commands.tune.search import FastestFirst, SettingFacts, make_axes, ranking
from conftest import SMALL
from test_tune import _small_model
from test_tune_budget import Clock


@pytest.mark.parametrize("within_from,answer,checks", [(0, "s4", 1), (2, "s2", 3), (5, None, 5)])
def test_fastest_first_checks_down_one_axis_until_the_first_within(within_from, answer, checks):
    """One axis s0 (mildest, slowest) .. s4 (strongest, fastest); s<i> keeps the budget when i <= 4 - within_from:
    the checks go down from the fastest and stop at the first within."""
    names = [f"s{i}" for i in range(5)]
    search = FastestFirst([names], {64: {n: 1.0 + 0.1 * i for i, n in enumerate(names)}}, dict.fromkeys(names, "m"))
    done = []
    while (name := search.next()) is not None:
        done.append(name)
        search.record(name, int(name[1:]) <= 4 - within_from)
    assert search.answer(64) == answer and len(done) == checks and not search.open(64)
    if answer is not None:
        assert search.milder_than(answer) == names[:names.index(answer)]


def test_a_setting_above_the_budget_decides_the_stronger_ones_of_its_axis():
    """The screen ranks the middle setting fastest (noise): above the budget, it decides the two stronger ones
    without a check; the milder one is then the answer."""
    names = ["r1", "r2", "r3", "r4"]
    speed = {"r3": 1.5, "r4": 1.45, "r2": 1.3, "r1": 1.1}
    search = FastestFirst([names], {64: speed}, dict.fromkeys(names, "tome"))
    assert search.next() == "r3"
    search.record("r3", False)
    assert search.above_by("r4") == "r3" and search.verdict("r4") is False and search.next() == "r2"
    search.record("r2", True)
    assert search.next() is None and search.answer(64) == "r2" and search.milder_than("r2") == ["r1"]


def test_ties_in_speed_favour_the_methods_the_study_supports():
    speed = {"atc a": 1.30, "tome r=8": 1.29, "dpc b": 1.50, "evit r=8": 1.10, "mctf c": 1.11}
    methods = {k: k.split()[0] for k in speed}
    assert ranking(speed, methods) == ["dpc b", "tome r=8", "atc a", "evit r=8", "mctf c"]


def test_several_batch_sizes_check_the_fastest_open_one_first():
    search = FastestFirst([["a"], ["b"]], {1: {"a": 1.2, "b": 1.1}, 64: {"a": 1.1, "b": 1.6}},
                          {"a": "tome", "b": "evit"})
    assert search.next() == "b"  # 1.6x at batch 64
    search.record("b", True)
    assert search.answer(64) == "b" and search.open(1) and search.next() == "a"


def test_axes_hold_a_methods_strengths_and_twins_are_one_schedule():
    facts = [SettingFacts("tome r=16", "tome", {"r": 16}, 2.0, (197, 181)),
             SettingFacts("tome flops_ratio=2.0", "tome", {"flops_ratio": 2.0}, 2.0, (197, 181)),
             SettingFacts("tome r=8", "tome", {"r": 8}, 1.4, (197, 189)),
             SettingFacts("tome r=8 prop_attn=False", "tome", {"r": 8, "prop_attn": False}, 1.4, (197, 189)),
             SettingFacts("evit r=8", "evit", {"r": 8}, 1.4, (197, 189))]
    axes, twins = make_axes(facts)
    assert axes == [["evit r=8"], ["tome r=8", "tome flops_ratio=2.0"], ["tome r=8 prop_attn=False"]]
    assert twins == {"tome r=16": "tome flops_ratio=2.0"}


# recorded per-forward times (plain: 1.0) by ToMe's r: the screen ranks r = 3 fastest; EViT is slower than plain
TIMES = {"tome r=1": 0.9, "tome r=2": 0.8, "tome r=3": 0.5, "tome r=4": 0.6, "tome r=5": 0.55, "evit r=1": 1.3,
         "evit r=2": 1.25}


def _key(name):
    """'tome prop_attn=True r=3 [torch, mask] eager' -> 'tome r=3'."""
    words = name.split(" [")[0].split()
    return f"{words[0]} {next(w for w in words if w.startswith('r='))}"


def _fake(monkeypatch, breaks_from, every=1, times=TIMES):
    """Predictions of a setting with r >= breaks_from changed on every `every`-th image of each batch; milder ones
    equal plain's. time_runs returns recorded times (a 1 % spread, so a few rounds settle them) and records whom it
    timed."""
    real = tuning_run._predictions
    timed = []

    def predictions(model, images, batch):
        preds = real(model, images, batch).clone()
        r = timm_tokcomp.get_reducer(model).params["r"] if timm_tokcomp.is_reduced(model) else 0
        r = max(r) if isinstance(r, list) else r
        if r >= breaks_from:
            preds[::every] = (preds[::every] + 1) % 10
        return preds

    def time_runs(models, x, rounds=5, warmup=1, progress=None, stop=None):
        timed.extend(name for name in models if name != tuning.NO_REDUCTION)
        return {name: [1.0 if name == tuning.NO_REDUCTION else times[_key(name)] * (1 + 0.01 * (-1) ** i)
                       for i in range(rounds)] for name in models}

    monkeypatch.setattr(tuning_run, "_predictions", predictions)
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    return timed


def _checked(monkeypatch):
    """The settings whose accuracy is checked, in order."""
    checked = []
    real = tuning_run._Tuner._check

    def check(self, setting, *args):
        checked.append(setting)
        return real(self, setting, *args)

    monkeypatch.setattr(tuning_run._Tuner, "_check", check)
    return checked


SPACE = [("tome", {"r": r}) for r in (1, 2, 3, 4, 5)] + [("evit", {"r": r}) for r in (1, 2)]


def test_speed_first_then_accuracy_fastest_first_with_the_axis_pruned_both_ways(image_folder, monkeypatch):
    """Settings from r = 3 up change every prediction. The screen drops EViT (1.3x slower) unchecked; the fastest,
    r = 3, is above the budget, which decides r = 4 and r = 5 without a check; r = 2 is within: the answer after 2
    checks of 7 settings; r = 1, milder, is never faster."""
    _fake(monkeypatch, breaks_from=3)
    checked = _checked(monkeypatch)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=30.0, space=SPACE, limit=20,
                               prune_images=8, max_rounds=6, show_progress=False)
    assert [s.split()[-1] for s in checked] == ["r=3", "r=2"] and not any(s.startswith("evit") for s in checked)
    status = {_key(r.candidate): r.status for r in result.rows if r.path in ("torch, mask", "torch")}
    assert status["evit r=1"].startswith("pruned: slower than plain (timing screen: 0.7")
    assert status["tome r=5"].startswith("pruned: budget (stronger than tome prop_attn=True r=3")
    assert status["tome r=1"].startswith("pruned: milder than tome prop_attn=True r=2 on its axis")
    assert result.choices[0].row.setting == "tome prop_attn=True r=2"
    line = next(s for s in result.settings["stages"] if s.startswith("accuracy, fastest first"))
    assert "2 settings checked (1 within the budget, 1 above it" in line and "2 stronger than one above" in line


def test_a_token_schedule_is_measured_once_however_it_is_named(image_folder, monkeypatch):
    timed = _fake(monkeypatch, breaks_from=9)
    space = [("tome", {"r": 2}), ("tome", {"r": [2] * SMALL["depth"]})]
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=30.0, space=space, limit=20,
                               prune_images=8, max_rounds=3, show_progress=False)
    twin = {r.status for r in result.rows if "r=[2, 2" in r.setting}
    assert twin == {"pruned: the same token schedule as tome prop_attn=True r=2 (measured once)"}
    assert not any("r=[2" in name for name in timed)


def test_too_few_images_name_the_best_setting_and_write_a_preset_per_finalist(image_folder, tmp_path, monkeypatch):
    """Every setting changes one image in four (25 %) against a 40 % budget: below it as a point, above it at the
    95 % upper bound on 12 held-out images. Nothing is promised (preset.json: none), but the answer names the one
    closest to a promise (all are as close: the fastest, r = 3), with both intervals and what would let it be
    promised, and candidates/ holds its preset."""
    _fake(monkeypatch, breaks_from=1, every=4)
    out = tmp_path / "t"
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=40.0, space=SPACE[:3],
                               limit=20, prune_images=8, max_rounds=6, out=str(out), show_progress=False)
    assert result.choices[0].row is None
    assert json.loads((out / "preset.json").read_text())["method"] == "none"
    best = next(line for line in result.answer if "best measured" in line)
    assert "tome prop_attn=True r=3 [torch, fold] eager, 2.00x [" in best  # as close as any, and the fastest
    assert "25.00 % of the plain model's predictions changed, 95 % upper bound" in best
    assert "to promise it: about" in best and "more held-out images at its rates (--limit" in best
    assert "or --budget 52.8;" in best  # the upper bound of 3 of 12 (52.7 %), rounded up to a tenth
    presets = sorted(p.name for p in (out / "candidates").iterdir())
    assert "tome_prop_attn=True_r=3_torch_mask_eager.json" in presets and len(presets) >= 3
    preset = json.loads((out / "candidates" / "tome_prop_attn=True_r=3_torch_mask_eager.json").read_text())
    assert preset["method"] == "tome" and preset["params"]["r"] == 3
    assert "NOT promised" in preset["tuned"]["reason"]
    assert timm_tokcomp.load_preset(str(out / "candidates" / "tome_prop_attn=True_r=3_torch_mask_eager.json"))
    table = (out / "table.md").read_text()
    assert "## Answer" in table and "best measured" in table and "preset in candidates/" in table
    assert result.answer[-1].startswith("tune ended: all decided in ")


def test_a_sample_note_comes_before_any_work_and_the_table_counts_settings(image_folder, monkeypatch):
    _fake(monkeypatch, breaks_from=1)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=2.0,
                               space=[("tome", {"r": 2})], limit=12, prune_images=6, max_rounds=3, show_progress=False)
    stages = result.settings["stages"]
    note = next(i for i, s in enumerate(stages) if s.startswith("note:") and "held-out images" in s)
    assert note < next(i for i, s in enumerate(stages) if s.startswith("timing screen"))
    table = result.table()
    assert "no candidate was timed" in table and "| candidate |" not in table
    assert "not timed: 1 setting pruned: budget" in table  # one setting, whatever its three paths


@pytest.mark.parametrize("minutes", [0.1, 0.5, 1.5])
def test_the_time_budget_holds_within_a_round_of_forwards_whatever_its_size(image_folder, monkeypatch, minutes):
    """Every forward (a batch of images, a timed or warm-up forward) takes 1 recorded second: the run ends by the
    budget plus one timing round (plain and up to six candidates)."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    real_predict, real_time_runs = tuning_run._Tuner._predict, tuning_timing.time_runs

    def predict(self, model, images):
        clock.now += 1.0
        return real_predict(self, model, images)

    def slow(model):
        def forward(x):
            clock.now += 1.0
            return model(x)
        return forward

    monkeypatch.setattr(tuning_run._Tuner, "_predict", predict)
    monkeypatch.setattr(tuning_timing, "time_runs", lambda models, x, **kw: real_time_runs(
        {k: slow(m) for k, m in models.items()}, x, **kw))
    space = [("tome", {"r": r}) for r in (1, 2, 3)] + [("evit", {"r": r}) for r in (1, 2)]
    timm_tokcomp.tune(_small_model(), str(image_folder), batches=[2], budget=100.0, space=space, limit=20,
                      prune_images=4, max_rounds=30, time_budget=minutes, show_progress=False)
    assert clock.now <= 60 * minutes + 7.0


def test_a_setting_no_promise_can_come_of_stops_early(image_folder, monkeypatch):
    """Half of every batch changed (50 %) against a budget of 25 %: not surely above at 4 held-out images (the 99 %
    lower bound of 2 / 4 is 4 %), but at these rates not even all 12 held-out images would bring its upper bound
    within 25 %, so it stops there (futility, after the first batch here) instead of spending the rest."""
    from timm_tokcomp.commands.tune import accuracy

    monkeypatch.setattr(accuracy, "FUTILE_LEAST", 4)
    _fake(monkeypatch, breaks_from=1, every=2)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=25.0,
                               space=[("tome", {"r": 2})], limit=20, prune_images=8, max_rounds=3, show_progress=False)
    (status,) = {r.status for r in result.rows}
    assert status.startswith("pruned: held-out (50.00 % of the plain model's predictions changed")
    assert "4 images; at these rates not even all 12 held-out images would bring the bound within the budget" in status


def test_the_cli_ends_with_the_answer_and_verbose_shows_every_candidate(image_folder, tmp_path, monkeypatch,
                                                                        capsys):
    from timm_tokcomp.cli import main

    _fake(monkeypatch, breaks_from=99, times={"tome r=8": 0.7, "evit r=8": 0.8})
    code = main(["tune", "deit_tiny_patch16_224", "--data", str(image_folder), "--out", str(tmp_path / "t"),
                 "--batches", "4", "--budget", "100", "--methods", "tome_r8,evit_r8", "--limit", "20",
                 "--prune-images", "8", "--rounds", "3", "--no-progress", "--verbose"])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("tune ended: all decided in ") and out[-2].startswith("batch 4: tome prop_attn=True "
                                                                                    "r=8 [torch, mask] eager, 1.42x [")
    evit = "batch 4: evit prop_attn=False r=8 [torch] eager: not checked: slower than tome"
    assert any(line.startswith(evit) for line in out), \
        [line for line in out if line.startswith("batch")]
