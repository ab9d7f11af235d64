"""r schedules: the formulas, the FLOPs-target solver, and spec validation."""
import math

import pytest

from timm_tokcomp.methods.schedules import (
    BlockCost, decreasing_schedule, inflection_schedule, resolve_r, schedule_macs, solve_flops_schedule,
)

DEIT_TINY = BlockCost(attn_linear=4 * 192 * 192, attn_dim=192, mlp_linear=2 * 192 * 768)


def test_decreasing_schedule_formula():
    sched = decreasing_schedule(12, 196, 4, 3.0)
    g = lambda x: (1 - x / 12) ** 2
    assert sched == [30, 28, 25, 22, 20, 17, 14, 12, 9, 6, 4, 1]  # exact values; 28 and 12 would floor to 27, 11 in naive float
    assert sched == [math.floor((g(l - 1) - g(l)) * 192 + 1e-9) for l in range(1, 13)]
    assert sched == sorted(sched, reverse=True) and sum(sched) <= 192
    assert decreasing_schedule(12, 196, 4, 2.0) == [16] * 12  # F/f = 2: g is linear, r constant


def test_flops_schedule_meets_target_with_most_tokens_left():
    plain = schedule_macs([0] * 12, 197, 1, DEIT_TINY)
    for ratio in (1.5, 2.0, 3.0):
        sched = solve_flops_schedule(ratio, 12, 196, 1, DEIT_TINY)
        macs = schedule_macs(sched, 197, 1, DEIT_TINY)
        assert macs <= plain / ratio
        assert macs > 0.9 * plain / ratio  # not far under the budget: the largest t was taken


def test_flops_ratio_out_of_reach():
    with pytest.raises(ValueError, match="flops_ratio=50.0 is out of reach"):
        solve_flops_schedule(50.0, 12, 196, 1, DEIT_TINY)


def test_inflection_schedule():
    assert inflection_schedule(8, 0.0, 4) == [8, 8, 8, 8]
    assert inflection_schedule(8, -1.0, 5) == [16, 12, 8, 4, 0]
    assert inflection_schedule(8, 1.0, 5) == [0, 4, 8, 12, 16]


def test_resolve_r_forms():
    assert resolve_r(3, 2) == [3, 3]
    assert resolve_r([1, 2], 2) == [1, 2]
    assert resolve_r((4, 1.0), 3) == [0, 4, 8]
    with pytest.raises(ValueError, match=r"one entry per block \(3\)"):
        resolve_r([1, 2], 3)


@pytest.mark.parametrize("num_patch", [100, 196, 576])
def test_flops_targets_are_reachable_whenever_a_stronger_one_is(num_patch):
    """A milder flops_ratio is never refused where a stronger one is accepted (at 160 px, 100 patches, every target
    was refused: the target's own schedule shape is clamped at half the tokens per block), and every accepted
    schedule keeps its MACs within the budget."""
    from timm_tokcomp.methods.schedules import schedule_macs, solve_flops_schedule

    cost = BlockCost(attn_linear=4 * 384 * 384, attn_dim=384, mlp_linear=8 * 384 * 384)
    full = schedule_macs([0] * 12, num_patch + 1, 1, cost)
    accepted = []
    for ratio in [1.1 + 0.1 * i for i in range(60)]:
        try:
            schedule = solve_flops_schedule(ratio, 12, num_patch, 1, cost)
        except ValueError:
            accepted.append(False)
            continue
        accepted.append(True)
        assert schedule_macs(schedule, num_patch + 1, 1, cost) <= full / ratio
    assert accepted[:20] == [True] * 20 and accepted == sorted(accepted, reverse=True)


def test_apply_checks_r_once_and_a_forward_does_not_check_it_again(monkeypatch):
    """r is checked where it is given (the method's Param), not again when each forward resolves the schedule."""
    import torch

    import timm_tokcomp
    from conftest import make_model
    from timm_tokcomp.methods import schedules

    real, names = schedules.check_int, []

    def counting(name, value, *args, **kwargs):
        names.append(name)
        return real(name, value, *args, **kwargs)

    monkeypatch.setattr(schedules, "check_int", counting)
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=[1, 2, 1, 0])
    model(torch.randn(2, 3, 32, 32))
    model(torch.randn(2, 3, 32, 32))
    assert names == ["r[0]", "r[1]", "r[2]", "r[3]"]
