"""The tag forms of the methods' names ('tome_r16', 'evit_k70', 'tome_high', 'ltmp_m60'): a parser per form and the
mixins that give a method its parse_tag / tag_forms."""
from typing import Any, ClassVar, Dict, Optional, Tuple

from .schedules import NAMED_SCHEDULES


def parse_r_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_r<k>' -> {'r': k}; None for any other tag."""
    digits = tag[len(name) + 2:]
    if tag.startswith(f"{name}_r") and digits.isdigit() and digits.isascii():
        return {"r": int(digits)}
    return None


def parse_keep_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_k<pct>' -> {'keep_rate': pct / 100} for pct in 1..100; None for any other tag."""
    digits = tag[len(name) + 2:]
    if tag.startswith(f"{name}_k") and digits.isdigit() and digits.isascii() and 1 <= int(digits) <= 100:
        return {"keep_rate": int(digits) / 100}
    return None


def parse_named_schedule_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_low' / '<name>_high' -> {'r': that NAMED_SCHEDULES list}; None for any other tag."""
    schedule = tag[len(name) + 1:] if tag.startswith(f"{name}_") else None
    return {"r": list(NAMED_SCHEDULES[schedule])} if schedule in NAMED_SCHEDULES else None



class RTagged:
    """Mixin for methods named by '<name>_r<k>' tags (r = k)."""

    name: ClassVar[str]

    @classmethod
    def parse_tag(cls, tag: str) -> Optional[Dict[str, Any]]:
        return parse_r_tag(cls.name, tag)

    @classmethod
    def tag_forms(cls) -> Tuple[str, ...]:
        return (f"{cls.name}_r<k>",)


class MacsTargetTagged:
    """Mixin for learned methods trained against a MACs target (DiffRate, LTMP), named '<name>' (its defaults) and
    '<name>_m<pct>' (macs_target = pct / 100, pct in 1..100)."""

    name: ClassVar[str]

    @classmethod
    def parse_tag(cls, tag: str) -> Optional[Dict[str, Any]]:
        if tag == cls.name:
            return {}
        digits = tag[len(cls.name) + 2:]
        if tag.startswith(f"{cls.name}_m") and digits.isdigit() and digits.isascii() and 1 <= int(digits) <= 100:
            return {"macs_target": int(digits) / 100}
        return None

    @classmethod
    def tag_forms(cls) -> Tuple[str, ...]:
        return (cls.name, f"{cls.name}_m<pct>")
