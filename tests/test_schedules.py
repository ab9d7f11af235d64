"""r schedules: the formulas, the FLOPs-target solver, and spec validation."""
import math

import pytest

from timm_tokcomp.schedules import (
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
