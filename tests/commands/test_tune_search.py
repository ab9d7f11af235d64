"""tune's accuracy search and its time budget: each method's axis bisected for its strongest setting within the
budget, one token schedule checked once however it is named, the time budget held within a round of forwards
whatever its size (on a recorded clock that moves with every forward), the plan and the table counting settings."""
import pytest

import timm_tokcomp
from timm_tokcomp import tuning
from timm_tokcomp.tuning import run as tuning_run
from timm_tokcomp.tuning import timing as tuning_timing
from timm_tokcomp.tuning.search import Bisection, SettingFacts, make_axes
from conftest import SMALL
from test_tune import _small_model
from test_tune_budget import Clock


@pytest.mark.parametrize("length,strongest_within", [(1, 0), (1, -1), (8, 5), (8, -1), (8, 7), (5, 2)])
def test_bisection_finds_the_strongest_setting_within_in_log_checks(length, strongest_within):
    names = [f"s{i}" for i in range(length)]
    search = Bisection([names])
    checks = []
    while (name := search.next()) is not None:
        checks.append(name)
        search.record(name, int(name[1:]) <= strongest_within)
    assert len(checks) <= search.most_checks() == length.bit_length()
    verdicts = {**{n: (v, None) for n, v in search.verdicts.items()}, **search.implied()}
    assert {n: v for n, (v, _) in verdicts.items()} == {n: int(n[1:]) <= strongest_within for n in names}


def test_axes_hold_a_methods_strengths_and_twins_are_one_schedule():
    facts = [SettingFacts("tome r=16", "tome", {"r": 16}, 2.0, (197, 181)),
             SettingFacts("tome flops_ratio=2.0", "tome", {"flops_ratio": 2.0}, 2.0, (197, 181)),
             SettingFacts("tome r=8", "tome", {"r": 8}, 1.4, (197, 189)),
             SettingFacts("tome r=8 prop_attn=False", "tome", {"r": 8, "prop_attn": False}, 1.4, (197, 189)),
             SettingFacts("evit r=8", "evit", {"r": 8}, 1.4, (197, 189))]
    axes, twins = make_axes(facts)
    assert axes == [["evit r=8"], ["tome r=8", "tome flops_ratio=2.0"], ["tome r=8 prop_attn=False"]]
    assert twins == {"tome r=16": "tome flops_ratio=2.0"}


def _fake_loss(monkeypatch, breaks_from):
    """Predictions of a setting with r >= breaks_from changed on every image; milder ones equal plain's."""
    real = tuning_run._predictions

    def predictions(model, images, batch):
        preds = real(model, images, batch)
        r = timm_tokcomp.get_reducer(model).params["r"] if timm_tokcomp.is_reduced(model) else 0
        r = max(r) if isinstance(r, list) else r
        return (preds + 1) % 10 if r >= breaks_from else preds

    monkeypatch.setattr(tuning_run, "_predictions", predictions)
    monkeypatch.setattr(tuning_timing, "time_runs", lambda models, x, rounds=5, warmup=1, progress=None, stop=None: {
        name: [1.0 if name == tuning.NO_REDUCTION else 0.5] * rounds for name in models})


def test_the_search_checks_few_settings_and_a_schedule_once(image_folder, monkeypatch):
    """Five strengths of ToMe and r = 2 spelled as a per-block list: the list is r = 2's twin (checked once); the
    bisection checks 3 of the 5 distinct settings (r = 3: above; r = 1, r = 2: within) and decides r = 4 and r = 5
    (stronger than r = 3) by the axis."""
    _fake_loss(monkeypatch, breaks_from=3)
    space = [("tome", {"r": r}) for r in (1, 2, 3, 4, 5)] + [("tome", {"r": [2] * SMALL["depth"]})]
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=30.0, space=space, limit=20,
                               prune_images=8, max_rounds=3, show_progress=False)
    status = {r.setting: r.status for r in result.rows if r.path == "torch, mask"}
    checked = {r.setting for r in result.rows if r.screen_n is not None}
    assert checked == {"tome prop_attn=True r=1", "tome prop_attn=True r=2", "tome prop_attn=True r=3"}
    assert status["tome prop_attn=True r=[2, 2, 2, 2]"].startswith("pruned: the same token schedule as tome "
                                                                   "prop_attn=True r=2")
    assert status["tome prop_attn=True r=5"].startswith("pruned: budget (stronger than tome prop_attn=True r=3")
    assert result.choices[0].row.setting == "tome prop_attn=True r=2"
    line = next(s for s in result.settings["stages"] if s.startswith("accuracy search"))
    assert "2 checked within the budget, 1 above it" in line and "2 decided by their axis" in line and \
        "1 the same schedule as another" in line


def test_a_sample_note_comes_before_any_work_and_the_table_counts_settings(image_folder, monkeypatch):
    _fake_loss(monkeypatch, breaks_from=1)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=2.0,
                               space=[("tome", {"r": 2})], limit=12, prune_images=6, max_rounds=3, show_progress=False)
    stages = result.settings["stages"]
    note = next(i for i, s in enumerate(stages) if s.startswith("note:") and "held-out images" in s)
    assert note < next(i for i, s in enumerate(stages) if s.startswith("accuracy search"))
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
    from timm_tokcomp.tuning import accuracy

    monkeypatch.setattr(accuracy, "FUTILE_LEAST", 4)
    real = tuning_run._predictions

    def predictions(model, images, batch):
        preds = real(model, images, batch).clone()
        if timm_tokcomp.is_reduced(model):
            preds[::2] = (preds[::2] + 1) % 10
        return preds

    monkeypatch.setattr(tuning_run, "_predictions", predictions)
    result = timm_tokcomp.tune(_small_model(), str(image_folder), batches=[4], budget=25.0,
                               space=[("tome", {"r": 2})], limit=20, prune_images=8, max_rounds=3, show_progress=False)
    (status,) = {r.status for r in result.rows}
    assert status.startswith("pruned: held-out (50.00 % of the plain model's predictions changed")
    assert "4 images; at these rates not even all 12 held-out images would bring the bound within the budget" in status
