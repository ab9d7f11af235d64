"""The --methods grammar of bench, speed, tune and analyze: 'none,tome_r8,tome_r16@triton,preset.json'.
An item is the plain model ('none'), a method tag optionally with its path after '@' (a kernel, a
proportional-attention implementation, or both joined by '+'), or a preset file."""
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from .. import kernels
from ..ops.attention import PROP_ATTN_IMPLS
from ..methods import METHODS, method_class, parse_method_tag
from .presets import load_preset, read_preset

BASELINE = "none"


class MethodItem(NamedTuple):
    """One --methods item, read once: its name as written ('tome_r16@triton', 'my_preset.json', 'none'), the method
    ('none': the plain model) with its params, and the execution mode a preset recorded ('eager' otherwise)."""

    name: str
    method: str
    params: Dict[str, Any]
    mode: str = "eager"


def parse_methods(spec: str, device: Optional[str] = None, dtype: Optional[str] = None,
                  batch_size: Optional[int] = None) -> List[MethodItem]:
    """'none,tome_r8,my_preset.json' -> their MethodItems, each read and checked once, duplicates dropped, 'none'
    first (added if missing). A .json item is a preset saved by `tokcomp calibrate` or `tune`; a tune preset warns
    when the device, dtype or batch size given differ from those it was measured with."""
    items: Dict[str, MethodItem] = {BASELINE: MethodItem(BASELINE, BASELINE, {})}
    for name in (s.strip() for s in spec.split(",")):
        if not name or name in items:
            continue
        if name.endswith(".json"):
            preset = read_preset(name, device=device, dtype=dtype, batch_size=batch_size)
            items[name] = MethodItem(name, preset.method, preset.params, preset.mode)
            continue
        try:
            items[name] = MethodItem(name, *method_spec(name))
        except ValueError as e:
            raise ValueError(f"--methods: {e}; or '{BASELINE}', or a preset .json file") from None
    return list(items.values())


def parse_space(spec: str) -> List[Tuple[str, Dict[str, Any]]]:
    """tune's --methods: 'tome_r8,evit_r4,preset.json' -> [(method, params), ...], each item as method_spec reads it."""
    try:
        return [method_spec(name.strip()) for name in spec.split(",") if name.strip()]
    except ValueError as e:
        raise ValueError(f"--methods: {e}") from None


def method_spec(name: str) -> Tuple[str, Dict[str, Any]]:
    """A --methods item -> (method, params): a preset .json saved by `tokcomp calibrate` / `tune`, or a method tag,
    optionally with its path after '@': a kernel ('tome_r16@triton'), a proportional-attention implementation
    ('tome_r16@fold_qkv'), or both joined by '+' ('tome_r16@triton+fold')."""
    if name.endswith(".json"):
        return load_preset(name)
    tag, at, path = name.partition("@")
    method, params = parse_method_tag(tag)
    if at:
        for item in path.split("+"):
            if item in kernels.BACKENDS:
                if not method_class(method).has_kernel_choice():
                    with_kernel = [m for m, cls in METHODS.items() if cls.has_kernel_choice()]
                    raise ValueError(f"{name}: {method} has no kernel choice (kernels are for {', '.join(with_kernel)})")
                params = {**params, "kernel": item}
            elif item in PROP_ATTN_IMPLS:
                if "prop_attn" not in method_class(method).param_names():
                    raise ValueError(f"{name}: {method} has no proportional attention (it keeps every token's size)")
                params = {**params, "prop_attn": item}
            else:
                raise ValueError(f"{name}: each item after '@' must be a kernel ({', '.join(kernels.BACKENDS)}) or a "
                                 f"proportional-attention implementation ({', '.join(PROP_ATTN_IMPLS)}), got {item!r}")
    return method, params
