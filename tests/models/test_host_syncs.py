"""What a GPU pays for, counted on the CPU: host synchronisations and aten ops per forward of DeiT-Tiny."""
import pytest
import timm
import torch

import timm_tokcomp
from conftest import reducing_setting
from timm_tokcomp.methods import METHODS
from timm_tokcomp.measure.counting import OpCounter


def _count(method=None, **params):
    model = timm.create_model("deit_tiny_patch16_224").eval()
    if method:
        timm_tokcomp.apply(model, method, **params)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        model(x)
        with OpCounter() as ops:
            model(x)
    return ops


def _fixed_count_settings():
    """Every method whose counts do not come from the data (a new one included, with no list to forget it in), at a
    reducing setting, and a few forms of their own."""
    settings = [(name, reducing_setting(cls, 1 if cls.spec.dense else 8, {"keep_rate": 0.7}))
                for name, cls in METHODS.items() if not cls.spec.data_dependent]
    return settings + [("tome", {"r": 16}), ("tome", {"flops_ratio": 2.0}), ("evit", {"r": 8}),
                       ("pyra", {"r": 16, "form": "pooled"}), ("mctf", {"r": 8})]


@pytest.mark.parametrize("method, params", _fixed_count_settings())
def test_fixed_r_methods_never_wait_for_the_device(method, params):
    assert _count(method, **params).host_syncs == 0


def test_atm_waits_at_most_once_per_merging_block():
    model = timm.create_model("deit_tiny_patch16_224").eval()
    timm_tokcomp.apply(model, "atm")
    settings = timm_tokcomp.get_reducer(model).block_settings(12, 197, 1, model._tokcomp.block_cost)
    assert _count("atm").host_syncs <= sum(s is not None for s in settings)


def test_op_counts_do_not_grow():
    """A regression guard on dispatch cost. Measured on torch 2.14: plain 334 ops, ToMe r16 706 (2.11x; 956
    before tokens and sizes were merged in one pass, 765 before the A / B halves were sliced straight from the
    tokens), EViT r8 864. The GPU issue's target is 1.5x; lower these bounds as the reduction step gets
    cheaper, never raise them."""
    plain = _count().total
    assert plain <= 340
    assert _count("tome", r=16).total <= 2.12 * plain
    assert _count("evit", r=8).total <= 2.6 * plain
    # 629 and 1449 while the start / knot positions were computed in every block (float32_linspace, 9 ops)
    assert _count("kmedoids", keep_rate=0.7).total <= 1.81 * plain  # 602
    assert _count("pyra", r=16, form="pooled").total <= 4.02 * plain  # 1341
