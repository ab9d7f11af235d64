"""ATM (Lee & Choi, "Lossless Token Merging Even Without Fine-Tuning in Vision Transformers"):
merge the token pairs whose similarity exceeds a layer-dependent threshold, with size-distinctive
matching in the late layers and one merge count per batch.

- Threshold of block l = 1..L: theta_l = max(alpha - (exp(beta * (l - 1)) - 1), theta_min).
  Blocks with theta_l >= 1 merge nothing (cosine similarity cannot exceed 1) and skip matching.
- Matching: ToMe's bipartite matching on the keys averaged over heads (cosine similarity). For
  l > split_layer, A / B are the smaller / larger halves of the tokens by merging size instead of
  the alternate positions, so two large tokens are never merged together.
- Batch-adaptive count: r = mean over the batch of the per-image number of A tokens whose best
  similarity exceeds theta_l, rounded half up (r.5 -> r + 1); every image merges its r most
  similar pairs, so tensors stay rectangular. A single image merges exactly its own count.
- In the last block only the prefix tokens are kept after attention when the head reads only them
  (prefix_only_last_block, on by default where exact, as in the paper).
"""
import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from .. import kernels
from ..ops.matching import batch_adaptive_r, best_matches, count_above, max_merges, merge_top_r, size_distinctive_split
from ..plans import MergePlan
from ..utils.checks import check_choice, check_int, real
from .schedules import BlockCost
from .base import TokenReducer, warn_if_compiling
from .params import COMMON, REQUIRED, Param, kernel_choice
from .tome import HeadKeys, ToMe, key_metric
from .register import register_method
from .tags import BARE_TAG, TagForm


@dataclass(frozen=True)
class ATMPreset:
    """(alpha, beta, theta_min) and where the setting comes from."""

    alpha: float
    beta: float
    theta_min: float
    source: str


# intent -> model family -> preset. The families are matched by embedding width (see model_family).
PRESETS: Dict[str, Dict[str, ATMPreset]] = {
    "lossless": {
        "tiny": ATMPreset(1.0, 0.035, 0.88, "paper Table A2, DeiT-T without training: 0.90 GFLOPs, 72.04% top-1"),
        "small": ATMPreset(0.99, 0.04, 0.88, "paper Table A2, DeiT-S without training: 3.26 GFLOPs, 79.80% top-1"),
        "base": ATMPreset(1.0, 0.025, 0.89, "paper Table A2, DeiT-B without training: 13.89 GFLOPs, 81.76% top-1"),
    },
    # found here with `tokcomp calibrate deit_tiny_patch16_224 --target-ratio R --data unlabeled-64px`
    # (512 unlabeled images, none of the evaluation images), theta_min rounded to 3 decimals
    "balanced": {"tiny": ATMPreset(1.0, 0.035, 0.868, "tokcomp calibrate --target-ratio 0.70 on DeiT-Tiny")},
    "fast": {"tiny": ATMPreset(1.0, 0.035, 0.824, "tokcomp calibrate --target-ratio 0.62 on DeiT-Tiny")},
}
DEFAULT_PRESET = "lossless"
FAMILY_WIDTHS = {"tiny": 192, "small": 384, "base": 768}
PAPER_FAMILIES = {"deit_tiny_patch16_224": ("tiny", ""), "deit_small_patch16_224": ("small", ""),
                  "deit_base_patch16_224": ("base", ""), "vit_base_patch16_224.mae": ("base", "mae_")}


def _add_paper_presets() -> None:
    """Every setting of the paper's Tables A2 / A5 (ATM without training) as a preset 'g<GFLOPs x 100>' of its
    model's family ('mae_g<...>' for MAE ViT-B), e.g. atm_g090: DeiT-T at 0.90 GFLOPs."""
    table = Path(__file__).resolve().parents[1] / "assets" / "atm_paper_settings.csv"
    with open(table, newline="") as f:
        for row in csv.DictReader(f):
            if not row["alpha"]:
                continue  # the unreduced model's row
            family, prefix = PAPER_FAMILIES[row["model"]]
            name = f"{prefix}g{round(float(row['gflops']) * 100):03d}"
            source = (f"paper Table {'A5' if prefix else 'A2'}, {row['model']} without training: {row['gflops']} "
                      f"GFLOPs, {row['top1']}% top-1")
            PRESETS.setdefault(name, {})[family] = ATMPreset(
                float(row["alpha"]), float(row["beta"]), float(row["theta_min"]), source)


_add_paper_presets()


def model_family(width: int) -> str:
    """The preset family for an embedding width: the family of the nearest DeiT width (192 / 384 / 768)."""
    return min(FAMILY_WIDTHS, key=lambda f: (abs(FAMILY_WIDTHS[f] - width), FAMILY_WIDTHS[f]))


def get_preset(name: str, width: int) -> ATMPreset:
    """The preset `name` for a model of this embedding width. Raises ValueError naming what exists."""
    check_choice("preset", name, sorted(PRESETS))
    family = model_family(width)
    if family not in PRESETS[name]:
        have = sorted(p for p, fams in PRESETS.items() if family in fams)
        raise ValueError(
            f"preset {name!r} exists for the {sorted(PRESETS[name])} families only; a width-{width} model is "
            f"in the {family!r} family, whose presets are {have}; find your own with `tokcomp calibrate`"
        )
    return PRESETS[name][family]


def threshold_schedule(alpha: float, beta: float, theta_min: float, num_blocks: int) -> List[float]:
    """theta_l = max(alpha - (exp(beta * (l - 1)) - 1), theta_min) for l = 1..num_blocks. A decay so fast that
    exp overflows (beta * (l - 1) > 700) has long reached theta_min."""
    return [max(alpha - (math.exp(min(beta * (l - 1), 700.0)) - 1.0), theta_min) for l in range(1, num_blocks + 1)]


@dataclass(frozen=True)
class ATMStep:
    """What one active block does: merge pairs above `threshold`, on the size-distinctive split or not."""

    threshold: float
    size_split: bool


def _check_split_layer(value: Any) -> Optional[int]:
    return None if value is None else check_int("split_layer", value, 0,
                                                "or None (blocks after it use size-distinctive matching)")



def parse_preset_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'atm_<preset>' -> {'preset': preset} for a preset of PRESETS; None for any other tag."""
    head, _, preset = tag.partition("_")
    return {"preset": preset} if head == name and preset in PRESETS else None


PRESET_TAGS = TagForm(tuple(f"{{name}}_{preset}" for preset in PRESETS), parse_preset_tag)

@register_method
class ATM(TokenReducer):
    """alpha: initial threshold; beta: decay rate (>= 0); theta_min: threshold floor; split_layer:
    blocks l > split_layer (1-based) use size-distinctive matching (default round(0.75 * depth), 9 of
    12; 0 = all blocks, depth = none). Metric and proportional attention as in ToMe.

    Through apply() / set_params(), `preset` (one of PRESETS, default 'lossless', chosen per model by
    embedding width) fills in whichever of alpha, beta, theta_min is not given.

    kernel: 'torch' (default), 'triton' or 'auto', as for ToMe: the Triton path matches, counts and merges in
    three launches per merging block with one host synchronisation (the batch's merge count).
    """

    spec = TokenReducer.spec.but(
        name="atm",
        batch_adaptive=True,  # one merge count per batch: the mean of its images' counts
        data_dependent=True,
        export_refusal="the number of tokens it merges is counted from the data in every forward",
        listed_tags=("atm",),
        tune_space=({}, {"preset": "balanced"}, {"preset": "fast"}),
        default_prefix_only_last_block=True,
        params=(Param("alpha", REQUIRED, real("alpha", None), "threshold of the first block"),
                Param("beta", REQUIRED, real("beta", 0.0, strict=False),
                      "decay of the threshold per block (>= 0)"),
                Param("theta_min", REQUIRED, real("theta_min", None), "floor of the threshold"),
                Param("split_layer", None, _check_split_layer,
                      "first block of size-distinctive matching; None: the paper's for the depth"),
                *COMMON, kernel_choice()),
        tags=(BARE_TAG, PRESET_TAGS),
        tag_legend=f"atm: the '{DEFAULT_PRESET}' preset; atm_lossless / _balanced / _fast: named presets; "
                   f"atm_g<NNN>: the ATM paper's settings without training (its Table A2) for the DeiT of the "
                   f"model's width at NNN / 100 GFLOPs, e.g. atm_g090 = DeiT-T at 0.90; atm_mae_g<NNN>: "
                   f"the same for MAE ViT-B (Table A5)",
    )

    @classmethod
    def resolve_params(cls, model: nn.Module, params: Dict[str, Any]) -> Dict[str, Any]:
        params = dict(params)
        preset = params.pop("preset", None)
        missing = [k for k in ("alpha", "beta", "theta_min") if params.get(k) is None]
        if missing or preset is not None:
            chosen = get_preset(DEFAULT_PRESET if preset is None else preset, model.embed_dim)
            for k in missing:
                params[k] = getattr(chosen, k)
        return params

    @classmethod
    def update_params(cls, current: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
        merged = dict(current)
        if "preset" in new:  # a new preset replaces the thresholds not given explicitly
            for k in ("alpha", "beta", "theta_min"):
                merged.pop(k, None)
        merged.update(new)
        return merged

    default_prop_attn = ToMe.default_prop_attn
    metric = ToMe.metric

    def attention_metric(self, q, k, v, attn_bias, scale, inputs) -> Union[torch.Tensor, HeadKeys]:
        """The keys themselves (HeadKeys) where the Triton step may run (kernels.atm_merge averages them), metric()
        otherwise."""
        return HeadKeys(k) if kernels.use_triton(self.kernel, k) else self.metric(q, k, attn_bias, scale)

    def check_depth(self, num_blocks: int) -> None:
        if self.split_layer is not None and self.split_layer > num_blocks:
            raise ValueError(f"split_layer must be in [0, {num_blocks}] for a {num_blocks}-block model, "
                             f"got {self.split_layer}")

    def thresholds(self, num_blocks: int) -> List[float]:
        return threshold_schedule(self.alpha, self.beta, self.theta_min, num_blocks)

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[Optional[ATMStep]]:
        cache: Dict[int, List[Optional[ATMStep]]] = self._settings
        if num_blocks not in cache:
            split = round(0.75 * num_blocks) if self.split_layer is None else self.split_layer
            cache[num_blocks] = [
                ATMStep(theta, size_split=l > split) if theta < 1.0 else None
                for l, theta in enumerate(self.thresholds(num_blocks), start=1)
            ]
        return cache[num_blocks]

    def plan(self, metric: Union[torch.Tensor, HeadKeys], step: ATMStep, num_prefix: int,
             size: Optional[torch.Tensor]) -> Optional[MergePlan]:
        metric = key_metric(metric)  # keys: the Triton step declined (a rope model, a source map, an empty batch)
        cap = max_merges(metric.shape[1], num_prefix)
        if cap == 0:
            return None
        # with every size still 1 the size-distinctive split is the alternate one
        split = size_distinctive_split(size, num_prefix) if step.size_split and size is not None else None
        node_max, node_idx = best_matches(metric, num_prefix, split)
        warn_if_compiling(self.name)
        r = min(batch_adaptive_r(count_above(node_max, step.threshold)), cap)
        return merge_top_r(node_max, node_idx, r, num_prefix, split) if r > 0 else None

    def reduce_fused(self, metric, x, size, source, step, num_prefix, positions=None):
        if not isinstance(metric, HeadKeys) or source is not None or positions is not None or x.shape[0] == 0:
            return None
        if max_merges(x.shape[1], num_prefix) == 0:
            return None  # nothing can merge: plan() declines
        split = size_distinctive_split(size, num_prefix) if step.size_split and size is not None else None
        merged = kernels.atm_merge(metric.k, x, size, step.threshold, num_prefix, split)
        if merged is None:  # nothing merged; the block takes size.log() itself (no log carried)
            return x, size, source, None, None
        x, size, log_size = merged
        return x, size, None, None, log_size
