"""What the training configs (finetune's FinetuneConfig, ToCom's TrainConfig) share: each field's check declared once,
as a Param whose error names the field's command-line flag, all run by validate_fields before the config's own checks
of fields together."""
from typing import Any, Callable, ClassVar, Sequence, Tuple

from ..utils.checks import (FlagType, Param, check_bool, check_choice, check_real, flag_type, int_list, integer,
                            is_real, optional, real, real_list)


def flag(name: str) -> str:
    """A config field's command-line flag: 'batch_size' -> '--batch-size'."""
    return "--" + name.replace("_", "-")


def int_field(name: str, low: int, shown: str = "", allow_none: bool = False) -> Param:
    """An integer field >= low (None allowed with allow_none); its error names `shown` (the flag, where it is not
    flag(name))."""
    check = integer(shown or flag(name), low)
    return Param(name, check=optional(check) if allow_none else check)


def real_field(name: str, low: float = 0.0, strict: bool = True, allow_none: bool = False, shown: str = "") -> Param:
    """A finite number field above low (at least low where not strict); None allowed with allow_none; its error
    names `shown` (the flag, where it is not flag(name))."""
    check: Callable[[Any], Any] = real(shown or flag(name), low, strict)
    return Param(name, check=optional(check) if allow_none else check)


def check_crop_scale(value: Any) -> Tuple[float, float]:
    """crop_scale (lo, hi), the area range of a random resized crop: 0 < lo <= hi <= 1 (the flag sets lo)."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(is_real(v) for v in value) \
        and 0 < value[0] <= value[1] <= 1
    if not ok:
        raise ValueError(f"--crop-min must be in (0, 1] (crop_scale (lo, hi), 0 < lo <= hi <= 1), got {value!r}")
    return float(value[0]), float(value[1])


CROP_SCALE = Param("crop_scale", check=check_crop_scale)
SEED = int_field("seed", 0)


def check_crop_min(value: Any) -> float:
    """--crop-min, the low end of crop_scale (the flag's check)."""
    return check_real("--crop-min", value, 0.0, high=1.0, note="(the smallest random-crop area)")


def list_field(name: str, low: float, integers: bool, what: str) -> Param:
    """A non-empty list of integers (or finite numbers) above low, kept as a tuple."""
    check = int_list(flag(name), int(low), what) if integers else real_list(flag(name), low, what=what)
    return Param(name, check=lambda value: tuple(check(value)))


def choice_field(name: str, choices: Sequence[Any]) -> Param:
    return Param(name, check=lambda value: check_choice(flag(name), value, choices))


def bool_field(name: str) -> Param:
    return Param(name, check=lambda value: check_bool(flag(name), value))


class CheckedFields:
    """Mixin for a dataclass config: FIELDS checks each named field alone and keeps what its check returns."""

    FIELDS: ClassVar[Tuple[Param, ...]] = ()

    @classmethod
    def field_type(cls, name: str, parse: Callable[[str], Any] = int) -> FlagType:
        """The argparse type of the flag that sets field `name`: the field's own check, after parse."""
        return flag_type(next(p.check for p in cls.FIELDS if p.name == name), parse)

    def validate_fields(self) -> None:
        """Raise ValueError naming the flag of the first bad field, in FIELDS' order."""
        for param in self.FIELDS:
            setattr(self, param.name, param.check(getattr(self, param.name)))
