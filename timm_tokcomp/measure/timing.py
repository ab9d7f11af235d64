"""Timing forwards side by side: the models interleaved round by round so that machine noise hits them alike, the
device synchronised around each forward, and dynamo configured to fail rather than fall back to eager silently."""
import statistics
import time
from typing import Callable, Dict, List, Union

import torch


def time_side_by_side(models: Dict[str, Callable], x: Union[torch.Tensor, Dict[str, torch.Tensor]], rounds: int = 5,
                      warmup: int = 1, progress: Callable[[int], None] = lambda n: None) -> Dict[str, float]:
    """Median seconds per forward of x for each model, interleaving the models round by round so
    that machine noise hits them alike (CUDA work is synchronised around each forward)."""
    times = time_runs(models, x, rounds, warmup, progress)
    return {name: statistics.median(t) for name, t in times.items()}


def no_silent_eager_fallback(num_models: int):
    """Dynamo config for compiling num_models models of the same classes in one process: room for two
    compilations per model (e.g. two input shapes), and an error, not a silent eager fallback, if that is
    not enough."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    fail = "fail_on_recompile_limit_hit" if hasattr(config, "fail_on_recompile_limit_hit") else "fail_on_cache_limit_hit"
    return config.patch(**{limit: max(8, 2 * num_models), fail: True})


def synchronizer(x: Union[torch.Tensor, Dict[str, torch.Tensor]]) -> Callable[[], None]:
    """What waits for the device of x (a tensor, or a dict of them such as a NaFlex batch) to finish its queued
    work before a clock is read (nothing on the CPU)."""
    tensor = next(v for v in x.values() if torch.is_tensor(v)) if isinstance(x, dict) else x
    return torch.cuda.synchronize if tensor.is_cuda else (lambda: None)


@torch.inference_mode()
def time_runs(models: Dict[str, Callable], x: Union[torch.Tensor, Dict[str, torch.Tensor]], rounds: int = 5,
              warmup: int = 1, progress: Callable[[int], None] = lambda n: None,
              stop: Callable[[], bool] = lambda: False) -> Dict[str, List[float]]:
    """Seconds of each of `rounds` forwards of x per model (any callable), after `warmup` untimed ones,
    the models interleaved round by round. stop: read before each warm-up forward and each round; once it says
    True, the rounds timed so far are returned (every model has as many)."""
    for model in models.values():
        for _ in range(warmup):
            if stop():
                return {name: [] for name in models}
            model(x)
            progress(1)
    sync = synchronizer(x)
    times: Dict[str, List[float]] = {name: [] for name in models}
    for _ in range(rounds):
        if stop():
            break
        for name, model in models.items():
            sync()
            start = time.perf_counter()
            model(x)
            sync()
            times[name].append(time.perf_counter() - start)
            progress(1)
    return times

