"""timm_tokcomp.runtime.compile and kernels.library: a reduced model compiled by regions traces its block once for every
block, batch size and r, counted with torch's own counters (graphs, graph breaks); the reduction step is one custom
operator (checked by torch.library.opcheck) that runs the Triton kernels inside the compiled graph. The 'eager' and
'aot_eager' backends check what is captured without Inductor's code generation (scripts/compile_counts.py times
Inductor)."""
import warnings

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch._dynamo.utils import counters

import timm_tokcomp
from conftest import SMALL, reducing_setting
from timm_tokcomp.runtime import compile as compiling
from timm_tokcomp.kernels import library
from timm_tokcomp.deployment import modes
from timm_tokcomp.methods import METHODS

DEEP = dict(SMALL, depth=6)  # 65 tokens, six blocks: five that share the middle graph
STUDY = {"keep_rate": 0.7, "stages": (2, 4, 5)}


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _breaks() -> int:
    return sum(counters["graph_break"].values())


class GraphRecorder:
    """A torch.compile backend that runs each captured graph as traced and keeps it, to ask which ops it holds."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example):
        self.graphs.append(gm.graph)
        return gm.forward

    def calls(self, op: str) -> bool:
        """Whether some captured graph calls an op whose name contains op."""
        return any(op in str(node.target) for graph in self.graphs for node in graph.nodes)


def _model(method=None, seed=0, **params):
    torch.manual_seed(seed)
    model = VisionTransformer(**DEEP).eval()
    return timm_tokcomp.apply(model, method, **params) if method else model


def _images(batch, seed=1):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["tome", "evit"])
def test_compiles_three_graphs_for_every_block_batch_and_r(method):
    model = _model(method, r=8)
    fast = compiling.compile(model, backend="eager")
    assert isinstance(fast, compiling.RegionallyCompiled)
    with torch.no_grad():
        torch.testing.assert_close(fast(_images(2)), model(_images(2)), rtol=0, atol=0)
        assert (_graphs(), _breaks()) == (3, 0)  # the embedding, every block (the first with sizes of one), the end
        for batch in (3, 7):
            torch.testing.assert_close(fast(_images(batch)), model(_images(batch)), rtol=0, atol=0)
        for params in ({"r": 4}, {"r": 6}) if method == "evit" else ({"r": 4}, {"r": 12}, {"flops_ratio": 2.0}):
            timm_tokcomp.set_params(model, **params)
            torch.testing.assert_close(fast(_images(3)), model(_images(3)), rtol=0, atol=0)
    assert (_graphs(), _breaks()) == (3, 0)


def test_flex_attention_compiles_by_region_and_matches_the_mask(monkeypatch):
    from timm_tokcomp.ops import attention

    recorder = GraphRecorder()
    monkeypatch.setattr(attention, "_flex_runs", lambda q, dropout_p: dropout_p == 0)  # as on CUDA: flex is traced
    model, reference = _model("tome", r=8, prop_attn="flex"), _model("tome", r=8, prop_attn="mask")
    fast = compiling.compile(model, backend=recorder)
    with torch.no_grad():
        for batch in (2, 3):
            torch.testing.assert_close(fast(_images(batch)), reference(_images(batch)), rtol=1e-5, atol=1e-5)
    assert (_graphs(), _breaks()) == (3, 0)
    assert recorder.calls("flex_attention")


def test_a_batch_of_one_compiles_its_graphs_once():
    model = _model("tome", r=8)
    fast = compiling.compile(model, backend="eager")
    with torch.no_grad():
        for batch in (1, 2, 1, 3):
            fast(_images(batch))
    assert _graphs() == 6  # torch specialises size-1 dimensions: batch 1 has its own three graphs


REGIONAL = sorted(name for name, cls in METHODS.items() if cls.spec.compiles_by_region and not cls.spec.dense)


@pytest.mark.parametrize("method", REGIONAL)
def test_every_method_that_compiles_by_region_matches_eager_without_recompiling(method):
    cls = METHODS[method]
    needed = {"thresholds": [0.0] * DEEP["depth"]} if method == "dymu" else {}  # DyMU has no default thresholds
    model = _model(method, **reducing_setting(cls, 4, STUDY), **needed)
    fast = compiling.compile(model, backend="eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # data-dependent methods say they reduce between graphs
        for batch in (2, 3):
            torch.testing.assert_close(fast(_images(batch)), model(_images(batch)), rtol=1e-5, atol=1e-5)
            if batch == 2:
                first = _graphs()
    if cls.spec.data_dependent:  # a host-side count per block: the graph breaks there
        assert _breaks() > 0
    else:
        # the embedding, a block that does not reduce, at most two reducing ones (PiToMe's protect on / off), the end;
        # ATC's clustering runs one step per merge, unrolled: a graph per count of merges
        assert _breaks() == 0 and _graphs() <= (7 if method == "atc" else 5)
        assert _graphs() == first  # a new batch size reuses every graph


@pytest.mark.parametrize("method, params", [("pitome", {"r": 4}),
                                            ("kmedoids", {"keep_rate": 0.8, "stages": (2, 3, 4, 5, 6)})])
def test_a_setting_that_differs_per_block_shares_the_blocks_graph(method, params):
    # PiToMe's margin falls with depth, K-Medoids' cluster count with the tokens: both stay symbolic in the graph
    model = _model(method, **params)
    fast = compiling.compile(model, backend="eager")
    with torch.no_grad():
        for batch in (2, 3):
            torch.testing.assert_close(fast(_images(batch)), model(_images(batch)), rtol=0, atol=0)
    # the embedding, PiToMe's blocks without and with protection (K-Medoids': the first, which does not reduce, and
    # the reducing ones), the end
    assert (_graphs(), _breaks()) == (4, 0)


@pytest.mark.parametrize("method, params, graphs", [("pyra", {"r": 4, "form": "pooled"}, 3), ("dtem", {"r": 4}, 3),
                                                    ("dynamicvit", STUDY, 4)])
def test_learned_layers_compile_one_graph_for_every_block(method, params, graphs):
    # each block's learned module rides in its setting (LearnedParams.settings_for): the compiler takes its
    # parameters as inputs, so no block gets a graph of its own (DynamicViT: the blocks before the first stage do)
    model = _model(method, **params)
    untrained = model(_images(2))
    with torch.no_grad():
        for p in model.tokcomp.parameters():  # untrained PYRA equals ToMe: make every method differ
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    fast = compiling.compile(model, backend="eager")
    assert isinstance(fast, compiling.RegionallyCompiled)
    with torch.no_grad():
        assert not torch.allclose(model(_images(2)), untrained, atol=1e-3)
        for batch in (2, 3):
            torch.testing.assert_close(fast(_images(batch)), model(_images(batch)), rtol=0, atol=0)
        if method == "pyra":  # the pooled form runs at any r: a new r reuses the graphs too
            timm_tokcomp.set_params(model, r=6)
            torch.testing.assert_close(fast(_images(3)), model(_images(3)), rtol=0, atol=0)
    assert (_graphs(), _breaks()) == (graphs, 0)


def test_diffrate_counts_and_search_logits_ride_in_the_setting():
    # each block's (P, M) are symbolic ints of its setting (RateSetting), the search's logits rows tensors of it, and
    # the search records its settings outside the blocks: no graph per block, no recompile for a new batch size
    model = _model("diffrate", macs_target=0.5)
    with torch.no_grad():
        for p in model.tokcomp.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 2)
    model.eval()  # the counts are read here
    assert len(set(model.tokcomp["diffrate"].counts())) == 5  # every block its own
    fast = compiling.compile(model, backend="eager")
    assert isinstance(fast, compiling.RegionallyCompiled)
    with torch.no_grad():
        for batch in (2, 3):
            torch.testing.assert_close(fast(_images(batch)), model(_images(batch)), rtol=0, atol=0)
            first = _graphs() if batch == 2 else first
    assert _breaks() == 0 and _graphs() == first <= 5
    torch._dynamo.reset()
    counters.clear()
    model.train()  # the search: the compiled forward, its MACs penalty and their gradients are eager's
    reducer, rates = timm_tokcomp.get_reducer(model), list(model.tokcomp.parameters())
    grads = []
    for run in (model, compiling.compile(model, backend="eager")):
        loss = run(_images(2)).square().mean() + reducer.method_loss()
        grads.append(torch.autograd.grad(loss, rates) + (loss.detach(),))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _breaks() == 0 and _graphs() <= 5


def test_pyra_paper_form_compiles_whole():
    # its rank weights are as long as each block's r and the compiler holds a parameter's shape static: by region
    # it would compile a graph per r
    assert not compiling.by_region(_model("pyra", r=[4, 3, 3, 2, 2, 1]))
    assert compiling.by_region(_model("pyra", r=[4, 3, 3, 2, 2, 1], form="pooled"))


def test_methods_that_do_not_compile_by_region_compile_whole():
    whole = sorted(name for name, cls in METHODS.items() if not cls.spec.compiles_by_region)
    assert {"l1", "patchmerger", "pyra"} <= set(whole) and "diffrate" not in whole  # PYRA: its 'paper' form
    for name in whole:
        cls = METHODS[name]
        model = _model(name, **reducing_setting(cls, 4, STUDY))
        assert not compiling.by_region(model)
        assert not isinstance(compiling.compile(model, backend="eager"), compiling.RegionallyCompiled)
    assert not compiling.by_region(_model())


@pytest.mark.parametrize("method", sorted(name for name, cls in METHODS.items() if not cls.spec.compiles_by_region))
def test_methods_compiled_whole_match_eager_with_their_learned_parameters_perturbed(method):
    model = _model(method, **reducing_setting(METHODS[method], 4, STUDY))
    learned = getattr(model, "tokcomp", None)
    with torch.no_grad():
        for p in [] if learned is None else learned.parameters():  # untrained PYRA equals ToMe: make it differ
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
        torch.testing.assert_close(compiling.compile(model, backend="eager")(_images(2)), model(_images(2)),
                                   rtol=1e-5, atol=1e-5)


def _rope_model(**params):
    torch.manual_seed(0)
    return timm_tokcomp.apply(timm.create_model("eva02_small_patch14_224", img_size=56, depth=4).eval(), "tome",
                              **params)


def test_rope_model_compiles_three_graphs_for_every_batch():
    model = _rope_model(r=2)
    recorder = GraphRecorder()
    fast = compiling.compile(model, backend=recorder)
    with torch.no_grad():
        for batch in (2, 3):  # 2 is also the width of the rope coordinates: no duck sizing ties them
            x = torch.randn(batch, 3, 56, 56)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    # the step and its rope coordinates are one operator: the matching is not traced
    assert recorder.calls("tome_merge_rope")
    assert (_graphs(), _breaks()) == (3, 0)  # the first block too rotates by rows from the coords, with sizes of one


def test_many_models_compile_in_one_process_each_with_its_own_graphs():
    limit = "fail_on_recompile_limit_hit" if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit") \
        else "fail_on_cache_limit_hit"
    with torch.no_grad(), torch._dynamo.config.patch(**{limit: True}):
        for r in (2, 3, 4, 5, 6):  # ten block graphs: more than one function's limit of eight
            model = _model("tome", r=r)
            torch.testing.assert_close(compiling.compile(model, backend="eager")(_images(2)), model(_images(2)))


def test_the_model_stays_eager_for_its_other_callers():
    model, other = _model("tome", r=8), _model("tome", seed=1, r=8)
    fast = compiling.compile(model, backend="eager")
    with torch.no_grad():
        fast(_images(2))
        captured = counters["stats"]["calls_captured"]
        model(_images(3))
        with fast.active():
            other(_images(3))  # another model inside the compiled call's context
    assert counters["stats"]["calls_captured"] == captured and _graphs() == 3


def test_last_stats_and_features_of_a_compiled_call():
    model = _model("tome", r=8)
    fast = compiling.compile(model, backend="eager")
    with torch.no_grad():
        fast(_images(2))
        compiled_stats = timm_tokcomp.last_stats(model)
        model(_images(2))
        assert compiled_stats.tokens_per_block == timm_tokcomp.last_stats(model).tokens_per_block == \
            [65, 57, 49, 41, 33, 25]
        with fast.active():
            features = model.forward_features(_images(2))
        torch.testing.assert_close(model.forward_head(features), model(_images(2)), rtol=0, atol=0)


def test_compile_mode_of_the_runner_compiles_by_region():
    x = _images(2)
    assert isinstance(modes.runner(_model("tome", r=8), "compile", x), compiling.RegionallyCompiled)
    assert not isinstance(modes.runner(_model(), "compile", x), compiling.RegionallyCompiled)
    with pytest.raises(ValueError, match="mode must be one of compile, cudagraph, got 'graph'"):
        compiling.compile(_model("tome", r=8), mode="graph")


def test_cudagraph_mode_captures_the_regionally_compiled_forward_once_per_shape():
    """Inductor's CUDA graphs would start a new generation at each block's compiled call and overwrite the outputs
    the next block reads (an H200 run failed so): the regions compile plainly and one CUDA graph per input shape
    replays the whole forward. On the CPU the capture is refused with the CUDA reason."""
    from timm_tokcomp.runtime.graphs import GraphedByShape
    model = _model("tome", r=8)
    fast = compiling.compile(model, mode="cudagraph", backend="eager")
    assert isinstance(fast, GraphedByShape) and isinstance(fast.forward, compiling.RegionallyCompiled)
    assert fast.model() is model and fast.forward.model is model  # the forward holds the model, the graphs weakly
    with pytest.raises(ValueError, match="example must be a CUDA tensor"):
        fast(_images(2))
    assert not isinstance(compiling.compile(_model(), mode="cudagraph", backend="eager"), GraphedByShape)


def test_a_cuda_graph_by_shape_is_captured_again_when_the_method_changes(monkeypatch):
    """set_params gives the model a new method instance: the graph captured with the old one would replay the old r,
    so the next call of that shape captures again (a stand-in capture records r: the CPU has no CUDA graphs)."""
    from timm_tokcomp.runtime import graphs

    captured = []

    class Capture:
        def __init__(self, model, example, forward):
            captured.append((tuple(example.shape), timm_tokcomp.get_reducer(model).params["r"]))
            self.forward = forward

        def __call__(self, x):
            return self.forward(x)

    monkeypatch.setattr(graphs, "GraphedForward", Capture)
    model = _model("tome", r=8)
    graphed = graphs.GraphedByShape(model, model)
    with torch.no_grad():
        for r in (8, 4):
            timm_tokcomp.set_params(model, r=r)
            for batch in (2, 2, 3):
                torch.testing.assert_close(graphed(_images(batch)), model(_images(batch)), rtol=0, atol=0)
    assert captured == [((2, 3, 32, 32), 8), ((3, 3, 32, 32), 8), ((2, 3, 32, 32), 4), ((3, 3, 32, 32), 4)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cudagraph_mode_replays_the_eager_forward_on_cuda():
    model = _model("tome", r=8).cuda()
    fast = compiling.compile(model, mode="cudagraph")
    with torch.no_grad():
        for batch in (2, 4, 2):
            x = _images(batch, seed=batch).cuda()
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    assert len(fast.graphs) == 2


def _step_inputs(batch=2, tokens=41, channels=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    metric, x = torch.randn(batch, tokens, 16, generator=g), torch.randn(batch, tokens, channels, generator=g)
    return metric, x, torch.rand(batch, tokens, 1, generator=g) + 0.5


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("with_size", [True, False])
def test_tome_merge_operator_passes_opcheck(backend, with_size):
    metric, x, size = _step_inputs()
    torch.library.opcheck(torch.ops.timm_tokcomp.tome_merge, (metric, x, size if with_size else None, 8, 1, backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("coords_merge", ["dst", "centroid"])
def test_tome_merge_rope_operator_passes_opcheck(backend, coords_merge):
    metric, x, size = _step_inputs()
    coords = torch.rand(2, 40, 2, generator=torch.Generator().manual_seed(1)) * 10
    torch.library.opcheck(torch.ops.timm_tokcomp.tome_merge_rope,
                          (metric, x, size, coords, 8, 1, coords_merge, backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("coords_merge", ["dst", "centroid"])
def test_evit_prune_rope_operator_passes_opcheck(backend, coords_merge):
    coords = torch.rand(2, 40, 2, generator=torch.Generator().manual_seed(1)) * 10
    torch.library.opcheck(torch.ops.timm_tokcomp.evit_prune_rope,
                          (*_evit_inputs(), coords, 6, 1, coords_merge, backend))


def test_compiled_evit_on_a_rope_model_runs_its_step_as_one_operator():
    model = _rope_model(r=2).eval()
    evit = timm_tokcomp.apply(timm_tokcomp.remove(model), "evit", r=3, rope_merge="centroid")
    recorder = GraphRecorder()
    fast = compiling.compile(evit, backend=recorder)
    with torch.no_grad():
        x = torch.randn(3, 3, 56, 56)
        torch.testing.assert_close(fast(x), evit(x), rtol=1e-5, atol=1e-5)
    assert recorder.calls("evit_prune_rope")
    assert _breaks() == 0


@pytest.mark.parametrize("rope_merge", ["dst", "centroid"])
def test_triton_kernels_run_inside_a_compiled_rope_model(rope_merge):
    fast = compiling.compile(_rope_model(r=2, kernel="triton", rope_merge=rope_merge), backend="aot_eager")
    reference = _rope_model(r=2, kernel="torch", rope_merge=rope_merge)
    with torch.no_grad():
        x = torch.randn(3, 3, 56, 56)
        torch.testing.assert_close(fast(x), reference(x), rtol=1e-5, atol=1e-5)
    assert _breaks() == 0


def _evit_inputs(batch=2, tokens=41, heads=3, channels=24, seed=0, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, batch, heads, tokens, 8, generator=g)
    bias = torch.rand(batch, 1, 1, tokens, generator=g).log() if with_bias else None
    x, size = torch.randn(batch, tokens, channels, generator=g), torch.rand(batch, tokens, 1, generator=g) + 0.5
    return q, k, bias, 8 ** -0.5, x, size


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("with_size", [True, False])
def test_evit_prune_operator_passes_opcheck(backend, with_size):
    q, k, bias, scale, x, size = _evit_inputs(with_bias=with_size)
    torch.library.opcheck(torch.ops.timm_tokcomp.evit_prune,
                          (q, k, bias, scale, x, size if with_size else None, 6, 1, backend))


def test_operator_backends_agree():
    metric, x, size = _step_inputs(tokens=57)
    pairs = [(torch.ops.timm_tokcomp.tome_merge(metric, x, size, 12, 1, "triton"),
              torch.ops.timm_tokcomp.tome_merge(metric, x, size, 12, 1, "torch")),
             (torch.ops.timm_tokcomp.evit_prune(*_evit_inputs(), 9, 1, "triton"),
              torch.ops.timm_tokcomp.evit_prune(*_evit_inputs(), 9, 1, "torch"))]
    coords = torch.rand(2, 56, 2, generator=torch.Generator().manual_seed(1)) * 10
    pairs += [(torch.ops.timm_tokcomp.tome_merge_rope(metric, x, size, coords, 12, 1, merge, "triton"),
               torch.ops.timm_tokcomp.tome_merge_rope(metric, x, size, coords, 12, 1, merge, "torch"))
              for merge in ("dst", "centroid")]
    evit_coords = torch.rand(2, 40, 2, generator=torch.Generator().manual_seed(2)) * 10
    pairs += [(torch.ops.timm_tokcomp.evit_prune_rope(*_evit_inputs(), evit_coords, 9, 1, "dst", "triton"),
               torch.ops.timm_tokcomp.evit_prune_rope(*_evit_inputs(), evit_coords, 9, 1, "dst", "torch"))]
    for got, want in pairs:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, backend", [("tome", "eager"), ("tome", "aot_eager"), ("evit", "eager")])
def test_triton_kernels_run_inside_the_compiled_model(method, backend):
    model = _model(method, r=8, kernel="triton")
    reference = _model(method, r=8, kernel="torch")
    fast = compiling.compile(model, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(fast(_images(3)), reference(_images(3)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiling.compile(reference, backend=backend)(_images(3)), reference(_images(3)),
                                   rtol=1e-5, atol=1e-5)
    assert _breaks() == 0


def test_a_compiled_forward_that_needs_gradients_traces_the_torch_plan():
    x = torch.randn(2, 5, 4, requires_grad=True)
    assert not library.uses_library_op(x)  # not compiling
    model = _model("tome", r=8)
    fast = compiling.compile(model, backend="eager")
    out = fast(_images(2))
    out.sum().backward()
    assert model.head.weight.grad is not None
