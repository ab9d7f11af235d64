"""ToMe (Bolya et al.): merge the r most similar token pairs of each block by bipartite soft matching."""
from typing import NamedTuple, Optional, Union

import torch

from .. import kernels
from ..kernels import library
from ..ops.matching import bipartite_soft_matching, max_merges
from ..plans import MergePlan
from .base import prop_attn_unless_avg_pool
from .fused import FusedScheduledReducer
from .tags import NAMED_SCHEDULE_TAGS
from .register import register_method


class HeadKeys(NamedTuple):
    """What the fused step reads instead of the metric: the keys k (B, H, N, d), averaged over heads inside the
    match kernel (kernels.tome_merge)."""

    k: torch.Tensor

    def mean(self) -> torch.Tensor:
        """(B, N, d): the metric the torch plan uses."""
        return self.k.mean(dim=1)


def key_metric(metric: Union[torch.Tensor, HeadKeys]) -> torch.Tensor:
    """The metric (B, N, d) a torch plan reads: metric itself, or the mean of HeadKeys (where a fused step that would
    have read the keys declined)."""
    return metric.mean() if isinstance(metric, HeadKeys) else metric


@register_method
class ToMe(FusedScheduledReducer):
    """Metric: keys averaged over heads (cosine similarity). Merge: size-weighted mean.
    Proportional attention is on by default, off for avg-pooled (MAE-style) models. Tags also name
    PYRA's 12-block schedules: '<name>_low', '<name>_high' (schedules.NAMED_SCHEDULES).

    kernel (FusedScheduledReducer): the Triton path fuses each block's metric, matching and merging into two
    launches (kernels.tome_merge, on the keys: HeadKeys)."""

    spec = FusedScheduledReducer.spec.but(
        name="tome",
        export_refusal=None,
        tocom_compatible=True,
        listed_tags=("tome_r8", "tome_r16"),
        tune_space=({"r": 4}, {"r": 8}, {"r": 12}, {"r": 16}, {"flops_ratio": 1.5}, {"flops_ratio": 2.0}),
        tags=(*FusedScheduledReducer.spec.tags, NAMED_SCHEDULE_TAGS),
    )
    min_keep_rate = 0.5  # bipartite matching merges at most half of a block's tokens

    default_prop_attn = prop_attn_unless_avg_pool

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k.mean(dim=1)

    def attention_metric(self, q, k, v, attn_bias, scale, inputs) -> Union[torch.Tensor, HeadKeys]:
        """The keys themselves (HeadKeys) where the fused step or its operator runs (the kernel averages them),
        metric() otherwise."""
        fused = kernels.use_triton(self.kernel, k) or library.uses_library_op(k)
        return HeadKeys(k) if fused else self.metric(q, k, attn_bias, scale)

    def plan(self, metric: Union[torch.Tensor, HeadKeys], r: int, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        return tome_plan(metric, r, num_prefix)

    def reduce_fused(self, metric, x, size, source, r, num_prefix, positions=None):
        """The Triton kernels in eager inference where the backend is 'triton' (the rotary positions moved by the
        same plan: kernels.tome_merge's coords); compiled, the step as one operator (kernels.library.compiled_step,
        the rotary positions moved inside it) on the resolved backend."""
        if not isinstance(metric, HeadKeys) or source is not None:  # keys: attention_metric chose the fused step
            return None
        r = min(r, max_merges(x.shape[1], num_prefix))
        if r <= 0:
            return None  # nothing merges: plan() declines
        return self.run_step("tome_merge", kernels.tome_merge, (metric.k,), x, size, r, num_prefix, positions)


def tome_plan(metric: Union[torch.Tensor, HeadKeys], r: int, num_prefix: int) -> Optional[MergePlan]:
    """Bipartite soft matching of r merges on metric (B, N, C) (HeadKeys: their mean), or None when nothing
    merges."""
    if r <= 0:
        return None
    metric = key_metric(metric)  # keys: the fused step declined (a source map is traced) or is not this method's
    if max_merges(metric.shape[1], num_prefix) == 0:
        return None
    plan = bipartite_soft_matching(metric, r, num_prefix)
    return plan if plan.r > 0 else None
