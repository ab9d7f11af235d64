"""PatchMerger (Renggli et al., 2022; a soft-merging method of "Which Tokens to Use?"): each reducing block
replaces its n patch tokens by M learned mixtures of them. With learned queries W (M, D),
    weights = softmax over the n inputs of W LayerNorm(x)^T / sqrt(D)      (M, n)
    output  = weights @ x                                                    (M, D)
and the prefix tokens (class, distillation, registers) are passed on unchanged. M is the count the schedule
leaves (the study's protocol: floor(196 keep_rate^s) patch tokens after stage s), so the queries fit the
schedule they were made for. Learned: an untrained PatchMerger (queries ~ N(0, 0.02^2)) mixes every output to
nearly the mean token; it needs training (`tokcomp finetune --method patchmerger_k70 --distill ...`).
The 1 / sqrt(D) scale is ours (as in attention); sizes and source maps are shared out by the weights (SoftPlan).

The other learned soft-merging methods of the study (Sinkhorn, SiT) subclass PatchMerger with their own layer:
everything but how a layer turns its tokens into mixing weights is shared.
"""
from typing import Any, List, NamedTuple, Optional, Sequence

import torch
from torch import nn

from ..utils.checks import MAX_BLOCKS, int_list, integer
from ..plans import SoftPlan
from .base import LearnedParams, ScheduledReducer
from .params import COMMON, REQUIRED, SCHEDULE, FromConfig, Param
from .register import register_method


class MergerSetting(NamedTuple):
    """A reducing block's setting: r tokens fewer, M = outputs patch tokens out, in block `layer` (0-based)."""

    r: int
    outputs: int
    layer: int


class MergerLayer(nn.Module):
    """One block's parameters: norm LayerNorm(dim) and queries (outputs, dim)."""

    def __init__(self, dim: int, outputs: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.queries = nn.Parameter(torch.empty(outputs, dim).normal_(0.0, 0.02))

    def weights(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, n, D) -> (B, M, n) mixing weights, each row summing to 1."""
        keys = self.norm(tokens)
        scores = torch.einsum("md,bnd->bmn", self.queries.to(keys.dtype), keys) * keys.shape[-1] ** -0.5
        return scores.float().softmax(dim=-1).to(tokens.dtype)


class PatchMergerParams(FromConfig, nn.Module):
    """PatchMerger's parameters for a model of len(outputs) blocks and width dim: layers[str(l)] (a layer_class)
    for every block l with outputs[l] > 0 (the patch tokens it leaves; 0: the block merges nothing)."""

    CONFIG = (Param("dim", REQUIRED, integer("dim", 1)),
              Param("outputs", REQUIRED, int_list("outputs", 0, "integers (tokens left per block)", most=MAX_BLOCKS)))

    layer_class = MergerLayer

    def __init__(self, dim: int, outputs: Sequence[int]) -> None:
        super().__init__()
        self.dim, self.outputs = dim, [int(m) for m in outputs]
        self.layers = nn.ModuleDict({str(l): self.layer_class(dim, m) for l, m in enumerate(self.outputs) if m > 0})


def _outputs(settings: Sequence[Optional[MergerSetting]]) -> List[int]:
    return [0 if s is None else s.outputs for s in settings]


def check_fits(params: PatchMergerParams, dim: int, settings: Sequence[Optional[MergerSetting]], method: str) -> None:
    """Raise ValueError unless params fit a model of width dim whose blocks have these settings."""
    if params.dim != dim:
        raise ValueError(f"these {method} parameters are for width {params.dim}; the model has width {dim}")
    if len(params.outputs) != len(settings):
        raise ValueError(f"these {method} parameters are for {len(params.outputs)} blocks; the model has {len(settings)}")
    if _outputs(settings) != params.outputs:
        raise ValueError(f"these {method} parameters leave {params.outputs} patch tokens per block; the method's "
                         f"schedule on this model leaves {_outputs(settings)} (learned layers fit their schedule only)")


@register_method
class PatchMerger(LearnedParams, ScheduledReducer):
    """Learned soft merging (see the module docstring): r / flops_ratio / keep_rate say how many patch tokens
    each block leaves, as for every scheduled method. The parameters are made at apply (untrained) or given as
    `merger_params`, and live on the model as model.tokcomp['patchmerger']. Proportional attention is off
    unless asked."""

    spec = ScheduledReducer.spec.but(
        name="patchmerger",
        compiles_by_region=False,  # each block's merger is looked up by its layer number
        holds_patches="soft",
        export_refusal=None,
        learned_class=PatchMergerParams,
        learned_param="merger_params",
        params=(*SCHEDULE, Param("merger_params", None, help="trained merger queries (a learned folder)"), *COMMON),
    )

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost) -> List[Optional[MergerSetting]]:
        return [None if c is None or c[0] == c[1] else MergerSetting(c[0] - c[1], c[1], layer)
                for layer, c in enumerate(self.patch_counts(num_blocks, num_tokens, num_prefix, cost))]

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        if self.merger_params is None:
            self.merger_params = self.spec.learned_class(dim, _outputs(settings))
        else:
            check_fits(self.merger_params, dim, settings, type(self).__name__)

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the plan reads the tokens

    def plan_input(self, metric: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The block's tokens (B, N, C), with their gradient: earlier blocks learn through the assignment."""
        return x

    def plan(self, tokens: torch.Tensor, setting: MergerSetting, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[SoftPlan]:
        n = tokens.shape[1] - num_prefix
        if n != setting.r + setting.outputs:
            raise ValueError(f"{type(self).__name__} block {setting.layer} was set up for {setting.r + setting.outputs} "
                             f"patch tokens and got {n}: its learned layer fits one input size (the model's default)")
        return SoftPlan(num_prefix, self.merger_params.layers[str(setting.layer)].weights(tokens[:, num_prefix:]))
