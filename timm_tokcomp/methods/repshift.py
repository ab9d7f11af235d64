"""Representation Shift (Choi, Lee et al., ICCV 2025): a token matters as much as a layer moves it, the norm of
F(x)_i - x_i. In a pre-norm block, on the residual stream, that is the norm of a branch's output; each reducing block
drops the patch tokens it moved least. No attention map is read, so attention stays fused (SDPA, FlashAttention,
Flex) and the compiled path keeps it. Training-free."""
from typing import Optional

import torch

from ..utils.checks import check_choice
from ..plans import PrunePlan
from .places import ReducesAt
from .base import ScheduledReducer
from .params import COMMON, SCHEDULE, Param
from .register import register_method

SHIFT_AT = ("block", "mlp", "attn")


def shift_pruning(shift: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> PrunePlan:
    """Keep the non-prefix tokens of largest shift (B, N), drop the r others (ties: the lower index is kept); r clamped
    so that one non-prefix token remains. Tokens of size 0 (padding) rank below every real one."""
    n = shift.shape[1] - num_prefix
    r = max(min(r, n - 1), 0)
    with torch.no_grad():
        score = shift[:, num_prefix:]
        if size is not None:
            score = score.masked_fill(size[:, num_prefix:, 0] <= 0, float("-inf"))
        order = score.argsort(dim=-1, descending=True, stable=True)
        return PrunePlan(num_prefix, order[:, : n - r].sort(dim=-1).values)


@register_method
class RepShift(ScheduledReducer):
    """shift_at: which layer's shift ranks the tokens: 'block' (default: both branches together, the whole block's
    change), 'mlp' (the authors' figure measures the MLP) or 'attn' (the attention branch; the block then reduces
    between attention and MLP). The default was chosen on photos-3000 (agreement with the plain DeiT-Tiny at keep rate
    0.7: block 80.4 %, attn 78.6 %, mlp 76.2 %; not a reported set).
    The reduction runs right after the layer measured (after the MLP for 'mlp' and 'block'); under keep_rate (the
    study's protocol) at the end of the block, as every method there. Pruned tokens are dropped; the prefix tokens
    are never pruned. Proportional attention is off unless asked (kept tokens keep their sizes)."""

    spec = ScheduledReducer.spec.but(
        name="repshift",
        holds_patches="dropped",
        export_refusal=None,
        reads_branches=True,
        tune_space=(),  # not in tune's default space: below ToMe and DPC-KNN at matched GMACs (docs/study.md)
        params=(*SCHEDULE,
                Param("shift_at", "block", lambda v: check_choice("shift_at", v, SHIFT_AT),
                      "RepShift: the layer whose shift ranks the tokens, 'block' (both branches), 'mlp' or 'attn'"),
                *COMMON),
    )

    @property
    def reduces_at(self) -> ReducesAt:
        return ReducesAt.AFTER_ATTENTION if self.shift_at == "attn" and self.keep_rate is None else ReducesAt.AFTER_MLP

    def branch_metric(self, attn_out: torch.Tensor, mlp_out: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, N) the L2 norm, in fp32, of what the measured layer adds to each token."""
        shift = {"attn": attn_out, "mlp": mlp_out, "block": None if mlp_out is None else attn_out + mlp_out}
        return shift[self.shift_at].float().norm(dim=-1)

    def plan(self, metric: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]
             ) -> Optional[PrunePlan]:
        if r <= 0 or metric.shape[1] - num_prefix < 2:
            return None
        return shift_pruning(metric, r, num_prefix, size)
