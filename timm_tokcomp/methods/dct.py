"""DCT reduction, as the OpenToMe toolbox uses it (from the Fourier Transformer, He et al., ACL 2023): at the end
of a reducing block the patch tokens, in their current order, are a 1-D signal per channel; its n-point DCT-II is
cut to the m = n - r lowest frequencies and transformed back with the m-point inverse, giving m tokens. No matching,
no metric: one fixed (m, n) matrix per block. Training-free."""
from typing import Optional

import torch

from ..utils.checks import boolean, optional
from ..plans import ResamplePlan
from .places import ReducesAt
from .base import PlansOnTokens, ScheduledReducer
from .params import COMMON, SCHEDULE, Param
from .register import register_method


def dct_matrix(n: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix (n, n), float32: row u is alpha_u cos(pi (2 t + 1) u / (2 n)) over t."""
    t = torch.arange(n, device=device)
    phase = ((2 * t + 1) * t.unsqueeze(1)) % (4 * n)  # exact in integers: the cosine's argument stays below 2 pi
    phi = torch.cos(phase.float() * (torch.pi / (2 * n))) * (2 / n) ** 0.5
    return torch.cat([phi[:1] / 2 ** 0.5, phi[1:]])


def dct_resample(n: int, m: int, inflate: bool = False, device: Optional[torch.device] = None) -> torch.Tensor:
    """(m, n) float32: the n-point DCT, its m lowest frequencies kept, the m-point inverse DCT. inflate=False
    scales by sqrt(m / n), so a constant sequence stays that constant (each row sums to 1); inflate=True is the
    plain transform pair (OpenToMe's form), which scales a constant by sqrt(n / m)."""
    if not 1 <= m <= n:
        raise ValueError(f"a DCT resample needs 1 <= m <= n, got m={m}, n={n}")
    matrix = dct_matrix(m, device).T @ dct_matrix(n, device)[:m]
    return matrix if inflate else matrix * (m / n) ** 0.5


@register_method
class DCT(PlansOnTokens, ScheduledReducer):
    """inflate False (default): the transform pair scaled by sqrt(m / n), so a constant sequence of tokens stays
    that constant and token norms do not grow. True: OpenToMe's plain pair, which scales every token by about
    sqrt(n / m) at each reduction (1.0435 for 196 -> 180). r <= n // 2 per block. Sizes and source maps: each output
    token holds the stretch of the token axis it resamples (ResamplePlan.shares), so every patch stays held with
    total weight 1. On a rotary-position model the tokens' grid coordinates are resampled by the same
    mean-preserving map. Proportional attention is off by default, as in OpenToMe."""

    spec = ScheduledReducer.spec.but(
        name="dct",
        holds_patches="soft",
        export_refusal=None,
        tune_space=(),  # not in tune's default space: far below ToMe at matched GMACs (docs/study.md)
        place=ReducesAt.AFTER_MLP,  # at the end of the block, after its MLP (OpenToMe's place for it; the study's)
        params=(*SCHEDULE,
                Param("inflate", False, lambda v: bool(optional(boolean("inflate"))(v)),
                      "DCT: keep OpenToMe's amplitude inflation, sqrt(n / m) per reduction (default: mean-preserving)"),
                *COMMON),
    )
    min_keep_rate = 0.5

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the plan reads only the token count

    def plan(self, tokens: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]
             ) -> Optional[ResamplePlan]:
        n = tokens.shape[1] - num_prefix
        r = max(min(r, n // 2), 0)
        if r == 0:
            return None
        return ResamplePlan(num_prefix, dct_resample(n, n - r, self.inflate, tokens.device))
