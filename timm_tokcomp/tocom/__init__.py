"""ToCom token compensators: plugins that let a model trained at one ToMe / EViT degree run at another.

    comp, config = load("user/deit_tiny-tocom")   # peft adapters on the Hub, or a local folder
    attach(model, comp, source_r=0)      # keeps a pristine copy of the query / value rows
    set_compression(model, r=16)         # method r = 16 and weights for (0 -> 16), exact and reversible
    detach(model)                        # source weights back
"""
from .compensator import Compensator, attach, check_fits, compensate, detach, set_compression
from .hub import load, push_to_hub, save

__all__ = ["Compensator", "attach", "check_fits", "compensate", "detach", "load", "push_to_hub", "save",
           "set_compression"]
