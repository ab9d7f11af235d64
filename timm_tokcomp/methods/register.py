"""The methods by name (METHODS): each method class registers itself with @register_method, as a timm model
registers with @register_model; methods/__init__.py imports the method modules, in the order listings show them."""
import re
from typing import Dict

METHODS: Dict[str, type] = {}  # name -> TokenReducer subclass
RESERVED = ("none", "plain")  # names that mean the unreduced model (apply(model, 'none'), --methods none)
_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a method name as tags and timm names carry it: 'tome', 'dpcknn'


def register_method(cls: type) -> type:
    """Class decorator: METHODS[cls.name] = cls. ValueError for a name that is empty, reserved (RESERVED) or no
    lower-case identifier (a tag could not carry it), and where another class already has the name (it would
    replace the first)."""
    name = cls.name
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in RESERVED:
        raise ValueError(f"{cls.__qualname__}: a method's name must be a lower-case identifier ([a-z][a-z0-9_]*) "
                         f"other than {', '.join(map(repr, RESERVED))}, got {name!r}")
    known = METHODS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"two methods are named {cls.name!r}: {known.__qualname__} and {cls.__qualname__} "
                         f"({cls.__module__})")
    METHODS[cls.name] = cls
    return cls
