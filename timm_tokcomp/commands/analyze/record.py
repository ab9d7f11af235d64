"""Record what a token-reducing model did to every patch, streamed over a data set into compact arrays.

Per image and block: the output token that holds each patch after the block (-1: a dropping pruner removed
it). Per image and patch: its depth, the number of blocks that processed it as its own token (a token that
holds that patch alone; merged, fused or dropped patches stop counting). Per image: the class-token features
(the head's pre-logits). Only these small arrays are kept (int16 / uint8 / float32), never the activations.
"""
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import nn

from ...files.bounded import loads_json, npz_shapes
from ...files.outputs import replacing
from ...families import facade
from ...patch import trace_blocks


MAX_META_BYTES = 1 << 16  # a recording's meta: the settings it was made with, a few hundred bytes


@dataclass
class Recording:
    """One method over a data set. assign: (images, L, P) int16, the token holding each patch after each block
    (-1: dropped); depth: (images, P) uint8; features: (images, D) float32; grid: (H, W) of the patches."""

    method: str
    assign: np.ndarray
    depth: np.ndarray
    features: np.ndarray
    grid: Tuple[int, int]

    @property
    def images(self) -> int:
        return self.assign.shape[0]

    def mean_depth_map(self) -> np.ndarray:
        """(H, W) depth of each patch averaged over the images."""
        return self.depth.astype(np.float64).mean(axis=0).reshape(self.grid)

    def own(self, block: int) -> np.ndarray:
        """(images, P) bool: the patches that are still their own token after `block` (0-based)."""
        a = self.assign[:, block].astype(np.int64)
        # token indices count the prefix tokens: an unreduced block's reach P (the patches) and beyond
        counts = np.zeros((a.shape[0], a.max(initial=-1) + 2), dtype=np.int64)
        np.add.at(counts, (np.arange(a.shape[0])[:, None], a + 1), 1)  # index 0 counts dropped patches
        return (a >= 0) & (np.take_along_axis(counts, a + 1, axis=1) == 1)

    def save(self, path: Union[str, Path], meta: Dict[str, Any]) -> None:
        with replacing(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez_compressed(f, assign=self.assign, depth=self.depth, features=self.features,
                                    grid=np.array(self.grid), meta=np.array(json.dumps({"method": self.method, **meta})))

    @staticmethod
    def bytes_at_most(images: int, depth: int, patches: int, features: int) -> int:
        """What a recording of `images` images unpacks to at most: assign, depth, features, grid, meta."""
        return images * (depth * patches * 2 + patches + features * 4) + MAX_META_BYTES + 4096

    @staticmethod
    def load_if(path: Union[str, Path], method: str, meta: Dict[str, Any], max_bytes: int) -> Optional["Recording"]:
        """The recording of `method` at path if its meta equals `meta` (read first, alone) and its arrays unpack to
        at most max_bytes (their sizes read from the archive's directory and each array's header before any is
        decompressed: files.bounded.npz_shapes); else None. A recording someone else wrote (a run folder sent to
        --resume) is never decompressed beyond what this run would have recorded."""
        try:
            shapes = npz_shapes(path, max_bytes)
            meta_shape, meta_dtype = shapes.get("meta", ((MAX_META_BYTES + 1,), np.dtype("u1")))
            if set(shapes) != _MEMBERS or math.prod(meta_shape) * meta_dtype.itemsize > MAX_META_BYTES:
                return None
            with np.load(path) as data:
                if loads_json(str(data["meta"]), None, path) != {"method": method, **meta}:
                    return None
                return Recording(method, data["assign"], data["depth"], data["features"],
                                 tuple(int(v) for v in data["grid"]))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):  # not a recording this package wrote
            return None


_MEMBERS = {"assign", "depth", "features", "grid", "meta"}  # what save writes


def block_assignment(source: torch.Tensor, num_prefix: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """source: (B, N, N0) after a block -> (assign (B, P) int64: the token holding each patch, -1 if none;
    own (B, P) bool: the patch is its token's only patch). P = N0 - num_prefix patches."""
    patches = source[:, :, num_prefix:]
    held = patches.sum(dim=1) > 0  # (B, P)
    holder = patches.argmax(dim=1)  # (B, P)
    size = patches.sum(dim=2)  # (B, N) patches per token
    own = held & (size.gather(1, holder) == 1)
    return torch.where(held, holder, torch.full_like(holder, -1)), own


@torch.no_grad()
def record(model: nn.Module, method: str, batches: Iterable[torch.Tensor],
           progress: Optional[Callable[[int], None]] = None) -> Recording:
    """Run a token-reducing model (timm_tokcomp.apply'd) over batches of images (B, 3, H, W) and record it."""
    view = facade(model)  # timm's attribute names on every served family (NaFlexVit: its embeds' grid)
    num_prefix = view.num_prefix_tokens
    grid: Tuple[int, ...] = ()
    assigns: List[np.ndarray] = []
    depths: List[np.ndarray] = []
    features: List[np.ndarray] = []
    for x in batches:
        per_block: List[torch.Tensor] = []
        grid = tuple(view.patch_embed.dynamic_feat_size(tuple(x.shape[-2:])))  # the images' grid: one size in a run
        depth = torch.ones(x.shape[0], grid[0] * grid[1], dtype=torch.int64)  # every patch enters block 0 alone
        last = len(view.blocks) - 1

        def on_block(i: int, tokens: torch.Tensor, source: torch.Tensor, positions) -> None:
            assign, own = block_assignment(source.float(), num_prefix)
            per_block.append(assign.cpu())
            if i < last:
                depth.add_(own.cpu().long())  # it enters block i + 1 as its own token

        out = trace_blocks(model, x, on_block)
        features.append(model.forward_head(out, pre_logits=True).float().cpu().numpy())
        assigns.append(torch.stack(per_block, dim=1).to(torch.int16).numpy())
        depths.append(depth.to(torch.uint8).numpy())
        if progress is not None:
            progress(len(x))
    if not assigns:
        raise ValueError("no images to record")
    return Recording(method, np.concatenate(assigns), np.concatenate(depths), np.concatenate(features), grid)
