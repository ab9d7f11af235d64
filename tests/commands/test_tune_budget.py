"""tune's time budget and its accuracy promise: the stages end by their share of --time-budget on a recorded clock
(nothing rests on this machine's speed), a killed run resumes from any stage, the bar's total holds from the start,
the stage lines say what was kept and why, other paths wait for their default's figures, and the budget is judged on
the loss's one-sided 95 % upper bound (with the number of images a promise would need)."""
import json

import pytest
import torch

import timm_tokcomp
from timm_tokcomp import tuning
from timm_tokcomp.kit import stats
from timm_tokcomp.tuning import TuneRow, choose, read_rows
from timm_tokcomp.tuning import run as tuning_run
from timm_tokcomp.tuning import timing as tuning_timing
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


def _recorded(clock, seconds_per_forward, candidate_times=(0.5, 1.5)):
    """A time_runs that advances the clock by the forwards it 'ran' and returns recorded times: plain 1.0, every
    candidate alternating between candidate_times (never settled: its interval holds 1)."""
    seen = []

    @torch.inference_mode()
    def time_runs(models, x, rounds=5, warmup=1, progress=None, stop=None):
        seen.append(sorted(models))
        clock.now += seconds_per_forward * len(models) * (rounds + warmup)
        return {name: [1.0 if name == tuning.NO_REDUCTION else candidate_times[i % 2] for i in range(rounds)]
                for name in models}
    return time_runs, seen


def _tune(folder, **kwargs):
    args = dict(batches=[4], budget=100.0, space=SPACE, limit=20, prune_images=8, max_rounds=6, show_progress=False)
    return timm_tokcomp.tune(_small_model(), str(folder), **{**args, **kwargs})


def test_the_time_budget_ends_timing_and_the_choice_comes_from_what_was_measured(image_folder, tmp_path,
                                                                                  monkeypatch, capsys):
    """One minute: the search checks r = 2, then r = 3 (r = 1, milder, is decided by them); the two default paths'
    first rounds take 140 recorded seconds, past the timing stage's end (57 s), so they stop there with 5 rounds
    each, the other four paths are not reached, tune still chooses (from the two) and says what it did not get to; a
    resume with more time times only those four and measures no image again."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    time_runs, seen = _recorded(clock, seconds_per_forward=10.0)
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    out = tmp_path / "run"
    result = _tune(image_folder, time_budget=1.0, out=str(out))
    timed = [r for r in result.rows if r.status == "timed"]
    assert sorted(r.path for r in timed) == ["torch, mask"] * 2 and all(r.rounds == 5 for r in timed)
    unreached = [r for r in result.rows if r.status == "not reached: time budget (timing)"]
    assert len(unreached) == 4 and len(seen) == 1
    assert all(r.status.startswith("pruned: milder than tome prop_attn=True r=3") for r in result.rows
               if r.setting.endswith("r=1"))
    (note,) = [n for n in result.settings["notes"] if "time budget" in n]
    assert "ended with 2 settings without their timing; tune chose from what it measured" in note  # 4 paths
    assert "--resume" in note
    assert "2 candidates timed" in result.settings["stages"][-1] and "4 not reached (time budget)" in \
        result.settings["stages"][-1]
    assert result.choices[0].row is None and "surely faster" in result.choices[0].reason
    err = capsys.readouterr().err
    assert "tune plan: 3 settings on 9 paths and modes (eager)" in err
    assert "tune search: 3 settings on 1 method axis (bisected for the strongest setting within the budget, at most 2 " \
           "checks); 0 the same token schedule as another, checked once; first round: tome prop_attn=True r=2" in err

    def no_images(*args, **kwargs):
        raise AssertionError("a resumed run measured images again")

    monkeypatch.setattr(tuning_run._Tuner, "_paired", no_images)
    seen.clear()
    again = _tune(image_folder, time_budget=None, out=str(out), resume=True)
    assert {name for call in seen for name in call if name != tuning.NO_REDUCTION} == {r.candidate for r in unreached}
    assert {r.status for r in again.rows if not r.setting.endswith("r=1")} == {"timed"}


def test_the_accuracy_search_ends_by_its_share_and_says_how_many_it_did_not_reach(image_folder, monkeypatch):
    """Screening or holding out a setting costs 30 recorded seconds: with a 2-minute budget the accuracy stage ends
    at 78 s, after the first check (r = 2, the middle of its axis: 60 s); r = 3 is not screened, and r = 1, milder than
    r = 2 which kept the budget, is decided without a check. The choice says the time budget ended the search."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    real = tuning_run._Tuner._paired

    def paired(self, *args, **kwargs):
        clock.now += 30.0
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tuning_run._Tuner, "_paired", paired)
    monkeypatch.setattr(tuning_timing, "time_runs", _recorded(clock, 0.0)[0])
    result = _tune(image_folder, time_budget=2.0)
    screened = {r.setting.split()[-1] for r in result.rows if r.screen_n is not None}
    assert screened == {"r=2"}
    assert {r.status for r in result.rows if r.setting.endswith("r=3")} == {"not reached: time budget (screening)"}
    assert "1 not reached (time budget)" in next(s for s in result.settings["stages"] if s.startswith("accuracy"))
    assert any("1 setting without its screening" in n for n in result.settings["notes"])
    assert "the time budget, not the accuracy budget, ended the search: 1 setting never checked" in \
        result.choices[0].reason


def test_a_setting_the_held_out_check_did_not_reach_is_never_timed(image_folder, monkeypatch):
    """Each held-out check costs 40 recorded seconds: with 2 minutes the accuracy stage ends at 78 s, after the first
    setting's (r = 2); the second checked (r = 3) is screened, its held-out check not reached, and timing never runs
    it."""
    clock = Clock()
    monkeypatch.setattr(tuning.budget, "monotonic", clock)
    real = tuning_run._Tuner._paired

    def paired(self, *args, sequential, **kwargs):
        clock.now += 40.0 if sequential else 0.0
        return real(self, *args, sequential=sequential, **kwargs)

    monkeypatch.setattr(tuning_run._Tuner, "_paired", paired)
    time_runs, seen = _recorded(clock, 0.0)
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    result = _tune(image_folder, time_budget=2.0)
    assert {r.status for r in result.rows if r.setting.endswith("r=3")} == {"not reached: time budget (held-out check)"}
    assert not any("r=3" in name for call in seen for name in call)
    assert any("3 settings" not in n and "1 setting without its held-out check" in n for n in result.settings["notes"])


def test_a_run_killed_after_screening_resumes_without_screening_again(image_folder, tmp_path, monkeypatch):
    """Killed while holding out its first check (r = 2, screened): the resumed run holds r = 2 out without screening
    it again, and screens r = 3 only."""
    out = tmp_path / "run"
    real_paired = tuning_run._Tuner._paired

    def killed(self, *args, sequential, **kwargs):
        if sequential:
            raise KeyboardInterrupt
        return real_paired(self, *args, sequential=sequential, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(tuning_run._Tuner, "_paired", killed)
        with pytest.raises(KeyboardInterrupt):
            _tune(image_folder, out=str(out))
    rows = read_rows(out / "tune.csv")
    assert len(rows) == 3 and all(r.screen_n == 8 and r.status == "screened" and r.setting.endswith("r=2")
                                  for r in rows)
    screened = []

    def paired(self, model, *args, sequential, **kwargs):
        if not sequential:
            screened.append(timm_tokcomp.get_reducer(model).params["r"])
        return real_paired(self, model, *args, sequential=sequential, **kwargs)

    monkeypatch.setattr(tuning_run._Tuner, "_paired", paired)
    result = _tune(image_folder, out=str(out), resume=True)
    assert screened == [3]
    assert all(r.agree_n is not None for r in result.rows if not r.setting.endswith("r=1"))


def test_the_bar_total_is_known_from_the_start_and_every_unit_is_accounted(image_folder, monkeypatch):
    """Pruned paths, settled candidates and skipped stages credit their units as they go: the bar reaches its
    first total without the final top-up."""
    ends = []

    class Bar(tuning.budget.StageBar):
        def close(self):
            ends.append((self.bar.n, self.bar.total))
            super().close()

    monkeypatch.setattr(tuning_run, "StageBar", Bar)
    clock = Clock()
    monkeypatch.setattr(tuning_timing, "time_runs", _recorded(clock, 0.0, candidate_times=(2.0, 2.1))[0])
    _tune(image_folder, show_progress=True)
    (n, total), = ends
    assert n == total == 2 * 3 + 9 * 6 + 1


def test_other_paths_wait_for_their_default_and_are_skipped_when_it_is_no_contender(image_folder, monkeypatch):
    """Every candidate at half plain's speed, surely: the default paths stop after their first rounds and the other
    paths (fold, fold_qkv) are never timed."""
    time_runs, seen = _recorded(Clock(), 0.0, candidate_times=(2.0, 2.1))
    monkeypatch.setattr(tuning_timing, "time_runs", time_runs)
    result = _tune(image_folder)
    assert len(seen) == 1 and len(seen[0]) == 3  # plain and the default paths of the two checked settings, once
    for r in result.rows:
        if r.setting.endswith("r=1"):  # milder than r = 3, which kept the budget: never timed
            assert r.status.startswith("pruned: milder than tome prop_attn=True r=3")
        elif r.path == "torch, mask":
            assert r.status == "timed" and r.speedup_hi < 1.0 and r.rounds == 5
        else:
            assert r.status.startswith("pruned: its default path [torch, mask] is not a contender (0.")


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
    assert "| loss [95 % upper] |" in table and "## Stages" in table and "- accuracy search over 1 method axis" in table


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_time_budget_is_refused_naming_the_flag(value, image_folder, tmp_path, capsys):
    code = main(["tune", "deit_tiny_patch16_224", "--data", str(image_folder), "--out", str(tmp_path / "o"),
                 "--time-budget", value])
    assert code != 0 and "--time-budget must be a finite number > 0 (minutes" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
