"""Every pattern metric between every pair of recorded methods (same images, same model), as flat rows.

Per image, averaged over the images, after each compared block: kept-set IoU / IoA (a patch is 'kept' while
it is its own token) with the counting bounds, and homogeneity / completeness / NMI of the two assignments of
the patches to tokens (C = the method with more tokens in that image; the patches a pruner dropped form one
group). Over the data set: the depth maps' Spearman / EMD / JSD / intersection, and the class-token
features' Procrustes distance, linear CKA and PWCCA distance.
"""
from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .metrics import (assignment_agreement, depth_map_similarity, kept_overlap, linear_cka, procrustes_distance,
                      pwcca_distance)
from .record import Recording

PER_IMAGE = ("iou", "ioa", "homogeneity", "completeness", "nmi")
DEPTH = ("spearman", "emd", "jsd", "intersection")
FEATURES = ("procrustes", "cka", "pwcca")


@dataclass
class MetricRow:
    """One metric between two methods; block: 1-based block after which it was taken (None: whole model);
    value: mean over `images` images (None where undefined: the depth Spearman of a constant depth map);
    bound: what counting alone forces (IoU / IoA), else None."""

    method_a: str
    method_b: str
    block: Optional[int]
    metric: str
    value: Optional[float]
    bound: Optional[float]
    images: int


def compared_blocks(depth: int) -> List[int]:
    """0-based blocks after which patterns are compared: the ends of the model's four quarters (3, 6, 9, 12 of
    12 blocks), where the study's stages (before blocks 4, 7, 10) have just reduced."""
    return sorted({max(round(depth * k / 4) - 1, 0) for k in (1, 2, 3, 4)})


def _tokens(assign: np.ndarray) -> int:
    return len(np.unique(assign))


def _per_image(a: Recording, b: Recording, block: int) -> Dict[str, float]:
    own_a, own_b = a.own(block), b.own(block)
    sums = {name: 0.0 for name in (*PER_IMAGE, "iou_bound", "ioa_bound")}
    for i in range(a.images):
        for name, value in kept_overlap(own_a[i], own_b[i]).items():
            sums[name] += value
        x, y = a.assign[i, block], b.assign[i, block]
        c, k = (x, y) if _tokens(x) >= _tokens(y) else (y, x)
        for name, value in assignment_agreement(c, k).items():
            sums[name] += value
    return {name: value / a.images for name, value in sums.items()}


def compare(recordings: Dict[str, Recording], blocks: Sequence[int],
            progress: Optional[Callable[[int], None]] = None) -> List[MetricRow]:
    """Rows for every pair of recordings (in the given order) and every metric."""
    rows: List[MetricRow] = []
    counts = {rec.images for rec in recordings.values()}
    if len(counts) != 1:
        raise ValueError(f"the recordings cover different numbers of images ({sorted(counts)}); record the same images")
    for name_a, name_b in combinations(recordings, 2):
        a, b = recordings[name_a], recordings[name_b]
        for block in blocks:
            means = _per_image(a, b, block)
            for metric in PER_IMAGE:
                rows.append(MetricRow(name_a, name_b, block + 1, metric, means[metric],
                                      means.get(f"{metric}_bound"), a.images))
        for metric, value in depth_map_similarity(a.mean_depth_map(), b.mean_depth_map()).items():
            rows.append(MetricRow(name_a, name_b, None, f"depth_{metric}", value, None, a.images))
        feats = {"procrustes": procrustes_distance(a.features, b.features), "cka": linear_cka(a.features, b.features)}
        if a.images > max(a.features.shape[1], b.features.shape[1]):
            feats["pwcca"] = pwcca_distance(a.features, b.features)
        for metric, value in feats.items():
            rows.append(MetricRow(name_a, name_b, None, metric, value, None, a.images))
        if progress is not None:
            progress(1)
    return rows
