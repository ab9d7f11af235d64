"""The only module that knows timm's internals: swaps a VisionTransformer's classes (model, Block,
Attention) for static subclasses that reduce tokens, and back. Parameters and buffers are never
touched, so state_dict keys and weights stay exactly those of the timm model."""
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from timm.layers import Attention, LayerScale
from timm.models._features import feature_take_indices
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary

from . import attention, kernels
from .device_table import measured
from .matching import gather_tokens, max_merges
from .methods.base import TokenReducer
from .ops import group_index, unmerge
from .schedules import BlockCost
from .state import ReductionStats


class ReducingAttention(Attention):
    """timm Attention that also returns the reducer's metric and takes an additive score bias."""

    def forward_reduce(
        self, x: torch.Tensor, attn_bias: Optional[torch.Tensor], reducer: Optional[TokenReducer],
        prop_impl: str = "mask",
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x: (B, N, C); attn_bias: (B, 1, 1, N) log sizes or None; prop_impl: how the bias enters SDPA
        (attention.PROP_ATTN_IMPLS, resolved). Returns (out (B, N, C_out), metric or None)."""
        B, N, C = x.shape
        attn_dim = getattr(self, "attn_dim", C)
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        dropout_p = self.attn_drop.p if self.training else 0.0
        d = self.head_dim
        if attn_bias is not None and self.fused_attn and prop_impl == "fold_qkv":
            q, k, v = attention.folded_qkv(self, x, attn_bias)  # (B, H, N, d') views of one padded copy
            attn_bias = attn_bias.to(q.dtype)
            metric = self._metric(reducer, q[..., :d], k[..., :d], v[..., :d], attn_bias, self.scale)
            x = attention.padded_attention(q, k, v, d, dropout_p, self.scale)
        else:
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, d).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            q, k = self.q_norm(q), self.k_norm(k)
            if attn_bias is not None:
                attn_bias = attn_bias.to(q.dtype)
            metric = self._metric(reducer, q, k, v, attn_bias, self.scale)
            if not self.fused_attn:
                q = q * self.scale
                attn = q @ k.transpose(-2, -1)
                if attn_bias is not None:
                    attn = attn + attn_bias
                attn = attn.softmax(dim=-1)
                attn = self.attn_drop(attn)
                x = attn @ v
            elif attn_bias is None or prop_impl == "mask" or (prop_impl == "flex" and not _flex_runs(q, dropout_p)):
                x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p)
            elif prop_impl == "flex":
                x = attention.flex_attention(q, k, v, attn_bias, self.scale)
            else:  # fold, and fold_qkv on the path that runs q / k norm
                x = attention.padded_attention(*attention.fold_qk(q, k, v, attn_bias, self.scale), d, dropout_p)

        x = x.transpose(1, 2).reshape(B, N, attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        x = self.proj_drop(x)
        return x, metric

    @staticmethod
    def _metric(reducer: Optional[TokenReducer], q, k, v, attn_bias, scale: float) -> Optional[torch.Tensor]:
        """The reducer's metric from q, k, v: (B, H, N, d), or None without a reducer."""
        if reducer is None:
            return None
        return reducer.metric(q, k, attn_bias, scale, v) if reducer.metric_reads_values else \
            reducer.metric(q, k, attn_bias, scale)


def _flex_runs(q: torch.Tensor, dropout_p: float) -> bool:
    """FlexAttention has no dropout, and no backward on the CPU: the float mask serves there."""
    return dropout_p == 0 and (q.is_cuda or not (torch.is_grad_enabled() and q.requires_grad))


class ReducingBlock(Block):
    """timm Block that reduces tokens between attention and MLP. Run only by the patched model."""

    def forward(self, x, attn_mask=None, is_causal=False):
        raise RuntimeError(
            "this Block is patched by timm_tokcomp and changes the token count; run it through the model's "
            "forward / forward_features, or call timm_tokcomp.remove(model) first"
        )

    def forward_reduce(
        self,
        x: torch.Tensor,
        size: Optional[torch.Tensor],
        source: Optional[torch.Tensor],
        setting: Any,
        reducer: TokenReducer,
        prop_attn: Union[bool, str],
        num_prefix: int,
        prefix_only: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """x: (B, N, C), size: (B, N, 1) or None, source: (B, N, N0) or None -> the same, N' <= N tokens.

        setting: the reducer's setting for this block (None: no reduction); prop_attn: False, or how the log-size
        bias enters attention (attention.PROP_ATTN_IMPLS, resolved); prefix_only: keep only
        the num_prefix leading tokens after attention (the last block of a class-token head). The reduction
        runs between attention and MLP, or after the MLP when reducer.reduce_after_mlp (the study protocol's
        'before the next block'); the metric is this block's either way."""
        attn_bias = size.log().view(x.shape[0], 1, 1, x.shape[1]) if prop_attn and size is not None else None
        active = setting is not None and not prefix_only
        h, metric = self.attn.forward_reduce(self.norm1(x), attn_bias, reducer if active else None, prop_attn or "mask")
        x = x + self.drop_path1(self.ls1(h))
        if prefix_only:
            x = x[:, :num_prefix]
            size = None if size is None else size[:, :num_prefix]
            source = None if source is None else source[:, :num_prefix]
        elif metric is not None and not reducer.reduce_after_mlp:
            x, size, source = self._reduce(x, size, source, metric, setting, reducer, num_prefix)
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        if metric is not None and reducer.reduce_after_mlp:
            x, size, source = self._reduce(x, size, source, metric, setting, reducer, num_prefix)
        return x, size, source

    @staticmethod
    def _reduce(x, size, source, metric, setting, reducer: TokenReducer, num_prefix: int):
        if reducer.plan_on_tokens:  # the block's tokens, detached unless the plan learns through them
            metric = x if reducer.plan_differentiable else x.detach()
        fused = reducer.reduce_fused(metric, x, size, source, setting, num_prefix)
        if fused is not None:
            return fused
        plan = reducer.plan(metric, setting, num_prefix, size)
        return (x, size, source) if plan is None else reducer.reduce(plan, x, size, source, setting)


class DenseBlock(Block):
    """timm Block for dense prediction: attention on all tokens, then k tokens merged before the MLP and
    unmerged after it, so the output has the input's shape (runs inside the unmodified model forward)."""

    _tokcomp_reducer: TokenReducer
    _tokcomp_setting: Any  # this block's reducer setting (None: plain block)
    _tokcomp_num_prefix: int

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        """x: (B, N, C) -> (B, N, C)."""
        _refuse_fx_tracing()
        if attn_mask is not None or is_causal:
            raise ValueError("attn_mask / is_causal are not supported by the dense token-merging blocks")
        reducer, setting, num_prefix = self._tokcomp_reducer, self._tokcomp_setting, self._tokcomp_num_prefix
        h, metric = self.attn.forward_reduce(self.norm1(x), None, reducer if setting is not None else None)
        x = x + self.drop_path1(self.ls1(h))
        groups = None if metric is None else self._groups(x, metric, reducer, setting, num_prefix)
        if groups is None:
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        group, num_groups, members = groups
        backend = kernels.resolve_backend(reducer.kernel, x)
        y = self.mlp(kernels.merge_normed(x, self.norm2, group, num_groups, backend, members))
        fusable_scale = isinstance(self.ls2, nn.Identity) or (isinstance(self.ls2, LayerScale) and not self.ls2.inplace)
        if fusable_scale and (isinstance(self.drop_path2, nn.Identity) or not self.training):
            gamma = self.ls2.gamma if isinstance(self.ls2, LayerScale) else None
            return kernels.unmerge_add(x, y, group, gamma, backend)
        return x + self.drop_path2(self.ls2(unmerge(y, group)))

    @staticmethod
    def _groups(x: torch.Tensor, metric: torch.Tensor, reducer: TokenReducer, setting: Any, num_prefix: int):
        """(group (B, N), number of groups, members for the merge kernel or None), or None when nothing merges.
        kernel='triton' matches and lists the groups in one launch (three on large images); otherwise torch plans,
        then indexes ('auto' too: its matching in fp32 CUDA-core dots is not yet timed against torch's)."""
        if reducer.kernel == "triton" and kernels.use_triton(reducer.kernel, x):
            r = min(setting, max_merges(x.shape[1], num_prefix))
            if r <= 0:
                return None
            group, *members = kernels.tome_groups(metric, r, num_prefix)
            return group, x.shape[1] - r, tuple(members)
        plan = reducer.plan(metric, setting, num_prefix, None)
        return None if plan is None else (*group_index(plan, x.shape[1]), None)


class _DenseViT:
    """Marks a model whose blocks are DenseBlocks; the timm forward (features, intermediates, any
    input size) is unchanged."""

    _tokcomp_reducer: TokenReducer

    def __prepare_scriptable__(self):
        raise RuntimeError(_NOT_SCRIPTABLE)


class DenseVisionTransformer(_DenseViT, VisionTransformer):
    pass


class DenseVisionTransformerDistilled(_DenseViT, VisionTransformerDistilled):
    pass


_NOT_SCRIPTABLE = (
    "TorchScript is not supported on a timm_tokcomp model: its blocks call the method's Python objects (plans, "
    "schedules) that TorchScript cannot compile. Use torch.compile, or torch.export for a graph to deploy; "
    "or call timm_tokcomp.remove(model) first")
_NOT_FX_TRACEABLE = (
    "torch.fx symbolic tracing is not supported on a timm_tokcomp model: which tokens merge is decided from "
    "the data (sort / gather on the values) and the token count changes per block, which symbolic proxies "
    "cannot follow. Use torch.compile or torch.export (both trace with real shapes); for feature maps use "
    "features_only=True (feature_cls='getter') or forward_intermediates")


def _fx_symbolic_tracing_check():
    """The torch function telling whether torch.fx.symbolic_trace is running (not torch.export / compile)."""
    fx = torch.fx._symbolic_trace
    if hasattr(fx, "is_fx_symbolic_tracing"):  # torch >= 2.9
        return fx.is_fx_symbolic_tracing
    return lambda: fx.is_fx_tracing() and not torch.compiler.is_compiling()


_is_fx_symbolic_tracing = _fx_symbolic_tracing_check()


def _refuse_fx_tracing() -> None:
    if _is_fx_symbolic_tracing():
        raise RuntimeError(_NOT_FX_TRACEABLE)


def _resolve_prop_attn(prop_attn: Union[bool, str], x: torch.Tensor) -> Union[bool, str]:
    """False, or the implementation that runs on x's device and precision ('auto': the measured table's, else
    'mask')."""
    if prop_attn != "auto":
        return prop_attn
    return measured("prop_attn", x) or "mask"


def _prefix_only_last(model: nn.Module, reducer: TokenReducer) -> bool:
    """Whether the last block keeps only the prefix tokens (see TokenReducer.prefix_only_last_block).
    Checked at every forward: the head may have been reset since the method was applied."""
    exact = model.global_pool == "token" and model.num_prefix_tokens > 0
    if reducer.prefix_only_last_block is None:
        return exact and reducer.default_prefix_only_last_block
    if reducer.prefix_only_last_block and not exact:
        raise ValueError(
            "prefix_only_last_block=True needs a head that reads only the class token (global_pool='token' "
            f"and a class token); this model has global_pool={model.global_pool!r} and "
            f"{model.num_prefix_tokens} prefix tokens"
        )
    return reducer.prefix_only_last_block


class _ReducingViT:
    """Mixin over timm's VisionTransformer (and its distilled variant) running the reducing blocks."""

    _tokcomp_reducer: TokenReducer
    _tokcomp_prop_attn: Union[bool, str]  # False, or the implementation ('auto' or one of PROP_ATTN_IMPLS)
    _tokcomp_block_cost: BlockCost
    _tokcomp_pool_stats: Optional[ReductionStats]  # compiled forward only: this call's stats while its head runs
    _tokcomp_depth: int  # blocks the schedule is laid over (see model_depth)

    # Per-call state (token sizes, stats, source maps) is never kept where another call of the same model could
    # read it: it travels with the call's own feature tensor (_register_features), so calls from several threads
    # at once each pool with their own sizes. Under torch.compile the head reads it from a module attribute that
    # dynamo traces as a value of this call's graph.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) -> logits; the head pools with this call's token sizes."""
        x, stats = self._features(x)
        if not torch.compiler.is_compiling():
            return self.forward_head(self._register_features(x, stats))
        self._tokcomp_pool_stats = stats
        try:
            return self.forward_head(x)
        finally:
            self._tokcomp_pool_stats = None

    def forward_features(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        """x: (B, 3, H, W) -> (B, N', C) with N' <= N tokens (prefix tokens first). The token sizes travel
        with the returned tensor: forward_head / pool on it use them, whatever ran in between."""
        if attn_mask is not None or is_causal:
            raise ValueError("attn_mask / is_causal are not supported while tokens are reduced (token count changes)")
        return self._register_features(*self._features(x))

    def _features(self, x: torch.Tensor) -> Tuple[torch.Tensor, ReductionStats]:
        x, stats = self._reduce_blocks(self._embed(x))
        return self.norm(x), stats

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, H, W) -> (B, N, C) tokens entering the first block, as timm's forward_features makes them."""
        return self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))

    def _reduce_blocks(self, x: torch.Tensor, for_intermediates: bool = False, num_blocks: Optional[int] = None,
                       on_block: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None,
                       final: bool = True) -> Tuple[torch.Tensor, ReductionStats]:
        """x: (B, N, C) -> (B, N', C) through the first num_blocks blocks (all: None), with this call's stats.
        for_intermediates: trace the source map; on_block(i, x, source) sees each block's output, every token of
        it. final: the returned tokens are the final features, computed as forward_features computes them (a last
        block that keeps only the prefix tokens runs its MLP on those alone; for on_block it runs once more on
        every token); False: every block keeps its tokens to the end."""
        _refuse_fx_tracing()
        reducer, num_prefix = self._tokcomp_reducer, self.num_prefix_tokens
        settings = reducer.block_settings(self._tokcomp_depth, x.shape[1], num_prefix, self._tokcomp_block_cost)
        prefix_only_last = _prefix_only_last(self, reducer) and final
        size = None
        source = None
        if reducer.trace_source or for_intermediates:
            source = torch.eye(x.shape[1], device=x.device, dtype=x.dtype).expand(x.shape[0], -1, -1)
        prop_attn = _resolve_prop_attn(self._tokcomp_prop_attn, x)
        stats = ReductionStats(num_prefix=num_prefix)
        use_checkpoint = self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_scripting()
        last = self._tokcomp_depth - 1
        blocks = self.blocks if num_blocks is None else self.blocks[:num_blocks]
        for i, (blk, setting) in enumerate(zip(blocks, settings)):
            stats.tokens_per_block.append(x.shape[1])
            if reducer.masks_by_size:
                # size-0 padding (ATS) and tokens dropped in training (DynamicViT, size 1e-6) hold no patch
                real = x.shape[1] if size is None else (size[..., 0] >= 0.5).sum(dim=1)
                stats.real_tokens_per_block.append(real if torch.is_tensor(real) else torch.full((x.shape[0],), real))
            args = (x, size, source, setting, reducer, prop_attn, num_prefix)

            def run(prefix_only: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
                if use_checkpoint:
                    return checkpoint(blk.forward_reduce, *args, prefix_only, use_reentrant=False)
                return blk.forward_reduce(*args, prefix_only)

            prefix_only = prefix_only_last and i == last
            if on_block is not None and prefix_only:
                every, _, every_source = run(False)
                on_block(i, every, every_source)
            x, size, source = run(prefix_only)
            if on_block is not None and not prefix_only:
                on_block(i, x, source)
        stats.tokens_out = x.shape[1]
        stats.size = None if size is None else size.detach()
        stats.source = source.detach() if reducer.trace_source else None
        _remember_last(self, stats)
        return x, stats

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
        """Like timm's pool, but 'avg' / 'avgmax' weight each token by its size: the sizes of the
        forward_features call that returned x (or of the running forward)."""
        pool_type = self.global_pool if pool_type is None else pool_type
        if pool_type not in ("avg", "avgmax"):
            return super().pool(x, pool_type)
        size = self._token_sizes(x)
        if size is None:
            return super().pool(x, pool_type)
        start = 0 if getattr(self, "pool_include_prefix", False) else self.num_prefix_tokens
        xs, s = x[:, start:], size[:, start:].to(x.dtype)
        mean = (xs * s).sum(dim=1) / s.sum(dim=1)
        return mean if pool_type == "avg" else 0.5 * (xs.amax(dim=1) + mean)

    def _token_sizes(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, N, 1) sizes of the tokens x: (B, N, C); None when every token has size 1."""
        stats = self._tokcomp_pool_stats  # set while forward() runs its head
        if stats is None:
            stats = _feature_stats(self).get(x)
        if stats is not None:
            size = stats.size
        elif x.shape[1] == self.patch_embed.num_patches + self.num_prefix_tokens:
            return None  # nothing was reduced: every token stands for one patch
        else:
            raise RuntimeError(
                f"pool got {x.shape[1]} reduced tokens that are not a tensor returned by forward_features, so their "
                "sizes are unknown; pass forward_features' output itself (not a copy) to forward_head / pool")
        if size is not None and size.shape[:2] != x.shape[:2]:
            raise RuntimeError(f"pool got tokens {tuple(x.shape[:2])} whose sizes are {tuple(size.shape[:2])}")
        return size

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ):
        """timm's forward_intermediates (same arguments and return forms) on the full patch grid: each chosen
        block's output tokens are mapped back through the source map, so every patch position carries the
        features of the token that holds it after that block (a merged token at every patch it holds; a
        patch EViT pruned, the fused token that absorbed it; a patch a dropping pruner removed (Top-K, ATS,
        radial): zeros). Prefix tokens are never reduced. Intermediates:
        (B, C, H, W) for 'NCHW', (B, H * W, C) for 'NLC'; the final features are the reduced tokens
        (B, N', C), as forward_features returns them (only the prefix tokens where its last block keeps only those),
        with every block keeping its tokens to the end."""
        if attn_mask is not None or is_causal:
            raise ValueError("attn_mask / is_causal are not supported while tokens are reduced (token count changes)")
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B, _, height, width = x.shape
        x = self._embed(x)
        grids: List[torch.Tensor] = []

        def on_block(i: int, tokens: torch.Tensor, source: torch.Tensor) -> None:
            if i in take_indices:
                holder = source.argmax(dim=1)  # (B, N0): the token holding each original position
                held = source.sum(dim=1).unsqueeze(-1)  # (B, N0, 1): 0 where a dropping pruner removed the patch
                grids.append(gather_tokens(self.norm(tokens) if norm else tokens, holder) * held)

        x, stats = self._reduce_blocks(x, for_intermediates=True, num_blocks=max_index + 1 if stop_early else None,
                                       on_block=on_block, final=not intermediates_only)
        p = self.num_prefix_tokens
        prefix = [g[:, :p] for g in grids] if p else None
        spatial = [g[:, p:] for g in grids]
        if output_fmt == "NCHW":
            H, W = self.patch_embed.dynamic_feat_size((height, width))
            spatial = [g.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for g in spatial]
        final = None if intermediates_only else self._register_features(self.norm(x), stats)
        if output_dict:
            out: Dict[str, Any] = {"image_intermediates": spatial}
            if prefix is not None and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if final is not None:
                out["image_features"] = final
            return out
        if return_prefix_tokens and prefix is not None:
            spatial = list(zip(spatial, prefix))
        return spatial if intermediates_only else (final, spatial)

    def _register_features(self, x: torch.Tensor, stats: ReductionStats) -> torch.Tensor:
        """Remember the stats of the call that made x: (B, N', C), so that pool / forward_head on x use its sizes."""
        _feature_stats(self)[x] = stats
        return x

    def __prepare_scriptable__(self):
        raise RuntimeError(_NOT_SCRIPTABLE)


class ReducingVisionTransformer(_ReducingViT, VisionTransformer):
    pass


class ReducingVisionTransformerDistilled(_ReducingViT, VisionTransformerDistilled):
    pass


_MODEL_CLASSES: Dict[type, type] = {
    VisionTransformer: ReducingVisionTransformer,
    VisionTransformerDistilled: ReducingVisionTransformerDistilled,
}
_DENSE_CLASSES: Dict[type, type] = {
    VisionTransformer: DenseVisionTransformer,
    VisionTransformerDistilled: DenseVisionTransformerDistilled,
}
_ORIGINAL = {patched: plain for classes in (_MODEL_CLASSES, _DENSE_CLASSES) for plain, patched in classes.items()}
_ATTRS = ("_tokcomp_reducer", "_tokcomp_prop_attn", "_tokcomp_block_cost", "_tokcomp_pool_stats", "_tokcomp_depth")
_BLOCK_ATTRS = ("_tokcomp_reducer", "_tokcomp_setting", "_tokcomp_num_prefix")
# model -> (forward_features output -> the stats of the call that returned it); outside the model, so that
# pickling and deepcopy never meet the weak references, and both die with what they describe
_FEATURE_STATS: "weakref.WeakKeyDictionary[nn.Module, WeakIdKeyDictionary]" = weakref.WeakKeyDictionary()


_FEATURE_STATS_LOCK = threading.Lock()
# each thread's last forward per model (last_stats): a call never sees the stats of another thread's call
_LAST_STATS = threading.local()


def _feature_stats(model: nn.Module) -> WeakIdKeyDictionary:
    with _FEATURE_STATS_LOCK:  # two threads' first calls must not each make a registry and lose one
        if model not in _FEATURE_STATS:
            _FEATURE_STATS[model] = WeakIdKeyDictionary()
        return _FEATURE_STATS[model]


def _remember_last(model: nn.Module, stats: ReductionStats) -> None:
    """Keep stats as this thread's last forward of model (eager calls: a compiled graph keeps no Python state)."""
    if torch.compiler.is_compiling():
        return
    if not hasattr(_LAST_STATS, "by_model"):
        _LAST_STATS.by_model = weakref.WeakKeyDictionary()
    _LAST_STATS.by_model[model] = stats


def _linear_macs(module: nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def _block_cost(block: Block) -> BlockCost:
    return BlockCost(
        attn_linear=_linear_macs(block.attn),
        attn_dim=block.attn.qkv.out_features // 3,
        mlp_linear=_linear_macs(block.mlp),
    )


def is_patched(model: nn.Module) -> bool:
    return type(model) in _ORIGINAL


def check_supported(model: nn.Module) -> None:
    """Raise TypeError / ValueError explaining why the model cannot be reduced; return if it can."""
    if type(model) not in _MODEL_CLASSES and not is_patched(model):
        served = "timm_tokcomp reduces tokens in timm's VisionTransformer and VisionTransformerDistilled classes"
        if hasattr(model, "feature_info") and isinstance(getattr(model, "model", None), tuple(_MODEL_CLASSES)):
            raise TypeError(f"{served}; this is timm's features_only wrapper {type(model).__name__} around one: pass "
                            f"the method in the name instead, e.g. timm.create_model('vit_small_patch16_224."
                            f"dense_tome_r8', features_only=True)")
        raise TypeError(f"{served}, got {type(model).__name__} from {type(model).__module__}, which it does not "
                        f"serve yet")
    for i, blk in enumerate(model.blocks):
        if type(blk) not in (Block, ReducingBlock, DenseBlock):
            raise TypeError(f"blocks[{i}] is a {type(blk).__name__}; only timm's plain Block is supported")
        if type(blk.attn) not in (Attention, ReducingAttention):
            raise TypeError(
                f"blocks[{i}].attn is a {type(blk.attn).__name__}; only timm.layers.Attention is supported "
                "(RoPE and other attention variants are not)"
            )
    if getattr(model, "attn_pool", None) is not None:
        raise TypeError("attention-pooling heads (global_pool='map') are not supported with token reduction")


def model_depth(model: nn.Module) -> int:
    """The blocks a method's schedule is laid over: the model's blocks, or, for a model timm pruned to its
    first blocks (prune_intermediate_layers, as features_only does) before or after the method was applied,
    the depth it was built with (model._tokcomp_depth), so each kept block does what it does in the full model."""
    depth = model.__dict__.get("_tokcomp_depth")
    return len(model.blocks) if depth is None else depth


def patch(model: nn.Module, reducer: TokenReducer) -> None:
    """Make `model` reduce tokens with `reducer` (or switch the reducer of a patched model)."""
    check_supported(model)
    depth = model_depth(model)
    reducer.check_depth(depth)
    if reducer.dense:
        _patch_dense(model, reducer)
        return
    if reducer.needs_class_token and getattr(model, "cls_token", None) is None:
        raise ValueError(f"{reducer.name} ranks tokens by class-token attention and needs a model with a class token")
    _prefix_only_last(model, reducer)  # raises if asked for where it is not exact
    block_cost = _block_cost(model.blocks[0])
    # settings for the model's default input: a budget out of reach (flops_ratio) fails here, not in a forward
    settings = reducer.block_settings(depth, model.patch_embed.num_patches + model.num_prefix_tokens,
                                      model.num_prefix_tokens, block_cost)
    reducer.bind(model.embed_dim, settings)  # a learned method's parameters are made or checked here
    prop_attn = reducer.prop_attn if reducer.prop_attn is not None else reducer.default_prop_attn(model.global_pool)
    prop_attn = "auto" if prop_attn is True else prop_attn  # on: the implementation measured for the device
    if prop_attn == "fold_qkv":
        for i, blk in enumerate(model.blocks):
            attention.check_fold_qkv(blk.attn, f"blocks[{i}].attn")
    _swap_classes(model, ReducingBlock, _MODEL_CLASSES)
    model._tokcomp_reducer = reducer
    model._tokcomp_prop_attn = prop_attn
    model._tokcomp_block_cost = block_cost
    model._tokcomp_depth = depth
    model._tokcomp_pool_stats = None
    getattr(_LAST_STATS, "by_model", {}).pop(model, None)
    _attach_learned(model, reducer.learned_module(), reducer.name)


LEARNED_KEY = "tokcomp"  # a learned method's parameters: model.tokcomp[<method>], state_dict keys 'tokcomp.<method>.*'


def _attach_learned(model: nn.Module, module: Optional[nn.Module], method: str) -> None:
    """Put the method's parameters (or none) under model.tokcomp, on the model's device and dtype, in the model's
    train / eval mode."""
    model._modules.pop(LEARNED_KEY, None)
    if module is not None:
        ref = next(model.parameters(), None)
        if ref is not None:
            module.to(device=ref.device, dtype=ref.dtype)
        model.add_module(LEARNED_KEY, nn.ModuleDict({method: module}).train(model.training))


def _swap_classes(model: nn.Module, block_class: type, model_classes: Dict[type, type]) -> None:
    """Give the model, its blocks and their attention the patched classes of one kind (token-reducing
    or dense), first restoring the plain classes if it is patched with the other kind."""
    if is_patched(model) and type(model) not in model_classes.values():
        unpatch(model)
    if not is_patched(model):
        for blk in model.blocks:
            blk.__class__ = block_class
            blk.attn.__class__ = ReducingAttention
        model.__class__ = model_classes[type(model)]


def _patch_dense(model: nn.Module, reducer: TokenReducer) -> None:
    # a dense method's settings may not depend on the token count: any input size runs the same blocks
    num_prefix = model.num_prefix_tokens
    settings = reducer.block_settings(len(model.blocks), model.patch_embed.num_patches + num_prefix, num_prefix,
                                      _block_cost(model.blocks[0]))
    _swap_classes(model, DenseBlock, _DENSE_CLASSES)
    for blk, setting in zip(model.blocks, settings):
        blk._tokcomp_reducer = reducer
        blk._tokcomp_setting = setting
        blk._tokcomp_num_prefix = num_prefix
    model._tokcomp_reducer = reducer
    getattr(_LAST_STATS, "by_model", {}).pop(model, None)


def unpatch(model: nn.Module) -> None:
    """Restore the plain timm classes. Raises ValueError if the model is not patched."""
    if not is_patched(model):
        raise ValueError("model is not patched by timm_tokcomp")
    for blk in model.blocks:
        blk.__class__ = Block
        blk.attn.__class__ = Attention
        for name in _BLOCK_ATTRS:
            blk.__dict__.pop(name, None)
    model.__class__ = _ORIGINAL[type(model)]
    for name in _ATTRS:
        model.__dict__.pop(name, None)
    model._modules.pop(LEARNED_KEY, None)


def trace_blocks(model: nn.Module, x: torch.Tensor,
                 on_block: Callable[[int, torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """Run a token-reducing model's features on x: (B, 3, H, W) with the source map traced, calling
    on_block(i, tokens (B, N_i, C), source (B, N_i, N0)) after every block i. Returns what forward_features
    returns (B, N', C), registered so that forward_head / pool on it use its token sizes."""
    reducer_of(model)  # raises if not patched
    if model._tokcomp_reducer.dense:
        raise ValueError("dense methods keep every token (nothing to trace); trace a token-reducing method")
    tokens, stats = model._reduce_blocks(model._embed(x), for_intermediates=True, on_block=on_block)
    return model._register_features(model.norm(tokens), stats)


def reducer_of(model: nn.Module) -> TokenReducer:
    if not is_patched(model):
        raise ValueError("model is not patched by timm_tokcomp; call timm_tokcomp.apply first")
    return model._tokcomp_reducer


def stats_of(model: nn.Module, features: Optional[torch.Tensor] = None) -> Optional[ReductionStats]:
    """The stats of this thread's last eager forward of the model, or of the forward_features call that returned
    `features`."""
    reducer_of(model)  # raises if not patched
    if features is None:
        return getattr(_LAST_STATS, "by_model", {}).get(model)
    known = _feature_stats(model)
    if features not in known:
        raise ValueError("features is not a tensor returned by this model's forward_features")
    return known[features]
