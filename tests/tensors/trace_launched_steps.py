"""Trace the reduction steps' triton_ops (kernels.library.compiled_step on the 'triton' backend) as torch.compile
does before Inductor, on CPU tensors and without a GPU: `python tests/tensors/trace_launched_steps.py`. Run without
TRITON_INTERPRET (an interpreted kernel is not traced). Triton is pointed at an sm_90 target so that torch can read
which tensors each kernel writes. Prints, per step, one JSON line: the kernel launches in the graph, for each the
arguments it writes and whether one of them is the step's input, and the graph's other ops; then one for the first
block's graph of a reduced ViT compiled by regions (timm_tokcomp.compile; the batch and token count symbolic: its
launches, their grids and the strides of what each writes); then the ops a later block's graph (token sizes and
their log given) holds beyond the limit's block graph (speed.LimitReducer: the same token counts, no matching), and
the limit's beyond it."""
import collections
import json

import timm
import torch
import triton
from torch._dynamo.backends.common import aot_autograd
from triton.backends.compiler import GPUTarget

import timm_tokcomp
from timm_tokcomp import kernels
from timm_tokcomp.runtime import regions
from timm_tokcomp.kernels import library
from timm_tokcomp.patch import patch
from timm_tokcomp.runtime.loop import resolve_prop_attn
from timm_tokcomp.commands.speed import LimitReducer


class Sm90Driver:
    """The one thing torch's analysis of a kernel asks of the driver: the target to compile its IR for (an sm_90
    card's; also lower_regions_for_cuda.py's)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def trace(name, *args):
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm  # never run: the graph holds GPU kernel launches on CPU tensors

    def step(*tensors):  # the graph's inputs: args' tensors, in order
        given = iter(tensors)
        return library.compiled_step(name, *(next(given) if isinstance(a, torch.Tensor) else a for a in args),
                                     backend="triton")

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=record), fullgraph=True)
    torch._dynamo.reset()  # each step traced afresh, with static shapes
    try:
        compiled(*tensors)
    except Exception:  # the recorded graph's kernels cannot run on the CPU; its capture is what is read
        if not graphs:
            raise
    (gm,) = graphs
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    launches, others = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "triton_kernel_wrapper" in str(node.target):
            written = node.kwargs["tensors_to_clone"]
            launches.append({"writes": sorted(written),
                             "writes_input": any(node.kwargs["kwargs"][w] in inputs for w in written)})
        elif "getitem" not in str(node.target):
            others.append(str(node.target))
    print(json.dumps({"step": name, "launches": launches, "others": others}))


class _Traced(Exception):
    """Raised by a recorded graph that launches kernels, in place of running them on the CPU."""


def _recording(graphs):
    """A torch.compile backend appending each graph Inductor would receive to graphs: a graph without kernel
    launches runs, one with them raises _Traced."""
    def record(gm, example_inputs):
        graphs.append(gm)
        if not any("triton_kernel_wrapper" in str(node.target) for node in gm.graph.nodes):
            return gm

        def traced(*args):
            raise _Traced

        return traced

    return aot_autograd(fw_compiler=record)


def _written_strides(launch: torch.fx.Node) -> list:
    """The strides of each tensor the launch writes, as the trace states them (symbolic: strings)."""
    return [[str(stride) for stride in launch.kwargs["kwargs"][name].meta["val"].stride()]
            for name in sorted(launch.kwargs["tensors_to_clone"])]


def trace_block():
    graphs = []
    model = timm_tokcomp.apply(timm.create_model("vit_tiny_patch16_224", img_size=64, depth=3).eval(), "tome", r=4)
    try:
        with torch.no_grad():  # the embedding's graph runs, the first block's launches
            timm_tokcomp.compile(model, backend=_recording(graphs))(torch.randn(2, 3, 64, 64))
    except _Traced:
        pass
    block = graphs[-1]
    ops = [str(node.target) for node in block.graph.nodes if node.op == "call_function"]
    launches = [node for node in block.graph.nodes if "triton_kernel_wrapper" in str(node.target)]
    print(json.dumps({"step": "block", "launches": [{"writes": sorted(n.kwargs["tensors_to_clone"]),
                                                     "grid": [str(g) for g in n.kwargs["grid"][0]],
                                                     "strides": _written_strides(n)}
                                                    for n in launches],
                      "others": [op for op in ops if "triton_kernel_wrapper" not in op]}))


def _later_block_ops(model, setting, log_size_given):
    """The ops (launches by what they write) of model's compiled block graph for block 1 entering with sizes, 17
    tokens, and their log where log_size_given (as the loop hands on what a fused step wrote)."""
    graphs = []
    compiled = regions.compile_regions(model, backend=_recording(graphs))
    x, size = torch.randn(2, 17, model.embed_dim), torch.full((2, 17, 1), 2.0)
    log_size = size.log() if log_size_given else None
    prop_attn = resolve_prop_attn(model._tokcomp.prop_attn, x, compiled=True)  # as the loop resolves it
    try:
        with torch.no_grad(), regions.running(model, compiled):
            compiled.block(model.blocks[1], x, size, None, None, setting, model._tokcomp.reducer, prop_attn, 1, 1,
                           False, log_size)
    except _Traced:
        pass
    ops = collections.Counter()
    for node in graphs[-1].graph.nodes:
        name = str(node.target)
        if node.op != "call_function" or "getitem" in name or "built-in" in name or "sym_" in name:
            continue
        ops["launch " + ",".join(sorted(node.kwargs["tensors_to_clone"])) if "triton_kernel_wrapper" in name
            else name] += 1
    return ops


def trace_block_against_limit():
    vit = lambda: timm.create_model("vit_tiny_patch16_224", img_size=64, depth=3).eval()  # noqa: E731
    reduced, limit = timm_tokcomp.apply(vit(), "tome", r=4), vit()
    patch(limit, LimitReducer([17, 13, 9]))
    # the loop hands a block the log sizes the previous step wrote; the limit's plans write none
    ours, theirs = _later_block_ops(reduced, 4, True), _later_block_ops(limit, 13, False)
    print(json.dumps({"step": "block_vs_limit", "only_reduced": ours - theirs, "only_limit": theirs - ours}))


def main():
    assert library.LAUNCHED_BY_INDUCTOR, "run without TRITON_INTERPRET"
    triton.runtime.driver.set_active(Sm90Driver())
    kernels.resolve_backend = lambda kernel, x: "triton"  # as on a GPU: the compiled blocks' steps launch kernels
    g = torch.Generator().manual_seed(0)
    b, heads, n, d, c = 2, 4, 197, 16, 24
    q, k = torch.randn(2, b, heads, n, d, generator=g)
    x, size = torch.randn(b, n, c, generator=g), torch.rand(b, n, 1, generator=g) + 0.5
    coords = torch.rand(b, n - 1, 2, generator=g)
    bias = size.log().view(b, 1, 1, n)
    trace("tome_merge", k, x, size, 16, 1)
    trace("tome_merge_rope", k, x, size, coords, 16, 1, "dst")
    trace("evit_prune", q, k, bias, 0.25, x, size, 16, 1)
    trace("evit_prune_rope", q, k, bias, 0.25, x, size, coords, 16, 1, "dst")
    trace_block()
    trace_block_against_limit()


if __name__ == "__main__":
    main()
