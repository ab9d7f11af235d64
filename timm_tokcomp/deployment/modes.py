"""Execution modes and the one runner that builds any of them: what runs a model's forwards in bench, speed, tune
and deploy. eager: the module itself; compile: torch.compile, a reduced model by regions (its block compiled once,
batch and token count dynamic: timm_tokcomp.runtime.compile), a plain one whole with static shapes; cudagraph: the same
with CUDA graphs (compiling.compile); graph: the eager forward captured in one CUDA graph
(graphs.GraphedForward); onnx: the ONNX export in onnxruntime's CPU provider, fp32."""
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from ..runtime import compile as compiling
from ..runtime.graphs import GraphedForward
from ..utils.checks import MAX_BATCH, check_choice, check_int_list

TORCH_MODES = ("eager", "compile", "cudagraph", "graph")  # what speed and tune time
MODES = TORCH_MODES + ("onnx",)
CUDA_MODES = ("cudagraph", "graph")  # CUDA graphs replay GPU work


def check_mode(mode: str, device: str, dtype: str = "fp32", flag: str = "--modes",
               allowed: Sequence[str] = MODES) -> None:
    """Raise ValueError naming flag when mode is unknown or cannot run on this device and dtype."""
    check_choice(flag, mode, allowed)
    if mode in CUDA_MODES and torch.device(device).type != "cuda":
        raise ValueError(f"{flag} {mode} needs --device cuda (CUDA graphs replay GPU work)")
    if mode == "onnx" and (torch.device(device).type != "cpu" or dtype != "fp32"):
        raise ValueError(f"{flag} onnx runs fp32 on onnxruntime's CPU provider: use --device cpu --dtype fp32")


def check_modes(modes: Sequence[str], device: str, flag: str = "--modes") -> None:
    """check_mode for each of a list of torch modes."""
    for mode in modes:
        check_mode(mode, device, flag=flag, allowed=TORCH_MODES)


def warmup_calls(mode: str) -> int:
    """Untimed calls before timing: the first calls of a compiled mode compile (one per input shape)."""
    return 1 if mode == "eager" else 2


def runner(model: nn.Module, mode: str, example: torch.Tensor, workdir: Optional[str] = None,
           name: str = "model") -> Callable[[torch.Tensor], torch.Tensor]:
    """model as `mode` runs it, built for inputs shaped like example (B, 3, H, W): a callable images -> outputs.
    graph captures on example (later calls take its shape); onnx exports to workdir/<name>.onnx (at batch 2)."""
    if mode == "eager":
        return model
    if mode == "graph":
        return GraphedForward(model, example)
    if mode in ("compile", "cudagraph"):
        return compiling.compile(model, mode)
    if mode == "onnx":
        from .onnx import export_onnx, onnx_runner

        if workdir is None:
            raise ValueError("mode onnx needs a workdir for the exported file")
        example = example[:2] if len(example) >= 2 else example.expand(2, -1, -1, -1)
        return onnx_runner(export_onnx(model, str(Path(workdir) / f"{name}.onnx"), example.cpu()))
    check_choice("mode", mode, MODES)
    raise AssertionError(f"mode {mode!r} is in MODES but has no runner")


def check_batches(batches: Sequence[int]) -> List[int]:
    """The batch sizes (--batches): a non-empty list of integers in [1, MAX_BATCH]."""
    return check_int_list("--batches", batches, 1, "batch sizes", high=MAX_BATCH)
