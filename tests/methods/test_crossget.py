"""CrossGET: the guided matching against a reference written token by token from the method's description, the
importance-weighted merge (the paper's softmax ensemble for a pair), order kept, and the class-token refusal."""
import math

import pytest
import torch

import timm_tokcomp
from timm_tokcomp.methods.crossget import guided_matching
from conftest import check_edges, make_model


def _reference_groups(keys, query, r, p):
    """Per image, plain loops: the sources and where each merges (non-prefix indices)."""
    out = []
    for k, q in zip(keys[:, p:].double(), query.double()):
        n = k.shape[0]
        cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
        sim = [[cos(k[i], k[j]) if i != j else -math.inf for j in range(n)] for i in range(n)]
        best = [max(row) for row in sim]
        ranked = sorted(range(n), key=lambda i: (-best[i], i))
        rank = {t: pos for pos, t in enumerate(ranked)}
        later = [max([sim[i][j] for j in range(n) if rank[j] > rank[i]], default=-math.inf) for i in range(n)]
        imp = [cos(k[i], q) for i in range(n)]
        sources = sorted(sorted(range(n), key=lambda i: (imp[i] - later[i], i))[:r])
        keep = [j for j in range(n) if j not in sources]
        out.append({s: max(keep, key=lambda j: (sim[s][j], -j)) for s in sources})
    return out


@pytest.mark.parametrize("r, p", [(3, 1), (6, 2), (50, 1)])
def test_matching_equals_a_token_by_token_reference(r, p):
    torch.manual_seed(r)
    keys, query = torch.randn(2, 17, 12), torch.randn(2, 12)
    plan = guided_matching(keys, query, r, p)
    for row, expected in enumerate(_reference_groups(keys, query, min(r, 8), p)):
        got = {int(a): int(plan.b_idx[row, d]) for a, d in zip(plan.a_idx[row], plan.dst_idx[row])}
        assert got == expected


def test_a_pair_merges_as_the_softmax_of_its_importances_and_order_is_kept():
    keys = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.1, 0.0], [0.0, 1.0, 0.0]]])  # 1 and 2 alike
    query = torch.tensor([[1.0, 0.0, 0.3]])
    plan = guided_matching(keys, query, 1, 1)
    x = torch.arange(12.0).view(1, 4, 3)
    merged, size, _ = plan.apply(x, None, None)
    imp = torch.nn.functional.cosine_similarity(keys[0, 1:], query, dim=-1)
    s, d = int(plan.a_idx[0, 0]), int(plan.b_idx[0, plan.dst_idx[0, 0]])
    assert {s, d} == {0, 1}  # patch tokens 0 and 1 (the keys [1, 0, 0] and [1, 0.1, 0])
    p_s, p_d = torch.softmax(torch.stack([imp[s], imp[d]]), dim=0)
    torch.testing.assert_close(merged[0, 1], p_s * x[0, 1 + s] + p_d * x[0, 1 + d])
    torch.testing.assert_close(merged[0, [0, 2]], x[0, [0, 3]])  # the class token, then the rest in order
    assert size[0, :, 0].tolist() == [1.0, 2.0, 1.0]


def test_needs_a_class_token():
    with pytest.raises(ValueError, match="class token"):
        timm_tokcomp.apply(make_model("avgpool_noclass"), "crossget", r=2)


def test_weights_and_sizes_together(images):
    """Merged sizes count the patches; a model with sizes from earlier blocks stays finite and holds every patch."""
    model = timm_tokcomp.apply(make_model("registers"), "crossget", r=8, trace_source=True)
    with torch.no_grad():
        model(images)
    stats = timm_tokcomp.last_stats(model)
    assert torch.equal(stats.size[:, 4:, 0], stats.source[:, 4:].sum(dim=-1))
    assert torch.equal(stats.source.sum(dim=1)[:, 4:], torch.ones(3, 64))


@pytest.mark.parametrize("method, params", [("crossget", {"r": 8}), ("repshift", {"r": 8}),
                                            ("cubist", {"r_rows": 2, "r_cols": 2})])
def test_edge_sizes_of_the_methods_of_2024_2025(method, params, images):
    """An empty batch, a single patch token, bf16, and a torch.save round trip (the methods of issue 'beyond')."""
    from timm.models.vision_transformer import VisionTransformer

    check_edges(timm_tokcomp.apply(make_model("cls"), method, **params), images, (0, 10))
    with torch.no_grad():
        one_patch = timm_tokcomp.apply(VisionTransformer(img_size=8, patch_size=8, embed_dim=48, depth=2, num_heads=3,
                                                         num_classes=10).eval(), method, **params)
        assert torch.isfinite(one_patch(torch.randn(2, 3, 8, 8))).all()
        assert timm_tokcomp.last_stats(one_patch).tokens_per_block == [2, 2]
