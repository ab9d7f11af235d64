"""`tokcomp tune`'s choice on recorded timing tables: the statistics (t quantiles, binomial bounds, paired speed-up
intervals), the fastest sure candidate within the budget, ties, modes through the plain model's own speed, top-1
budgets, and the candidates a device offers."""
import pytest
import torch

from timm_tokcomp.commands import tune as tuning
from timm_tokcomp.measure import stats
from timm_tokcomp.commands.tune import TuneRow, candidate_paths, choose
from conftest import make_model

pytestmark = [pytest.mark.slow]  # tune runs end to end

scipy_stats = pytest.importorskip("scipy.stats")


def _row(name, ms, lo, hi, agree, batch=64, mode="eager", plain=10.0):
    return TuneRow(batch, mode, name, name, "-", "tome", "{}", status="timed", gmacs=1.0, mac_ratio=2.0,
                   ms_plain=plain, ms=ms, speedup=plain / ms, speedup_lo=lo, speedup_hi=hi, agree=agree, agree_n=50000,
                   changed=round(500 * (100 - agree)))  # enough images that the 95 % upper bound is near the loss


def test_t_quantile_and_binomial_bound_match_scipy():
    for df in (3, 5, 9, 20, 60):
        assert stats.t_quantile_975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=2e-3)
    for changed, n in ((1, 50), (4, 128), (13, 128), (30, 1000)):
        expected = scipy_stats.beta.ppf(0.05, changed, n - changed + 1)
        assert stats.disagreement_lower_bound(changed, n) == pytest.approx(expected, abs=1e-6)
    assert stats.disagreement_lower_bound(0, 100) == 0.0


def test_speedup_interval_pairs_rounds():
    point, lo, hi = stats.speedup_interval([2.0, 2.1, 1.9, 2.0], [1.0, 1.05, 0.95, 1.0])
    assert point == pytest.approx(2.0) and lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    point, lo, hi = stats.speedup_interval([1.0, 1.0, 1.0, 1.0], [0.8, 1.3, 0.9, 1.1])
    assert lo < 1.0 < hi


def test_choice_takes_the_fastest_sure_candidate_within_budget():
    rows = [_row("a", ms=5.0, lo=1.9, hi=2.1, agree=98.0),       # fastest, but breaks a 1-point budget
            _row("noisy", ms=6.0, lo=0.9, hi=2.5, agree=99.6),   # fast on median, not surely faster than plain
            _row("b", ms=7.0, lo=1.3, hi=1.5, agree=99.2),
            _row("c", ms=8.0, lo=1.2, hi=1.3, agree=99.8)]
    choice = choose(rows, 64, budget=1.0)
    assert choice.row.candidate == "b" and "fastest within the budget" in choice.reason
    assert choose(rows, 64, budget=2.2).row.candidate == "a"  # 2 % changed: its upper bound is above 2.0
    assert choose(rows, 64, budget=1.0, min_speedup=1.4).row.candidate == "b"
    none = choose(rows, 64, budget=1.0, min_speedup=1.5)
    assert none.row is None and "minimum speed-up 1.5x" in none.reason


def test_ties_are_broken_the_same_way_every_time():
    rows = [_row("y", ms=5.0, lo=1.5, hi=2.5, agree=99.5), _row("x", ms=5.0, lo=1.5, hi=2.5, agree=99.5),
            _row("z", ms=5.0, lo=1.8, hi=2.2, agree=99.5)]
    assert choose(rows, 64, 1.0).row.candidate == "z"  # same time: the surer one
    assert choose(rows[:2], 64, 1.0).row.candidate == choose(rows[1::-1], 64, 1.0).row.candidate == "x"


def test_modes_compare_through_the_plain_models_own_speed():
    """graph: 1.2x its plain, whose replays run 1.5x faster than eager plain: 1.8x plain eager, ahead of 1.6x eager;
    speed-ups, not milliseconds, compare rows timed in separate chunks (a drifting machine)."""
    rows = [_row("eager", ms=6.25, lo=1.5, hi=1.7, agree=99.5, plain=10.0),
            _row("graph", ms=5.5, lo=1.1, hi=1.3, agree=99.5, mode="graph", plain=6.6),
            _row("eager, slow chunk", ms=7.0, lo=1.5, hi=1.8, agree=99.5, plain=11.9)]
    scores = tuning.eager_speedups(rows)
    assert scores[id(rows[1])] == pytest.approx(1.2 * 10.95 / 6.6, rel=1e-3)
    assert choose(rows, 64, 1.0).row.candidate == "graph"
    assert choose([rows[0], rows[2]], 64, 1.0).row.candidate == "eager, slow chunk"  # 1.70x beats 1.60x


def test_the_choice_is_judged_against_the_fastest_plain_model_measured():
    """Plain compiled runs 1.4x plain eager: an eager candidate 1.3x its plain is slower than it; a compiled one 1.2x
    its plain is the choice; without it, no reduction, and the reason names plain compiled."""
    eager = _row("tome eager", ms=10.0 / 1.3, lo=1.25, hi=1.35, agree=99.5, plain=10.0)
    compiled = _row("tome compiled", ms=7.14 / 1.2, lo=1.1, hi=1.3, agree=99.5, mode="compile", plain=7.14)
    assert tuning.fastest_plain([eager, compiled], 64) == ("compile", 7.14)
    assert tuning.against_fastest_plain([eager, compiled])[id(eager)][0] == pytest.approx(1.3 * 7.14 / 10.0)
    choice = choose([eager, compiled], 64, 1.0)
    assert choice.row is compiled and "1.20x plain in compile mode" in choice.reason
    compiled_slow = _row("tome compiled", ms=7.5, lo=0.9, hi=1.0, agree=99.5, mode="compile", plain=7.14)
    none = choose([eager, compiled_slow], 64, 1.0)
    assert none.row is None and "surely faster than plain in compile mode, the fastest plain model (7.1 ms" in \
        none.reason and "best: tome eager, 1.30x plain in eager mode, 0.93x plain in compile mode" in none.reason
    plain_slow = _row("tome compiled", ms=12.0, lo=0.8, hi=0.9, agree=99.5, mode="compile", plain=11.0)
    assert choose([eager, plain_slow], 64, 1.0).row is eager  # plain eager is the fastest plain there


@pytest.mark.parametrize("rows,reason", [
    ([_row("a", ms=5.0, lo=1.9, hi=2.1, agree=97.0)], "within the budget of at most 1.0 % of the plain model's "
                                                      "predictions changed at its one-sided 95 % upper bound on the "
                                                      "held-out images (closest: a, 3.00 % of the plain model's "
                                                      "predictions changed, 95 % upper bound 3.13 (budget 1.0), "
                                                      "at 2.00x)"),
    ([_row("a", ms=12.0, lo=0.7, hi=0.9, agree=100.0), _row("b", ms=9.0, lo=0.95, hi=1.3, agree=99.5)],
     "surely faster than plain"),
    ([], "no candidate was timed"),
])
def test_no_candidate_qualifies_means_no_reduction(rows, reason):
    choice = choose(rows + [_row("other batch", ms=1.0, lo=5, hi=6, agree=100.0, batch=1)], 64, budget=1.0)
    assert choice.row is None and reason in choice.reason


def test_candidates_cover_paths_and_modes_the_device_offers():
    model = make_model("cls")
    names = {(c.path, c.mode) for c in candidate_paths("tome", {"r": 4}, model, "cpu", ["eager", "compile"])}
    assert names == {("torch, mask", "eager"), ("torch, fold", "eager"), ("torch, fold_qkv", "eager"),
                     ("torch, mask", "compile"), ("torch, fold", "compile"), ("torch, fold_qkv", "compile")}
    # flex compiled on CUDA only (on the CPU its compiled form is the mask: tests/kit/test_kit.py checks the CUDA list)
    assert {c.path for c in candidate_paths("tome", {"r": 4}, make_model("layerscale_qknorm"), "cpu", ["eager"])} == \
        {"torch, mask", "torch, fold"}
    assert [(c.path, c.mode) for c in candidate_paths("evit", {"r": 2}, model, "cpu", ["eager"])] == [("torch", "eager")]
    assert [c.mode for c in candidate_paths("atm", {}, model, "cpu", ["eager", "compile"])] == ["eager"] * 3
    settings = {c.setting for c in candidate_paths("tome", {"r": 4}, model, "cpu", ["eager"])}
    assert settings == {"tome prop_attn=True r=4"}  # every path of one setting shares its accuracy
    off = candidate_paths("tome", {"r": 4, "prop_attn": False}, model, "cpu", ["eager"])
    assert [c.setting for c in off] == ["tome prop_attn=False r=4"]


# ------------------------------------------------------------------ honest timing and a budget users mean


def test_the_speed_up_estimate_lies_inside_its_interval():
    """The estimate is the geometric mean of the paired rounds' ratios, the centre of its own interval (a ratio of
    medians could fall outside it: 1.99x [0.94, 1.57] on a busy machine)."""
    plain, times = [1.0, 1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 1.6, 1.6]
    point, lo, hi = stats.speedup_interval(plain, times)
    assert lo <= point <= hi and point == pytest.approx((2.0 ** 3 / 1.6 ** 2) ** 0.2)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(2, 12, (1,), generator=g))
        a, b = (torch.rand(n, generator=g) + 0.1).tolist(), (torch.rand(n, generator=g) + 0.1).tolist()
        point, lo, hi = stats.speedup_interval(a, b)
        assert lo <= point <= hi


def test_speed_prints_intervals_and_names_cells_within_noise():
    from timm_tokcomp.commands.speed import SpeedRow, format_speed

    rows = [SpeedRow("eager", 1, "none", 10.0, 1.0, None), SpeedRow("eager", 1, "atm", 4.3, 2.31, 0.9, 0.6, 8.9),
            SpeedRow("eager", 1, "tome_r8", 6.0, 1.66, 0.95, 1.5, 1.8)]
    text = format_speed(rows)
    assert "2.31x [0.60, 8.90] (0.90)" in text and "1.66x [1.50, 1.80]" in text
    notes = [line for line in text.splitlines() if "within timing noise" in line]
    assert len(notes) == 1 and "atm at batch 1" in notes[0] and "tome_r8" not in notes[0] and "--rounds" in notes[0]


def _labelled_row(name, ms, top1, top1_plain=80.0, agree=95.0):
    row = _row(name, ms=ms, lo=1.5, hi=2.5, agree=agree)
    row.top1, row.top1_plain = top1, top1_plain
    delta = round((top1_plain - top1) * row.agree_n / 100)  # lost - gained
    row.gained, row.lost = 100 + max(0, -delta), 100 + max(0, delta)
    return row


def test_a_top1_budget_judges_the_points_of_top1_lost():
    """With labels the budget limits the top-1 drop: a candidate changing 5 % of the predictions for 0.4 points of
    top-1 is within a 1-point budget, one losing 1.2 points is not, whatever their agreement."""
    rows = [_labelled_row("fast, 1.2 points", ms=4.0, top1=78.8, agree=97.0),
            _labelled_row("0.4 points", ms=5.0, top1=79.6, agree=95.0)]
    choice = choose(rows, 64, 1.0, measure="top1")
    assert choice.row.candidate == "0.4 points" and "0.40 points of top-1 lost, 95 % upper bound 0.46 (budget 1.0)" \
        in choice.reason
    assert choose(rows, 64, 1.0, measure="agreement").row is None  # 3 and 5 % of the predictions changed
    none = choose(rows, 64, 0.2, measure="top1")
    assert none.row is None and "closest: 0.4 points, 0.40" in none.reason


def test_a_sample_too_small_for_the_budget_is_noted_with_what_would_do():
    from timm_tokcomp.commands.tune import sample_notes

    (note,) = sample_notes(172, 128, 1.0, "top1")
    assert "172 held-out images" in note and "0.58 points" in note and "300 held-out images" in note
    assert "--limit 428" in note
    assert sample_notes(384, 128, 1.0, "top1") == [] and sample_notes(172, 128, 0.0, "agreement") == []


def test_a_top1_gain_reads_as_a_gain():
    row = _labelled_row("better", ms=5.0, top1=80.5)
    assert "0.50 points of top-1 gained, 95 % upper bound -0.44 (budget 1.0)" in \
        choose([row], 64, 1.0, measure="top1").reason


def test_the_images_needed_table_in_the_docs_is_what_the_statistics_give():
    """docs/speed.md's table and the README's figures: labelled held-out images for a 1-point top-1 promise at a
    true loss of 0.2 / 0.5 / 0.7 points, at 2 % of images changing correctness; a loss at the budget never."""
    import re
    from pathlib import Path

    from timm_tokcomp.measure.stats import images_for_promise, loss_bounds, promisable_loss

    root = Path(__file__).resolve().parents[2]
    table = dict(re.findall(r"^\| (0\.\d) \| about ([\d,]+) \|$", (root / "docs" / "speed.md").read_text(), re.M))
    assert sorted(table) == ["0.2", "0.5", "0.7"]
    for loss, shown in table.items():
        need = images_for_promise("top1", float(loss), 1.0)
        assert abs(need - int(shown.replace(",", ""))) <= 0.01 * need, (loss, need)
        d = round(0.02 * need)  # at that many images the bound fits
        lost = round((d + float(loss) / 100 * need) / 2)
        assert loss_bounds("top1", need, d, d - lost, lost)[2] <= 1.0 + 0.02
    readme = " ".join((root / "README.md").read_text().split())
    assert "about 930 labelled held-out images for a setting that truly loses 0.2 points, 2,170 for 0.5" in readme
    assert images_for_promise("top1", 1.0, 1.0) is None and promisable_loss("top1", 1172, 1.0) == pytest.approx(0.3)
