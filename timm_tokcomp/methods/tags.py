"""The tag forms of the methods' names ('tome_r16', 'evit_k70', 'tome_high', 'ltmp_m60'): a parser per form, and the
TagForms a method's spec lists (methods.spec), which its parse_tag and tag_forms read."""
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .schedules import NAMED_SCHEDULES


def parse_r_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_r<k>' -> {'r': k}; None for any other tag."""
    digits = tag[len(name) + 2:]
    if tag.startswith(f"{name}_r") and digits.isdigit() and digits.isascii():
        return {"r": int(digits)}
    return None


def _parse_percent_tag(name: str, tag: str, letter: str, param: str) -> Optional[Dict[str, Any]]:
    """'<name>_<letter><pct>' -> {param: pct / 100} for pct in 1..100; None for any other tag."""
    digits = tag[len(name) + 2:]
    if tag.startswith(f"{name}_{letter}") and digits.isdigit() and digits.isascii() and 1 <= int(digits) <= 100:
        return {param: int(digits) / 100}
    return None


def parse_keep_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_k<pct>' -> {'keep_rate': pct / 100} for pct in 1..100; None for any other tag."""
    return _parse_percent_tag(name, tag, "k", "keep_rate")


def parse_named_schedule_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_low' / '<name>_high' -> {'r': that NAMED_SCHEDULES list}; None for any other tag."""
    schedule = tag[len(name) + 1:] if tag.startswith(f"{name}_") else None
    return {"r": list(NAMED_SCHEDULES[schedule])} if schedule in NAMED_SCHEDULES else None


def parse_bare_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>' -> {} (the method's defaults); None for any other tag."""
    return {} if tag == name else None


def parse_macs_target_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_m<pct>' -> {'macs_target': pct / 100} for pct in 1..100; None for any other tag."""
    return _parse_percent_tag(name, tag, "m", "macs_target")


@dataclass(frozen=True)
class TagForm:
    """One form of a method's tags: forms, as listings show them ('{name}' stands for the method's name), and parse:
    (method name, tag) -> the parameters the tag stands for, or None where the tag is not of this form."""

    forms: Tuple[str, ...]
    parse: Callable[[str, str], Optional[Dict[str, Any]]]

    def shown(self, name: str) -> Tuple[str, ...]:
        return tuple(form.format(name=name) for form in self.forms)


def exact_tag(tag: str, params: Dict[str, Any]) -> TagForm:
    """A tag spelled out in full (no '{name}'), standing for params."""
    return TagForm((tag,), lambda name, given: dict(params) if given == tag else None)


R_TAG = TagForm(("{name}_r<k>",), parse_r_tag)
KEEP_TAG = TagForm(("{name}_k<pct>",), parse_keep_tag)
NAMED_SCHEDULE_TAGS = TagForm(tuple(f"{{name}}_{schedule}" for schedule in NAMED_SCHEDULES), parse_named_schedule_tag)
BARE_TAG = TagForm(("{name}",), parse_bare_tag)
MACS_TARGET_TAG = TagForm(("{name}_m<pct>",), parse_macs_target_tag)
