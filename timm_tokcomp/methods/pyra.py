"""PYRA (Xiong et al., ECCV 2024): ToMe's merging, with the r source tokens of every reducing block
modulated by learned per-layer weights before they are averaged into their targets.

In block l with r merges, M_s (r, D) are the merged-away tokens in score order (most similar first) and
M_t (r, D) the target each one merges into. P = LayerNorm_l(M_s + M_t); channel weights
c = 2 * sigmoid(w_l^T P) (1, D) from rank weights w_l (r,); token weights t = 2 * sigmoid(P W_D,l) - 1
(r, 1). The sources become M_s * (1 + t c) and are merged by ToMe's size-weighted mean; targets are
not modulated. W_D starts at zero, so t = 0 and an untrained PYRA is ToMe exactly.

Two forms of the rank weights w_l:
  'paper':  one weight per merged token (the paper's W_r, uniform(-1, 1) at init), so the trained
            parameters fit their training schedule only.
  'pooled': (ours) w_l(rho) = linear interpolation of KNOTS learned values at the normalised rank
            rho = i / (r - 1), and the weighted sum becomes a weighted mean (divided by r): the same
            parameters run at any r, the channel weights staying on one scale.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ..utils.checks import MAX_BLOCKS, check_choice, int_list, integer
from ..ops.matching import float32_linspace
from ..plans import MergePlan, Reduced, gather_tokens, split_tokens
from ..plans.merge import merge_sum
from .base import LearnedParams
from .params import COMMON, REQUIRED, SCHEDULE, FromConfig, Param
from .tome import ToMe, tome_plan
from .register import register_method

FORMS = ("paper", "pooled")
KNOTS = 8  # rank-weight knots of the 'pooled' form


class PyraSetting(NamedTuple):
    """A reducing block's setting: r merges in block `layer` (0-based), with that block's parameters (None until the
    method is bound to a model; LearnedParams.settings_for)."""

    r: int
    layer: int
    weights: Optional["PyraLayer"] = None


class PyraLayer(nn.Module):
    """One block's parameters: norm LayerNorm(dim); token_weight (dim,), W_D, zero at init; rank_weight (n,),
    uniform(-1, 1) at init (n = the block's r for 'paper', KNOTS for 'pooled')."""

    def __init__(self, dim: int, num_rank_weights: int, form: str = "paper") -> None:
        super().__init__()
        self.form = form
        self.norm = nn.LayerNorm(dim)
        self.token_weight = nn.Parameter(torch.zeros(dim))
        self.rank_weight = nn.Parameter(torch.empty(num_rank_weights).uniform_(-1.0, 1.0))

    def rank_weights(self, r: int) -> torch.Tensor:
        """(r,) weights of the merged tokens in score order, already divided by r for 'pooled' (knot positions in
        float32, matching.float32_linspace)."""
        w = self.rank_weight
        if self.form == "paper":
            if r > w.shape[0]:
                raise ValueError(f"PYRA ('paper' form) was trained with r = {w.shape[0]} in this block and cannot "
                                 f"merge {r} tokens there; use the training schedule or the 'pooled' form")
            return w[:r]
        if r == 1:
            return w.mean().view(1)
        pos = float32_linspace(KNOTS - 1, r, w.device).to(w.dtype)
        lo = pos.floor().clamp_max(KNOTS - 2).long()
        frac = pos - lo.to(pos.dtype)
        return (w[lo] * (1 - frac) + w[lo + 1] * frac) / r

    def modulate(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """src, dst: (B, r, D) merged-away tokens in score order and their targets -> modulated src."""
        p = self.norm(src + dst)  # (B, r, D)
        w = self.rank_weights(src.shape[1]).to(p.dtype)
        c = 2 * torch.sigmoid(torch.einsum("brd,r->bd", p, w)).unsqueeze(1)  # (B, 1, D)
        t = 2 * torch.sigmoid(p @ self.token_weight.to(p.dtype).unsqueeze(-1)) - 1  # (B, r, 1)
        return src * (1 + t * c)


def _check_form(form: Any) -> str:
    """The one check of form, for the method's parameter and the saved parameters' config."""
    return check_choice("form", form, FORMS)


class PyraParams(FromConfig, nn.Module):
    """PYRA's parameters for a model of len(ranks) blocks and width dim: layers[str(l)] is a PyraLayer for
    every block that merges in the training schedule `ranks` ('paper'), or for every block ('pooled')."""

    CONFIG = (Param("dim", REQUIRED, integer("dim", 1)),
              Param("ranks", REQUIRED, int_list("ranks", 0, "integers (r per block)", most=MAX_BLOCKS)),
              Param("form", "paper", _check_form))

    def __init__(self, dim: int, ranks: Sequence[int], form: str = "paper") -> None:
        super().__init__()
        self.form, self.ranks, self.dim = form, [int(r) for r in ranks], dim
        self.layers = nn.ModuleDict({str(l): PyraLayer(dim, r if form == "paper" else KNOTS, form)
                                     for l, r in enumerate(self.ranks) if r > 0 or form == "pooled"})

    @property
    def depth(self) -> int:
        return len(self.ranks)

    def config(self) -> Dict[str, Any]:
        """FromConfig's, and the 'pooled' form's knots."""
        return {**super().config(), "knots": KNOTS}

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "PyraParams":
        """As FromConfig's, and the 'pooled' form's knots must be this version's."""
        params = super().from_config(config)
        if params.form == "pooled" and config.get("knots") != KNOTS:
            raise ValueError(f"knots must be {KNOTS} for the 'pooled' form, got {config.get('knots')!r}")
        return params


def check_fits(params: PyraParams, dim: int, settings: Sequence[Any]) -> None:
    """Raise ValueError unless params fit a model of width dim whose blocks have these settings."""
    ranks = [0 if s is None else s.r for s in settings]
    if params.dim != dim:
        raise ValueError(f"these PYRA parameters are for width {params.dim}; the model has width {dim}")
    if params.depth != len(ranks):
        raise ValueError(f"these PYRA parameters are for {params.depth} blocks; the model has {len(ranks)}")
    if params.form == "paper" and ranks != params.ranks:
        raise ValueError(f"these PYRA parameters ('paper' form) fit the schedule r = {params.ranks} only; the method's "
                         f"schedule on this model is r = {ranks} (the 'pooled' form runs at any r)")


def pyra_merge(x: torch.Tensor, size: Optional[torch.Tensor], plan: MergePlan, layer: PyraLayer
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """ToMe's size-weighted merge with PYRA's modulated sources: x (B, N, C), size (B, N, 1) or None
    -> x (B, N - r, C), size (B, N - r, 1). With t = 0 it computes exactly what plans.merge.merge_mean does."""
    if size is None:
        size = x.new_ones(x.shape[0], x.shape[1], 1)
    split = None if plan.a_idx is None else (plan.a_idx, plan.b_idx)
    a, b = split_tokens(x, plan.num_prefix, split)
    src = layer.modulate(gather_tokens(a, plan.src_idx), gather_tokens(b, plan.dst_idx))
    src_size = gather_tokens(split_tokens(size, plan.num_prefix, split)[0], plan.src_idx).to(x.dtype)
    rows = torch.cat([x * size, size.to(x.dtype)], dim=-1)
    total, new_size = merge_sum(rows, plan, src=torch.cat([src * src_size, src_size], dim=-1)).split(
        [x.shape[-1], 1], -1)
    return total / new_size, new_size


@dataclass
class PyraMergePlan(MergePlan):
    """ToMe's matches, merged with PYRA's modulated sources: layer, the block's parameters."""

    layer: Optional[PyraLayer] = None

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        x_out, size_out = pyra_merge(x, size, self, self.layer)
        return x_out, size_out, None if source is None else merge_sum(source, self)


@register_method
class PYRA(LearnedParams, ToMe):
    """ToMe with PYRA's learned source modulation (see the module docstring). The parameters are made at
    apply (untrained: equal to ToMe) or given as `pyra_params`, and live on the model as model.tokcomp['pyra'].
    form: 'paper' (fits its training schedule) or 'pooled' (any r); set_params keeps the parameters."""

    spec = ToMe.spec.but(
        name="pyra",
        compiles_by_region=False,  # the default 'paper' form compiles whole; the 'pooled' form by region
        export_refusal=None,
        tocom_compatible=False,  # not ToMe's: its compensators were trained without PYRA's layers
        listed_tags=(),
        tune_space=(),  # learned: needs its trained folder
        learned_class=PyraParams,
        learned_param="pyra_params",  # the constructor argument that takes saved parameters
        params=(*SCHEDULE, Param("form", "paper", _check_form, "PYRA's modulation: 'paper' or 'pooled'"),
                Param("pyra_params", None, help="trained PYRA weights (a fine-tuned folder)"), *COMMON),
    )

    kernel = "torch"  # not a parameter: ToMe's fused merge has no learned modulation

    def validate(self) -> None:
        super().validate()
        if self.pyra_params is not None:
            self.form = self.pyra_params.form  # the parameters decide; form only chooses what apply creates

    @property
    def compiles_by_region(self) -> bool:
        """'paper': each block's rank weights are as long as its trained r, and the compiler holds a parameter's shape
        static, so by region it would compile a graph per distinct r (more than its recompile limit on the paper's
        schedules): compiled whole. 'pooled': every block's weights alike, one block graph."""
        return self.form == "pooled"

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost) -> List[Optional[PyraSetting]]:
        return [None if r is None else PyraSetting(r, layer)
                for layer, r in enumerate(super().block_settings(num_blocks, num_tokens, num_prefix, cost))]

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        if self.pyra_params is None:
            self.pyra_params = PyraParams(dim, [0 if s is None else s.r for s in settings], self.form)
        else:
            check_fits(self.pyra_params, dim, settings)

    def block_weights(self, setting: PyraSetting) -> PyraLayer:
        return self.pyra_params.layers[str(setting.layer)]

    def plan(self, metric: torch.Tensor, setting: PyraSetting, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        plan = tome_plan(metric, setting.r, num_prefix)
        return None if plan is None else PyraMergePlan.of(plan, layer=setting.weights)

    def reduce_fused(self, metric, x, size, source, setting, num_prefix, positions=None):
        return None  # ToMe's fused step has no learned modulation: plan() runs and its plan applies, compiled or not
