"""ToCom's trainable plugins: the compensator's low-rank factors as parameters, added un-merged to every block's
qkv output while a (source, target) pair is active."""
import contextlib
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .compensator import Compensator, check_fits


class Plugins(nn.Module):
    """Trainable plugins lora_a (S, L, 2, h, D), lora_b (S, L, 2, attn_dim, h) for [query, value],
    added un-merged to the output of every block's qkv while a pair is active."""

    def __init__(self, compensator: Compensator) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(compensator.lora_a.clone().float())
        self.lora_b = nn.Parameter(compensator.lora_b.clone().float())
        self._active: Optional[Tuple[int, int, float]] = None
        self._handles: List = []

    def install(self, model: nn.Module) -> None:
        """Hook every block's attn.qkv; the hooks do nothing until a pair is active."""
        check_fits(model, self.to_compensator(1.0))
        for block, blk in enumerate(model.blocks):
            self._handles.append(blk.attn.qkv.register_forward_hook(self._hook(block)))

    def _hook(self, block: int) -> Callable:
        def add_plugins(module: nn.Module, inputs: Tuple[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
            if self._active is None:
                return out
            lo, hi, coef = self._active
            x = inputs[0]  # (B, N, D)
            k, h, D = hi - lo, self.lora_a.shape[3], self.lora_a.shape[4]
            a = self.lora_a[lo:hi, block].transpose(0, 1).reshape(2, k * h, D)  # (2, k h, D)
            b = self.lora_b[lo:hi, block].permute(1, 2, 0, 3).reshape(2, -1, k * h)  # (2, attn_dim, k h)
            dq = (x @ a[0].t().to(x.dtype)) @ b[0].t().to(x.dtype)
            dv = (x @ a[1].t().to(x.dtype)) @ b[1].t().to(x.dtype)
            return out + coef * torch.cat([dq, torch.zeros_like(dq), dv], dim=-1).to(out.dtype)

        return add_plugins

    @contextlib.contextmanager
    def active(self, source_r: int, target_r: int, scale: float) -> Iterator[None]:
        """Within the block, the hooks add s * sign(n - m) * sum of plugins [min, max) (m = source_r)."""
        lo, hi = sorted((source_r, target_r))
        self._active = None if lo == hi else (lo, hi, scale * (1.0 if target_r > source_r else -1.0))
        try:
            yield
        finally:
            self._active = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def to_compensator(self, scale: float) -> Compensator:
        return Compensator(self.lora_a.detach().cpu().clone(), self.lora_b.detach().cpu().clone(), scale)
