"""Property-based tests of the public API: random parameter values, dtypes, batch sizes and call orders.

The invariant: every call either raises a clear ValueError / TypeError and leaves the model exactly as it
was (method, parameters and weights), or succeeds, and then the forward gives finite outputs equal to a
fresh model set up the same way. A forward never discovers a bad parameter."""
import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

import timm_tokcomp
from conftest import make_model

PARAMS = {
    "tome": ["r", "flops_ratio", "keep_rate", "prop_attn", "trace_source", "prefix_only_last_block"],
    "evit": ["r", "flops_ratio", "prop_attn", "prefix_only_last_block"],
    "atm": ["alpha", "beta", "theta_min", "split_layer", "preset", "prop_attn", "prefix_only_last_block"],
    "dense_tome": ["r", "k", "kernel"],
    **{name: ["r", "flops_ratio", "keep_rate", "stages", "trace_source"] for name in ("topk", "l2", "kmedoids", "dpcknn")},
}
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1.5, 3.0), st.sampled_from(["", "8", "lossless", "fast", "torch", "auto"]),
    st.lists(st.integers(-1, 12), min_size=3, max_size=5), st.tuples(st.integers(-1, 12), st.floats(-2, 2)),
)
VARIANTS = ["cls", "distilled", "registers", "avgpool_noclass"]
RUN = settings(max_examples=60, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _snapshot(model):
    reducer = timm_tokcomp.get_reducer(model) if timm_tokcomp.is_reduced(model) else None
    return (type(model), None if reducer is None else (reducer.name, repr(reducer)),
            {k: v.clone() for k, v in model.state_dict().items()})


def _assert_same(model, snapshot):
    cls, reducer, weights = _snapshot(model)
    assert (cls, reducer) == snapshot[:2]
    assert all(torch.equal(v, snapshot[2][k]) for k, v in weights.items())


def _forward(model, batch: int, dtype: torch.dtype):
    torch.manual_seed(1)
    x = torch.randn(batch, 3, 32, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        return model(x).float()


@RUN
@given(variant=st.sampled_from(VARIANTS), method=st.sampled_from(sorted(PARAMS)), data=st.data(),
       batch=st.integers(0, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_apply_is_all_or_nothing(variant, method, data, batch, dtype):
    params = data.draw(st.dictionaries(st.sampled_from(PARAMS[method]), ANY_VALUE, max_size=3), label="params")
    model = make_model(variant)
    before = _snapshot(model)
    try:
        timm_tokcomp.apply(model, method, **params)
    except (ValueError, TypeError):
        _assert_same(model, before)
        event("refused")
        return
    event("applied")
    out = _forward(model, batch, dtype)
    assert out.shape == (batch, 10) and torch.isfinite(out).all()
    assert torch.equal(out, _forward(timm_tokcomp.apply(make_model(variant), method, **params), batch, dtype))


PLAUSIBLE = st.one_of(st.integers(0, 8), st.floats(0.5, 1.0), st.booleans(), ANY_VALUE)


def _method_params(method: str):
    return st.dictionaries(st.sampled_from(PARAMS[method]), PLAUSIBLE, max_size=2)


CALLS = st.one_of(
    st.sampled_from(sorted(PARAMS)).flatmap(lambda m: st.tuples(st.just("apply"), st.just(m), _method_params(m))),
    st.tuples(st.just("set_params"), st.just(None), _method_params("tome") | _method_params("atm")),
    st.tuples(st.just("remove"), st.just(None), st.just({})),
)


@RUN
@given(calls=st.lists(CALLS, min_size=1, max_size=5))
def test_any_call_order_keeps_the_model_consistent(calls):
    model = timm_tokcomp.apply(make_model("cls"), "tome", r=2)
    for name, method, params in calls:
        before = _snapshot(model)
        try:
            if name == "apply":
                timm_tokcomp.apply(model, method, **params)
            elif name == "set_params":
                timm_tokcomp.set_params(model, **params)
            else:
                timm_tokcomp.remove(model)
        except (ValueError, TypeError):
            _assert_same(model, before)
            event(f"{name} refused")
            continue
        event(f"{name} done")
        out = _forward(model, 2, torch.float32)
        assert torch.isfinite(out).all()
    if timm_tokcomp.is_reduced(model):  # the end state equals a fresh model given the same method and settings
        reducer = timm_tokcomp.get_reducer(model)
        fresh = timm_tokcomp.apply(make_model("cls"), reducer.name, **reducer.params)
        assert torch.equal(_forward(model, 2, torch.float32), _forward(fresh, 2, torch.float32))
    else:
        assert torch.equal(_forward(model, 2, torch.float32), _forward(make_model("cls"), 2, torch.float32))


@RUN
@given(r=st.integers(0, 16), scale=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2),
                                              st.booleans(), st.none()),
       order=st.lists(st.integers(0, 16), min_size=1, max_size=4))
def test_compensator_switching_is_transactional(r, scale, order):
    from conftest import _random_compensator
    from timm_tokcomp.tocom import attach, detach, set_compression

    model = make_model("cls")
    pristine = {k: v.clone() for k, v in model.state_dict().items()}
    attach(model, _random_compensator(seed=3))
    for target in order:
        set_compression(model, target)
    before = _snapshot(model)
    try:
        set_compression(model, r, scale=scale)
    except (ValueError, TypeError):
        _assert_same(model, before)
    else:
        assert scale is None or math.isfinite(scale)
        assert torch.isfinite(_forward(model, 2, torch.float32)).all()
    detach(model)
    assert all(torch.equal(v, pristine[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_r0_of_every_method_equals_the_plain_model(dtype):
    for method, params in [("tome", {"r": 0}), ("evit", {"r": 0}), ("dense_tome", {"r": 0}),
                           ("atm", {"alpha": 1.0, "beta": 0.0, "theta_min": 1.0})]:
        out = _forward(timm_tokcomp.apply(make_model("cls"), method, **params), 3, dtype)
        torch.testing.assert_close(out, _forward(make_model("cls"), 3, dtype), rtol=0, atol=1e-6)
