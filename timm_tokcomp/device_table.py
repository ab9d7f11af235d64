"""What 'auto' resolves to on a device class and precision: the measured table in assets/device_defaults.json
(filled from `tokcomp speed` / `tokcomp tune` runs on that class of device), or today's rule where it has no
entry. A tune preset names its choices outright and does not consult the table."""
import functools
import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

TABLE = Path(__file__).parent / "assets" / "device_defaults.json"
FIELDS = ("kernel", "prop_attn")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def _entries(path: Path = TABLE) -> Dict[Tuple[str, str], Dict[str, str]]:
    doc = json.loads(path.read_text())
    return {(e["device_class"], e["dtype"]): e for e in doc["entries"]}


@functools.lru_cache(maxsize=None)
def device_class(device: torch.device) -> str:
    """'cpu', or 'cuda-sm<major><minor>' (an H100 is 'cuda-sm90'); other device types by their name."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    return device.type


def compute_dtype(x: torch.Tensor) -> str:
    """The precision x's matmuls run in: autocast's dtype where autocast is on for x's device, else x's own."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return _DTYPE_NAMES.get(torch.get_autocast_dtype(kind), str(torch.get_autocast_dtype(kind)))
    return _DTYPE_NAMES.get(x.dtype, str(x.dtype))


def measured(field: str, x: torch.Tensor) -> Optional[str]:
    """The table's choice of `field` ('kernel' or 'prop_attn') for x's device class and precision, or None."""
    if field not in FIELDS:
        raise ValueError(f"field must be one of {FIELDS}, got {field!r}")
    entry = _entries().get((device_class(x.device), compute_dtype(x)))
    return None if entry is None else entry.get(field)
