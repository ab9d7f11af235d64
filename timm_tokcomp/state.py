"""Per-forward token bookkeeping, created fresh by every forward of the block stack."""
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch


@dataclass
class ReductionStats:
    """What one forward of a patched model did.

    tokens_per_block: tokens entering each block (prefix tokens included), length L.
    tokens_out: tokens leaving the last block.
    size: (B, N, 1) original tokens each output token stands for; None when nothing was reduced.
    source: (B, N, N0) 0/1 map of the original tokens each output token holds; only when tracing.
    num_prefix: class / distillation / register tokens at the front, never reduced.
    real_tokens_per_block: where images keep different counts (methods that mask by size, such as ATS; a NaFlex
        batch of several grids), the (B,) count of real tokens entering each block; the batch runs (or is padded
        back to) tokens_per_block, the rest size-0 tokens that attention and pooling ignore. Empty otherwise.
    rope_merge: on a model with rotary positions, where a merged token's rope sits ('dst': its destination
        token's; 'centroid': the size-weighted centroid of its patches); None on a model without rope.
    positions: where the output tokens sit, as the model's family carries it (rope.TokenPositions; a SAM encoder's
        grid, families.sam.GridPositions); None for a family that carries none.
    """

    tokens_per_block: List[int] = field(default_factory=list)
    tokens_out: int = 0
    size: Optional[torch.Tensor] = None
    source: Optional[torch.Tensor] = None
    num_prefix: int = 0
    real_tokens_per_block: List[torch.Tensor] = field(default_factory=list)
    rope_merge: Optional[str] = None
    positions: Any = None
