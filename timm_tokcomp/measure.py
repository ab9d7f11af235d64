"""Measurements from the run itself: MACs counted by torch's FlopCounterMode, and timing."""
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


@torch.no_grad()
def forward_counting(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """One forward of x: (B, 3, H, W) -> (output, multiply-accumulates it executed for the whole batch),
    FLOPs / 2 as counted by torch.utils.flop_counter from the ops actually run."""
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(x)
    return out, counter.get_total_flops() / 2


def count_macs(model: nn.Module, x: torch.Tensor) -> float:
    """Multiply-accumulates executed by one forward of x: (B, 3, H, W), for the whole batch."""
    return forward_counting(model, x)[1]


@torch.inference_mode()
def time_side_by_side(models: Dict[str, nn.Module], x: torch.Tensor, rounds: int = 5, warmup: int = 1,
                      progress: Callable[[int], None] = lambda n: None) -> Dict[str, float]:
    """Median seconds per forward of x for each model, interleaving the models round by round so
    that machine noise hits them alike (CUDA work is synchronised around each forward)."""
    for model in models.values():
        for _ in range(warmup):
            model(x)
            progress(1)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times: Dict[str, List[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            model(x)
            sync()
            times[name].append(time.perf_counter() - start)
            progress(1)
    return {name: statistics.median(t) for name, t in times.items()}
