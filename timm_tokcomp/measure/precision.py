"""Precision and device, the one table every command reads: the dtype names, autocast with TF32 on or off, the
device checks and the device's description. Pure torch, below everything that runs a model."""
import contextlib
import platform
from typing import Iterator, Optional

import torch

from ..utils.checks import check_choice

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AMP_NAMES = {"bfloat16": "bf16", "float16": "fp16"}  # the trainers' --amp-dtype spellings -> DTYPES names


def check_dtype(dtype: str, flag: str = "--dtype") -> None:
    check_choice(flag, dtype, DTYPES)


def autocast_dtype(dtype: str) -> Optional[torch.dtype]:
    """The dtype autocast runs a named precision in; None for fp32 (no autocast)."""
    check_dtype(dtype)
    return None if dtype == "fp32" else DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bf16'; a dtype outside the table by torch's name."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype))


@contextlib.contextmanager
def precision(device: str, dtype: str, tf32: bool) -> Iterator[None]:
    """Run the block under autocast to dtype ('fp32': none) with TF32 matmuls and convolutions on or off
    (CUDA only); the previous TF32 settings come back on exit."""
    cast = autocast_dtype(dtype)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    autocast = torch.autocast(torch.device(device).type, dtype=cast) if cast is not None else contextlib.nullcontext()
    try:
        with autocast:
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def describe_settings(device: str, dtype: str, tf32: bool) -> str:
    """What the timings ran under: device, precision and (on CUDA) TF32."""
    precision_text = "fp32 (no autocast)" if autocast_dtype(dtype) is None else f"{dtype} autocast"
    tf32_text = f", TF32 {'on' if tf32 else 'off'}" if torch.device(device).type == "cuda" else ""
    return f"device {device}, {precision_text}{tf32_text}"


def check_device(device: str, source: str = "--device") -> None:
    """Raise ValueError for a device string torch cannot parse or a device this machine does not have (a CUDA build
    of torch without a driver included), naming where the device came from (source: '--device', 'device=', 'preset
    <file>')."""
    keyword = source.endswith("=")  # device='cuda' reads as the call gave it; --device cuda as typed
    named = f"{source}{device!r}" if keyword else f"{source} {device}"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"{source}{'' if keyword else ' '}{device!r} is not a torch device (cpu, cuda, cuda:1, "
                         "...)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{named}: CUDA is not available on this machine (no CUDA device or driver, or a "
                         f"torch built without CUDA)")
    index = torch.device(device).index
    if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"{named}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def device_description(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' for a CUDA device; 'CPU (<processor>, <threads> threads)' for the CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
