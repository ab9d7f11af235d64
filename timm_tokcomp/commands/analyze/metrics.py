"""The reduction-pattern metrics of the "Which Tokens to Use?" study, thin over scikit-learn and scipy.

Kept sets (pruning): IoU / IoA with the overlap that counting alone forces. Assignments (merging): each
stage's map of the patches to output tokens is a clustering; homogeneity, completeness and NMI between two.
Depth maps (how many blocks each patch was processed by as its own token): Spearman, earth mover's distance
on the patch grid, Jensen-Shannon divergence, histogram intersection. Features: orthogonal Procrustes
distance, linear CKA, PWCCA between two models' class-token features on the same images.
"""
from typing import Dict, Optional

import numpy as np

from ...utils.extras import require


def kept_overlap(kept_a: np.ndarray, kept_b: np.ndarray) -> Dict[str, float]:
    """kept_a, kept_b: (P,) bool, the patches two models keep at one stage (of one image). IoU = |A & B| /
    |A | B|, IoA = |A & B| / min(|A|, |B|) (how far the smaller set lies inside the larger), each with the
    value that counting alone forces (at least max(0, |A| + |B| - P) shared patches): iou_bound, ioa_bound."""
    a, b, total = int(kept_a.sum()), int(kept_b.sum()), kept_a.shape[0]
    inter = int((kept_a & kept_b).sum())
    forced = max(0, a + b - total)
    smaller = min(a, b)
    return {"iou": inter / max(a + b - inter, 1), "ioa": inter / max(smaller, 1),
            "iou_bound": forced / max(a + b - forced, 1), "ioa_bound": forced / max(smaller, 1)}


def assignment_agreement(c: np.ndarray, k: np.ndarray) -> Dict[str, float]:
    """c, k: (P,) int, the output token of every patch under two models (c: the one that keeps more tokens).
    Homogeneity (each of k's groups lies within one of c's), completeness, and NMI with the arithmetic mean,
    which is scikit-learn's V-measure (identical by definition; one call computes all three)."""
    scores = require("sklearn.metrics", "analysis", "assignment agreement").homogeneity_completeness_v_measure

    h, comp, v = scores(c, k)
    return {"homogeneity": float(h), "completeness": float(comp), "nmi": float(v)}


def _as_distribution(depth: np.ndarray) -> np.ndarray:
    d = np.asarray(depth, dtype=np.float64).ravel()
    total = d.sum()
    if total <= 0:
        raise ValueError("a depth map must have a positive sum")
    return d / total


def grid_emd(map_a: np.ndarray, map_b: np.ndarray) -> float:
    """Earth mover's distance between two (H, W) maps as distributions on the grid, Euclidean ground distance
    in patch units (scipy's wasserstein_distance_nd)."""
    wasserstein_distance_nd = require("scipy.stats", "analysis", "the grid EMD").wasserstein_distance_nd

    h, w = map_a.shape
    coords = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), -1).reshape(-1, 2).astype(np.float64)
    return float(wasserstein_distance_nd(coords, coords, _as_distribution(map_a), _as_distribution(map_b)))


def depth_map_similarity(map_a: np.ndarray, map_b: np.ndarray) -> Dict[str, Optional[float]]:
    """Two (H, W) mean-depth maps: Spearman rank correlation (None, undefined, where a map is constant: its
    patches have no ranks), EMD (grid_emd), Jensen-Shannon divergence (base 2, in [0, 1]) and histogram
    intersection (in [0, 1]) of the maps as distributions."""
    jensenshannon = require("scipy.spatial.distance", "analysis", "depth-map similarity").jensenshannon
    spearmanr = require("scipy.stats", "analysis", "depth-map similarity").spearmanr

    p, q = _as_distribution(map_a), _as_distribution(map_b)
    constant = np.ptp(map_a) == 0 or np.ptp(map_b) == 0
    rho = None if constant else float(spearmanr(np.ravel(map_a), np.ravel(map_b)).statistic)
    return {"spearman": rho, "emd": grid_emd(map_a, map_b),
            "jsd": float(jensenshannon(p, q, base=2) ** 2), "intersection": float(np.minimum(p, q).sum())}


def _centred(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"features must be (images >= 2, dims), got {x.shape}")
    return x - x.mean(axis=0)


def procrustes_distance(x: np.ndarray, y: np.ndarray) -> float:
    """Orthogonal Procrustes distance between features x (n, d) and y (n, d) of the same n images, each centred
    and scaled to unit Frobenius norm: 2 - 2 * (nuclear norm of x^T y), in [0, 2] (scipy's orthogonal_procrustes)."""
    orthogonal_procrustes = require("scipy.linalg", "analysis", "the Procrustes distance").orthogonal_procrustes

    a, b = _centred(x), _centred(y)
    a, b = a / np.linalg.norm(a), b / np.linalg.norm(b)
    _, nuclear = orthogonal_procrustes(a, b)
    return float(max(0.0, 2.0 - 2.0 * nuclear))


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA (Kornblith et al.) of x (n, d1) and y (n, d2): ||y^T x||_F^2 / (||x^T x||_F ||y^T y||_F), centred."""
    a, b = _centred(x), _centred(y)
    return float(np.linalg.norm(b.T @ a) ** 2 / (np.linalg.norm(a.T @ a) * np.linalg.norm(b.T @ b)))


def pwcca_distance(x: np.ndarray, y: np.ndarray) -> float:
    """PWCCA distance (Morcos et al.) of x (n, d1) and y (n, d2): 1 - sum_i alpha_i rho_i, rho the canonical
    correlations, alpha_i proportional to how much of x the i-th canonical variate of x accounts for
    (sum over x's columns of |<h_i, x_j>|). Needs more images than dimensions (n > max(d1, d2))."""
    a, b = _centred(x), _centred(y)
    if a.shape[0] <= max(a.shape[1], b.shape[1]):
        raise ValueError(f"PWCCA needs more images than feature dimensions, got {a.shape[0]} images of "
                         f"{a.shape[1]} / {b.shape[1]} dimensions")
    qa, qb = np.linalg.qr(a)[0], np.linalg.qr(b)[0]
    u, rho, _ = np.linalg.svd(qa.T @ qb, full_matrices=False)
    h = qa @ u  # (n, k) canonical variates of x, unit norm
    alpha = np.abs(h.T @ a).sum(axis=1)
    alpha = alpha / alpha.sum()
    return float(1.0 - (alpha * np.clip(rho, 0.0, 1.0)).sum())
