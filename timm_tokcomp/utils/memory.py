"""What a batch size costs before it is allocated: a batch whose inputs alone would not fit the device's memory
is refused naming its flag, instead of an allocator's traceback."""
import math
from typing import Optional, Sequence

import torch

from .checks import shown


def device_memory(device: torch.device) -> Optional[int]:
    """The bytes of memory `device` has (the machine's RAM for the CPU, the card's for CUDA), or None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return int(open("/proc/meminfo").readline().split()[1]) * 1024  # MemTotal, in kB
    except (OSError, ValueError, IndexError):
        return None


def check_batch_fits(flag: str, batch: int, item_shape: Sequence[int], device: torch.device,
                     dtype: torch.dtype = torch.float32) -> None:
    """Refuse `batch` inputs of item_shape (an image's (C, H, W)) whose bytes alone exceed half of device's memory:
    the forward needs many times its input, so such a batch can never run."""
    memory = device_memory(torch.device(device))
    need = batch * math.prod(item_shape) * torch.empty((), dtype=dtype).element_size()
    if memory is not None and need > memory // 2:
        raise ValueError(f"{flag} {batch:,}: a batch of {batch:,} inputs of shape {shown(tuple(item_shape))} takes "
                         f"{need / 2**30:,.1f} GiB before any activation, over half of the {memory / 2**30:.0f} GiB "
                         f"the {torch.device(device).type} has; use a smaller {flag}")
