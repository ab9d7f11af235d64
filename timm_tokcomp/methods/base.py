"""Base classes of the token-reduction methods: common parameters, the per-block settings, and the
two hooks a method implements (what metric it reads inside attention, and how it turns it into a plan).

A method is driven by the patched model in three steps per forward:
  settings = reducer.block_settings(L, N, num_prefix, cost)   # once: what each block does (None: nothing)
  metric = reducer.metric(q, k, ...)                           # inside attention of an active block
  plan = reducer.plan(metric, settings[l], num_prefix, size)   # after attention; None: no reduction
and then reducer.reduce(plan, x, size, source, setting) carries the plan out. A method with fused kernels
(ToMe, EViT, ATM with kernel='triton') does plan and reduce in one reducer.reduce_fused call where it can.
"""
import warnings
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from ..plans import ClusterPlan, Plan
from ..schedules import NAMED_SCHEDULES, BlockCost, resolve_r, solve_flops_schedule, stage_schedule
from .params import COMMON, SCHEDULE, Param, bind, kernel_choice, signature

def parse_r_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_r<k>' -> {'r': k}; None for any other tag."""
    digits = tag[len(name) + 2:]
    if tag.startswith(f"{name}_r") and digits.isdigit() and digits.isascii():
        return {"r": int(digits)}
    return None


def parse_keep_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_k<pct>' -> {'keep_rate': pct / 100} for pct in 1..100; None for any other tag."""
    digits = tag[len(name) + 2:]
    if tag.startswith(f"{name}_k") and digits.isdigit() and digits.isascii() and 1 <= int(digits) <= 100:
        return {"keep_rate": int(digits) / 100}
    return None


def parse_named_schedule_tag(name: str, tag: str) -> Optional[Dict[str, Any]]:
    """'<name>_low' / '<name>_high' -> {'r': that NAMED_SCHEDULES list}; None for any other tag."""
    schedule = tag[len(name) + 1:] if tag.startswith(f"{name}_") else None
    return {"r": list(NAMED_SCHEDULES[schedule])} if schedule in NAMED_SCHEDULES else None


def warn_if_compiling(method: str) -> None:
    """Say, under torch.compile, that a data-dependent method breaks the graph at its host-side count."""
    if torch.compiler.is_compiling():
        warnings.warn(f"{method} counts its tokens from the data (one host-side count per reducing block): under "
                      f"torch.compile the graph breaks there and each block's reduction runs between compiled "
                      f"pieces, correct but with little gain; fixed-count methods (tome, evit, topk, dense_tome, "
                      f"...) compile as whole graphs", stacklevel=3)


def prop_attn_unless_avg_pool(self, global_pool: str) -> bool:
    """ToMe's default_prop_attn, shared by the merging methods: merged tokens weigh by their size in attention,
    except in avg-pooled models."""
    return global_pool != "avg"


class TokenReducer(ABC):
    """The base of every method. Its parameters are declared once, as PARAMS (methods.params): the constructor
    takes them (by position or name, TypeError for unknown or missing ones), checks each, keeps each as an
    attribute of its name, then validate() checks them together. Those every token-dropping method takes (COMMON):

    prop_attn: add log(token size) to the attention scores; None picks the method's default. True (or 'auto') uses
        the implementation measured fastest for the device (timm_tokcomp.device_table; 'mask' where unmeasured);
        'mask', 'fold', 'fold_qkv' or 'flex' name one (timm_tokcomp.attention; all give the same result).
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

    name: ClassVar[str]
    default_prefix_only_last_block: ClassVar[bool] = False
    dense: ClassVar[bool] = False  # True: keeps every token (merge before the MLP, unmerge after)
    needs_class_token: ClassVar[bool] = False  # ranks tokens by the class token's attention
    plan_on_tokens: ClassVar[bool] = False  # plan() gets the block's tokens (B, N, C), not the metric
    plan_differentiable: ClassVar[bool] = False  # with plan_on_tokens: the tokens keep their gradient (a learned
    # soft assignment such as PatchMerger's); otherwise plan() sees them detached
    plan_reads_tokens: ClassVar[bool] = False  # plan() gets (metric, the block's tokens detached): it ranks by the
    # metric and matches on the tokens (DiffRate)
    reduce_after_mlp: bool = False  # reduce at the end of the block (after its MLP), not between attention and MLP
    reduces_before_attention: ClassVar[bool] = False  # reduce at the start of the block with lookahead(), from this
    # block's attention probabilities at the unreduced count, which are then merged and reused (MCTF)
    metric_reads_values: ClassVar[bool] = False  # metric() also gets v: (B, H, N, d)
    metric_reads_input: ClassVar[bool] = False  # metric() also gets inputs: the attention's input (B, N, C)
    masks_by_size: ClassVar[bool] = False  # pads images to one count with size-0 tokens (needs prop_attn)
    reads_grid: ClassVar[bool] = False  # block_settings also gets grid=(rows, cols): the patch tokens' grid, read
    # from the model and the input (FPET's checkerboard, the radial patterns)
    PARAMS: ClassVar[Tuple[Param, ...]] = COMMON
    # traits the commands read (bench, speed, tune, export, the registry, ToCom), declared beside the method
    data_dependent: ClassVar[bool] = False  # token counts read from the data (a host-side count per block):
    # eager only in speed / tune, no CUDA graph, no ONNX
    compiles_by_region: ClassVar[bool] = True  # torch.compile traces its block once, the token count and the
    # per-block settings symbolic (timm_tokcomp.compiling); False: its plan reads a per-block Python value (a
    # layer's module, a position list) that must stay constant, so the model compiles whole, with static shapes
    export_refusal: ClassVar[Optional[str]] = "it has not been checked against onnxruntime"  # None: exports to ONNX
    tocom_compatible: ClassVar[bool] = False  # ToCom compensators serve it (one integer r per block)
    listed_tags: ClassVar[Tuple[str, ...]] = ()  # tags timm.list_models(pretrained=True) shows on every served name
    tune_space: ClassVar[Tuple[Dict[str, Any], ...]] = ()  # its settings in `tokcomp tune`'s default space
    # what a method without one of the COMMON parameters behaves as
    prop_attn: Union[bool, str, None] = None
    trace_source: bool = False
    prefix_only_last_block: Optional[bool] = None
    rope_merge: str = "dst"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = signature(cls.PARAMS)  # what help() and inspect.signature show

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, value in bind(self.name, self.PARAMS, args, kwargs).items():
            setattr(self, name, value)
        self.validate()
        # block_settings' results per model shape. Made here, not lazily inside a forward: on torch 2.8 a cache made
        # while dynamo traces turns a second model's settings into symbolic ints, and compiling it never ends.
        self._settings: Dict[Any, list] = {}

    def validate(self) -> None:
        """Check the parameters together (each was checked alone); raise ValueError naming them."""
        if self.masks_by_size and self.prop_attn is False:
            raise ValueError(f"prop_attn must stay on for {self.name}: its padding tokens (size 0) are kept out of "
                             f"attention by the log-size bias")

    @classmethod
    def has_kernel_choice(cls) -> bool:
        """Whether the method takes `kernel` (a fused Triton path beside the torch one)."""
        return "kernel" in cls.param_names()

    @classmethod
    def exportable(cls) -> bool:
        return cls.export_refusal is None

    @classmethod
    def param_names(cls) -> Tuple[str, ...]:
        """Names of the method's parameters (what apply / set_params accept), in order."""
        return tuple(param.name for param in cls.PARAMS)

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
        """The parameters a name tag stands for, or None if the tag is not this method's."""
        return None

    @classmethod
    def tag_forms(cls) -> Tuple[str, ...]:
        """The tag forms parse_tag accepts, for error messages and help."""
        return ()

    @classmethod
    def tag_legend(cls) -> str:
        """What this method's own tag forms mean, for `tokcomp methods` ('' when the shared legend says it)."""
        return ""

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

    def default_prop_attn(self, global_pool: str) -> bool:
        """Proportional attention default for a model with this global pool."""
        return False

    def check_depth(self, num_blocks: int) -> None:
        """Raise ValueError if per-block parameters do not match the model's depth."""

    @abstractmethod
    def block_settings(self, num_blocks: int, num_tokens: int, num_prefix: int, cost: BlockCost) -> List[Any]:
        """What each block does, one entry per block, passed to plan(); None: the block reduces nothing
        (and its metric is not computed)."""

    @abstractmethod
    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """What the method reads inside attention. q, k: (B, H, N, d) after q/k norm;
        attn_bias: (B, 1, 1, N) or None."""

    @abstractmethod
    def plan(self, metric: torch.Tensor, setting: Any, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[Plan]:
        """The reduction of one block from its metric and setting, or None for no reduction.
        size: (B, N, 1) merging sizes, None while every token has size 1."""

    def reduce(self, plan: Plan, x: torch.Tensor, size: Optional[torch.Tensor], source: Optional[torch.Tensor],
               setting: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Carry out one block's plan on x: (B, N, C), size: (B, N, 1) or None, source: (B, N, N0) or None
        (the plan's own apply; a learned merge such as PYRA's overrides it)."""
        return plan.apply(x, size, source)

    def lookahead(self, x: torch.Tensor, probs: torch.Tensor, size: Optional[torch.Tensor],
                  source: Optional[torch.Tensor], setting: Any, num_prefix: int):
        """For reduces_before_attention: the tokens x (B, N, C) entering the block and this block's attention
        probabilities probs (B, H, N, N) -> (x, probs (B, H, M, M), size, source) reduced, or None for no reduction."""
        raise NotImplementedError(f"{self.name} reduces between attention and MLP; it has no lookahead step")

    def reduce_fused(self, metric: torch.Tensor, x: torch.Tensor, size: Optional[torch.Tensor],
                     source: Optional[torch.Tensor], setting: Any, num_prefix: int, positions: Optional[Any] = None
                     ) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[Any]]]:
        """plan() and reduce() of one block in fused kernels -> (x, size, source, positions moved as the plan moves
        them; rope.TokenPositions or None), or None where the method has none for these inputs (then plan() and
        reduce() run)."""
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


class LearnedParams:
    """Mixin for a method with learned parameters: learned_class is their nn.Module class (with config() /
    from_config() for timm_tokcomp.learned), learned_param the constructor argument that takes saved ones and
    the attribute that holds them (None until bind makes untrained ones)."""

    learned_class: ClassVar[type]
    learned_param: ClassVar[str]
    params: Dict[str, Any]

    def validate(self) -> None:
        """The learned parameters given are of learned_class (ValueError naming it otherwise)."""
        value = getattr(self, self.learned_param)
        # given by the user (else bind makes them; a made module stays marked so across set_params)
        self._learned_given = value is not None and not getattr(value, "_tokcomp_made", False)
        if value is not None and type(value) is not self.learned_class:
            raise ValueError(f"{self.learned_param} must be {self.learned_class.__name__} (e.g. from "
                             f"timm_tokcomp.learned.load_learned), got {type(value).__name__}")
        super().validate()

    def learned_module(self) -> Optional[nn.Module]:
        return getattr(self, self.learned_param)

    def mark_made(self) -> None:
        """Called after bind: learned parameters bind made (not given) are marked so (see params_for_update)."""
        module = self.learned_module()
        if module is not None and not self._learned_given:
            module._tokcomp_made = True

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
        if not self._learned_given and not self.learns({**params, **new, self.learned_param: None}):
            params[self.learned_param] = None
        return params

    @classmethod
    def trains_in_place(cls, params: Dict[str, Any]) -> bool:
        """Whether the method built from params, in training mode, keeps every token in place with soft sizes, which
        defines no rotary position for a merged token: not trained on rope models (see
        training.finetune.refuse_in_place_training)."""
        return False

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.params.items() if v is not None and k != self.learned_param)
        module = self.learned_module()
        count = "none yet" if module is None else str(sum(p.numel() for p in module.parameters()))
        return f"{type(self).__name__}({shown}, parameters={count})"


class RTagged:
    """Mixin for methods named by '<name>_r<k>' tags (r = k)."""

    name: ClassVar[str]

    @classmethod
    def parse_tag(cls, tag: str) -> Optional[Dict[str, Any]]:
        return parse_r_tag(cls.name, tag)

    @classmethod
    def tag_forms(cls) -> Tuple[str, ...]:
        return (f"{cls.name}_r<k>",)


class BlockSetting(NamedTuple):
    """A block a learned method may reduce, with the model's shape its MACs penalty needs (DiffRate, LTMP)."""

    block: int
    num_blocks: int
    num_patches: int
    num_prefix: int
    cost: BlockCost


class MacsTargetTagged:
    """Mixin for learned methods trained against a MACs target (DiffRate, LTMP), named '<name>' (its defaults) and
    '<name>_m<pct>' (macs_target = pct / 100, pct in 1..100)."""

    name: ClassVar[str]

    @classmethod
    def parse_tag(cls, tag: str) -> Optional[Dict[str, Any]]:
        if tag == cls.name:
            return {}
        digits = tag[len(cls.name) + 2:]
        if tag.startswith(f"{cls.name}_m") and digits.isdigit() and digits.isascii() and 1 <= int(digits) <= 100:
            return {"macs_target": int(digits) / 100}
        return None

    @classmethod
    def tag_forms(cls) -> Tuple[str, ...]:
        return (cls.name, f"{cls.name}_m<pct>")


class ScheduledReducer(RTagged, TokenReducer):
    """A method with an r schedule: r tokens removed per block (int, per-block list, or (r, inflection)
    tuple), a schedule solved from flops_ratio (unreduced MACs / target MACs), or the "Which Tokens to
    Use?" protocol: keep_rate, with the patch tokens brought down to floor(P * keep_rate ** s) before the
    s-th of the blocks `stages` (1-based, default 4, 7, 10): at the end of the block before it, after its MLP,
    with that block's attention as the metric. Block settings are the per-block r. Tags:
    '<name>_r<k>' (r = k) and '<name>_k<pct>' (keep_rate = pct / 100)."""

    min_keep_rate: ClassVar[float] = 0.0  # the lowest keep_rate one stage can reach
    PARAMS = (*SCHEDULE, *COMMON)

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
    def reduce_after_mlp(self) -> bool:  # type: ignore[override]
        """The study (keep_rate) reduces at the end of the block before each stage."""
        return self.keep_rate is not None

    @classmethod
    def parse_tag(cls, tag: str) -> Optional[Dict[str, Any]]:
        return parse_r_tag(cls.name, tag) or parse_keep_tag(cls.name, tag)

    @classmethod
    def tag_forms(cls) -> Tuple[str, ...]:
        return (f"{cls.name}_r<k>", f"{cls.name}_k<pct>")

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


class FusedScheduledReducer(ScheduledReducer):
    """A ScheduledReducer with fused Triton kernels for its reduction step (ToMe, EViT; see reduce_fused).
    kernel: 'auto' (default: Triton for CUDA tensors when no gradient is needed, unless the device table says
    torch), 'triton' or 'torch'. The Triton path serves inference outside torch.compile / export and without
    trace_source, and falls back to torch elsewhere under 'auto'. It is the default since an H200 timed it faster
    than the torch path for ToMe and EViT at every batch (1 to 256), eager and in CUDA graphs (docs/speed.md)."""

    PARAMS = (*SCHEDULE, *COMMON, kernel_choice("auto"))


class ClusterMerging(ScheduledReducer):
    """A method that merges each reducing block's patch tokens (the block's features, not a metric) into as
    many clusters as tokens stay; every cluster becomes its size-weighted mean. Subclasses give cluster()."""

    plan_on_tokens = True
    default_prop_attn = prop_attn_unless_avg_pool

    def metric(self, q: torch.Tensor, k: torch.Tensor, attn_bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        return k  # unused: the plan reads the tokens

    @abstractmethod
    def cluster(self, tokens: torch.Tensor, num_clusters: int) -> torch.Tensor:
        """tokens: (B, n, C) patch tokens -> (B, n) cluster index in [0, num_clusters), none empty."""

    def plan(self, tokens: torch.Tensor, r: int, num_prefix: int, size: Optional[torch.Tensor]) -> Optional[ClusterPlan]:
        n = tokens.shape[1] - num_prefix
        r = max(min(r, n - 1), 0)
        if r == 0:
            return None
        return ClusterPlan(num_prefix, self.cluster(tokens[:, num_prefix:], n - r), n - r)
