"""The study's check values, and the metrics' behaviour on cases whose answer is known."""
import numpy as np
import pytest

from timm_tokcomp.commands.analyze.metrics import (assignment_agreement, depth_map_similarity, grid_emd, kept_overlap,
                                           linear_cka, procrustes_distance, pwcca_distance)


def test_clustering_check_values():
    scores = assignment_agreement(np.array([0, 0, 0, 0, 1, 1, 1, 1]), np.array([0, 0, 1, 1, 2, 2, 3, 3]))
    assert scores["homogeneity"] == pytest.approx(1.0)
    assert scores["completeness"] == pytest.approx(0.5)
    assert scores["nmi"] == pytest.approx(0.6667, abs=5e-5)
    from sklearn.metrics import normalized_mutual_info_score

    g = np.random.default_rng(0)
    c, k = g.integers(0, 30, 196), g.integers(0, 12, 196)
    assert assignment_agreement(c, k)["nmi"] == pytest.approx(normalized_mutual_info_score(c, k))


def test_emd_check_value_corner_to_corner():
    a, b = np.zeros((14, 14)), np.zeros((14, 14))
    a[0, 0], b[13, 13] = 1.0, 1.0
    assert grid_emd(a, b) == pytest.approx(18.3848, abs=5e-5) and grid_emd(a, a) == pytest.approx(0.0, abs=1e-9)


def test_kept_overlap_and_its_counting_bound():
    a = np.zeros(10, bool)
    b = np.zeros(10, bool)
    a[:7], b[3:] = True, True  # 7 and 7 of 10 kept: at least 4 shared by counting; here exactly 4
    got = kept_overlap(a, b)
    assert got["iou"] == pytest.approx(4 / 10) and got["iou_bound"] == pytest.approx(4 / 10)
    assert got["ioa"] == pytest.approx(4 / 7) and got["ioa_bound"] == pytest.approx(4 / 7)
    got = kept_overlap(a, a)
    assert got["iou"] == 1.0 and got["ioa"] == 1.0 and got["iou_bound"] == pytest.approx(4 / 10)


def test_depth_maps_identical_and_opposite():
    g = np.random.default_rng(0)
    m = g.random((14, 14)) + 0.1
    same = depth_map_similarity(m, m)
    assert same["spearman"] == pytest.approx(1.0) and same["jsd"] == pytest.approx(0.0, abs=1e-12)
    assert same["intersection"] == pytest.approx(1.0) and same["emd"] == pytest.approx(0.0, abs=1e-9)
    flipped = depth_map_similarity(m, m.max() + m.min() - m)  # order reversed
    assert flipped["spearman"] == pytest.approx(-1.0) and flipped["intersection"] < 1.0 and flipped["jsd"] > 0


def test_feature_similarities():
    g = np.random.default_rng(0)
    x = g.standard_normal((300, 16))
    rotation = np.linalg.qr(g.standard_normal((16, 16)))[0]
    assert procrustes_distance(x, x @ rotation * 3.0 + 1.0) == pytest.approx(0.0, abs=1e-9)
    assert linear_cka(x, x @ rotation * 3.0) == pytest.approx(1.0)
    assert pwcca_distance(x, x @ g.standard_normal((16, 16))) == pytest.approx(0.0, abs=1e-9)  # any invertible map
    noise = g.standard_normal((300, 16))
    assert linear_cka(x, noise) < 0.2 and procrustes_distance(x, noise) > 1.0 and pwcca_distance(x, noise) > 0.5
    with pytest.raises(ValueError, match="more images than feature dimensions"):
        pwcca_distance(x[:10], x[:10])


def test_depth_spearman_is_undefined_for_a_constant_map_and_the_csv_stays_numeric(tmp_path):
    """A method that processed every patch for the same number of blocks has no depth ranks: its Spearman is
    None (not NaN), written as an empty cell, shown as 'undefined' with the reason."""
    import csv

    from timm_tokcomp.commands.analyze.compare import MetricRow
    from timm_tokcomp.commands.analyze.metrics import depth_map_similarity
    from timm_tokcomp.commands.analyze.report import _write_csv

    varied = np.arange(16.0).reshape(4, 4)
    got = depth_map_similarity(np.full((4, 4), 12.0), varied)
    assert got["spearman"] is None and all(np.isfinite(v) for k, v in got.items() if k != "spearman")
    assert depth_map_similarity(varied, varied)["spearman"] == pytest.approx(1.0)
    rows = [MetricRow("a", "b", None, f"depth_{k}", v, None, 4) for k, v in got.items()]
    _write_csv(rows, tmp_path / "metrics.csv")
    with open(tmp_path / "metrics.csv") as f:
        values = [r["value"] for r in csv.DictReader(f)]
    assert values[0] == "" and all(float(v) == float(v) for v in values[1:])  # no 'nan' text anywhere
