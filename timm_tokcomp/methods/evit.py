"""EViT (Liang et al.) as ToCom uses it: each block removes r tokens by keeping the patch tokens the
class token attends to most and fusing the r + 1 least attended ones into one token."""
from typing import NamedTuple, Optional, Union

import torch

from .. import kernels
from ..kernels import library
from ..ops.matching import attentive_pruning, class_attention
from ..plans import PrunePlan
from .fused import FusedScheduledReducer
from .register import register_method


class ClassAttentionInputs(NamedTuple):
    """What the fused kernel reads instead of the metric: q, k (B, H, N, d), attn_bias (B, 1, 1, N) or None."""

    q: torch.Tensor
    k: torch.Tensor
    attn_bias: Optional[torch.Tensor]
    scale: float

    def class_attention(self) -> torch.Tensor:
        """(B, N) the metric the torch path uses."""
        return class_attention(self.q, self.k, self.attn_bias, self.scale).mean(dim=1)


@register_method
class EViT(FusedScheduledReducer):
    """Metric: the class token's attention row, softmaxed and averaged over heads (computed next to
    SDPA at O(N) cost). The fused token is the attention-weighted mean of the pruned tokens and is
    an ordinary token in later blocks. Proportional attention is off unless asked.

    kernel (FusedScheduledReducer): the Triton path computes the class attention, the plan and the fusion in two
    launches per block, three on a rope model (kernels.evit_prune)."""

    spec = FusedScheduledReducer.spec.but(
        name="evit",
        export_refusal=None,
        tocom_compatible=True,
        listed_tags=("evit_r8", "evit_r16"),
        tune_space=({"r": 4}, {"r": 8}, {"r": 12}),
        needs_class_token=True,
    )

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor],
               scale: float) -> Union[torch.Tensor, ClassAttentionInputs]:
        inputs = ClassAttentionInputs(q, k, attn_bias, scale)
        fused = kernels.use_triton(self.kernel, q) or library.uses_library_op(q)
        return inputs if fused else inputs.class_attention()

    def plan(self, metric: Union[torch.Tensor, ClassAttentionInputs], r: int, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[PrunePlan]:
        if r <= 0:
            return None
        if isinstance(metric, ClassAttentionInputs):  # the fused step declined (a source map is traced)
            metric = metric.class_attention()
        if metric.shape[1] - num_prefix < 2:
            return None
        return attentive_pruning(metric, r, num_prefix)

    def reduce_fused(self, metric, x, size, source, r, num_prefix, positions=None):
        """The Triton kernels in eager inference where the backend is 'triton' (the rotary positions moved by the
        same plan: kernels.evit_prune's coords); compiled, the step as one operator (kernels.library.compiled_step,
        the rotary positions moved inside it) on the resolved backend."""
        if not isinstance(metric, ClassAttentionInputs) or source is not None:
            return None
        n = x.shape[1] - num_prefix
        r = min(r, n - 1)
        if r <= 0:
            return None  # nothing is pruned: plan() declines
        return self.run_step("evit_prune", kernels.evit_prune, metric, x, size, r, num_prefix, positions)
