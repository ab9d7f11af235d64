"""The fused Triton kernels compiled for real GPUs ahead of time (no GPU needed), and the keys Triton would compile
them under: token counts never cost a recompile."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import timm_tokcomp
from timm_tokcomp.kernels import triton_dense, triton_evit, triton_tome
from conftest import make_model

pytestmark = [pytest.mark.slow]  # Triton cubins and Inductor's CUDA lowering


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_real_gpus(arch):
    """Every kernel of the package compiles to a cubin for sm_80 / sm_90 in fp32, fp16 and bf16, ahead of time
    and without a GPU: the CPU interpreter accepts programs that the GPU compiler rejects."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_kernels_aot.py")
    done = subprocess.run([sys.executable, str(script), str(arch)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("cubin") == 3 * 33


def _compile_keys(runs):
    """For each of the package's Triton kernels, the distinct keys a GPU would compile it under (Triton's own
    specialization of each int and pointer argument, plus the constexprs) over `runs`, a callable doing forwards;
    grouped by constexprs: {kernel: {constexprs: number of keys}}."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    keys = {}
    hooks = []
    for module in (triton_tome, triton_evit, triton_dense):
        for name in dir(module):
            kernel = getattr(module, name)
            if not name.endswith("_kernel"):
                continue
            plain = set(kernel.kwargs.get("do_not_specialize") or [])
            unaligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or [])

            def hook(*args, _kernel=kernel, _name=f"{module.__name__}.{name}", _plain=plain, _unaligned=unaligned,
                     **constexprs):
                key = tuple(native_specialize_impl(BaseBackend, value, False, arg not in _plain, arg not in _unaligned)
                            for arg, value in zip(_kernel.arg_names, args)
                            if isinstance(value, (int, torch.Tensor)) and not isinstance(value, bool))
                keys.setdefault(_name, {}).setdefault(tuple(sorted(constexprs.items())), set()).add(key)

            kernel.add_pre_run_hook(hook)
            hooks.append((kernel, hook))
    try:
        runs()
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)
    return {name: {c: len(k) for c, k in by.items()} for name, by in keys.items()}


def test_token_counts_never_cost_a_recompile():
    """Triton compiles a kernel anew for each specialization of its int arguments (== 1, divisible by 16) and
    pointer alignments. Token counts change from block to block and, for ATM, from batch to batch: they are
    not specialized, so each kernel compiles once per set of constexprs, whatever the schedule (before: up to 5
    compilations of the matching kernel on these few forwards)."""
    def runs():
        torch.manual_seed(0)
        with torch.no_grad():
            for method, params in (("tome", {"r": 13}), ("tome", {"flops_ratio": 2.0}),
                                   ("evit", {"keep_rate": 0.7, "stages": (2, 3, 4)}),
                                   ("atm", {"alpha": 0.3, "beta": 0.0, "theta_min": 0.0}), ("dense_tome", {"k": 5})):
                model = timm_tokcomp.apply(make_model("cls").eval(), method, kernel="triton", **params)
                for batch in (1, 2, 3, 4):
                    model(torch.randn(batch, 3, 32, 32))

    counts = _compile_keys(runs)
    assert set(counts) == {f"timm_tokcomp.kernels.{m}" for m in (
        "triton_tome._match_and_plan_kernel", "triton_tome._merge_kernel", "triton_evit._class_attention_plan_kernel",
        "triton_evit._prune_fuse_kernel", "triton_dense._merge_kernel", "triton_dense._unmerge_add_kernel")}
    assert {name: max(by.values()) for name, by in counts.items()} == dict.fromkeys(counts, 1)


def test_compiled_steps_are_kernel_launches_that_inductor_makes():
    """Where Triton compiles the kernels, a compiled forward's step is a triton_op (library.compiled_step) that
    torch.compile decomposes, before Inductor, into its kernels' launches: a ToMe or EViT reducing block adds two
    launches (ToMe's metric inside its match kernel) and allocations, and no Python dispatch; the merge launch writes
    the next block's log sizes, so a later block adds nothing else beyond the limit's. Each launch writes only its own
    outputs and scratch, so nothing of the step's inputs is copied for it. Traced on the CPU without a GPU (tests/tensors/trace_launched_steps.py)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("trace_launched_steps.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = {line["step"]: line for line in map(json.loads, done.stdout.splitlines())}
    allocations = {"aten.empty_strided.default"}  # triton_common.contiguous_empty: every tensor a launch writes
    block, against_limit = steps.pop("block"), steps.pop("block_vs_limit")
    assert set(steps) == {"tome_merge", "tome_merge_rope", "evit_prune", "evit_prune_rope"}
    for name, step in steps.items():  # EViT's rope step: its coordinates fused by a second prune-fuse launch
        assert len(step["launches"]) == (3 if name == "evit_prune_rope" else 2), (name, step)
        assert not any(launch["writes_input"] for launch in step["launches"]), (name, step)
    # a reduced ViT's block graph (compiled by regions, the batch symbolic): the step is two launches, no metric op
    assert [launch["writes"] for launch in block["launches"]] == [["NORMED", "WS"], ["LOG_OUT", "SIZE_OUT", "Y"]]
    assert not block["launches"][0]["grid"][0].isdigit()
    # what a launch writes has the strides Inductor lays its buffer out with (torch.empty's traced strides hold
    # Max(1, size) factors, which made torch 2.11's Inductor copy a written output into a buffer reading itself)
    strides = [s for launch in block["launches"] for written in launch["strides"] for s in written]
    assert any(not s.isdigit() for s in strides) and not any("Max(1," in s for s in strides), strides
    assert not any("mean" in op for op in block["others"])
    # a later block (sizes and their log given, as the previous step wrote them) against the limit's (same token
    # counts, no matching): the step's two launches, their allocations and the view of the log sizes as
    # proportional attention's bias, no kernel more (the log is the merge launch's); the limit only slices, and hands
    # its plan's sizes (a view) on contiguous, as every compiled block does (reducing._handed_on)
    assert against_limit["only_reduced"] == {"launch NORMED,WS": 1, "launch LOG_OUT,SIZE_OUT,Y": 1,
                                             "aten.empty_strided.default": 5, "aten.view.default": 1}
    assert against_limit["only_limit"] == {"aten.slice.Tensor": 4, "aten.clone.default": 1}
    assert steps["tome_merge"]["launches"][0]["writes"] == ["NORMED", "WS"]
    assert set(steps["tome_merge"]["others"]) | set(steps["evit_prune"]["others"]) <= allocations
    # EViT's rope step: the coordinates behind zero rows for the prefix, fused, sliced back and copied to a fresh
    # tensor (the operator's contract)
    assert set(steps["evit_prune_rope"]["others"]) - allocations == {
        "aten.new_zeros.default", "aten.cat.default", "aten.slice.Tensor", "aten.clone.default"}
    # the rope step's 'dst' coordinates: each output's source row, indexed and gathered by torch (pointwise index
    # arithmetic that Inductor fuses with the gathers)
    assert set(steps["tome_merge_rope"]["others"]) - allocations <= {
        "aten.arange.default", "aten.clamp.default", "aten.slice.Tensor", "aten.lt.Scalar", "aten.mul.Tensor",
        "aten.add.Tensor", "aten.sub.Tensor", "aten.where.self", "aten.unsqueeze.default", "aten.expand.default",
        "aten.gather.default"}


def test_inductor_generates_cuda_code_for_every_compiled_region():
    """Every graph of a reduced model compiled by regions (embedding, blocks, end) is lowered by
    Inductor for a CUDA device in bf16, with the steps' launches inside, up to its generated module, without a GPU
    (tests/tensors/lower_regions_for_cuda.py): EVA02 with ToMe (its rope step launched; torch 2.11's Inductor failed
    its later blocks with a KeyError in the scheduler until each written tensor had explicit strides,
    triton_common.contiguous_empty), DINOv3 with EViT (its rope table made on the device inside the embedding's
    graph; EViT's rope step launched), a ViT with EViT (EViT's launches). One graph per region: EVA02's third block
    merges every A token (r = n_a = 4) without a recompile (triton_tome._destination_coords)."""
    import json

    settings = ["eva02_tiny_patch14_224:56:tome:r=4,depth=3", "vit_small_patch16_dinov3:64:evit:r=4",
                "vit_tiny_patch16_224:64:evit:r=4"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("lower_regions_for_cuda.py")
    done = subprocess.run([sys.executable, str(script), *settings], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    graphs = [json.loads(line) for line in done.stdout.splitlines()]
    assert [g for g in graphs if not g["generated"]] == []
    for setting in settings:
        name, _, method, _ = setting.split(":")
        mine = [g for g in graphs if (g["model"], g["method"]) == (name, method)]
        assert len(mine) == 3, mine
        # the embedding and the end launch nothing; the blocks' graph (the first block's too) launches the step
        assert [g["launched_steps"] for g in mine] == [0, 1, 0], mine
