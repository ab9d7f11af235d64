"""The whole reduced forward compiled (timm_tokcomp.runtime.compile): the embedding (patch convolution, position
embedding or rope table, prefix tokens) and the end (final norm, pooling with the sizes, head) are compiled regions
like the blocks, so no aten op of a compiled forward runs eagerly, for every family; and torch.compile(model), the
way every timm model is compiled, takes the same regions (counted with dynamo's counters)."""
import warnings

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer
from torch._dynamo.utils import counters

import timm_tokcomp
from conftest import SMALL, family_model, reducing_setting
from timm_tokcomp.runtime import compile as compiling
from timm_tokcomp.runtime.graphs import GraphedByShape
from timm_tokcomp.methods import METHODS


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]


class InGraphs:
    """A torch.compile backend that runs each captured graph as traced, inside a profiler range, and keeps it; and
    the aten ops a profiled forward runs outside every such range: the ops it runs eagerly."""

    RANGE = "captured_graph"

    def __init__(self):
        self.graphs = []

    def backend(self, gm, example):
        self.graphs.append(gm.graph)

        def run(*args):
            with torch.profiler.record_function(self.RANGE):
                return gm.forward(*args)

        return run

    def eager_ops(self, forward):
        """The aten ops forward() runs outside every captured graph."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward()
        return [e.name for e in prof.events() if e.name.startswith("aten::") and not self._in_graph(e)]

    def _in_graph(self, event) -> bool:
        while event is not None:
            if event.name == self.RANGE:
                return True
            event = event.cpu_parent
        return False

    def graph_with(self, parameter: str, op: str) -> bool:
        """Whether some captured graph takes a parameter whose path holds `parameter` and calls an op named op."""
        return any(any(parameter in node.name for node in graph.nodes if node.op == "placeholder")
                   and any(op in str(node.target) for node in graph.nodes) for graph in self.graphs)


def _vit(method="tome", **params):
    torch.manual_seed(0)
    return timm_tokcomp.apply(VisionTransformer(**dict(SMALL, depth=6)).eval(), method, **params)


def _naflex():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model("naflexvit_base_patch16_gap", img_size=32, patch_size=8, embed_dim=64, depth=3,
                                  num_heads=2, num_classes=10).eval()
    return timm_tokcomp.apply(model, "tome", r=2)


def _hf():
    from test_hf import hf_model

    return timm_tokcomp.apply(hf_model("vit_classifier"), "tome", r=8)


CONV = ("patch", "conv2d")
MODELS = {  # name -> (a reduced model, (the patch embedding's parameter path, its op), the head's parameter path)
    "vit_tome": (lambda: _vit("tome", r=8), CONV, "head"),
    "vit_evit": (lambda: _vit("evit", r=8), CONV, "head"),
    "eva02_rope_tome": (lambda: timm_tokcomp.apply(family_model("eva02_cat_swiglu"), "tome", r=2), CONV, "head"),
    "siglip_map_tome": (lambda: timm_tokcomp.apply(family_model("siglip_map"), "tome", r=2), CONV, "attn_pool"),
    "naflex_images_tome": (_naflex, ("embeds", "linear"), "head"),  # NaFlex embeds patches by a linear
    "transformers_vit_tome": (_hf, CONV, "classifier"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_aten_op_of_a_compiled_forward_runs_eagerly(name):
    make, embed, head = MODELS[name]
    model, recorder = make(), InGraphs()
    fast = compiling.compile(model, backend=recorder.backend)
    x = _images(2)
    with torch.no_grad():
        want = model(x)
        fast(x)  # compiles
        assert recorder.eager_ops(lambda: fast(x)) == []
        got = fast(x)
    unwrap = (lambda out: out) if torch.is_tensor(want) else (lambda out: out.logits)
    torch.testing.assert_close(unwrap(got), unwrap(want), rtol=1e-5, atol=1e-5)
    assert recorder.graph_with(*embed)  # the patch embedding
    assert recorder.graph_with(head, "linear")  # the head (or the attention pool) of the end region
    assert sum(counters["graph_break"].values()) == 0


def _images(batch, seed=1):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_torch_compile_of_a_reduced_model_runs_its_regions_by_its_backend_for_every_batch_and_r():
    """torch.compile(model, backend=...) hands the reduced forward to its regions, which that backend compiles (here
    a recording one): three graphs, nothing said, and none compiled again for another batch size or r."""
    model, recorder = _vit("tome", r=8), InGraphs()
    fast = torch.compile(model, backend=recorder.backend)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to say: the call's backend reached the regions
        torch.testing.assert_close(fast(_images(2)), model(_images(2)), rtol=0, atol=0)
        regions = counters["stats"]["unique_graphs"]
        assert regions == len(recorder.graphs) == 3  # the embedding, every block (the first too), the end
        for batch in (3, 7):
            torch.testing.assert_close(fast(_images(batch)), model(_images(batch)), rtol=0, atol=0)
        for params in ({"r": 4}, {"r": 12}, {"flops_ratio": 2.0}):
            timm_tokcomp.set_params(model, **params)
            torch.testing.assert_close(fast(_images(3)), model(_images(3)), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == regions and len(recorder.graphs) == 3  # nothing compiled again


@pytest.mark.parametrize("kwargs, regions_kwargs, cuda_graphs", [
    ({}, {}, False),
    ({"mode": "reduce-overhead"}, {}, True),
    ({"mode": "max-autotune"}, {"options": {"max_autotune": True, "coordinate_descent_tuning": True}}, True),
    ({"options": {"max_autotune": True}}, {"options": {"max_autotune": True}}, False),
])
def test_torch_compile_hands_its_mode_and_options_to_the_regions(monkeypatch, kwargs, regions_kwargs, cuda_graphs):
    """Inductor's options reach the regions' compile; its CUDA graphs are the whole forward captured per input shape
    (graphs.GraphedByShape, as timm_tokcomp.compile's 'cudagraph' mode), not Inductor's own per region. The regions
    are compiled here by the 'eager' backend (the arguments recorded), so no Inductor compile runs on this CPU."""
    from timm_tokcomp.runtime import handoff

    asked = []

    def compile_regions(model, **regions_kwargs):
        asked.append(regions_kwargs)
        return make(model, backend="eager")

    make = handoff.compile_regions
    monkeypatch.setattr(handoff, "compile_regions", compile_regions)
    model = _vit("tome", r=8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # on the CPU no CUDA graphs and nothing said, as Inductor's own
        torch.testing.assert_close(torch.compile(model, **kwargs)(_images(2)), model(_images(2)), rtol=0, atol=0)
    assert asked == [regions_kwargs]
    (handed_on,) = handoff._BY_MODEL[model].values()
    assert (handed_on.graphed is not None) == cuda_graphs


def test_fullgraph_names_the_way_to_one_whole_graph():
    """The hand-off is a graph break: fullgraph=True refuses it, naming traced_whole()."""
    from torch._dynamo.exc import Unsupported

    with torch.no_grad(), pytest.raises(Unsupported, match=r"traced_whole\(\)"):
        torch.compile(_vit("tome", r=8), backend="eager", fullgraph=True)(_images(2))


def test_the_regions_handed_on_do_not_keep_the_model_alive():
    """What torch.compile(model) keeps for a model (its regions, and where CUDA graphs are asked for, the graphs per
    shape) goes with the model."""
    import gc
    import weakref

    from timm_tokcomp.runtime import handoff

    model = _vit("tome", r=8)
    fast = torch.compile(model, backend="eager")
    with torch.no_grad():
        fast(_images(2))
    assert len(handoff._BY_MODEL[model]) == 1
    handed_on, gone = next(iter(handoff._BY_MODEL[model].values())), weakref.ref(model)
    handed_on.graphed = GraphedByShape(model, handed_on._forward)  # as a compile asking for CUDA graphs holds it
    del model, fast, handed_on
    torch._dynamo.reset()
    gc.collect()
    assert gone() is None


def test_cuda_graphs_replay_only_inference_forwards_of_an_image_batch_on_the_gpu():
    """What a torch.compile asking for CUDA graphs captures (fake CUDA tensors: no GPU needed): an eval-mode forward
    of an image batch given alone (NaFlex's coordinates, transformers' options None), under no_grad, of a
    fixed-count method; every other forward is told why not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from timm_tokcomp.runtime.handoff import _why_not_graphed

    with FakeTensorMode():
        images = torch.empty(2, 3, 32, 32, device="cuda")
    model, atm = _vit("tome", r=8), _vit("atm")
    with torch.no_grad():
        alone = (((images,), {}), ((), {"x": images}), ((images, None, None), {"output_hidden_states": None}))
        for args, kwargs in alone:
            assert _why_not_graphed(model, args, kwargs) is None  # the images alone, the other arguments None
        for args, kwargs in (((images, images), {}), ((None, images), {}), ((images,), {"return_dict": False}),
                             ((_images(2),), {})):  # the last on the CPU
            assert "image batch on the GPU given alone" in _why_not_graphed(model, args, kwargs)
        assert "from the data" in _why_not_graphed(atm, (images,), {})
        assert "inference" in _why_not_graphed(model.train(), (images,), {})
    assert "inference" in _why_not_graphed(model.eval(), (images,), {})  # gradients recorded


def test_module_compile_and_a_model_compiled_whole_keep_their_forms():
    model = _vit("tome", r=8)
    model.compile(backend="eager")  # the module's own compile: its forward calls itself without looping
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(model(_images(2)), _vit("tome", r=8)(_images(2)), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 3
    torch._dynamo.reset()
    counters.clear()
    # PatchMerger's queries are shaped per block, so it does not compile by region: traced whole, no break
    whole = _vit("patchmerger", **reducing_setting(METHODS["patchmerger"], 4, {"keep_rate": 0.7, "stages": (2, 4, 5)}))
    assert not whole._tokcomp.reducer.compiles_by_region
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(whole, backend="eager")(_images(2)), whole(_images(2)),
                                   rtol=1e-5, atol=1e-5)
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (1, 0)


def test_torch_compile_of_a_transformers_and_a_naflex_model_runs_their_regions():
    from test_naflex import naflex_batch

    hf, naflex = _hf(), _naflex()
    batch = naflex_batch([torch.randn(3, 32, 32), torch.randn(3, 16, 32)], width=16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(torch.compile(hf, backend="eager")(_images(2)).logits, hf(_images(2)).logits,
                                   rtol=1e-5, atol=1e-5)
        compiled = torch.compile(naflex, backend="eager")
        torch.testing.assert_close(compiled(_images(2)), naflex(_images(2)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(compiled(batch), naflex(batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["tome", "evit"])
def test_compiled_blocks_take_the_log_sizes_their_steps_wrote(method):
    """Proportional attention's bias is the log of the sizes; the step (its operator, or its merge kernel on a GPU)
    returns it beside the sizes and the loop hands it to the next block, so no compiled graph takes a log itself."""
    model, recorder = _vit(method, r=8, prop_attn=True), InGraphs()
    fast = compiling.compile(model, backend=recorder.backend)
    with torch.no_grad():
        torch.testing.assert_close(fast(_images(2)), model(_images(2)), rtol=1e-5, atol=1e-5)
    assert len(recorder.graphs) == 3  # the embedding, every block, the end
    logs = [node for graph in recorder.graphs for node in graph.nodes if node.target in ("log", torch.log)]
    assert logs == []


ONE_BLOCK_GRAPH = {  # name -> a reduced model whose blocks (the first among them) should share one compiled graph
    "vit_tome": lambda: _vit("tome", r=8),  # proportional attention, the log sizes from the step's operator
    "vit_tome_no_prop_attn": lambda: _vit("tome", r=8, prop_attn=False),  # no log sizes carried
    "vit_evit": lambda: _vit("evit", r=8),
    "vit_dpcknn": lambda: _vit("dpcknn", r=8, prop_attn=True),  # a torch plan: the block takes the log itself
    "eva02_rope_tome": lambda: timm_tokcomp.apply(family_model("eva02_cat_swiglu", depth=4), "tome", r=2),
    "dinov3_rope_evit": lambda: timm_tokcomp.apply(family_model("dinov3_registers", depth=4), "evit", r=2),
    "ropevit_mixed_tome": lambda: timm_tokcomp.apply(family_model("ropevit_mixed", depth=4), "tome", r=2),
}


@pytest.mark.parametrize("name", sorted(ONE_BLOCK_GRAPH))
def test_the_first_compiled_block_runs_the_graph_of_the_others(name):
    """The compiled embedding hands the first block sizes of one, their log (zeros) where attention is
    proportional, and on a rope model its positions as coordinates (timm's table aside), so that block takes the
    inputs the later blocks take: three graphs in all (embedding, blocks, end), the outputs the eager model's."""
    model = ONE_BLOCK_GRAPH[name]()
    fast = compiling.compile(model, backend="eager")
    with torch.no_grad():
        for batch in (2, 3):
            torch.testing.assert_close(fast(_images(batch)), model(_images(batch)), rtol=1e-5, atol=1e-5)
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (3, 0)
