"""Method parameters declared once: a Param names one parameter, its default and its check; a method's spec lists
its Params (spec.params), composed from the shared groups below, and TokenReducer builds the constructor, the
signature help() shows, param_names() and the params dict from that list (as peft's per-method configs feed one
BaseTuner). A new method adds only its own: params=(*SCHEDULE, Param("mine", 1, check_mine), *COMMON)."""
import inspect
from typing import Any, Dict, Sequence, Tuple

from ..ops.attention import check_prop_attn
from ..kernels import check_kernel
from ..ops.rope import check_rope_merge
from ..utils.checks import REQUIRED, Param, boolean, check_real, optional
from .schedules import STUDY_STAGES, check_keep_rate, check_stages, validate_r


class FromConfig:
    """Mixin for a learned module saved as its config and weights (timm_tokcomp.methods.learned): CONFIG declares its
    constructor's arguments as Params, each checked once (ValueError naming the config field); from_config builds
    the module of the shape a config describes (its values to be loaded)."""

    CONFIG: Tuple[Param, ...] = ()

    def config(self) -> Dict[str, Any]:
        """What from_config needs to rebuild these parameters (saved beside them as JSON): each CONFIG value, as the
        module keeps it under the same name (a sequence as a list)."""
        values = {p.name: getattr(self, p.name) for p in self.CONFIG}
        return {name: list(v) if isinstance(v, (list, tuple)) else v for name, v in values.items()}

    @classmethod
    def from_config(cls, config: Dict[str, Any]):
        return cls(**{p.name: p.check(config.get(p.name, None if p.default is REQUIRED else p.default))
                      for p in cls.CONFIG})


def signature(params: Sequence[Param]) -> inspect.Signature:
    """The keyword-or-positional signature of a method constructor taking `params`, in order."""
    return inspect.Signature([inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default)
                              for p in params])


def bind(method: str, params: Sequence[Param], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A method constructor's arguments, each checked once by its Param (None: the parameter's default):
    {name: value} for every one of params. TypeError naming the method for an unknown, missing or extra one."""
    unknown = sorted(set(kwargs) - {p.name for p in params})
    if unknown:
        raise TypeError(f"unknown parameter(s) {unknown} for method {method!r}; valid: {[p.name for p in params]}")
    try:
        bound = signature(params).bind(*args, **kwargs)
    except TypeError as e:  # a required parameter missing, or too many positional ones
        raise TypeError(f"method {method!r}: {e}") from None
    bound.apply_defaults()
    return {p.name: p.check(p.default if bound.arguments[p.name] is None else bound.arguments[p.name])
            for p in params}


def check_flops_ratio(value: Any) -> float:
    return check_real("flops_ratio", value, 1.0, note="(unreduced MACs / target MACs)")


def check_macs_target(value: Any) -> float:
    return check_real("macs_target", value, 0.0, high=1.0,
                      note="(the share of the unreduced blocks' MACs the training aims at)")


# the target of a method whose training trades accuracy against MACs (DiffRate, LTMP)
MACS_TARGET = Param("macs_target", None, optional(check_macs_target),
                    "the training's target: a share in (0, 1] of the unreduced blocks' MACs (None: no MACs penalty)")


# the parameters every token-dropping method takes (TokenReducer documents them)
COMMON: Tuple[Param, ...] = (
    Param("prop_attn", None, check_prop_attn,
          "add log(token size) to attention scores: True / 'auto' (the measured implementation), 'mask', 'fold', "
          "'fold_qkv', 'flex', False; None: the method's default"),
    Param("trace_source", False, optional(boolean("trace_source")), "keep a (B, N, N0) map of the patches each token holds"),
    Param("prefix_only_last_block", None, optional(boolean("prefix_only_last_block")),
          "the last block's MLP runs on the prefix tokens alone (exact for class-token heads); None: where exact"),
    Param("rope_merge", "dst", check_rope_merge,
          "rotary models: a merged token's position, 'dst' (its destination's) or 'centroid' (of its patches)"),
)
# the r schedule of ScheduledReducer: r per block, a FLOPs ratio, or the study's keep rate at its stages
SCHEDULE: Tuple[Param, ...] = (
    Param("r", 0, validate_r, "tokens each block removes: an int, a list (one per block), or (r, inflection in [-1, 1])"),
    Param("flops_ratio", None, optional(check_flops_ratio),
          "unreduced MACs / target MACs (> 1): r solved per block for that budget instead of r"),
    Param("keep_rate", None, optional(check_keep_rate),
          "the share of tokens kept at each of `stages` (the study's protocol) instead of r"),
    Param("stages", STUDY_STAGES, check_stages,  # checked even unused: a bad value is never kept
          "the blocks that reduce under keep_rate (block indices)"),
)


def kernel_choice(default: str = "torch") -> Param:
    """The fused-kernel choice ('torch', 'triton', 'auto')."""
    return Param("kernel", default, check_kernel,
                 "'torch', 'triton' (fused kernels, CUDA inference) or 'auto' (Triton for CUDA inference)")
