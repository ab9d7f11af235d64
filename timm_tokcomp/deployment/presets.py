"""The preset file format that `tokcomp calibrate` and `tokcomp tune` write and `--methods`, `load_preset` and
`deploy` read: {"format", "method", "params", "execution": {"mode"}, "tuned" | "calibration": {...}}.
A tune preset records the conditions it was measured under; loading it elsewhere warns."""
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..core import NO_REDUCTION, __version__
from ..methods import METHODS
from ..files.outputs import new_output
from ..utils.checks import is_version
from ..measure.precision import DTYPES, check_device, device_description
from ..files.userfiles import fail, read_json
from .modes import TORCH_MODES

PRESET_FORMAT = 1


@dataclass(frozen=True)
class Preset:
    """A read preset. mode: the execution mode it was timed in ('eager' where none is recorded); tuned: what a
    tune preset was measured with (device name, dtype, batch size, versions, figures), else {}."""

    method: str
    params: Dict[str, Any]
    mode: str = "eager"
    tuned: Dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> Optional[str]:
        """The torch device a tune preset was measured on ('cpu', 'cuda', 'cuda:1'); None for other presets."""
        if not self.tuned:
            return None
        return self.tuned.get("torch_device") or device_type_of(str(self.tuned.get("device", "")))

    @property
    def dtype(self) -> str:
        """The precision it was measured in ('fp32' where none is recorded)."""
        return self.tuned.get("dtype", "fp32")


def device_type_of(name: str) -> str:
    """The torch device type behind a precision.device_description: 'cpu' for 'CPU (...)', else 'cuda'."""
    return "cpu" if name.startswith("CPU") else "cuda"


def versions() -> Dict[str, str]:
    """The versions a preset records and is compared against."""
    import timm

    return {"timm_tokcomp": __version__, "torch": torch.__version__, "timm": timm.__version__}


def write_preset(path: Union[str, Path], method: str, params: Dict[str, Any], overwrite: bool = False,
                 flag: str = "path", **sections: Any) -> None:
    """Write a preset; sections: 'execution', 'tuned' or 'calibration' dicts. An existing file is refused unless
    overwrite (flag names the option that gave the path)."""
    doc = {"format": PRESET_FORMAT, "method": method, "params": params, **sections}
    with new_output(path, overwrite, flag) as tmp:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")


def read_preset(path: str, device: Optional[str] = None, dtype: Optional[str] = None,
                batch_size: Optional[int] = None, warn: bool = True) -> Preset:
    """The preset at path, checked at the door; with warn, a tune preset warns when read under other versions, or,
    where given, another device, dtype or batch size than it was measured with (warn_if_conditions_differ)."""
    if device is not None:
        check_device(device, "device=")
    doc = read_json(path, "preset file")
    check_schema(doc, path)
    tuned = doc.get("tuned") or {}
    preset = Preset(doc["method"], doc["params"], (doc.get("execution") or {}).get("mode", "eager"), tuned)
    if preset.mode not in TORCH_MODES:
        raise fail("preset file", path, f"records execution mode {preset.mode!r}, not one of {', '.join(TORCH_MODES)}")
    if preset.dtype not in DTYPES:
        raise fail("preset file", path, f"records dtype {preset.dtype!r}, not one of {', '.join(DTYPES)}")
    if warn:
        warn_if_conditions_differ(path, preset, device, dtype, batch_size)
    return preset


# section -> {key: (the types it may hold, what it means)}; a key not listed is refused, so is a value of another type
SECTIONS: Dict[str, Dict[str, Tuple[Tuple[type, ...], str]]] = {
    "execution": {"mode": ((str,), "an execution mode")},
    "tuned": {"model": ((str,), "a model name"), "device": ((str,), "a device description"),
              "torch_device": ((str,), "a torch device"),
              "dtype": ((str,), "a dtype name"), "tf32": ((bool,), "true or false"),
              "batch_size": ((int,), "an integer"), "versions": ((dict,), "an object of version strings")},
}


def check_schema(doc: Dict[str, Any], path: str) -> None:
    """The preset's layout, checked once at the door: UserFileError naming the file and the key that is wrong."""
    def wrong(key: str, want: str) -> Exception:
        return fail("preset file", path, f"key {key!r} must be {want}, got {json.dumps(doc_value(key))}")

    def doc_value(key: str) -> Any:
        value: Any = doc
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    if not is_version(doc.get("format"), PRESET_FORMAT) or "method" not in doc or "params" not in doc:
        raise fail("preset file", path, f"is not a tokcomp preset (format {PRESET_FORMAT} with 'method' and 'params')")
    if not isinstance(doc["method"], str):
        raise wrong("method", "a method name (a string)")
    if doc["method"] != NO_REDUCTION and doc["method"] not in METHODS:
        raise fail("preset file", path, f"names method {doc['method']!r}, which is not one of {NO_REDUCTION}, "
                                        f"{', '.join(METHODS)}")
    if not isinstance(doc["params"], dict):
        raise wrong("params", "an object of parameter names and values")
    if doc["method"] == NO_REDUCTION and doc["params"]:
        raise wrong("params", f"empty for method {NO_REDUCTION!r} (the plain model takes no parameters)")
    for section, keys in SECTIONS.items():
        value = doc.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise wrong(section, f"an object with the keys {', '.join(keys)}")
        for key, item in value.items():
            if key not in keys:
                if section == "tuned":  # the figures a tune preset records beside its conditions
                    continue
                raise fail("preset file", path, f"key '{section}.{key}' is not one of "
                                                 f"{', '.join(f'{section}.{k}' for k in keys)}")
            types, want = keys[key]
            if not isinstance(item, types) or (bool not in types and isinstance(item, bool)):
                raise wrong(f"{section}.{key}", want)
    versions_ = doc_value("tuned.versions") or {}
    if not all(isinstance(v, str) for v in versions_.values()):
        raise wrong("tuned.versions", "an object of version strings")
    if doc.get("calibration") is not None and not isinstance(doc["calibration"], dict):
        raise wrong("calibration", "an object")


def load_preset(path: str, device: Optional[str] = None, dtype: Optional[str] = None,
                batch_size: Optional[int] = None) -> Tuple[str, Dict[str, Any]]:
    """(method, params) of a preset file written by `tokcomp calibrate` or `tokcomp tune`, for
    timm_tokcomp.apply(model, method, **params); method 'none' (a tune that found nothing to gain) leaves the model
    plain. A tune preset warns when loaded under other versions, or, where given, another device, dtype or batch
    size than it was measured with."""
    preset = read_preset(path, device, dtype, batch_size)
    return preset.method, preset.params


def warn_if_conditions_differ(path: str, preset: Preset, device: Optional[str], dtype: Optional[str],
                              batch_size: Optional[int]) -> None:
    """One warning listing what differs from a tune preset's measurement: versions, and where given the device
    (by its description), dtype and batch size; nothing for other presets."""
    tuned = preset.tuned
    if not tuned:
        return
    now = versions()
    differ = [f"{k} {v} (now {now[k]})" for k, v in (tuned.get("versions") or {}).items() if k in now and v != now[k]]
    if device is not None:
        name = device_description(device)
        if tuned.get("device") != name:
            differ.append(f"device {tuned.get('device')} (now {name})")
    if dtype is not None and tuned.get("dtype") != dtype:
        differ.append(f"dtype {tuned.get('dtype')} (now {dtype})")
    if batch_size is not None and tuned.get("batch_size") != batch_size:
        differ.append(f"batch size {tuned.get('batch_size')} (now {batch_size})")
    if differ:
        warnings.warn(f"preset {path} was tuned under other conditions: {'; '.join(differ)}; its speed-up may not "
                      f"hold here (run tokcomp tune again)")  # one location: the same message is shown once
