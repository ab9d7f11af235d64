"""DynamicViT (Rao et al., 2021; a learned pruning method of "Which Tokens to Use?"): before each stage a small
predictor scores every patch token as keep / drop from its own features and the mean of the kept tokens',
    h = GELU(Linear(LayerNorm(x)))                       (n, D); local = h[:, :D/2], global = mean of h[:, D/2:]
    log p = LogSoftmax(MLP(cat(local, global)))          (n, 2): [keep, drop]; MLP: D -> D/2 -> D/4 -> 2, GELU
In eval mode a stage keeps the schedule's count of patch tokens with the highest keep probability and drops
the others (a fixed count, as in the study's protocol). In training mode nothing is removed: a hard
Gumbel-softmax sample (straight-through gradient) decides keep / drop per token, a dropped token stays in
place with size eps = 1e-6 (so the log-size attention bias keeps it out of every other token's attention while
gradients still reach the predictor), and decisions accumulate over the stages. `method_loss()` then gives
the ratio loss, sum over stages of (keep_rate^s - kept share)^2 averaged over images; the fine-tuning command
adds it (weight 2, as in the paper) to its KL distillation loss. Prefix tokens are never scored or dropped.
"""
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.checks import MAX_BLOCKS, int_list, integer
from ..plans import Plan, PrunePlan, Reduced
from .base import LearnedParams, ScheduledReducer
from .params import COMMON, REQUIRED, SCHEDULE, FromConfig, Param
from .register import register_method

EPS = 1e-6  # the size a token dropped in training keeps (log-size bias log(EPS) ~ -13.8)
RATIO_WEIGHT = 2.0  # the paper's weight of the ratio loss


class StageSetting(NamedTuple):
    """A reducing block's setting: the patch tokens it keeps (`keep`), its share of the 196 (`ratio`, the ratio
    loss's target), and its stage's index into the predictors."""

    keep: int
    ratio: float
    stage: int
    weights: Optional["Predictor"] = None  # the stage's predictor (None until bind: LearnedParams.settings_for)


class Predictor(nn.Module):
    """One stage's keep / drop predictor (see the module docstring); about 1.6 D^2 parameters."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Sequential(nn.Linear(dim, dim // 2), nn.GELU(), nn.Linear(dim // 2, dim // 4), nn.GELU(),
                                  nn.Linear(dim // 4, 2))

    def forward(self, tokens: torch.Tensor, policy: torch.Tensor) -> torch.Tensor:
        """tokens: (B, n, D) patch tokens; policy: (B, n, 1) 1 = kept so far -> (B, n, 2) log [keep, drop]."""
        h = F.gelu(self.proj(self.norm(tokens)))
        half = h.shape[-1] // 2
        glob = (h[..., half:] * policy).sum(dim=1, keepdim=True) / policy.sum(dim=1, keepdim=True).clamp_min(1.0)
        return self.head(torch.cat([h[..., :half], glob.expand(-1, h.shape[1], -1)], dim=-1)).log_softmax(dim=-1)


class DynamicViTParams(FromConfig, nn.Module):
    """The predictors of a model of width dim, one per stage (predictors[str(s)]), and the blocks they follow."""

    CONFIG = (Param("dim", REQUIRED, integer("dim", 4)),
              Param("blocks", REQUIRED, int_list("blocks", 0, "block indices", MAX_BLOCKS - 1, MAX_BLOCKS)))

    def __init__(self, dim: int, blocks: Sequence[int]) -> None:
        super().__init__()
        self.dim, self.blocks = dim, [int(b) for b in blocks]
        self.predictors = nn.ModuleDict({str(s): Predictor(dim) for s in range(len(self.blocks))})
        self._ratios: List[torch.Tensor] = []  # the last training forward's (B,) kept shares, one per stage
        self._targets: List[float] = []


def _blocks(settings: Sequence[Optional[StageSetting]]) -> List[int]:
    return [layer for layer, s in enumerate(settings) if s is not None]


def check_fits(params: DynamicViTParams, dim: int, settings: Sequence[Optional[StageSetting]]) -> None:
    if params.dim != dim:
        raise ValueError(f"these DynamicViT predictors are for width {params.dim}; the model has width {dim}")
    if _blocks(settings) != params.blocks:
        raise ValueError(f"these DynamicViT predictors follow blocks {params.blocks}; the method's schedule on this "
                         f"model reduces after blocks {_blocks(settings)}")


@register_method
class DynamicViT(LearnedParams, ScheduledReducer):
    """Learned pruning (see the module docstring). keep_rate / r / flops_ratio give the count each stage keeps
    in eval mode (and the ratio loss's targets in training). The predictors are made at apply (untrained) or
    given as `predictor_params`, and live on the model as model.tokcomp['dynamicvit']. Proportional attention
    is always on: it is what keeps the tokens dropped in training out of attention (kept tokens have size 1)."""

    spec = ScheduledReducer.spec.but(
        name="dynamicvit",
        holds_patches="dropped",
        export_refusal=None,
        masks_by_size=True,
        learned_class=DynamicViTParams,
        learned_param="predictor_params",
        params=(*SCHEDULE, Param("predictor_params", None, help="trained predictor parameters (a learned folder)"),
                *COMMON),
    )

    def default_prop_attn(self, global_pool: str) -> bool:
        return True

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost) -> List[Optional[StageSetting]]:
        settings, total = [], num_tokens - num_prefix
        for counts in self.patch_counts(num_blocks, num_tokens, num_prefix, cost):
            stage = sum(s is not None for s in settings)
            settings.append(None if counts is None else StageSetting(counts[1], counts[1] / total, stage))
        return settings

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        if self.predictor_params is None:
            self.predictor_params = DynamicViTParams(dim, _blocks(settings))
        else:
            check_fits(self.predictor_params, dim, settings)

    def block_weights(self, setting: StageSetting) -> "Predictor":
        return self.predictor_params.predictors[str(setting.stage)]

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the predictor reads the tokens

    def plan_input(self, metric: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The block's tokens (B, N, C), with their gradient: earlier blocks learn through the keep mask."""
        return x

    def plan(self, tokens: torch.Tensor, setting: StageSetting, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[PrunePlan]:
        """Eval mode: keep the setting's count of patch tokens with the highest keep probability (policy: all
        present tokens, the dropped ones being gone)."""
        params = self.predictor_params
        if params.training:
            return MaskPlan(num_prefix, setting, params)  # its apply samples the decisions
        patches = tokens[:, num_prefix:]
        policy = patches.new_ones(patches.shape[0], patches.shape[1], 1)
        score = setting.weights(patches, policy)[..., 0]
        keep = min(setting.keep, patches.shape[1])
        with torch.no_grad():
            order = score.argsort(dim=-1, descending=True, stable=True)[:, :keep]
        return PrunePlan(num_prefix, order.sort(dim=-1).values)

    def method_loss(self) -> Optional[torch.Tensor]:
        """The ratio loss of the last training forward, weighted by 2 (None if none ran since the last call):
        mean over images of sum over stages of (target share - kept share)^2."""
        params = self.predictor_params
        if params is None or not params._ratios:
            return None
        loss = sum((share - target) ** 2 for share, target in zip(params._ratios, params._targets)).mean()
        params._ratios, params._targets = [], []
        return RATIO_WEIGHT * loss


@dataclass
class MaskPlan(Plan):
    """Training: the stage's keep decisions, sampled when the plan applies; no token is removed or moved.

    num_prefix: leading tokens, kept; setting: the stage; params: the predictors (their ratio record grows)."""

    num_prefix: int
    setting: StageSetting
    params: DynamicViTParams
    keeps_positions = True  # every token stays where it is: rotary positions travel unchanged

    def apply(self, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor]) -> Reduced:
        """x: (B, N, C) unchanged; size (B, N, 1) after the sampled decisions (kept 1, dropped EPS); source unchanged."""
        p, params, stage = self.num_prefix, self.params, self.setting.stage
        patches = x[:, p:]
        before = patches.new_ones(patches.shape[0], patches.shape[1], 1) if size is None else \
            (size[:, p:] - EPS) / (1 - EPS)  # 0 / 1 decisions so far, with their gradient
        log_p = self.setting.weights(patches, before)
        keep = F.gumbel_softmax(log_p, hard=True)[..., :1]  # (B, n, 1), straight-through
        policy = before * keep
        if stage == 0:
            params._ratios, params._targets = [], []
        params._ratios.append(policy[..., 0].mean(dim=1))
        params._targets.append(self.setting.ratio)
        prefix = x.new_ones(x.shape[0], p, 1) if size is None else size[:, :p]
        return x, torch.cat([prefix, policy * (1 - EPS) + EPS], dim=1), source
