"""timm's NaFlexVit (SigLIP2 NaFlex, NaFlexViT, C-RADIO, and timm's ViT / EVA / DINOv3 built with use_naflex=True).
Its blocks are timm's Block or EvaBlock, reduced by the VisionTransformer and Eva adapters' classes; what this adapter
adds is its embedding and its two inputs:

- images (B, 3, H, W): one patch grid, the shared loop as for VisionTransformer / Eva (the model's forward, bit for
  bit, while nothing is reduced);
- NaFlex batches (patches (B, N, P*P*C) with patch_coord (B, N, 2) and patch_valid (B, N), or the collator's dict):
  each image's valid patches are its tokens, padding is never one. Images sharing a token count (and their grid,
  where the method's settings read it) run the shared loop together, each with its own rotary positions, with no
  padding, so every image reduces exactly as it would alone (one host read groups them); the outputs are padded
  back to one count with tokens of size 0, which pooling ignores, and the returned patch_valid marks the real
  ones."""
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from timm.layers import Attention
from timm.models._features import feature_take_indices
from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg, _overlay_kwargs, get_block_fn
from timm.models.vision_transformer import Block
from timm.layers.attention import AttentionRope
from torch import nn

from ..plans import gather_tokens
from ..runtime.loop import SIZED_POOLS, ReducingModel, spread_tokens
from ..runtime.handoff import compiled_whole, forward_by_region
from ..ops.rope import PATCH_DROP_REFUSAL, ROPE_CLASSES, TokenPositions, check_rope, grid_coords
from ..runtime.state import ReductionStats, remember_last
from .base import BuildArgs, Facade, Family, eva_skips_qkv_module, vit_block_refusal
from .eva import ReducingAttentionRope, ReducingEvaAttention, ReducingEvaBlock, ReducingEvaBlockPostNorm
from .vit import ReducingAttention, ReducingBlock


@dataclass(frozen=True)
class EmbedsGrid:
    """timm's patch_embed facts of a NaFlexEmbeds: its default patch grid (its learned position table's, or its
    default image size's) and the grid of an image size."""

    embeds: nn.Module

    @property
    def grid_size(self) -> Tuple[int, int]:
        return tuple(self.embeds.pos_embed_grid_size)

    @property
    def num_patches(self) -> int:
        rows, cols = self.grid_size
        return rows * cols

    def dynamic_feat_size(self, image_size: Tuple[int, int]) -> Tuple[int, int]:
        return tuple(self.embeds.dynamic_feat_size(tuple(image_size)))


class GroupRun(NamedTuple):
    """One group of a NaFlex batch through the blocks: members its images' batch indices (host), images the same
    (k,) on the device, columns (k, p + n) the positions of its tokens (prefix, then valid patches) in the padded
    input, x (k, N', C) the normed output, stats its ReductionStats."""

    members: List[int]
    images: torch.Tensor
    columns: torch.Tensor
    x: torch.Tensor
    stats: ReductionStats


class Group(NamedTuple):
    """Images of a NaFlex batch that run the blocks together: their batch indices, their valid count n, and each
    one's patch grid (rows, cols), spanning its valid patches' coordinates."""

    images: List[int]
    n: int
    grids: List[Tuple[int, int]]


def naflex_groups(valid: torch.Tensor, coord: torch.Tensor, by_grid: bool, fills_grid: bool = False) -> List[Group]:
    """valid: (B, N) bool, coord: (B, N, 2) (row, col) -> the groups of images sharing their valid count n (and, by_grid,
    their grid), in order of first appearance. fills_grid (a rope model: timm's NaFlex rope gives the k-th valid patch
    the k-th row-major cell of its grid): ValueError unless each image's valid patches fill its grid row by row, in
    order. One host read."""
    extent = coord.masked_fill(~valid.unsqueeze(-1), -1).amax(dim=1) + 1
    k = valid.cumsum(dim=1) - 1  # each valid patch's place among its image's valid patches
    cols = extent[:, 1:2].clamp(min=1)
    row_major = ((coord == torch.stack([k // cols, k % cols], dim=-1)).all(dim=-1) | ~valid).all(dim=1)
    facts = torch.cat([valid.sum(dim=1, keepdim=True).to(extent.dtype), extent,
                       row_major.unsqueeze(1).to(extent.dtype)], dim=1).tolist()
    groups: Dict[Tuple[int, ...], Group] = {}
    for image, (n, rows, cols, in_order) in enumerate(facts):
        if n == 0:
            raise ValueError(f"patch_valid marks no patch of image {image} as valid; every image of a NaFlex batch "
                             f"needs at least one")
        if fills_grid and (n != rows * cols or not in_order):
            what = (f"marks {n} patches of image {image} valid, its patch_coord spans a {rows} x {cols} grid"
                    if n != rows * cols else f"has image {image}'s valid patches out of row-major order")
            raise ValueError(f"patch_coord {what}: a rope model's NaFlex patches fill their grid row by row, in order "
                             f"(timm's NaFlex rope gives the k-th valid patch the k-th cell), as timm's Patchify "
                             f"makes them")
        group = groups.setdefault((int(n), int(rows), int(cols)) if by_grid else (int(n),), Group([], int(n), []))
        group.images.append(image)
        group.grids.append((int(rows), int(cols)))
    return list(groups.values())


class ReducingNaFlexVit(ReducingModel, NaFlexVit):
    """NaFlexVit running the shared reducing loop on images, and on each group of a NaFlex batch."""

    dynamic_img_size = True  # an image of any size has its own patch grid

    @property
    def patch_embed(self) -> EmbedsGrid:
        return EmbedsGrid(self.embeds)

    def _positions(self, x: torch.Tensor, grids: List[Tuple[int, int]]) -> Optional[TokenPositions]:
        """The rotary positions of x's patch tokens, image i's a row-major grid grids[i] (rows, cols) (one grid for
        all: grids of length 1): with timm's own table where the grids are one, else each image's rows from its
        coordinates."""
        if self.rope is None:
            return None
        merge = self._tokcomp.reducer.rope_merge
        if len(set(grids)) == 1:
            coords = grid_coords(self.rope, grids[0], x.device).expand(x.shape[0], -1, -1)
            return TokenPositions(self.rope, coords, self.rope.get_embed(shape=list(grids[0])), merge)
        return TokenPositions(self.rope, torch.stack([grid_coords(self.rope, g, x.device) for g in grids]), None, merge)

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[TokenPositions]]:
        x, grid = self.embeds(x)
        positions = self._positions(x, [tuple(grid)])
        if self.patch_drop is not None and self.training:
            if positions is not None:
                raise ValueError(PATCH_DROP_REFUSAL)
            x, _ = self.patch_drop(x)
        return self.norm_pre(x), positions

    def forward(self, x: Any, patch_coord: Optional[torch.Tensor] = None, patch_valid: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: images (B, 3, H, W), or NaFlex patches (B, N, P*P*C) with patch_coord and patch_valid (or the NaFlex
        collator's dict of them) -> logits; the head pools with this call's token sizes. Traced whole by
        torch.compile, it runs compiled by regions instead (handoff.compiled_whole)."""
        if compiled_whole(self):
            return forward_by_region(self, x, patch_coord, patch_valid, attn_mask)
        x, patch_coord, patch_valid, attn_mask = _naflex_inputs(x, patch_coord, patch_valid, attn_mask)
        if patch_coord is None:
            _refuse_attn_mask(attn_mask)
            return super().forward(x)
        return self.forward_head(**self.forward_features(x, patch_coord, patch_valid, attn_mask))

    def forward_features(self, patches: torch.Tensor, patch_coord: Optional[torch.Tensor] = None,
                         patch_valid: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None):
        """Images (B, 3, H, W) -> (B, N', C), as ReducingModel.forward_features; NaFlex patches with patch_coord and
        patch_valid -> {'patches': (B, N', C), 'patch_valid': (B, N' - prefix) bool}, timm's dict, each image's
        tokens first and padding (size 0) after them. The token sizes travel with the returned tokens."""
        _refuse_attn_mask(attn_mask)
        if patch_coord is None:
            return super().forward_features(patches)
        x, stats, _ = self._naflex_features(patches, patch_coord, patch_valid)
        p = self.num_prefix_tokens
        return {"patches": self._register_features(x, stats), "patch_valid": stats.size[:, p:, 0] > 0}

    def _naflex_features(self, patches: torch.Tensor, patch_coord: torch.Tensor, patch_valid: Optional[torch.Tensor],
                         take: Tuple[int, ...] = (), norm: bool = False, num_blocks: Optional[int] = None,
                         final: bool = True) -> Tuple[torch.Tensor, ReductionStats, Dict[int, torch.Tensor]]:
        """A NaFlex batch through the blocks, group by group -> (the padded tokens (B, N', C), the batch's stats,
        {block in take: (B, N, C) every input position's token after that block (spread_tokens; padding: zeros),
        normed where norm}). num_blocks, final: as ReducingModel._reduce_blocks."""
        if patch_valid is None:
            raise ValueError("patch_valid (B, N) is required with patch_coord (a NaFlex batch), as timm requires it")
        if patch_valid.shape[0] == 0 or patch_valid.shape[1] == 0:
            raise ValueError(f"a NaFlex batch needs at least one image and one patch (patch_valid of shape "
                             f"{tuple(patch_valid.shape)} given)")
        if self.patch_drop is not None and self.training:
            raise ValueError("patch dropout (patch_drop_rate > 0) in training is not supported on a NaFlex batch "
                             "while tokens are reduced: set patch_drop_rate=0, or train on images (B, 3, H, W)")
        x, _ = self.embeds(patches, patch_coord=patch_coord, patch_valid=patch_valid)
        x = self.norm_pre(x)
        (B, width_in, C), p, valid = x.shape, self.num_prefix_tokens, patch_valid.bool()
        order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)  # each image's valid patches first
        groups = self._groups(valid, patch_coord)
        grouped = torch.tensor([i for group in groups for i in group.images], device=x.device)  # one transfer
        runs, start, spread = [], 0, {}
        for images, n, grids in groups:
            idx, start = grouped[start:start + len(images)], start + len(images)
            tokens = order[idx, :n]
            columns = torch.cat([torch.arange(p, device=x.device).expand(len(images), -1), tokens + p], dim=1)
            group = torch.cat([x[idx, :p], gather_tokens(x[idx, p:], tokens)], dim=1)

            def on_block(i: int, out: torch.Tensor, source: torch.Tensor, positions, idx=idx, columns=columns) -> None:
                if i in take:
                    held = spread_tokens(self.norm(out) if norm else out, source)  # (k, p + n, C)
                    at = spread.setdefault(i, held.new_zeros(B, width_in, C))
                    at[idx] = held.new_zeros(len(idx), width_in, C).scatter(1, columns.unsqueeze(-1).expand_as(held),
                                                                             held)

            # the grid is read by the methods whose settings read it (reads_grid), whose groups share one
            out, stats = self._reduce_blocks(group, self._positions(group, grids), for_intermediates=bool(take),
                                             num_blocks=num_blocks, on_block=on_block if take else None, final=final,
                                             grid=grids[0])
            runs.append(GroupRun(images, idx, columns, self.norm(out), stats))
        x, stats = pad_runs(runs, p, width_in, self._tokcomp.reducer.trace_source)
        remember_last(self, stats)
        return x, stats, spread

    def _groups(self, valid: torch.Tensor, coord: torch.Tensor) -> List[Group]:
        """The groups a NaFlex batch runs as (naflex_groups): images of one count together, of one grid too where the
        method's settings read it."""
        return naflex_groups(valid, coord, by_grid=self._tokcomp.reducer.spec.reads_grid,
                             fills_grid=self.rope is not None)

    def _pool(self, x: torch.Tensor, pool_type: Optional[str] = None, patch_valid: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        """timm's _pool while nothing is reduced, and for 'token' / ''; else ReducingModel.pool with the sizes of
        x's call (padding: size 0)."""
        pool_type = self.global_pool if pool_type is None else pool_type
        if self._token_sizes(x) is None or (self.attn_pool is None and pool_type not in SIZED_POOLS):
            return super()._pool(x, pool_type, patch_valid)
        return self.pool(x, pool_type)

    def forward_intermediates(self, x: Any, indices=None, return_prefix_tokens: bool = False, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
                              output_dict: bool = False, patch_coord: Optional[torch.Tensor] = None,
                              patch_valid: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None):
        """ReducingModel.forward_intermediates on images (B, 3, H, W). On a NaFlex batch (the collator's dict, or
        patches with patch_coord and patch_valid), timm's NaFlex forms ('NLC' only): each intermediate (B, N, C) over
        the input's patch positions, every position carrying the token that holds it after that block (zeros for
        padding and for patches a dropping pruner removed); the final features the reduced tokens, padded (size 0),
        as forward_features returns them; output_dict adds the input's patch_valid."""
        x, patch_coord, patch_valid, attn_mask = _naflex_inputs(x, patch_coord, patch_valid, attn_mask)
        if patch_coord is None:
            return super().forward_intermediates(x, indices, return_prefix_tokens, norm, stop_early, output_fmt,
                                                 intermediates_only, output_dict, attn_mask)
        _refuse_attn_mask(attn_mask)
        if output_fmt != "NLC":
            raise ValueError(f"output_fmt must be 'NLC' for a NaFlex batch (its images' grids differ), as in timm; got "
                             f"{output_fmt!r}")
        take, max_index = feature_take_indices(len(self.blocks), indices)
        tokens, stats, spread = self._naflex_features(
            x, patch_coord, patch_valid, take=tuple(take), norm=norm,
            num_blocks=max_index + 1 if stop_early else None, final=not intermediates_only)
        p = self.num_prefix_tokens
        taken = [spread[i] for i in take]
        prefix, spatial = [t[:, :p] for t in taken], [t[:, p:] for t in taken]
        final = None if intermediates_only else self._register_features(tokens, stats)
        if output_dict:
            out: Dict[str, Any] = {"image_intermediates": spatial, "patch_valid": patch_valid}
            if p and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix
            if final is not None:
                out["image_features"] = final
            return out
        if p and return_prefix_tokens:
            spatial = list(zip(spatial, prefix))
        return spatial if intermediates_only else (final, spatial)


def _naflex_inputs(x: Any, patch_coord: Optional[torch.Tensor], patch_valid: Optional[torch.Tensor],
                   attn_mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                                               Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(x, patch_coord, patch_valid, attn_mask) as given, or read from the NaFlex collator's dict x, whose entries
    take priority, as in timm."""
    if not isinstance(x, dict):
        return x, patch_coord, patch_valid, attn_mask
    missing = [key for key, given in (("patches", None), ("patch_coord", patch_coord), ("patch_valid", patch_valid))
               if key not in x and given is None]
    if missing:
        raise ValueError(f"a NaFlex batch (the collator's dict) needs the keys patches, patch_coord and patch_valid; "
                         f"{', '.join(missing)} missing (keys given: {sorted(x)})")
    return (x["patches"], x.get("patch_coord", patch_coord), x.get("patch_valid", patch_valid),
            x.get("attn_mask", attn_mask))


def _refuse_attn_mask(attn_mask: Optional[torch.Tensor]) -> None:
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported while tokens are reduced (the token count changes); a NaFlex "
                         "batch's padding is read from patch_valid")


def pad_runs(runs: List[GroupRun], num_prefix: int, width_in: int, trace: bool) -> Tuple[torch.Tensor, ReductionStats]:
    """The groups' outputs in one batch (B, N', C), N' their largest count, each image's tokens first and
    zeros of size 0 after them; the stats of the whole batch: sizes (B, N', 1), each image's real count per block
    (real_tokens_per_block), tokens_per_block the largest, the source map over the padded input's width_in tokens
    where traced."""
    x0 = runs[0].x
    batch = sum(len(run.members) for run in runs)
    width = max(run.x.shape[1] for run in runs)
    x = x0.new_zeros(batch, width, x0.shape[-1])
    size = torch.zeros(batch, width, 1, device=x0.device)
    source = x0.new_zeros(batch, width, width_in) if trace else None
    depth = len(runs[0].stats.tokens_per_block)
    counts = [0] * (depth * batch)  # (depth, batch) on the host: each image's count per block, one transfer
    for run in runs:
        for i in run.members:
            counts[i::batch] = run.stats.tokens_per_block
    real = list(torch.tensor(counts, device=x0.device).view(depth, batch).unbind(0))
    for run in runs:
        m = run.x.shape[1]
        x[run.images, :m] = run.x
        held = size.new_ones(len(run.members), m, 1) if run.stats.size is None else run.stats.size
        size[run.images, :m] = held.to(size.dtype)  # float32, also under autocast
        if trace:
            columns = run.columns.unsqueeze(1).expand(-1, m, -1)
            mapped = run.stats.source.new_zeros(len(run.members), m, width_in).scatter(2, columns, run.stats.source)
            source[run.images, :m] = mapped.to(source.dtype)
        for block, per_image in enumerate(run.stats.real_tokens_per_block):  # a method whose images keep their own
            real[block][run.images] = per_image.to(real[block])  # counts within the run (ATS)
    stats = ReductionStats(
        tokens_per_block=[max(run.stats.tokens_per_block[b] for run in runs) for b in range(depth)],
        tokens_out=width, size=size, source=source, num_prefix=num_prefix, real_tokens_per_block=real,
        rope_merge=runs[0].stats.rope_merge)
    return x, stats


def effective_cfg(args: BuildArgs) -> NaFlexVitCfg:
    """The NaFlexVitCfg a NaFlexVit built with args has (its cfg with the keyword overrides)."""
    cfg = args.arg("cfg") or NaFlexVitCfg()
    return _overlay_kwargs(cfg, **{k: v for k, v in args.kwargs.items() if k in NaFlexVitCfg.__dataclass_fields__})


def _arch_refusal(args: BuildArgs) -> Optional[str]:
    """Blocks, attention or rope of a class the family does not serve (timm's block choice, get_block_fn)."""
    cfg = effective_cfg(args)
    if cfg.rope_type not in ("", "none", "axial", "dinov3", "mixed"):
        return f"rope_type={cfg.rope_type!r}, which timm_tokcomp does not serve (served: 'axial', 'dinov3', 'mixed')"
    block = get_block_fn(cfg)
    block = block.func if isinstance(block, partial) else block
    if block in (EvaBlock, EvaBlockPostNorm):
        return None
    return vit_block_refusal(BuildArgs(NaFlexVit, {"block_fn": block, "attn_layer": cfg.attn_layer or Attention}))


def _check(model: nn.Module) -> None:
    check_rope(model.rope)
    if model.embeds.pos_embed_grid_size is None:
        raise TypeError("this NaFlexVit has no default patch grid (its embeds' pos_embed_grid_size: built without "
                        "img_size and without a learned position table), which the methods' schedules are checked on")


@dataclass(frozen=True)
class NaFlexFamily(Family):
    """timm's NaFlexVit: its attributes under timm's VisionTransformer names (Facade), its class token in its cfg."""

    def facade(self, model: nn.Module) -> Facade:
        return Facade(blocks=model.blocks, embed_dim=model.embed_dim, num_prefix_tokens=model.num_prefix_tokens,
                      global_pool=model.global_pool, patch_embed=EmbedsGrid(model.embeds), dynamic_img_size=True)

    @staticmethod
    def has_class_token(model: nn.Module) -> bool:
        return bool(model.has_class_token)

    @staticmethod
    def builds_class_token(args: BuildArgs) -> bool:
        return bool(effective_cfg(args).class_token)

    def dense_refusal(self, model: nn.Module) -> Optional[str]:
        return "the dense methods serve timm's VisionTransformer and Eva classes, not NaFlexVit (use a token-reducing " \
               "method)"


NAFLEX = NaFlexFamily(
    name="NaFlexVit",
    timm_modules=("naflexvit",),
    models={NaFlexVit: ReducingNaFlexVit},
    dense_models={},
    blocks={Block: ReducingBlock, EvaBlock: ReducingEvaBlock, EvaBlockPostNorm: ReducingEvaBlockPostNorm},
    dense_blocks={},
    attentions={Attention: ReducingAttention, EvaAttention: ReducingEvaAttention,
                AttentionRope: ReducingAttentionRope},
    attn_dim=lambda attn: attn.num_heads * attn.head_dim,
    check=_check,
    arch_refusal=_arch_refusal,
    fused_qkv_attentions=(Attention,),
    plain_skips_qkv_module=eva_skips_qkv_module,
    other_classes=ROPE_CLASSES,
)
