"""`tokcomp analyze`: record several methods on the same images, compare every pair, draw the pictures and
write a self-contained Markdown report with a CSV of every metric.

Output folder: records/<method>.npz (the recordings, reused by a re-run with the same settings, so --resume
only redraws what changed), metrics.csv, depth_maps.png, metric_matrices.png, overlay_<method>.png, report.md.
"""
import copy
import csv
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from ...utils.checks import integer, optional
from ...core import __version__, apply
from ...families import facade
from ...utils.extras import require
from ...deployment.specs import method_spec
from ...methods import method_class
from ...files.outputs import replacing, run_folder, write_text
from .compare import MetricRow, compare, compared_blocks
from .plots import plot_depth_maps, plot_metric_matrices, plot_overlays
from .record import Recording, record

RUN_ENTRIES = ("records", "metrics.csv", "report.md", "*.png")
MATRIX_METRICS = ("nmi", "iou", "depth_spearman", "cka")
LIMIT = optional(integer("--limit", 2, "(images)"))  # the checks of analyze's flags
OVERLAYS = integer("--overlays", 0)


def _settings(model_name: str, weights: str, data: str, limit: Optional[int], method: str) -> Dict[str, object]:
    """What a cached recording must have been made with to be reused: the weights and images by content
    (timm_tokcomp.files.identity digests), and the library version, so a changed method is recorded again."""
    return {"model": model_name, "weights_sha256": weights, "data_sha256": data, "limit": limit, "method_tag": method,
            "version": __version__}


def _images_for_display(dataset, count: int, model) -> np.ndarray:
    """The first count images as the model sees them, un-normalised to (n, H, W, 3) in [0, 1]."""
    import timm

    cfg = timm.data.resolve_model_data_config(model)
    mean, std = torch.tensor(cfg["mean"]).view(3, 1, 1), torch.tensor(cfg["std"]).view(3, 1, 1)
    pictures = [(dataset[i][0] * std + mean).clamp(0, 1).permute(1, 2, 0).numpy() for i in range(count)]
    return np.stack(pictures)


def run_analysis(model_name: str, methods: Sequence[str], data: str, out: str, limit: Optional[int] = 256,
                 checkpoint: Optional[str] = None, pretrained: bool = False, batch_size: int = 32, overlays: int = 4,
                 device: str = "cpu", resume: bool = False, overwrite: bool = False,
                 show_progress: bool = True) -> List[MetricRow]:
    """Record each method (tags as `tokcomp bench --methods` takes them) on the first `limit` images of `data`,
    compare every pair and write the report folder `out` (see the module docstring). Returns the metric rows."""
    if len(methods) < 2 or len(set(methods)) != len(methods):
        raise ValueError(f"--methods needs two or more different methods to compare, got {list(methods)}")
    if "none" in methods:
        raise ValueError("--methods: 'none' reduces nothing (every patch stays its own token); list reducing methods")
    from ...models.open_clip import is_open_clip_name

    if is_open_clip_name(model_name):  # before the run folder: nothing written
        raise ValueError(f"MODEL {model_name}: analyze records timm models (their source maps, grid and head); "
                         f"time and measure open_clip towers with bench, speed or tune")
    try:
        specs = {name: method_spec(name) for name in methods}  # an unknown tag fails before any work
    except ValueError as e:
        raise ValueError(f"--methods: {e}") from None
    for name, (method, _) in specs.items():
        if method_class(method).spec.dense:
            raise ValueError(f"--methods: {name} keeps every token (dense); analyze compares token-reducing methods")
    LIMIT(limit)
    OVERLAYS(overlays)
    for module in ("scipy", "sklearn", "matplotlib"):  # before any work
        require(module, "analysis", "tokcomp analyze")
    # resume keeps the recordings (reused where their settings match); the report, metrics and pictures of the
    # earlier run are set aside and redrawn, so nothing of its settings lingers, and come back if this run fails
    with run_folder(out, resume, overwrite, RUN_ENTRIES, kept_on_resume=("records",)):
        return _analyze(model_name, specs, data, out, limit, checkpoint, pretrained, batch_size, overlays, device,
                        show_progress)


def _analyze(model_name, specs, data, out, limit, checkpoint, pretrained, batch_size, overlays, device,
             show_progress) -> List[MetricRow]:
    from ...files.data import open_images
    from ...files.identity import data_digest, weights_digest
    from ...models.build import build_base_model, eval_transform

    methods = list(specs)
    base = build_base_model(model_name, checkpoint, pretrained, device)
    dataset = open_images(data, eval_transform(base), limit=limit)
    count = len(dataset)
    if count < 2:
        raise ValueError(f"--data {data} has {count} image(s); analyze needs two or more")
    records = Path(out) / "records"
    recordings: Dict[str, Recording] = {}
    weights, images = weights_digest(base), data_digest(data)
    view = facade(base)  # timm's attribute names on every served family
    grid = view.patch_embed.dynamic_feat_size(tuple(dataset[0][0].shape[-2:]))  # the eval transform's images
    max_bytes = Recording.bytes_at_most(count, len(view.blocks), math.prod(grid),
                                        max(base.num_features, getattr(base, "head_hidden_size", 0) or 0))
    for name, (method, params) in specs.items():
        path = records / f"{name}.npz"
        settings = _settings(model_name, weights, images, limit, name)
        rec = Recording.load_if(path, name, settings, max_bytes) if path.is_file() else None
        if rec is not None and rec.images == count:
            recordings[name] = rec
            continue
        model = apply(copy.deepcopy(base), method, **params)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
        with tqdm(total=count, desc=f"record {name}", disable=not show_progress, file=sys.stderr) as bar:
            rec = record(model, name, (x.to(device) for x, _ in loader), bar.update)
        rec.save(path, settings)
        recordings[name] = rec
    depth = len(view.blocks)
    blocks = compared_blocks(depth)
    pairs = len(methods) * (len(methods) - 1) // 2
    with tqdm(total=pairs, desc="compare", disable=not show_progress, file=sys.stderr) as bar:
        rows = compare(recordings, blocks, bar.update)
    _write_csv(rows, Path(out) / "metrics.csv")
    plot_depth_maps(recordings, depth, Path(out) / "depth_maps.png")
    last = blocks[-1] + 1
    plot_metric_matrices(rows, list(methods), {m: (last if m in ("nmi", "iou") else None) for m in MATRIX_METRICS},
                         Path(out) / "metric_matrices.png")
    shown = min(overlays, count)
    if shown:
        pictures = _images_for_display(dataset, shown, base)
        for name, rec in recordings.items():
            plot_overlays(pictures, rec, blocks, Path(out) / f"overlay_{name}.png")
    write_text(Path(out) / "report.md", _report(model_name, data, count, recordings, rows, blocks, shown))
    return rows


def _write_csv(rows: Sequence[MetricRow], path: Path) -> None:
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})


def _report(model_name: str, data: str, count: int, recordings: Dict[str, Recording], rows: Sequence[MetricRow],
            blocks: Sequence[int], overlays: int) -> str:
    lines = [f"# Reduction patterns of {model_name}", "",
             f"{count} images of `{data}`; methods: {', '.join(f'`{m}`' for m in recordings)}. Patterns are compared "
             f"after blocks {', '.join(str(b + 1) for b in blocks)}. Every metric is in `metrics.csv`.", "",
             "## Tokens and depth", "",
             "| method | " + " | ".join(f"tokens after block {b + 1}" for b in blocks) + " | mean depth (blocks) |",
             "| --- | " + " | ".join("---" for _ in blocks) + " | --- |"]
    for name, rec in recordings.items():
        tokens = [np.mean([len(np.unique(a[a >= 0])) for a in rec.assign[:, b]]) for b in blocks]
        lines.append(f"| `{name}` | " + " | ".join(f"{t:.1f}" for t in tokens) + f" | {rec.depth.mean():.2f} |")
    lines += ["", "A patch's depth is the number of blocks that processed it as its own token (a token holding "
                  "that patch alone).", "", "![depth maps](depth_maps.png)", "",
              "## Method against method", "", "![metric matrices](metric_matrices.png)", "",
              "| methods | after block | NMI | homogeneity | completeness | IoU (counting bound) | IoA (bound) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    by_key = {(r.method_a, r.method_b, r.block, r.metric): r for r in rows}
    names = list(recordings)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for block in blocks:
                get = lambda m: by_key[(a, b, block + 1, m)]  # noqa: E731
                lines.append(f"| `{a}` / `{b}` | {block + 1} | {get('nmi').value:.3f} | {get('homogeneity').value:.3f} | "
                             f"{get('completeness').value:.3f} | {get('iou').value:.3f} ({get('iou').bound:.3f}) | "
                             f"{get('ioa').value:.3f} ({get('ioa').bound:.3f}) |")
    lines += ["", "| methods | depth Spearman | depth EMD | depth JSD | depth intersection | Procrustes | CKA | PWCCA |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            cells = [by_key.get((a, b, None, m)) for m in ("depth_spearman", "depth_emd", "depth_jsd", "depth_intersection",
                                                           "procrustes", "cka", "pwcca")]
            lines.append(f"| `{a}` / `{b}` | " + " | ".join("n/a" if c is None else "undefined" if c.value is None
                                                            else f"{c.value:.3f}" for c in cells) + " |")
    if any(r.metric == "depth_spearman" and r.value is None for r in rows):
        lines += ["", "Depth Spearman is undefined (empty in `metrics.csv`) where a method's depth map is constant: "
                      "every patch was processed by the same number of blocks, so the patches have no ranks."]
    if overlays:
        lines += ["", "## What each method did to the first images", "",
                  "Each token holding two or more patches in its own colour, dropped patches grey, group borders white.", ""]
        lines += [f"![{name}](overlay_{name}.png)" for name in recordings]
    return "\n".join(lines) + "\n"
