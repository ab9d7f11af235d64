"""Base class of the token-reduction methods: parameters, per-block budgets, and the two hooks a
method implements (what metric it reads inside attention, and how it turns it into a plan)."""
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Union

import torch

from ..matching import MergePlan, PrunePlan
from ..schedules import BlockCost, RSpec, resolve_r, solve_flops_schedule, validate_r

Plan = Union[MergePlan, PrunePlan]


class TokenReducer(ABC):
    """A method with an r schedule: r tokens removed per block (int, per-block list, or
    (r, inflection) tuple), or a schedule solved from flops_ratio (unreduced MACs / target MACs).

    prop_attn: add log(token size) to the attention scores; None picks the method's default.
    trace_source: keep a (B, N, N0) map of the original patches each token holds.
    """

    name: ClassVar[str]

    def __init__(
        self,
        r: RSpec = 0,
        flops_ratio: Optional[float] = None,
        prop_attn: Optional[bool] = None,
        trace_source: bool = False,
    ) -> None:
        if flops_ratio is not None:
            if isinstance(flops_ratio, bool) or not isinstance(flops_ratio, (int, float)) or flops_ratio <= 1.0:
                raise ValueError(f"flops_ratio must be a number > 1 (unreduced MACs / target MACs), got {flops_ratio!r}")
            if r != 0:
                raise ValueError("give either r or flops_ratio, not both")
        for name, value in (("prop_attn", prop_attn), ("trace_source", trace_source)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self.r = validate_r(r)
        self.flops_ratio = None if flops_ratio is None else float(flops_ratio)
        self.prop_attn = prop_attn
        self.trace_source = trace_source
        self._budget_cache: Dict[Tuple[int, int, int, BlockCost], List[int]] = {}

    @property
    def params(self) -> Dict[str, Any]:
        """The constructor arguments, for set_params and display."""
        return dict(r=self.r, flops_ratio=self.flops_ratio, prop_attn=self.prop_attn, trace_source=self.trace_source)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if v is not None)
        return f"{type(self).__name__}({shown})"

    def default_prop_attn(self, global_pool: str) -> bool:
        """Proportional attention default for a model with this global pool."""
        return False

    def check_depth(self, num_blocks: int) -> None:
        """Raise ValueError if a per-block r list does not match the model's depth."""
        if isinstance(self.r, list) and len(self.r) != num_blocks:
            raise ValueError(f"r as a per-block list needs one entry per block ({num_blocks}), got {len(self.r)}")

    def budgets(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[int]:
        """Tokens each block should remove (before the per-block clamp)."""
        key = (num_blocks, num_tokens, num_prefix, cost)
        if key not in self._budget_cache:
            if self.flops_ratio is not None:
                sched = solve_flops_schedule(self.flops_ratio, num_blocks, num_tokens - num_prefix, num_prefix, cost)
            else:
                sched = resolve_r(self.r, num_blocks)
            self._budget_cache[key] = sched
        return self._budget_cache[key]

    @abstractmethod
    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """What the method reads inside attention. q, k: (B, H, N, d) after q/k norm;
        attn_bias: (B, 1, 1, N) or None."""

    @abstractmethod
    def plan(self, metric: torch.Tensor, r: int, num_prefix: int) -> Optional[Plan]:
        """The reduction of one block from its metric, or None for no reduction."""
