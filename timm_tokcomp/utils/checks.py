"""Checks of one value, shared by every parameter, config and command-line flag: each returns the value as it is
kept, or raises ValueError naming it (a parameter, a config field, a flag) and its valid range. A method's
parameters, a learned module's config and a training config's fields declare theirs as Params; a command's flags
take theirs as argparse types (flag_type), so a flag is refused while the command line is read, with the
message the Python call gives."""
import argparse
import inspect
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

REQUIRED = inspect.Parameter.empty  # a Param default meaning: no default, the caller must give it


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Param:
    """name; default (REQUIRED: none); check: value -> the value kept, raising ValueError that names the parameter
    and its valid range; help: one line for `tokcomp methods` and the docs' parameter table."""

    name: str
    default: Any = REQUIRED
    check: Callable[[Any], Any] = _identity
    help: str = ""


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


MAX_INT = 2**31 - 1  # the ceiling of every integer check without a closer one: a count an int32 index and islice hold
MAX_BLOCKS = 1024  # the most blocks (and block indices) a config may declare: the deepest ViTs have 48-64
MAX_BATCH = 65536  # the most images in one batch: 40 GB of 224 px float32 inputs before any activation


def shown(value: Any, most: int = 60) -> str:
    """repr(value), cut to `most` characters: a 5,000-digit value must not fill the error line."""
    text = repr(value)
    return text if len(text) <= most else f"{text[:most - 15]}... ({len(text):,} characters)"


def check_int(name: str, value: Any, low: int = 0, note: str = "", high: Optional[int] = None) -> int:
    """value as a Python int in [low, high] (high None: MAX_INT; the error names high only for a value above it);
    note: what the value counts, shown in the error ('(batches per step)')."""
    top = MAX_INT if high is None else high
    if not is_int(value) or not low <= value <= top:
        bound = f"in [{low}, {top:,}]" if is_int(value) and value > top else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}{f' {note}' if note else ''}, got {shown(value)}")
    return int(value)


def env_int(name: str, default: int, low: int = 0, note: str = "", high: Optional[int] = None) -> int:
    """The environment variable `name` as an integer, checked as a flag is (check_int), its error naming the
    variable; `default` where it is unset."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value: Any = int(text.strip()) if len(text) <= 30 else text
    except ValueError:
        value = text
    return check_int(f"the environment variable {name}", value, low, note, high)


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
        raise ValueError(f"{name} must be a finite number{bound}{f' {note}' if note else ''}, got {shown(value)}")
    return float(value)


def check_int_list(name: str, value: Any, low: int = 0, what: str = "integers", high: Optional[int] = None,
                   most: Optional[int] = None) -> List[int]:
    """value as a non-empty list of at most `most` Python ints in [low, high] (None: MAX_INT); what: what the
    entries are ('block indices')."""
    top = MAX_INT if high is None else high
    if not isinstance(value, (list, tuple)) or not value or not all(is_int(v) and low <= v <= top for v in value):
        over = isinstance(value, (list, tuple)) and any(is_int(v) and v > top for v in value)
        bound = f"in [{low}, {top:,}]" if over else f">= {low}"
        raise ValueError(f"{name} must be a non-empty list of {what} {bound}, got {shown(value)}")
    if most is not None and len(value) > most:
        raise ValueError(f"{name} must list at most {most:,} {what}, got {len(value):,}")
    return [int(v) for v in value]


def check_real_list(name: str, value: Any, low: float = 0.0, strict: bool = True, what: str = "numbers") -> List[float]:
    """value as a non-empty list of finite Python floats above low (at least low where not strict); what: what the
    entries are ('scales')."""
    ok = isinstance(value, (list, tuple)) and value and all(
        is_real(v) and math.isfinite(v) and (v > low or (not strict and v == low)) for v in value)
    if not ok:
        raise ValueError(f"{name} must be a non-empty list of finite {what} {'>' if strict else '>='} {low:g}, "
                         f"got {shown(value)}")
    return [float(v) for v in value]


def check_choice(name: str, value: Any, choices: Sequence[Any], note: str = "") -> Any:
    """value, one of choices; note: what the choices mean, shown in the error."""
    if isinstance(value, (list, dict, set)) or value not in choices:  # an unhashable value is never a choice
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}{f' {note}' if note else ''}, "
                         f"got {shown(value)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {shown(value)}")
    return value


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """check, letting None through."""
    return lambda value: None if value is None else check(value)


def integer(name: str, low: int = 0, note: str = "", high: Optional[int] = None) -> Callable[[Any], int]:
    """check_int as a one-argument check (a Param's)."""
    return lambda value: check_int(name, value, low, note, high)


def boolean(name: str) -> Callable[[Any], bool]:
    """check_bool as a one-argument check (a Param's)."""
    return lambda value: check_bool(name, value)


def real(name: str, low: Optional[float] = 0.0, strict: bool = True, high: Optional[float] = None,
         high_strict: bool = False, note: str = "") -> Callable[[Any], float]:
    """check_real as a one-argument check (a Param's)."""
    return lambda value: check_real(name, value, low, strict, high, high_strict, note)


def choice(name: str, choices: Sequence[Any], note: str = "") -> Callable[[Any], Any]:
    """check_choice as a one-argument check (a Param's)."""
    return lambda value: check_choice(name, value, choices, note)


def int_list(name: str, low: int = 0, what: str = "integers", high: Optional[int] = None,
             most: Optional[int] = None) -> Callable[[Any], List[int]]:
    """check_int_list as a one-argument check (a Param's)."""
    return lambda value: check_int_list(name, value, low, what, high, most)


def real_list(name: str, low: float = 0.0, strict: bool = True, what: str = "numbers") -> Callable[[Any], List[float]]:
    """check_real_list as a one-argument check (a Param's)."""
    return lambda value: check_real_list(name, value, low, strict, what)


class FlagType:
    """An argparse type= from a one-value check: the text parsed by `parse`, then checked; a refused value is
    argparse's error, in the check's words ('argument --limit: must be an integer >= 1, got -3'). Text that does not
    parse reaches the check as it is, so its error still says the valid range."""

    def __init__(self, check: Callable[[Any], Any], parse: Callable[[str], Any] = int):
        self.check, self.parse = check, parse

    def __call__(self, text: str) -> Any:
        try:
            value = self.parse(text)
        except ValueError:
            value = text
        try:
            return self.check(value)
        except (TypeError, ValueError) as e:
            words = str(e).split(" ", 1)  # the check names the flag first; argparse already does
            raise argparse.ArgumentTypeError(words[1] if words[0].startswith("--") and len(words) > 1 else str(e))


def flag_type(check: Callable[[Any], Any], parse: Callable[[str], Any] = int) -> FlagType:
    """A flag's argparse type: `check`, after `parse` (int, float, or a comma list: comma_list(int))."""
    return FlagType(check, parse)


def comma_list(kind: type) -> Callable[[str], list]:
    """A parse of '2,3' -> [2, 3] (kind int) for flag_type; its kind is kept on it (parse.kind)."""
    def parse(text: str) -> list:
        return [kind(item) for item in text.split(",")]

    parse.kind = kind  # type: ignore[attr-defined]
    return parse


BATCH_SIZE = integer("--batch-size", 1, high=MAX_BATCH)  # the checks of the flags every command shares
NUM_WORKERS = integer("--num-workers", 0, "(0: load in the main process)")
