"""Base classes of the token-reduction methods: common parameters, the per-block settings, and the hooks the
reducing loop (timm_tokcomp.runtime.loop) calls, the same for every method:

  settings = reducer.settings_for(L, N, num_prefix, cost, grid)    # once per shape: per-block settings (None: nothing)
  reducer.record_block(stats, x, size)                              # each block: what the stats keep
  metric = reducer.attention_metric(q, k, v, bias, scale, inputs)  # inside attention of an active block (metric())
  metric = reducer.branch_metric(attn_out, mlp_out)                # instead, for a method that reads_branches
  plan = reducer.plan(reducer.plan_input(metric, x), settings[l], num_prefix, size)  # None: no reduction
  x, size, source = plan.apply(x, size, source)                    # the plan carries itself out (plans/)

at the place in the block reducer.reduces_at names. A method with fused kernels (ToMe, EViT, ATM with kernel='triton')
plans and reduces in one reducer.reduce_fused call where it can; one that reduces before attention (MCTF) does both in
lookahead(). A step of its own (a training step, a learned merge) is a plan kind with its own apply, in its file."""
import warnings
import weakref
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from ..plans import Plan
from .schedules import BlockCost, resolve_r, solve_flops_schedule, stage_schedule
from .params import COMMON, SCHEDULE, bind, signature
from .places import ReducesAt
from .spec import SPEC_FIELDS, MethodSpec
from .tags import KEEP_TAG, R_TAG


def warn_if_compiling(method: str) -> None:
    """Say, under torch.compile, that a data-dependent method breaks the graph at its host-side count."""
    if torch.compiler.is_compiling():
        warnings.warn(f"{method} counts its tokens from the data (a host-side count per reducing block): the graph "
                      f"breaks there, correct but with little gain; fixed-count methods (tome, evit, topk, "
                      f"dense_tome, ...) compile as whole graphs", stacklevel=3)


def prop_attn_unless_avg_pool(self, global_pool: str) -> bool:
    """ToMe's default_prop_attn, shared by the merging methods: merged tokens weigh by size, except in avg pools."""
    return global_pool != "avg"


class TokenReducer(ABC):
    """The base of every method. Its parameters are declared once, in its spec (methods.spec): the constructor
    takes them (by position or name, TypeError for unknown or missing ones), checks each, keeps each as an
    attribute of its name, then validate() checks them together. Those every token-dropping method takes (COMMON):

    prop_attn: add log(token size) to the attention scores; None picks the method's default. True (or 'auto') uses
        the implementation measured fastest for the device (timm_tokcomp.measure.device_table; 'mask' where unmeasured);
        'mask', 'fold', 'fold_qkv' or 'flex' name one (timm_tokcomp.ops.attention; all give the same result).
    trace_source: keep a (B, N, N0) map of the original patches each token holds.
    prefix_only_last_block: in the last block keep only the prefix tokens after attention, so its MLP
        runs on those alone. Exact when the head reads only the class (and distillation) token
        (global_pool='token'); refused otherwise. None picks the method's default, which applies it
        only where it is exact.
    rope_merge: on a model with rotary position embeddings (timm's Eva class), the rope of a merged token: 'dst'
        (default) its destination token's, 'centroid' the size-weighted centroid of its patches' grid coordinates,
        its sin / cos recomputed from the rope module's frequencies. Pruned and kept tokens keep their own; a token
        with no destination (a cluster, a soft mix, EViT's fused token) sits at its centroid either way. Ignored on
        models without rope.
    """

    spec: ClassVar[MethodSpec] = MethodSpec()  # what the method is (methods.spec); the class holds what it does
    name: ClassVar[str] = ""  # spec.name, set from the spec
    # what a method without one of the COMMON parameters behaves as
    prop_attn: Union[bool, str, None] = None
    trace_source: bool = False
    prefix_only_last_block: Optional[bool] = None
    rope_merge: str = "dst"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = sorted(name for name in SPEC_FIELDS.intersection(vars(cls))
                          if not isinstance(vars(cls)[name], property))  # a property is a hook (PYRA's compiling)
        if declared:  # a trait set on the class would be read nowhere: it belongs in the spec
            base = next(b for b in cls.__mro__[1:] if "spec" in vars(b))
            raise TypeError(f"{cls.__qualname__} sets {', '.join(declared)} on the class: declare them in its spec, "
                            f"spec = {base.__name__}.spec.but({declared[-1].lower()}=...)")
        cls.name = cls.spec.name
        cls.__signature__ = signature(cls.spec.params)  # what help() and inspect.signature show

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, value in bind(self.name, self.spec.params, args, kwargs).items():
            setattr(self, name, value)
        self.validate()
        # block_settings' results per model shape. Made here, not lazily inside a forward: on torch 2.8 a cache made
        # while dynamo traces turns a second model's settings into symbolic ints, and compiling it never ends.
        self._settings: Dict[Any, list] = {}

    def validate(self) -> None:
        """Check the parameters together (each was checked alone); raise ValueError naming them."""
        if self.spec.masks_by_size and self.prop_attn is False:
            raise ValueError(f"prop_attn must stay on for {self.name}: its padding tokens (size 0) are kept out of "
                             f"attention by the log-size bias")

    @classmethod
    def has_kernel_choice(cls) -> bool:
        """Whether the method takes `kernel` (a fused Triton path beside the torch one)."""
        return "kernel" in cls.param_names()

    @classmethod
    def exportable(cls) -> bool:
        return cls.spec.export_refusal is None

    @classmethod
    def param_names(cls) -> Tuple[str, ...]:
        """Names of the method's parameters (what apply / set_params accept), in order."""
        return tuple(param.name for param in cls.spec.params)

    @classmethod
    def resolve_params(cls, model: nn.Module, params: Dict[str, Any]) -> Dict[str, Any]:
        """Fill model-dependent defaults into params before construction (e.g. ATM's per-model preset)."""
        return params

    @classmethod
    def update_params(cls, current: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
        """The parameters after set_params(**new) on a reducer with `current` parameters."""
        return {**current, **new}

    @classmethod
    def parse_tag(cls, tag: str) -> Optional[Dict[str, Any]]:
        """The parameters a name tag stands for, or None if the tag is not this method's (its spec's tag forms)."""
        return cls.spec.parse_tag(tag)

    @classmethod
    def tag_forms(cls) -> Tuple[str, ...]:
        """The tag forms parse_tag accepts, for error messages and help."""
        return cls.spec.tag_forms()

    @classmethod
    def tag_legend(cls) -> str:
        """What this method's own tag forms mean, for `tokcomp methods` ('' when the shared legend says it)."""
        return cls.spec.tag_legend

    @property
    def params(self) -> Dict[str, Any]:
        """The constructor arguments, for set_params and display."""
        return {name: getattr(self, name) for name in self.param_names()}

    def params_for_update(self, new: Dict[str, Any]) -> Dict[str, Any]:
        """What set_params(**new) starts from: the current parameters."""
        return self.params

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if v is not None)
        return f"{type(self).__name__}({shown})"

    # The hooks the reducing loop (timm_tokcomp.runtime.loop) calls; a method overrides those where it differs.
    @property
    def reduces_at(self) -> ReducesAt:
        """Where this reducer's blocks reduce: its spec's place (a method whose parameters decide overrides it)."""
        return self.spec.place

    @property
    def compiles_by_region(self) -> bool:
        """Whether torch.compile traces its block once (its spec's; a method whose parameters decide overrides it)."""
        return self.spec.compiles_by_region

    def settings_for(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost,
                     grid: Tuple[int, int]) -> List[Any]:
        """block_settings for a forward whose patch tokens lie on grid (rows, cols) (GridSettings reads it)."""
        return self.block_settings(num_blocks, num_tokens, num_prefix, cost)

    def attention_metric(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: Optional[torch.Tensor],
                         scale: float, inputs: torch.Tensor) -> torch.Tensor:
        """What the plan reads from a reducing block's attention: q, k, v (B, H, N, d) as attention uses them,
        attn_bias (B, 1, 1, N) or None, inputs: the attention's input (B, N, C). metric() of q and k by default."""
        return self.metric(q, k, attn_bias, scale)

    def branch_metric(self, attn_out: torch.Tensor, mlp_out: Optional[torch.Tensor]) -> Any:
        """For a method that reads_branches (its attention then runs untouched): what plan() reads from a reducing
        block's branch outputs, what attention and MLP add to the residual stream, (B, N, C) each; mlp_out is None
        where the block reduces between them."""
        raise NotImplementedError(f"{self.name} reads attention (attention_metric), not the branch outputs")

    def plan_input(self, metric: Any, x: torch.Tensor) -> Any:
        """What plan() gets: the block's metric, by default; a method that plans on the block's tokens x (B, N, C)
        returns them (detached unless it learns through them)."""
        return metric

    def record_block(self, stats: Any, x: torch.Tensor, size: Optional[torch.Tensor]) -> None:
        """Note in stats (state.ReductionStats) what a block receives, x (B, N, C) with sizes (B, N, 1) or None:
        for a method that masks_by_size, the real tokens per image (size-0 padding (ATS) and tokens dropped in
        training (DynamicViT, size 1e-6) hold no patch)."""
        if self.spec.masks_by_size:
            real = x.shape[1] if size is None else (size[..., 0] >= 0.5).sum(dim=1)
            stats.real_tokens_per_block.append(real if torch.is_tensor(real) else torch.full((x.shape[0],), real))

    def keeps_prefix_only_last(self, exact: bool, why_not: str) -> bool:
        """Whether the last block keeps only the prefix tokens (prefix_only_last_block; None: the method's default
        where exact, i.e. the head reads only the class token). Asked for where not exact: ValueError with why_not."""
        if self.prefix_only_last_block is None:
            return exact and self.spec.default_prefix_only_last_block
        if self.prefix_only_last_block and not exact:
            raise ValueError(f"prefix_only_last_block=True needs a head that reads only the class token "
                             f"(global_pool='token' and a class token); {why_not}")
        return self.prefix_only_last_block

    def default_prop_attn(self, global_pool: str) -> bool:
        """Proportional attention default for a model with this global pool."""
        return False

    def check_depth(self, num_blocks: int) -> None:
        """Raise ValueError if per-block parameters do not match the model's depth."""

    @abstractmethod
    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[Any]:
        """What each block does, one entry per block, passed to plan(); None: the block reduces nothing
        (and its metric is not computed)."""

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """What the method reads inside attention. q, k: (B, H, N, d) after q/k norm; attn_bias: (B, 1, 1, N) or
        None. A method whose metric reads more (v, the attention's input) overrides attention_metric instead."""
        raise NotImplementedError(f"{self.name} defines neither metric nor attention_metric")

    @abstractmethod
    def plan(self, metric: torch.Tensor, setting: Any, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[Plan]:
        """The reduction of one block from its metric and setting (as settings_for gives it), or None for no
        reduction. size: (B, N, 1) merging sizes, None while every token has size 1."""

    def lookahead(self, x: torch.Tensor, probs: torch.Tensor, size: Optional[torch.Tensor],
                  source: Optional[torch.Tensor], setting: Any, num_prefix: int):
        """For reduces_at 'before_attention': the tokens x (B, N, C) entering the block and this block's attention
        probabilities probs (B, H, N, N) -> (x, probs (B, H, M, M), size, source) reduced, or None for no reduction."""
        raise NotImplementedError(f"{self.name} reduces between attention and MLP; it has no lookahead step")

    def reduce_fused(self, metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor],
                     source: Optional[torch.Tensor], setting: Any, num_prefix: int, positions: Optional[Any] = None
                     ) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[Any],
                                         Optional[torch.Tensor]]]:
        """plan() and its apply for one block in fused kernels -> (x, size, source, positions moved as the plan moves
        them (rope.TokenPositions or None), size.log() where the step wrote it, else None), or None where the method
        has none for these inputs (then plan() runs and its plan applies itself; a step that leaves the tokens as they
        are returns None too, so that plan() declines and the carried log size stays)."""
        return None

    def bind(self, dim: int, settings: List[Any], head_dim: int) -> None:
        """Called by patch before the model changes, with the model's width, the block settings for its default
        input and its attention's head width: a learned method creates its parameters here, or raises ValueError if
        given ones do not fit. Training-free methods have nothing to do."""

    def learned_module(self) -> Optional[nn.Module]:
        """The method's trainable parameters (patch attaches them as model.tokcomp[<name>], so they move, save
        and train with the model); None for a training-free method."""
        return None

    def method_loss(self) -> Optional[torch.Tensor]:
        """The method's own training loss from the last training forward (e.g. DynamicViT's ratio loss), already
        weighted, to add to the task loss; None if it has none. Reading it clears it."""
        return None

    # The learned-method protocol (LearnedParams implements it, spec.learned_class / learned_param name the module
    # class and the constructor argument): a training-free method learns nothing.
    def mark_made(self) -> None:
        """Called by patch after bind (LearnedParams marks parameters bind made, not given)."""

    @classmethod
    def learns(cls, params: Dict[str, Any]) -> bool:
        """Whether the method built from params has learned parameters that train (and a fine-tuning folder holds)."""
        return False

    @classmethod
    def trains_in_place(cls, params: Dict[str, Any]) -> bool:
        """Whether the method built from params, in training mode, keeps every token in place with soft sizes, which
        defines no rotary position for a merged token: not trained on rope models (see
        training.finetune.refuse_in_place_training)."""
        return False


class LearnedParams:
    """Mixin for a method with learned parameters: learned_class is their nn.Module class (with config() /
    from_config() for timm_tokcomp.methods.learned), learned_param the constructor argument that takes saved ones and
    the attribute that holds them (None until bind makes untrained ones)."""

    made: ClassVar["weakref.WeakSet[nn.Module]"] = weakref.WeakSet()  # modules bind made, not given: across set_params
    params: Dict[str, Any]

    def validate(self) -> None:
        """The learned parameters given are of learned_class (ValueError naming it otherwise)."""
        value = getattr(self, self.spec.learned_param)
        self._learned_given = value is not None and value not in LearnedParams.made  # given by the user
        if value is not None and type(value) is not self.spec.learned_class:
            raise ValueError(f"{self.spec.learned_param} must be {self.spec.learned_class.__name__} (e.g. from "
                             f"timm_tokcomp.methods.learned.load_learned), got {type(value).__name__}")
        super().validate()

    def learned_module(self) -> Optional[nn.Module]:
        return getattr(self, self.spec.learned_param)

    def block_weights(self, setting: Any) -> Optional[nn.Module]:
        """The learned module a reducing block with this setting runs (None: none of its own). A method with one per
        block keeps `weights` in its settings (a NamedTuple), filled by settings_for: the plan takes the module as an
        argument, whose parameters the compiler takes as inputs (one graph for every block), where a lookup by the
        block's number specialises the graph on it."""
        return None

    def settings_for(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: Any,
                     grid: Tuple[int, int]) -> List[Any]:
        """The reducer's settings, each with its block's learned module (block_weights) once bind has made them."""
        settings = super().settings_for(num_blocks, num_tokens, num_prefix, cost, grid)
        if self.learned_module() is None:
            return settings
        return [s._replace(weights=self.block_weights(s)) if hasattr(s, "weights") else s for s in settings]

    def mark_made(self) -> None:
        """Called after bind: learned parameters bind made (not given) are marked so (see params_for_update)."""
        module = self.learned_module()
        if module is not None and not self._learned_given:
            LearnedParams.made.add(module)

    @classmethod
    def learns(cls, params: Dict[str, Any]) -> bool:
        """Whether the method built from params has learned parameters (that train, and that a fine-tuning folder
        holds): no for a setting that fixes them (FPET without its adapter, a DiffRate schedule, LTMP thresholds)."""
        return True

    def params_for_update(self, new: Dict[str, Any]) -> Dict[str, Any]:
        """The current parameters; learned parameters that bind made (not given) are left out where the new setting
        fixes them (FPET without its adapter, LTMP thresholds, a DiffRate schedule), so they are made again from it
        rather than blamed as given. Made ones the setting still learns (perhaps trained since) are kept."""
        params = self.params
        if not self._learned_given and not self.learns({**params, **new, self.spec.learned_param: None}):
            params[self.spec.learned_param] = None
        return params

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.params.items()
                          if v is not None and k != self.spec.learned_param)
        module = self.learned_module()
        count = "none yet" if module is None else str(sum(p.numel() for p in module.parameters()))
        return f"{type(self).__name__}({shown}, parameters={count})"


class BlockSetting(NamedTuple):
    """A block a learned method may reduce, with the model's shape its MACs penalty needs (DiffRate, LTMP)."""

    block: int
    num_blocks: int
    num_patches: int
    num_prefix: int
    cost: BlockCost


class ScheduledReducer(TokenReducer):
    """A method with an r schedule: r tokens removed per block (int, per-block list, or (r, inflection)
    tuple), a schedule solved from flops_ratio (unreduced MACs / target MACs), or the "Which Tokens to
    Use?" protocol: keep_rate, with the patch tokens brought down to floor(P * keep_rate ** s) before the
    s-th of the blocks `stages` (1-based, default 4, 7, 10): at the end of the block before it, after its MLP,
    with that block's attention as the metric. Block settings are the per-block r. Tags:
    '<name>_r<k>' (r = k) and '<name>_k<pct>' (keep_rate = pct / 100)."""

    min_keep_rate: ClassVar[float] = 0.0  # the lowest keep_rate one stage can reach
    spec = TokenReducer.spec.but(params=(*SCHEDULE, *COMMON), tags=(R_TAG, KEEP_TAG))

    def validate(self) -> None:
        super().validate()
        given = [name for name, value in (("r", self.r != 0), ("flops_ratio", self.flops_ratio is not None),
                                          ("keep_rate", self.keep_rate is not None)) if value]
        if len(given) > 1:
            raise ValueError(f"give one of r, flops_ratio, keep_rate, not {' and '.join(given)}")
        if self.keep_rate is not None and self.keep_rate < self.min_keep_rate:
            raise ValueError(f"keep_rate must be in [{self.min_keep_rate}, 1] for {self.name} (it reduces at most "
                             f"{1 - self.min_keep_rate:.0%} of a block's tokens), got {self.keep_rate}")

    @property
    def reduces_at(self) -> ReducesAt:
        """The study (keep_rate) moves a method that reduces after attention to the end of the block before a stage."""
        study = self.keep_rate is not None and self.spec.place == ReducesAt.AFTER_ATTENTION
        return ReducesAt.AFTER_MLP if study else self.spec.place

    @classmethod
    def update_params(cls, current: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
        """Giving one of r, flops_ratio, keep_rate clears the other two."""
        merged = dict(current)
        if "r" in new or new.get("flops_ratio") is not None or new.get("keep_rate") is not None:
            merged.update(r=0, flops_ratio=None, keep_rate=None)
        merged.update(new)
        return merged

    def check_depth(self, num_blocks: int) -> None:
        if isinstance(self.r, list) and len(self.r) != num_blocks:
            raise ValueError(f"r as a per-block list needs one entry per block ({num_blocks}), got {len(self.r)}")
        if self.keep_rate is not None and self.stages[-1] > num_blocks:
            raise ValueError(f"stages must be blocks 2..{num_blocks} of this model, got {self.stages}")

    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[Optional[int]]:
        """Tokens each block should remove (before the per-block clamp); None where 0."""
        key = (num_blocks, num_tokens, num_prefix, cost)
        cache: Dict[Tuple[int, int, int, BlockCost], List[Optional[int]]] = self._settings
        if key not in cache:
            if self.flops_ratio is not None:
                sched = solve_flops_schedule(self.flops_ratio, num_blocks, num_tokens - num_prefix, num_prefix, cost)
            elif self.keep_rate is not None:
                sched = stage_schedule(self.keep_rate, self.stages, num_blocks, num_tokens - num_prefix)
            else:
                sched = resolve_r(self.r, num_blocks)
            cache[key] = [r if r > 0 else None for r in sched]
        return cache[key]


    def patch_counts(self, num_blocks: int, num_tokens: int, num_prefix: int,
                     cost: BlockCost) -> List[Optional[Tuple[int, int]]]:
        """Per block: None where the schedule reduces nothing, else (patch tokens in, patch tokens left), at
        least one left. For methods whose settings are counts rather than r (ATS, PatchMerger, DynamicViT)."""
        counts, n = [], num_tokens - num_prefix
        for r in ScheduledReducer.block_settings(self, num_blocks, num_tokens, num_prefix, cost):
            counts.append(None if r is None else (n, max(n - r, 1)))
            n = n if r is None else max(n - r, 1)
        return counts


class GridSettings:
    """Mixin for a method whose block settings read the patch grid (rows, cols) of the forward's input (FPET's
    checkerboard, the radial patterns): its block_settings takes grid=; its spec says reads_grid=True."""

    def settings_for(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost,
                     grid: Tuple[int, int]) -> List[Any]:
        return self.block_settings(num_blocks, num_tokens, num_prefix, cost, grid=grid)


class PlansOnTokens:
    """Mixin for a method whose plan() reads the block's tokens (B, N, C), detached, not a metric."""

    def plan_input(self, metric: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()
