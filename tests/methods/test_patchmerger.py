"""PatchMerger, Sinkhorn and SiT: the soft merges against hand computations, SoftPlan against the hard-cluster contract, the
parameters' shape on DeiT-Tiny at the study's keep rate 0.7, saving / loading, and schedule mismatches refused."""
import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.methods.learned import load_learned, save_learned
from timm_tokcomp.plans import ClusterPlan, SoftPlan
from timm_tokcomp.methods.patchmerger import MergerLayer, PatchMergerParams
from conftest import make_model


def test_the_merge_is_softmax_of_queries_over_normed_tokens_times_tokens():
    torch.manual_seed(0)
    layer = MergerLayer(16, 5)
    x = torch.randn(2, 1 + 12, 16)
    plan = SoftPlan(1, layer.weights(x[:, 1:]))
    out, size, source = plan.apply(x, None, torch.eye(13).expand(2, -1, -1))
    for b in range(2):
        normed = torch.nn.functional.layer_norm(x[b, 1:], (16,), layer.norm.weight, layer.norm.bias)
        for m in range(5):
            w = torch.softmax(torch.stack([layer.queries[m] @ normed[j] / 4.0 for j in range(12)]), 0)
            torch.testing.assert_close(out[b, 1 + m], (w[:, None] * x[b, 1:]).sum(0))
    assert torch.equal(out[:, 0], x[:, 0]) and out.shape == (2, 6, 16)
    torch.testing.assert_close(size.sum(1), torch.full((2, 1), 13.0))
    torch.testing.assert_close(source.sum(1), torch.ones(2, 13))


def test_one_hot_weights_give_the_hard_cluster_merge():
    """weights = 1 / |cluster| on a cluster's members: the same x, size and source as ClusterPlan."""
    torch.manual_seed(1)
    x = torch.randn(3, 2 + 10, 8)
    assign = torch.randint(0, 4, (3, 10))
    assign[:, :4] = torch.arange(4)  # no empty cluster
    one_hot = torch.nn.functional.one_hot(assign, 4).transpose(1, 2).float()  # (B, 4, 10)
    soft = SoftPlan(2, one_hot / one_hot.sum(-1, keepdim=True)).apply(x, None, torch.eye(12).expand(3, -1, -1))
    hard = ClusterPlan(2, assign, 4).apply(x, None, torch.eye(12).expand(3, -1, -1))
    for a, b in zip(soft, hard):
        torch.testing.assert_close(a, b)


def test_deit_tiny_at_keep_rate_07_has_the_studys_counts_and_its_parameters_on_the_model():
    model = timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224"), "patchmerger", keep_rate=0.7)
    params = model.tokcomp["patchmerger"]
    assert params.outputs == [0, 0, 137, 0, 0, 96, 0, 0, 67, 0, 0, 0]
    assert sum(p.numel() for p in params.parameters()) == (137 + 96 + 67) * 192 + 3 * 2 * 192
    assert "tokcomp.patchmerger.layers.2.queries" in model.state_dict()
    with torch.no_grad():
        model(torch.randn(1, 3, 224, 224))
    assert timm_tokcomp.last_stats(model).tokens_out == 1 + 67


def test_saved_parameters_reload_to_the_same_model_and_refuse_another_schedule(tmp_path, images):
    model = timm_tokcomp.apply(make_model("cls"), "patchmerger", keep_rate=0.6, stages=(2, 3))
    with torch.no_grad():
        for p in model.tokcomp.parameters():
            p.add_(torch.randn_like(p))
        expected = model(images)
    save_learned(model.tokcomp["patchmerger"], "patchmerger", tmp_path)
    loaded = load_learned("patchmerger", tmp_path)
    again = timm_tokcomp.apply(make_model("cls"), "patchmerger", keep_rate=0.6, stages=(2, 3), merger_params=loaded)
    with torch.no_grad():
        assert torch.equal(again(images), expected)
    with pytest.raises(ValueError, match=r"leave \[38, 23, 0, 0\] .* leaves \[32, 16, 0, 0\]"):
        timm_tokcomp.apply(make_model("cls"), "patchmerger", keep_rate=0.5, stages=(2, 3), merger_params=loaded)
    with pytest.raises(ValueError, match="merger_params must be PatchMergerParams"):
        timm_tokcomp.apply(make_model("cls"), "patchmerger", keep_rate=0.6, merger_params=object())
    with pytest.raises(ValueError, match="outputs must be a non-empty list"):
        PatchMergerParams.from_config({"dim": 8, "outputs": [-1]})


def test_gradients_reach_the_queries_and_the_blocks_before_the_merge(images):
    """The assignment keeps its gradient (its plan_input keeps it): earlier blocks learn through the weights too."""
    model = timm_tokcomp.apply(make_model("cls"), "patchmerger", keep_rate=0.6, stages=(2, 3)).train()
    model(images).sum().backward()
    assert model.tokcomp["patchmerger"].layers["0"].queries.grad.abs().sum() > 0
    assert model.blocks[0].mlp.fc2.weight.grad.abs().sum() > 0


def test_sinkhorn_balances_the_assignment_in_three_iterations():
    """Against the algorithm written out in probabilities: K = exp(S), 3 x (columns to 1, rows to n / M),
    then rows to 1."""
    from timm_tokcomp.methods.sinkhorn import SinkhornLayer

    torch.manual_seed(2)
    layer = SinkhornLayer(16, 4)
    with torch.no_grad():
        layer.queries.mul_(50)  # far from uniform, so the balancing has work to do
    x = torch.randn(2, 12, 16)
    keys = torch.nn.functional.layer_norm(x, (16,), layer.norm.weight, layer.norm.bias)
    k = torch.exp(torch.einsum("md,bnd->bmn", layer.queries, keys).double() / 4.0)
    for _ in range(3):
        k = k / k.sum(1, keepdim=True)
        k = k / k.sum(2, keepdim=True) * (12 / 4)
    expected = k / k.sum(2, keepdim=True)
    weights = layer.weights(x)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-4, atol=1e-6)
    plain = MergerLayer(16, 4)
    plain.load_state_dict(layer.state_dict())
    spread = lambda w: (w.sum(1) - w.sum(1).mean()).abs().max()  # how unequal the inputs' total weights are
    assert spread(weights) < spread(plain.weights(x))


def test_sit_weights_are_a_softmax_over_tokens_of_a_token_mlp():
    from timm_tokcomp.methods.sit import SlimmingLayer

    torch.manual_seed(3)
    layer = SlimmingLayer(16, 5)
    x = torch.randn(2, 12, 16)
    norm = lambda t: torch.nn.functional.layer_norm(t, (16,), layer.norm.weight, layer.norm.bias)
    for b in range(2):
        scores = torch.stack([layer.fc2(torch.nn.functional.gelu(layer.fc1(norm(x[b, j])))) for j in range(12)], 1)
        torch.testing.assert_close(layer.weights(x)[b], scores.softmax(dim=-1))  # (5 outputs, 12 tokens)


@pytest.mark.parametrize("method, count", [("sinkhorn", (137 + 96 + 67) * 192 + 3 * 2 * 192),
                                           ("sit", 3 * (2 * 192 + 192 * 96 + 96) + (137 + 96 + 67) * 96 + 137 + 96 + 67)])
def test_sinkhorn_and_sit_live_on_the_model_and_reload(method, count, tmp_path, images):
    deit = timm_tokcomp.apply(timm.create_model("deit_tiny_patch16_224"), method, keep_rate=0.7)
    assert sum(p.numel() for p in deit.tokcomp[method].parameters()) == count
    model = timm_tokcomp.apply(make_model("cls"), method, keep_rate=0.6, stages=(2, 3))
    with torch.no_grad():
        expected = model(images)
    save_learned(model.tokcomp[method], method, tmp_path)
    again = timm_tokcomp.apply(make_model("cls"), method, keep_rate=0.6, stages=(2, 3),
                               merger_params=load_learned(method, tmp_path))
    with torch.no_grad():
        assert torch.equal(again(images), expected)
    with pytest.raises(ValueError, match="merger_params must be"):
        timm_tokcomp.apply(make_model("cls"), "patchmerger", keep_rate=0.6, stages=(2, 3),
                           merger_params=load_learned(method, tmp_path))
