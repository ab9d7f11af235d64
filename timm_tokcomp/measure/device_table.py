"""What 'auto' resolves to on a device class and precision: the measured table in assets/device_defaults.json
(filled from `tokcomp speed` / `tokcomp tune` runs on that class of device), or today's rule where it has no
entry. A tune preset names its choices outright and does not consult the table."""
import functools
import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from .precision import dtype_name
from ..utils.checks import check_choice

TABLE = Path(__file__).resolve().parents[1] / "assets" / "device_defaults.json"
FIELDS = ("kernel", "prop_attn", "prop_attn_compiled")  # the last: under torch.compile, models without rope


@functools.lru_cache(maxsize=None)
def _entries(path: Path = TABLE) -> Dict[Tuple[str, str], Dict[str, str]]:
    doc = json.loads(path.read_text())
    return {(e["device_class"], e["dtype"]): e for e in doc["entries"]}


def device_class(device: torch.device) -> str:
    """'cpu', or 'cuda-sm<major><minor>' (an H100 is 'cuda-sm90'); other device types by their name."""
    return _device_class(device.type, device.index)


@functools.lru_cache(maxsize=None)
def _device_class(kind: str, index: Optional[int]) -> str:
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda-sm{major}{minor}"
    return kind


def compute_dtype(x: torch.Tensor) -> str:
    """The precision x's matmuls run in: autocast's dtype where autocast is on for x's device, else x's own."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    return dtype_name(dtype)


def measured(field: str, x: torch.Tensor) -> Optional[str]:
    """The table's choice of `field` (one of FIELDS) for x's device class and precision, or None."""
    check_choice("field", field, FIELDS)
    return _lookup(field, x.device.type, x.device.index, compute_dtype(x))


@torch.compiler.assume_constant_result
def _lookup(field: str, kind: str, index: Optional[int], dtype: str) -> Optional[str]:
    """A constant under torch.compile: the table is read when the graph is traced, not in it."""
    entry = _entries().get((_device_class(kind, index), dtype))
    return None if entry is None else entry.get(field)
