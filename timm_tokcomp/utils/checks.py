"""Checks of one value, shared by every parameter, config and command-line flag: each returns the value as it is
kept, or raises ValueError naming it (a parameter, a config field, a flag) and its valid range. A method's
parameters and a learned module's config declare them as Params (methods.params); the training configs too."""
import math
import numbers
from typing import Any, Callable, List, Optional, Sequence


def is_int(value: Any) -> bool:
    """An integer of any type (numpy's too), not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def is_version(value: Any, expected: int) -> bool:
    """Whether a file's format number is the integer `expected` (true, 1.0 or "1" is not, though true == 1 in
    Python)."""
    return is_int(value) and value == expected


def is_real(value: Any) -> bool:
    """A real number of any type (numpy's too), not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_int(name: str, value: Any, low: int = 0, note: str = "") -> int:
    """value as a Python int >= low; note: what the value counts, shown in the error ('(batches per step)')."""
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{f' {note}' if note else ''}, got {value!r}")
    return int(value)


def check_real(name: str, value: Any, low: Optional[float] = 0.0, strict: bool = True, high: Optional[float] = None,
               high_strict: bool = False, note: str = "") -> float:
    """value as a finite Python float above low (at least low where not strict; low None: any) and, with high, below
    it (at most high where not high_strict); note: what the value means, shown in the error ('(minutes)')."""
    if low is None:
        bound = ""
    elif high is None:
        bound = f" {'>' if strict else '>='} {low:g}"
    else:
        bound = f" in {'(' if strict else '['}{low:g}, {high:g}{')' if high_strict else ']'}"
    ok = is_real(value) and math.isfinite(value) and (
        low is None or value > low or (not strict and value == low)) and (
        high is None or value < high or (not high_strict and value == high))
    if not ok:
        raise ValueError(f"{name} must be a finite number{bound}{f' {note}' if note else ''}, got {value!r}")
    return float(value)


def check_int_list(name: str, value: Any, low: int = 0, what: str = "integers") -> List[int]:
    """value as a non-empty list of Python ints >= low; what: what the entries are ('block indices')."""
    if not isinstance(value, (list, tuple)) or not value or not all(is_int(v) and v >= low for v in value):
        raise ValueError(f"{name} must be a non-empty list of {what} >= {low}, got {value!r}")
    return [int(v) for v in value]


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """check, letting None through."""
    return lambda value: None if value is None else check(value)


def integer(name: str, low: int = 0, note: str = "") -> Callable[[Any], int]:
    """check_int as a one-argument check (a Param's)."""
    return lambda value: check_int(name, value, low, note)


def boolean(name: str) -> Callable[[Any], bool]:
    """check_bool as a one-argument check (a Param's)."""
    return lambda value: check_bool(name, value)


def real(name: str, low: Optional[float] = 0.0, strict: bool = True) -> Callable[[Any], float]:
    """check_real as a one-argument check (a Param's)."""
    return lambda value: check_real(name, value, low, strict)


def int_list(name: str, low: int = 0, what: str = "integers") -> Callable[[Any], List[int]]:
    """check_int_list as a one-argument check (a Param's)."""
    return lambda value: check_int_list(name, value, low, what)
