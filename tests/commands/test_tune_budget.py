"""tune's time budget and its accuracy promise: the stages end by their share of --time-budget on a recorded clock
(nothing rests on this machine's speed), a killed run resumes from any stage, the bar counts the work being done now,
the stage lines say what was kept and why, other paths wait for their default's figures, and the budget is judged on
the loss's one-sided 95 % upper bound (with the number of images a promise would need)."""
import json

import pytest
import torch

import timm_tokcomp
from timm_tokcomp.commands import tune as tuning
from timm_tokcomp.measure import stats
from timm_tokcomp.commands.tune import TuneRow, choose, read_rows, run as tuning_run, timing as tuning_timing
from timm_tokcomp.cli import main
from test_tune import _small_model

scipy_stats = pytest.importorskip("scipy.stats")

SPACE = [("tome", {"r": 3}), ("tome", {"r": 2}), ("tome", {"r": 1})]  # 3 settings x 3 paths (mask, fold, fold_qkv)


class Clock:
    """Recorded time: it moves only when a recorded timing says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _recorded(clock, seconds_per_forward, candidate_times=(0.5, 1.5), by_r=None, screen_only=None):
    """A time_runs that advances the clock by the forwards it 'ran' (only the screen's when screen_only, a
    monkeypatch, is given) and returns recorded times: plain 1.0, every candidate alternating between
    candidate_times (never settled: its interval holds 1), or by_r[its r] with a 1 % spread."""
    seen, stage = [], {"screen": True}
    if screen_only is not None:
        real = tuning_timing.TimingStage._time

        def time(self, batch, mode, screen):
            stage["screen"] = screen
            return real(self, batch, mode, screen)
        screen_only.setattr(tuning_timing.TimingStage, "_time", time)

    @torch.inference_mode()
    def time_runs(models, x, rounds=5, warmup=1, progress=None, stop=None):
        seen.append(sorted(models))
        time_runs.batches.append(len(x))
        if stage["screen"]:
            clock.now += seconds_per_forward * len(models) * (rounds + warmup)

        def times(name):
            if name == tuning.NO_REDUCTION:
                return [1.0] * rounds
            if by_r is not None:
                return [by_r[name.split(" [")[0].split("r=")[-1]] * (1 + 0.01 * (-1) ** i) for i in range(rounds)]
            return [candidate_times[(i + len(seen)) % 2] for i in range(rounds)]  # alternating across calls
        return {name: times(name) for name in models}
    time_runs.batches = []  # the batch size of each call
    return time_runs, seen


def _tune(folder, **kwargs):
    args = dict(batches=[4], budget=100.0, space=SPACE, limit=20, prune_images=8, max_rounds=6, show_progress=False)
    return timm_tokcomp.tune(_small_model(), str(folder), **{**args, **kwargs})


def test_the_screen_ends_by_its_share_and_a_resume_times_only_what_it_did_not_reach(image_folder, tmp_path,
                                                                                  monkeypatch):
    """One pass, one minute, 3 recorded seconds a forward, batches 4 and 8: batch 4's screen (plain and three default
    paths, 3 rounds: 36 s) runs past the screen's end (27 s), so batch 8's screen is not reached, and tune says so
    in its end line; a resume with no limit screens batch 8 first and goes on to the end."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    monkeypatch.setattr(tuning_run, "MAX_PASSES", 1)
    time_runs, seen = _recorded(clock, seconds_per_forward=3.0)
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    out = tmp_path / "run"
    result = _tune(image_folder, time_budget=1.0, out=str(out), batches=[4, 8])
    assert time_runs.batches[:3] == [4, 4, 4] and 8 not in time_runs.batches
    unreached = [r for r in result.rows if r.status == "not reached: time budget (screen)"]
    assert len(unreached) == 9 and {r.batch for r in unreached} == {8}
    (note,) = [n for n in result.settings["notes"] if "time budget" in n]
    assert "3 settings without their timing screen" in note and "--resume" in note
    assert result.answer[-1].startswith("tune ended: the time budget ended the timing screen")
    time_runs.batches.clear()
    again = _tune(image_folder, time_budget=None, out=str(out), resume=True, batches=[4, 8])
    assert time_runs.batches[0] == 8 and again.answer[-1].startswith("tune ended: all decided")


def test_a_stage_cut_short_gets_what_later_stages_left(image_folder, monkeypatch):
    """One minute, 2 recorded seconds a screened forward, the rest free: batch 4's screen takes 24 s, batch 8's first
    round runs past the screen's end (27 s) and is lost; accuracy and re-timing take nothing, so a second pass
    shares the 28 s left and screens batch 8 (two rounds) instead of leaving them unused."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    time_runs, _ = _recorded(clock, seconds_per_forward=2.0, screen_only=monkeypatch)
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    result = _tune(image_folder, time_budget=1.0, batches=[4, 8])
    assert any(line.startswith("pass 2: 0.5 min left, shared by the stages again")
               for line in result.settings["stages"])
    defaults = [r for r in result.rows if r.batch == 8 and r.path == "torch, mask"]
    assert all(r.rounds >= 2 and not r.status.startswith("not reached") for r in defaults), defaults
    assert result.answer[-1].startswith("tune ended: all decided")


def _above_from(monkeypatch, r_min):
    """Predictions of a setting with r >= r_min changed on every image."""
    real = tuning_run._predictions

    def predictions(model, images, batch):
        preds = real(model, images, batch)
        r = timm_tokcomp.get_reducer(model).params["r"] if timm_tokcomp.is_reduced(model) else 0
        return (preds + 1) % 10 if r >= r_min else preds

    monkeypatch.setattr(tuning_run, "_predictions", predictions)


def test_the_accuracy_stage_ends_by_its_share_and_an_unchecked_setting_is_never_re_timed(image_folder, monkeypatch):
    """Two minutes; each screening or held-out pass costs 40 recorded seconds. Fastest first: r = 3, then r = 2
    break the budget at screening (80 s); r = 1 is screened (120 s), past the accuracy stage's end (96 s), so its
    held-out check is not reached, it is never re-timed, and the choice says the time budget ended the search."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    real = tuning_run._Tuner._paired

    def paired(self, *args, **kwargs):
        if self.budget.over(kwargs.get("stage", "accuracy")):
            return real(self, *args, **kwargs)
        clock.now += 40.0
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tuning_run._Tuner, "_paired", paired)
    _above_from(monkeypatch, 2)
    time_runs, seen = _recorded(clock, 0.0, by_r={"1": 0.9, "2": 0.8, "3": 0.7})
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    result = _tune(image_folder, time_budget=2.0, budget=30.0)
    status = {r.setting.split()[-1]: r.status for r in result.rows if r.path == "torch, mask"}
    assert status["r=3"].startswith("pruned: budget (screening") and status["r=2"].startswith("pruned: budget (scr")
    assert status["r=1"] == "not reached: time budget (accuracy check)"
    line = next(s for s in result.settings["stages"] if s.startswith("accuracy, fastest first"))
    assert "2 settings checked (0 within the budget, 2 above it" in line and "1 setting not reached" in line
    assert not any(r.status == "timed" for r in result.rows)
    assert "the time budget, not the accuracy budget, ended the search: 1 setting never checked" in \
        result.choices[0].reason


def test_a_run_killed_while_holding_out_resumes_without_measuring_again(image_folder, tmp_path, monkeypatch):
    """Killed while holding out its first check (r = 3, the fastest, screened): the resumed run neither times the
    screen nor screens r = 3 again; it holds r = 3 out (within the budget: the answer) and re-times it."""
    out = tmp_path / "run"
    real_paired = tuning_run._Tuner._paired
    time_runs, seen = _recorded(Clock(), 0.0, by_r={"1": 0.9, "2": 0.8, "3": 0.7})
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)

    def killed(self, *args, sequential, **kwargs):
        if sequential:
            raise KeyboardInterrupt
        return real_paired(self, *args, sequential=sequential, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(tuning_run._Tuner, "_paired", killed)
        with pytest.raises(KeyboardInterrupt):
            _tune(image_folder, out=str(out))
    rows = read_rows(out / "tune.csv")
    assert {r.setting.split()[-1] for r in rows if r.screen_n == 8} == {"r=3"}
    assert all(r.status == "screen-timed" for r in rows)
    assert all(r.speedup is not None for r in rows if r.path == "torch, mask")  # the others follow their default
    screened = []

    def paired(self, model, *args, sequential, **kwargs):
        if not sequential:
            screened.append(timm_tokcomp.get_reducer(model).params["r"])
        return real_paired(self, model, *args, sequential=sequential, **kwargs)

    monkeypatch.setattr(tuning_run._Tuner, "_paired", paired)
    seen.clear()
    result = _tune(image_folder, out=str(out), resume=True)
    assert screened == [] and all("r=3" in name for call in seen for name in call if name != tuning.NO_REDUCTION)
    assert result.choices[0].row.setting.endswith("r=3")


def test_the_bar_counts_the_work_being_done_now_and_every_unit_is_accounted(image_folder, monkeypatch):
    """Each piece of work (a batch size's screen, a setting's accuracy check, the re-timing, the choice) starts the
    bar with its own total and unit; what ends early is credited, so each reaches its total."""
    ends = []

    class Bar(tuning.budget.StageBar):
        def start(self, name, total, unit):
            if self.name != "starting":
                ends.append((self.name, self.bar.n, self.bar.total))
            super().start(name, total, unit)

        def close(self):
            ends.append((self.name, self.bar.n, self.bar.total))
            super().close()

    monkeypatch.setattr(tuning_run, "StageBar", Bar)
    monkeypatch.setattr(tuning_timing, "time_runs", _recorded(Clock(), 0.0, by_r={"1": 0.9, "2": 0.8, "3": 0.7})[0])
    _tune(image_folder, show_progress=True)
    assert [name for name, _, _ in ends] == ["timing screen, batch 4, eager", "accuracy: tome prop_attn=True r=3",
                                             "re-timing the finalists, batch 4, eager", "checking the choice, batch 4"]
    assert all(n == total for _, n, total in ends), ends
    assert ends[0][2] == 3 * 3 and ends[1][2] == 20  # 3 default paths x 3 rounds; 20 images


def test_other_paths_wait_for_their_default_and_are_skipped_when_it_is_surely_slower(image_folder, monkeypatch):
    """Every candidate at half plain's speed, surely: the screen stops the default paths once that is sure, never
    times the other paths (fold, fold_qkv) and checks no accuracy."""
    time_runs, seen = _recorded(Clock(), 0.0, candidate_times=(2.0, 2.1))
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    result = _tune(image_folder)
    assert all(len(call) == 4 for call in seen)  # plain and the three default paths, round by round
    for r in result.rows:
        assert r.screen_n is None
        if r.path == "torch, mask":
            assert r.status.startswith("pruned: slower than plain (timing screen: 0.4") and r.rounds == len(seen)
        else:
            assert r.status.startswith("pruned: its default path [torch, mask] is not a contender (0.4")
    assert result.choices[0].row is None


@pytest.mark.parametrize("changed,n", [(0, 20), (3, 17), (12, 384), (370, 384)])
def test_loss_bounds_are_clopper_pearson(changed, n):
    loss, lo, hi = stats.loss_bounds("agreement", n, changed)
    assert loss == pytest.approx(100 * changed / n)
    assert lo == pytest.approx(100 * (scipy_stats.beta.ppf(0.05, changed, n - changed + 1) if changed else 0), abs=1e-6)
    assert hi == pytest.approx(100 * scipy_stats.beta.ppf(0.95, changed + 1, n - changed), abs=1e-6)
    # top-1: of the d = changed images whose correctness changed, lost = 2/3 turned wrong
    lost = 2 * changed // 3
    loss, lo, hi = stats.loss_bounds("top1", n, changed, changed - lost, lost)
    p_hi = scipy_stats.beta.ppf(0.95, lost + 1, changed - lost) if changed else 0.5
    assert hi == pytest.approx(100 * changed * (2 * p_hi - 1) / n, abs=1e-6) and lo <= loss <= hi


def test_images_needed_is_where_the_bound_first_fits():
    need = stats.images_needed("agreement", 384, 12, 0, 0, 4.0)
    scaled = lambda m: stats.loss_bounds("agreement", m, round(12 * m / 384))[2]  # noqa: E731
    assert scaled(need) <= 4.0 < scaled(int(need * 0.9))  # about: the scaled counts are rounded
    assert stats.images_needed("agreement", 384, 12, 0, 0, 3.0) is None  # 3.1 % changed: no number of images does
    assert stats.images_needed("top1", 384, 17, 9, 8, 1.0) == 384 or \
        stats.loss_bounds("top1", 384, 17, 9, 8)[2] > 1.0


def test_too_few_held_out_images_decline_and_say_how_many_would_do():
    """12 of 384 changed (3.1 %) is within a 4 % budget as a point, not at its upper bound (5.0 %): no reduction,
    and about 1,400 held-out images would make it a promise."""
    row = TuneRow(64, "eager", "tome r=8", "tome r=8", "-", "tome", "{}", status="pruned: held-out", gmacs=1.0,
                  mac_ratio=1.5, agree=100 * 372 / 384, agree_n=384, changed=12)
    choice = choose([row], 64, 4.0, prune_images=128)
    need = stats.images_needed("agreement", 384, 12, 0, 0, 4.0)
    assert choice.row is None and "95 % upper bound 5.01 (budget 4.0)" in choice.reason
    assert f"its 384 held-out images are too few for a promise: about {need} at the same rates" in choice.reason
    assert f"(--limit {need + 128})" in choice.reason and 1300 < need < 1500


def test_the_preset_and_table_state_the_bound(image_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(tuning_timing, "time_runs", _recorded(Clock(), 0.0, candidate_times=(0.5, 0.52))[0])
    result = _tune(image_folder, out=str(tmp_path / "t"), space=[("tome", {"r": 1})])
    assert result.choices[0].row is not None, result.choices[0].reason
    tuned = json.loads((tmp_path / "t" / "preset.json").read_text())["tuned"]
    row = result.choices[0].row
    assert tuned["loss_upper_95"] == pytest.approx(row.loss_upper("agreement"))
    assert tuned["loss"] == row.loss("agreement")
    table = (tmp_path / "t" / "table.md").read_text()
    assert "| loss [95 % upper] |" in table and "## Stages" in table and "- accuracy, fastest first: 1 setting" in table


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_time_budget_is_refused_naming_the_flag(value, image_folder, tmp_path, capsys):
    code = main(["tune", "deit_tiny_patch16_224", "--data", str(image_folder), "--out", str(tmp_path / "o"),
                 "--time-budget", value])
    assert code == 2 and "argument --time-budget: must be a finite number > 0 (minutes" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_finalist_the_re_timing_did_not_reach_keeps_its_screen_timing(image_folder, monkeypatch):
    """The accuracy stage ends at 96 % of the budget: no time is left to re-time the answer, so it keeps the
    screen's figures (3 rounds), is chosen with them, and a note says so (a resume re-times it)."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    real = tuning_run._Tuner._search

    def search(self, *args):
        real(self, *args)
        clock.now = 0.96 * 60

    monkeypatch.setattr(tuning_run._Tuner, "_search", search)
    time_runs, seen = _recorded(clock, 0.0, by_r={"1": 0.9, "2": 0.8, "3": 0.7})
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    result = _tune(image_folder, time_budget=1.0)
    row = result.choices[0].row
    assert row is not None and row.setting.endswith("r=3") and len(seen) == row.rounds <= 3  # the screen's
    assert any("kept the timing screen's speed-up (3 rounds" in n for n in result.settings["notes"])
