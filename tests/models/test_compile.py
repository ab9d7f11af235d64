"""torch.compile of reduced models traced whole (compiling.traced_whole: one graph, as fullgraph=True, explain and
export trace them; torch.compile(model) alone takes the regions, tests/models/test_compiled_whole.py): several models
with different settings compile in one process as whole graphs (no graph break on torch >= 2.10, no recompile-limit
fallback to eager) and give the eager outputs. The 'eager' backend checks what dynamo captures without the minutes
inductor takes on a CPU."""
import pytest
import timm
import torch

import timm_tokcomp
from conftest import reducing_setting
from timm_tokcomp.runtime.compile import traced_whole
from timm_tokcomp.methods import METHODS

pytestmark = [pytest.mark.slow]  # Inductor compiles


@pytest.fixture(autouse=True)
def whole():
    with traced_whole():
        yield


def _deit_tiny(method=None, **params):
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224").eval()
    return timm_tokcomp.apply(model, method, **params) if method else model


def test_three_reduced_models_compile_whole_in_one_process():
    torch._dynamo.reset()
    limit_flag = "fail_on_recompile_limit_hit" if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") \
        else "fail_on_cache_limit_hit"
    x = torch.randn(2, 3, 224, 224)
    models = [_deit_tiny(), _deit_tiny("tome", r=16), _deit_tiny("tome", r=8), _deit_tiny("evit", r=8),
              _deit_tiny("dense_tome", r=2)]
    with torch.no_grad(), torch._dynamo.config.patch(**{limit_flag: True}):
        for model in models:
            compiled = torch.compile(model, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        for model in models:  # a second round hits the cache: no recompile is needed
            with torch._dynamo.config.patch(error_on_recompile=True):
                torch.compile(model, backend="eager", fullgraph=True)(x)


def _counting_backend(compiles):
    def backend(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward
    return backend


def _fixed_settings():
    """Every method whose counts do not come from the data (a new one included): its study form where it has one,
    else r; and the r forms of their own."""
    settings = [(name, reducing_setting(cls, 2 if cls.spec.dense else 8, {"keep_rate": 0.7}))
                for name, cls in METHODS.items() if not cls.spec.data_dependent]
    return settings + [("tome", {"r": 16}), ("tome", {"flops_ratio": 2.0}), ("evit", {"r": 8}), ("pyra", {"r": 16}),
                       *[(name, {"r": 8}) for name in ("tofu", "pitome", "dct", "atc", "mctf")],
                       ("repshift", {"r": 8, "shift_at": "attn"})]


@pytest.mark.parametrize("method, params", _fixed_settings())
def test_fixed_settings_compile_without_graph_breaks(method, params):
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_deit_tiny(method, **params))(torch.randn(2, 3, 224, 224))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_same_shape_never_recompiles_and_set_params_recompiles_once():
    torch._dynamo.reset()
    model = _deit_tiny("tome", r=16)
    compiles = []
    compiled = torch.compile(model, backend=_counting_backend(compiles), fullgraph=True)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        first = len(compiles)
        timm_tokcomp.set_params(model, r=8)
        out = compiled(x)
        compiled(x)
        assert len(compiles) == 2 * first  # one recompile for the new r, graphs for it as many as for r = 16
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, params", [("atm", {}), ("ats", {"keep_rate": 0.7})])
def test_compiled_data_dependent_methods_say_they_reduce_between_graphs(method, params):
    torch._dynamo.reset()
    model = _deit_tiny(method, **params)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad(), pytest.warns(UserWarning, match=f"{method} counts its tokens from the data.*fixed-count"):
        out = torch.compile(model, backend="eager")(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
