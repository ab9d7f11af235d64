"""SiT's token slimming (Zong et al., "Self-slimmed Vision Transformer"; a learned soft-merging method of "Which
Tokens to Use?"): a small MLP maps every token to one score per output token, and each output token is the
softmax-over-inputs weighted mean of the tokens,
    scores = Linear(GELU(Linear(LayerNorm(x))))      (n, M): D -> D / 2 -> M
    output = softmax over the n inputs of scores^T @ x   (M, D)
so unlike PatchMerger's fixed queries the weights come from a learned function of each token. SiT's
feature-recalibration distillation is not built: it trains with the fine-tuning command's losses. Sizes and
source maps are shared out by the weights, as for PatchMerger."""
import torch
import torch.nn.functional as F
from torch import nn

from .patchmerger import PatchMerger, PatchMergerParams
from .register import register_method


class SlimmingLayer(nn.Module):
    """One block's token-slimming MLP: LayerNorm(dim), dim -> dim / 2 -> outputs."""

    def __init__(self, dim: int, outputs: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim // 2)
        self.fc2 = nn.Linear(dim // 2, outputs)

    def weights(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, n, D) -> (B, M, n) mixing weights, each row summing to 1."""
        scores = self.fc2(F.gelu(self.fc1(self.norm(tokens))))  # (B, n, M)
        return scores.transpose(1, 2).float().softmax(dim=-1).to(tokens.dtype)


class SiTParams(PatchMergerParams):
    """SiT's parameters: PatchMerger's shape, slimming MLPs."""

    layer_class = SlimmingLayer


@register_method
class SiT(PatchMerger):
    """Learned token slimming; parameters as `merger_params`, on the model as model.tokcomp['sit']."""

    spec = PatchMerger.spec.but(
        name="sit",
        holds_patches="soft",
        learned_class=SiTParams,
    )
