"""What a model family adapter declares: the timm classes it serves and their reducing and dense counterparts,
the checks of what it cannot serve, and the MACs of one block. The reducing loop itself is shared
(timm_tokcomp.reducing); patch.py swaps classes by these tables."""
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from timm.layers import AttentionPoolLatent
from torch import nn

from ..schedules import BlockCost


def linear_macs(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


@dataclass(frozen=True)
class Family:
    """One timm model family, served in timm's model modules timm_modules. Each table maps a plain timm class to its patched subclass (same parameters and
    buffers, so state_dict keys never change). dense_blocks may miss a block class the dense variant cannot serve.
    check(model), where a family has one, raises TypeError naming what else it cannot serve; attn_dim(attention)
    gives heads * head_dim."""

    name: str
    timm_modules: Tuple[str, ...]  # timm's model modules whose architectures take method tags (timm_tokcomp.registry)
    models: Dict[type, type]
    dense_models: Dict[type, type]
    blocks: Dict[type, type]
    dense_blocks: Dict[type, type]
    attentions: Dict[type, type]
    attn_dim: Callable[[nn.Module], int]
    check: Callable[[nn.Module], None] = lambda model: None
    plain_skips_qkv_module: Callable[[nn.Module], bool] = lambda model: False  # timm's own forward reads the qkv
    # weight directly (an adapter wrapped around qkv, such as peft's LoRA, would be skipped while nothing is reduced)

    def serves(self, model_class: type) -> bool:
        return model_class in self.models or model_class in self.plain_models()

    def plain_models(self) -> Dict[type, type]:
        """patched model class -> plain timm class."""
        return {patched: plain for table in (self.models, self.dense_models) for plain, patched in table.items()}

    def plain_block(self, block_class: type) -> Optional[type]:
        for table in (self.blocks, self.dense_blocks):
            for plain, patched in table.items():
                if block_class in (plain, patched):
                    return plain
        return None

    def plain_attention(self, attn_class: type) -> Optional[type]:
        for plain, patched in self.attentions.items():
            if attn_class in (plain, patched):
                return plain
        return None

    def block_cost(self, block: nn.Module) -> BlockCost:
        return BlockCost(attn_linear=linear_macs(block.attn), attn_dim=self.attn_dim(block.attn),
                         mlp_linear=linear_macs(block.mlp))

    def check_blocks(self, model: nn.Module) -> None:
        """Every block and its attention are of classes this family serves, and the head is one it can pool."""
        for i, blk in enumerate(model.blocks):
            if self.plain_block(type(blk)) is None:
                served = ", ".join(c.__name__ for c in self.blocks)
                raise TypeError(f"blocks[{i}] is of class {type(blk).__name__}; in timm's {self.name} "
                                f"timm_tokcomp serves {served}")
            if self.plain_attention(type(blk.attn)) is None:
                served = ", ".join(c.__name__ for c in self.attentions)
                raise TypeError(f"blocks[{i}].attn is of class {type(blk.attn).__name__}; in timm's {self.name} "
                                f"timm_tokcomp serves {served}")
        check_pool_head(getattr(model, "attn_pool", None))

    def dense_refusal(self, model: nn.Module) -> Optional[str]:
        """Why the dense variant cannot serve this model, or None."""
        for i, blk in enumerate(model.blocks):
            if self.plain_block(type(blk)) not in self.dense_blocks:
                return (f"the dense methods do not serve blocks[{i}], a {type(blk).__name__} (served: "
                        f"{', '.join(c.__name__ for c in self.dense_blocks)})")
        return None


def check_pool_head(pool: Optional[nn.Module]) -> None:
    """Raise TypeError for an attention-pool head that cannot take token sizes."""
    if pool is None:
        return
    if type(pool) is not AttentionPoolLatent:
        raise TypeError(f"the attention-pool head is of class {type(pool).__name__}; timm_tokcomp serves timm's "
                        f"AttentionPoolLatent ('map') heads, whose attention takes the token sizes")
    if pool.pos_embed is not None:
        raise TypeError("the attention-pool head adds a position embedding per input token (pos_embed='abs'), which "
                        "needs every token; reduced tokens cannot be pooled by it")

