"""The methods by name (METHODS): each method class registers itself with @register_method, as a timm model
registers with @register_model; methods/__init__.py imports the method modules, in the order listings show them."""
from typing import Dict

METHODS: Dict[str, type] = {}  # name -> TokenReducer subclass


def register_method(cls: type) -> type:
    """Class decorator: METHODS[cls.name] = cls. ValueError where another class already has the name (it would
    replace the first)."""
    known = METHODS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"two methods are named {cls.name!r}: {known.__qualname__} and {cls.__qualname__} "
                         f"({cls.__module__})")
    METHODS[cls.name] = cls
    return cls
