"""Pictures (matplotlib, PNG): merge / prune overlays on the input images, dataset-averaged depth maps, and
method x method metric matrices."""
from pathlib import Path
from typing import Dict, List, Sequence, Union

import numpy as np

from ...utils.extras import pyplot
from ...files.outputs import replacing
from .compare import MetricRow
from .record import Recording

DROPPED_GREY = 0.35
SCALES = {"nmi": (0, 1), "homogeneity": (0, 1), "completeness": (0, 1), "iou": (0, 1), "ioa": (0, 1), "cka": (0, 1),
          "depth_spearman": (-1, 1), "depth_intersection": (0, 1), "depth_jsd": (0, 1)}  # colour scales of the matrices


def _pyplot():
    return pyplot("analysis", "tokcomp analyze")


def _save(fig, path: Union[str, Path]) -> None:
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi, bbox_inches="tight")
    _pyplot().close(fig)


def group_colours(count: int) -> np.ndarray:
    """(count, 3) well-separated colours (golden-ratio hues, two saturation / value levels)."""
    import colorsys

    return np.array([colorsys.hsv_to_rgb((i * 0.618033988749895) % 1.0, 0.85 - 0.3 * (i % 2), 0.95 - 0.25 * (i % 3 == 2))
                     for i in range(count)])


def overlay(image: np.ndarray, assign: np.ndarray, grid: Sequence[int], alpha: float = 0.55) -> np.ndarray:
    """image: (H, W, 3) in [0, 1]; assign: (P,) token of every patch (-1: dropped). Every token that holds two or
    more patches is painted in its own colour with a white border, dropped patches are greyed, single patches
    stay as they are. Returns (H, W, 3)."""
    gh, gw = grid
    h, w = image.shape[:2]
    ph, pw = h // gh, w // gw
    tokens = assign.reshape(gh, gw)
    ids, counts = np.unique(assign[assign >= 0], return_counts=True)
    colours = dict(zip(ids.tolist(), group_colours(len(ids))))
    sizes = dict(zip(ids.tolist(), counts.tolist()))
    out = image.copy()
    for r in range(gh):
        for c in range(gw):
            t = int(tokens[r, c])
            cell = out[r * ph:(r + 1) * ph, c * pw:(c + 1) * pw]
            if t < 0:
                cell[:] = DROPPED_GREY + 0.25 * cell.mean(axis=-1, keepdims=True)
            elif sizes[t] > 1:
                cell[:] = (1 - alpha) * cell + alpha * colours[t]
            grouped = t >= 0 and sizes[t] > 1
            right = int(tokens[r, c + 1]) if c + 1 < gw else t
            below = int(tokens[r + 1, c]) if r + 1 < gh else t
            if right != t and (grouped or (right >= 0 and sizes[right] > 1)):  # a group's border, not every patch's
                out[r * ph:(r + 1) * ph, (c + 1) * pw - 1] = 1.0
            if below != t and (grouped or (below >= 0 and sizes[below] > 1)):
                out[(r + 1) * ph - 1, c * pw:(c + 1) * pw] = 1.0
    return out


def plot_overlays(images: np.ndarray, recording: Recording, blocks: Sequence[int], path: Union[str, Path]) -> None:
    """One row per image (images: (n, H, W, 3) in [0, 1], the first n recorded), one column per block."""
    plt = _pyplot()
    n = len(images)
    fig, axes = plt.subplots(n, len(blocks) + 1, figsize=(2.0 * (len(blocks) + 1), 2.0 * n), dpi=80, squeeze=False)
    for i in range(n):
        axes[i, 0].imshow(images[i])
        for j, block in enumerate(blocks, 1):
            assign = recording.assign[i, block]
            axes[i, j].imshow(overlay(images[i], assign, recording.grid))
            if i == 0:
                axes[i, j].set_title(f"after block {block + 1}", fontsize=9)
            kept = len(np.unique(assign[assign >= 0]))
            axes[i, j].set_xlabel(f"{kept} tokens", fontsize=8)
        if i == 0:
            axes[i, 0].set_title("input", fontsize=9)
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{recording.method}: merged groups in colour, dropped patches grey", fontsize=10)
    _save(fig, path)


def plot_depth_maps(recordings: Dict[str, Recording], depth: int, path: Union[str, Path]) -> None:
    """The dataset-averaged depth of every patch, one heat map per method on one colour scale (0 .. depth)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(recordings), figsize=(2.6 * len(recordings), 2.8), dpi=80, squeeze=False)
    image = None
    for ax, (name, rec) in zip(axes[0], recordings.items()):
        m = rec.mean_depth_map()
        image = ax.imshow(m, vmin=0, vmax=depth, cmap="viridis")
        ax.set_title(f"{name}\nmean {m.mean():.2f} blocks", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="blocks as its own token")
    _save(fig, path)


def plot_metric_matrices(rows: Sequence[MetricRow], methods: List[str], metrics: Dict[str, Union[int, None]],
                         path: Union[str, Path]) -> None:
    """One annotated method x method heat map per metric: metrics maps a metric name to the 1-based block it is
    read at (None for whole-model metrics). Bounded metrics use their whole range as the colour scale (SCALES);
    the diagonal is left empty."""
    plt = _pyplot()
    size = 1.2 + 0.75 * len(methods)
    fig, axes = plt.subplots(1, len(metrics), figsize=(size * len(metrics), size), dpi=80, squeeze=False,
                             layout="constrained")
    index = {m: i for i, m in enumerate(methods)}
    for ax, (metric, block) in zip(axes[0], metrics.items()):
        grid = np.full((len(methods), len(methods)), np.nan)
        for row in rows:
            if row.metric == metric and row.block == block:
                value = np.nan if row.value is None else row.value  # None: undefined
                grid[index[row.method_a], index[row.method_b]] = grid[index[row.method_b], index[row.method_a]] = value
        low, high = SCALES.get(metric, (np.nanmin(grid), np.nanmax(grid)) if np.isfinite(grid).any() else (0, 1))
        ax.imshow(grid, cmap="magma", vmin=low, vmax=high)
        for (i, j), value in np.ndenumerate(grid):
            if np.isfinite(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8,
                        color="black" if value > (low + high) / 2 else "white")
        ax.set_xticks(range(len(methods)), methods, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(methods)), methods, fontsize=8)
        ax.set_title(metric + (f" (after block {block})" if block else ""), fontsize=9)
    _save(fig, path)
