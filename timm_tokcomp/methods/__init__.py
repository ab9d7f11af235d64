"""Token-reduction methods by name, and the `<method>_r<k>` tag grammar."""
import re
from typing import Any, Dict, Tuple, Type

from .base import TokenReducer
from .evit import EViT
from .tome import ToMe

METHODS: Dict[str, Type[TokenReducer]] = {cls.name: cls for cls in (ToMe, EViT)}

_TAG_RE = re.compile(r"^(?P<method>[a-z]+)_r(?P<r>\d+)$")
TAG_FORMS = tuple(f"{name}_r<k>" for name in METHODS)


def make_reducer(method: str, **params: Any) -> TokenReducer:
    """Build a method by name, e.g. make_reducer("tome", r=16). Raises ValueError / TypeError naming
    the bad parameter."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    cls = METHODS[method]
    valid = ("r", "flops_ratio", "prop_attn", "trace_source")
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise TypeError(f"unknown parameter(s) {unknown} for method {method!r}; valid: {list(valid)}")
    return cls(**params)


def parse_method_tag(tag: str) -> Tuple[str, Dict[str, Any]]:
    """'tome_r16' -> ('tome', {'r': 16}). Raises ValueError listing the valid forms."""
    match = _TAG_RE.match(tag)
    if not match or match["method"] not in METHODS:
        raise ValueError(f"unknown token-reduction tag {tag!r}; valid forms: {', '.join(TAG_FORMS)} (k >= 0)")
    return match["method"], {"r": int(match["r"])}


def is_method_tag(tag: str) -> bool:
    match = _TAG_RE.match(tag)
    return bool(match) and match["method"] in METHODS
