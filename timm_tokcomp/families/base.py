"""What a model family adapter declares: the timm classes it serves and their reducing and dense counterparts,
the checks of what it cannot serve (of a built model, and of an architecture from the arguments timm would build it
with), and the MACs of one block; and the attention helpers the adapters share. The reducing loop itself is shared
(timm_tokcomp.runtime.loop); patch.py swaps classes by these tables."""
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Type

import torch
from timm.layers import Attention, AttentionPoolLatent
from timm.models.vision_transformer import ATTN_LAYERS, Block
from torch import nn

from ..ops.attention import check_fold_qkv
from ..methods.base import TokenReducer
from ..runtime.loop import ReducingBlockMixin
from ..methods.schedules import BlockCost


class BuildArgs(NamedTuple):
    """What a timm entrypoint builds: the model class and every keyword argument of its constructor (the class's
    defaults where the entrypoint gives none)."""

    model_class: type
    kwargs: Dict[str, Any]

    def arg(self, name: str, default: Any = None) -> Any:
        return self.kwargs.get(name, default)


class _Built(Exception):
    def __init__(self, args: BuildArgs):
        super().__init__(args.model_class.__name__)
        self.built = args  # not .args: an exception keeps that as a plain tuple


_BUILD_ARGS_LOCK = threading.Lock()


def build_args(entrypoint: Callable[[], nn.Module], classes: Tuple[type, ...]) -> Optional[BuildArgs]:
    """What entrypoint() would construct, read without building it: the first constructor of `classes` it reaches
    stops it (in this thread only; other threads build as usual) and reports its class and arguments. None where the
    entrypoint builds none of them, or fails before it does (the registry then lists none of its names). About
    0.1 ms, where building on the meta device takes tens of ms to seconds."""
    me = threading.get_ident()
    originals = {cls: cls.__dict__["__init__"] for cls in classes}

    def stopping(original: Callable) -> Callable:
        def init(self, *args: Any, **kwargs: Any) -> None:
            if threading.get_ident() != me:
                return original(self, *args, **kwargs)
            bound = inspect.signature(original).bind(self, *args, **kwargs)
            bound.apply_defaults()
            given = {k: v for k, v in bound.arguments.items() if k != "self"}
            given.update(given.pop("kwargs", {}))
            raise _Built(BuildArgs(type(self), given))
        return init

    with _BUILD_ARGS_LOCK:
        try:
            for cls, original in originals.items():
                cls.__init__ = stopping(original)
            entrypoint()
        except _Built as built:
            return built.built
        except Exception:  # an entrypoint that cannot build without more arguments: nothing to read
            return None
        finally:
            for cls, original in originals.items():
                cls.__init__ = original
    return None


def project_heads(attn: nn.Module, x: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """The attention's output side, as timm's: heads x (B, H, N, d) -> (B, N, H * d), its norm, the gate
    (B, N, H * d) or None, proj and proj_drop -> (B, N, C)."""
    B, H, N, d = x.shape
    x = attn.norm(x.transpose(1, 2).reshape(B, N, H * d))  # explicit width: an empty batch has no -1 to infer
    if gate is not None:
        x = x * gate
    return attn.proj_drop(attn.proj(x))


def reducer_metric(reducer: Optional[TokenReducer], q, k, v, attn_bias, scale: float, inputs: torch.Tensor
                   ) -> Optional[torch.Tensor]:
    """The reducer's metric from q, k, v: (B, H, N, d) as attention uses them (and the attention's input (B, N, C)),
    or None without a reducer."""
    return None if reducer is None else reducer.attention_metric(q, k, v, attn_bias, scale, inputs)


def linear_macs(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


@dataclass(frozen=True)
class Facade:
    """A model whose attributes are not timm's VisionTransformer's, under those names (Family.facade): blocks (each
    with .attn, .mlp), embed_dim, num_prefix_tokens, global_pool, patch_embed (grid_size, num_patches,
    dynamic_feat_size), dynamic_img_size."""

    blocks: Sequence[Any]
    embed_dim: int
    num_prefix_tokens: int
    global_pool: str
    patch_embed: Any
    dynamic_img_size: bool = False


@dataclass(frozen=True)
class PatchGrid:
    """timm's patch_embed facts of another library's vision model: the patch grid at the configured image size, and
    at another (H, W)."""

    image_size: Tuple[int, int]
    patch_size: int

    @classmethod
    def of(cls, config: Any) -> "PatchGrid":
        """From a transformers vision config."""
        size = config.image_size
        return cls(tuple(size) if isinstance(size, (tuple, list)) else (size, size), int(config.patch_size))

    @property
    def grid_size(self) -> Tuple[int, int]:
        return self.dynamic_feat_size(self.image_size)

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid_size
        return rows * cols

    def dynamic_feat_size(self, image_size: Tuple[int, int]) -> Tuple[int, int]:
        return image_size[0] // self.patch_size, image_size[1] // self.patch_size


@dataclass(frozen=True)
class BlockView:
    """Another library's layer as patch reads a timm block: its attention and MLP modules."""

    attn: nn.Module
    mlp: nn.Module


@dataclass(frozen=True)
class Family:
    """One timm model family, served in timm's model modules timm_modules. Each table maps a plain timm class to its
    patched subclass (same parameters and buffers, so state_dict keys never change). dense_blocks may miss a block
    class the dense variant cannot serve. check(model), where a family has one, raises TypeError naming what else it
    cannot serve; arch_refusal(args) says the same of an architecture from the arguments timm builds it with
    (BuildArgs), so the registry lists no name it would refuse; attn_dim(attention) gives heads * head_dim."""

    name: str
    timm_modules: Tuple[str, ...]  # timm's model modules whose architectures take method tags (models/timm_names.py)
    models: Dict[type, type]
    dense_models: Dict[type, type]
    blocks: Dict[type, type]
    dense_blocks: Dict[type, type]
    attentions: Dict[type, type]
    attn_dim: Callable[[nn.Module], int]
    check: Callable[[nn.Module], None] = lambda model: None
    arch_refusal: Callable[[BuildArgs], Optional[str]] = lambda args: None
    fused_qkv_attentions: Tuple[type, ...] = ()  # timm attention classes with one qkv Linear, heads of equal width:
    # what the lookahead methods (MCTF) and prop_attn='fold_qkv' need
    plain_skips_qkv_module: Callable[[nn.Module], bool] = lambda model: False  # timm's own forward reads the qkv
    # weight directly (an adapter wrapped around qkv, such as peft's LoRA, would be skipped while nothing is reduced)
    other_classes: Dict[type, type] = field(default_factory=dict)  # other submodules' plain class -> patched class,
    # swapped wherever they sit in the model, for both kinds (Eva: DINOv3's rope, its table made once per grid)

    def __post_init__(self) -> None:
        for patched in self.plain_models():  # a patched model's class names its family: no search (family_of)
            patched.tokcomp_family = self

    def load(self) -> "Family":
        return self

    def served(self) -> str:
        """The classes served, for messages."""
        return ", ".join(f"{c.__name__} ({c.__module__})" for c in self.models)

    def facade(self, model: nn.Module) -> Any:
        """What patch reads of a plain or patched model, with timm's attribute names: blocks (each with .attn,
        .mlp), embed_dim, num_prefix_tokens, global_pool, patch_embed (num_patches, grid_size,
        dynamic_feat_size). A timm model is its own facade."""
        return model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The model's transformer blocks in order, the modules whose classes swap (timm: model.blocks)."""
        return model.blocks

    def swap(self, model: nn.Module, dense: bool) -> None:
        """Give a plain model, its blocks and (where the family patches attention classes) their attention the
        patched classes of one kind."""
        blocks = self.dense_blocks if dense else self.blocks
        for blk in self.layers(model):
            blk.__class__ = blocks[type(blk)]
            if self.attentions:
                blk.attn.__class__ = self.attentions[type(blk.attn)]
        self._swap_others(model, self.other_classes)
        model.__class__ = (self.dense_models if dense else self.models)[type(model)]

    def restore(self, model: nn.Module) -> None:
        """Give a patched model, its blocks and their attention their plain classes back."""
        for blk in self.layers(model):
            blk.__class__ = self.plain_block(type(blk))
            if self.attentions:
                blk.attn.__class__ = self.plain_attention(type(blk.attn))
        self._swap_others(model, {patched: plain for plain, patched in self.other_classes.items()})
        model.__class__ = self.plain_models()[type(model)]

    @staticmethod
    def _swap_others(model: nn.Module, classes: Dict[type, type]) -> None:
        for module in model.modules():
            if type(module) in classes:
                module.__class__ = classes[type(module)]

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

    @staticmethod
    def has_class_token(model: nn.Module) -> bool:
        return getattr(model, "cls_token", None) is not None

    @staticmethod
    def builds_class_token(args: BuildArgs) -> bool:
        """Whether a model built with args has a class token (a class without the argument always has one)."""
        return bool(args.arg("class_token", True))

    def build_args(self, entrypoint: Callable[[], nn.Module]) -> Optional[BuildArgs]:
        """What entrypoint() builds, if it is one of this family's model classes (build_args)."""
        return build_args(entrypoint, tuple(self.models))

    def lookahead_refusal(self, model: nn.Module) -> Optional[str]:
        """Why a method that reduces before attention (reusing its probabilities: MCTF) cannot serve model, or None:
        its reducing blocks need a _lookahead_branch and an attention of fused_qkv_attentions."""
        for i, blk in enumerate(model.blocks):
            patched = self.blocks.get(self.plain_block(type(blk)))
            if patched is None or patched._lookahead_branch is ReducingBlockMixin._lookahead_branch:
                return (f"blocks[{i}] is of class {type(blk).__name__}: the methods that reduce before attention "
                        f"(mctf) serve timm's VisionTransformer blocks, not those of its {self.name} family")
            if self.plain_attention(type(blk.attn)) not in self.fused_qkv_attentions:
                return (f"blocks[{i}].attn is of class {type(blk.attn).__name__}: the methods that reduce before "
                        f"attention (mctf) need timm's fused qkv Attention")
        return None

    def fold_qkv_refusal(self, model: nn.Module) -> Optional[str]:
        """Why prop_attn='fold_qkv' (attention.check_fold_qkv) cannot serve model's attention, or None where it can."""
        for i, blk in enumerate(model.blocks):
            if self.plain_attention(type(blk.attn)) not in self.fused_qkv_attentions:
                return (f"prop_attn='fold_qkv' pads timm's fused qkv Attention; blocks[{i}].attn is a "
                        f"{type(blk.attn).__name__}: use prop_attn='fold'")
            try:
                check_fold_qkv(blk.attn, f"blocks[{i}].attn")
            except ValueError as e:
                return str(e)
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

    def method_refusal(self, method: Type[TokenReducer]) -> Optional[str]:
        """Why this family cannot run a method (its class) on any of its models, or None."""
        return None

    def dense_refusal(self, model: nn.Module) -> Optional[str]:
        """Why the dense variant cannot serve this model, or None."""
        for i, blk in enumerate(model.blocks):
            if self.plain_block(type(blk)) not in self.dense_blocks:
                return (f"the dense methods do not serve blocks[{i}], a {type(blk).__name__} (served: "
                        f"{', '.join(c.__name__ for c in self.dense_blocks)})")
        return None


def vit_block_refusal(args: BuildArgs) -> Optional[str]:
    """Why timm's VisionTransformer (and NaFlexVit) blocks built with args are not served: blocks or attention of a
    class the family does not serve (parallel, post-norm or differential ones); None where they are."""
    block = args.arg("block_fn", Block)
    if block is not Block:
        return (f"blocks of class {block.__name__}, which timm_tokcomp does not serve (in timm's VisionTransformer: "
                f"Block)")
    attn = args.arg("attn_layer", Attention)
    attn = ATTN_LAYERS.get(attn, attn) if isinstance(attn, str) else attn
    if attn is not Attention:
        name = getattr(attn, "__name__", repr(attn))
        return f"attention of class {name}, which timm_tokcomp does not serve (in timm's VisionTransformer: Attention)"
    return None


def eva_skips_qkv_module(model: nn.Module) -> bool:
    """Whether the model's forward skips a qkv adapter (Family.plain_skips_qkv_module): timm's EvaAttention with a
    fused qkv and q / v biases calls F.linear on qkv.weight, not the qkv module."""
    return any(getattr(blk.attn, "qkv", None) is not None and getattr(blk.attn, "q_bias", None) is not None
               and not blk.attn.qkv_bias_separate for blk in model.blocks)


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

