"""ToCom token compensators: plugins that let a model trained at one ToMe / EViT degree run at another.

    comp = Compensator(lora_a, lora_b, scale=0.1)
    attach(model, comp, source_r=0)      # keeps a pristine copy of the query / value rows
    set_compression(model, r=16)         # method r = 16 and weights for (0 -> 16), exact and reversible
    detach(model)                        # source weights back
"""
from .compensator import Compensator, attach, check_fits, compensate, detach, set_compression

__all__ = ["Compensator", "attach", "check_fits", "compensate", "detach", "set_compression"]
