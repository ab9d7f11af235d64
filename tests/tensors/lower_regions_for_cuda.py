"""Lower a reduced model's compiled regions with Inductor for CUDA, without a GPU:
`python tests/tensors/lower_regions_for_cuda.py MODEL:IMG_SIZE:METHOD[:KEY=VALUE,...] ...` (depth=D: the model's
blocks, 2 unless given; every other key: the method's parameter). Run without TRITON_INTERPRET.

The model is compiled by regions (timm_tokcomp.compile) on the CPU under bf16 autocast with the steps' kernels
launched as on a GPU (their triton_ops), each region's graph recorded as dynamo hands it to Inductor (its launches run
by the torch plan, so the forward goes on to every region: the embedding, the blocks (sizes and their log, from the
first block on), the end). Each graph is then lowered by Inductor for a CUDA device (fake tensors on 'cuda', the
dynamic shapes kept, bf16 autocast, an sm_90 card's properties): lowering, scheduling and the generated module's code,
up to loading that module, the first point that needs a driver. Prints one JSON line per graph: its region, whether
Inductor generated its code, and the error if not. The launches' inputs, layouts and aliasing are what this checks
(the attention path is the CPU's choice: resolve_prop_attn reads the images' device)."""
import json
import sys
import types

import timm
import torch
import torch._inductor.config as inductor_config
import triton
from torch._dynamo.device_interface import CudaInterface
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._inductor import codecache, scheduler
from torch._inductor.compile_fx import compile_fx

import timm_tokcomp
from timm_tokcomp import kernels
from trace_launched_steps import Sm90Driver  # beside this script

SM90 = types.SimpleNamespace(  # what Inductor reads of a card: an H100's
    name="NVIDIA H100", major=9, minor=0, multi_processor_count=132, regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32, total_memory=80 * 2**30,
    L2_cache_size=50 * 2**20, shared_memory_per_block_optin=227 * 1024, gcnArchName="")


class _Generated(Exception):
    """Raised in place of loading Inductor's generated module (which needs a driver)."""


def _pretend_a_card():
    """Inductor's device queries answered as an sm_90 card would, and its generated module not loaded."""
    triton.runtime.driver.set_active(Sm90Driver())
    for name, value in (("get_device_properties", lambda device=None: SM90),
                        ("get_compute_capability", lambda device=None: 90), ("is_available", lambda: True),
                        ("is_triton_capable", lambda device=None: True), ("is_bf16_supported", lambda *a, **k: True),
                        ("current_device", lambda: 0), ("device_count", lambda: 1)):
        setattr(CudaInterface, name, staticmethod(value))
    # torch.cuda itself stays unavailable (nothing initialises CUDA) but describes the card
    torch.cuda.get_device_properties = lambda device=None: SM90
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.current_device, torch.cuda.device_count = (lambda: 0), (lambda: 1)
    scheduler.has_triton = lambda: True
    inductor_config.joint_graph_constant_folding = False  # it runs ops on real (here absent) CUDA tensors
    inductor_config.compile_threads = 1

    def load(*args, **kwargs):
        raise _Generated

    codecache.PyCodeCache.load_by_key_path = load


def _run_by_torch_plan(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """gm with each launched step (timm_tokcomp::<name>_launched) called as its operator on the torch plan, to run
    on the CPU."""
    gm = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "")
        if node.op == "call_function" and "_launched" in name:
            step = getattr(torch.ops.timm_tokcomp, name.split("_launched")[0])
            node.target = lambda *args, _step=step: _step(*args, "torch")
    gm.recompile()
    return gm


def _on_cuda(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """gm with every device it names (what a tensor made in the graph is made on) the CUDA device."""
    gm = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
    cuda = torch.device("cuda", 0)

    def moved(value):
        if isinstance(value, torch.device) and value.type == "cpu" or value == "cpu":  # 'cpu': autocast's too
            return cuda if isinstance(value, torch.device) else "cuda"
        return value

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, moved)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, moved)
    gm.recompile()
    return gm


def _lower_for_cuda(gm: torch.fx.GraphModule) -> dict:
    """Inductor on gm, its inputs fake CUDA tensors of the shapes dynamo traced (symbolic ones kept)."""
    values = [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]
    gm = _on_cuda(gm)
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with mode:
        inputs = [v.to("cuda") if isinstance(v, torch.Tensor) else v for v in values]
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        with tracing(TracingContext(mode)), torch.no_grad():
            compile_fx(gm, inputs)
    except Exception as error:  # noqa: BLE001 - every failure is the finding; Inductor wraps _Generated
        cause = error
        while cause is not None and not isinstance(cause, _Generated):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            return {"generated": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        return {"generated": True}
    finally:
        torch.set_autocast_enabled("cuda", False)
    return {"generated": False, "error": "the module loaded without a driver"}


def lower(name: str, img_size: int, method: str, depth: int = 2, **kwargs):
    """Print, for each compiled region graph of timm model name (depth blocks) reduced by method(**kwargs), whether
    Inductor generated its CUDA code."""
    model = timm_tokcomp.apply(timm.create_model(name, img_size=img_size, depth=depth).eval(), method, **kwargs)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return _run_by_torch_plan(gm)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        timm_tokcomp.compile(model, backend=record)(torch.randn(2, 3, img_size, img_size))
    for index, gm in enumerate(graphs):
        launches = sum("_launched" in str(node.target) for node in gm.graph.nodes)
        print(json.dumps({"model": name, "method": method, "graph": index, "launched_steps": launches,
                          **_lower_for_cuda(gm)}), flush=True)


def main(*settings: str):
    """settings: MODEL:IMG_SIZE:METHOD[:KEY=VALUE,...] each."""
    _pretend_a_card()
    kernels.resolve_backend = lambda kernel, x: "triton"  # as on a GPU: the compiled blocks' steps launch kernels
    for setting in settings:
        name, img_size, method, *options = setting.split(":")
        kwargs = dict(option.split("=") for option in options[0].split(",")) if options else {}
        lower(name, int(img_size), method, **{k: int(v) if v.isdigit() else v for k, v in kwargs.items()})


if __name__ == "__main__":
    main(*sys.argv[1:])
