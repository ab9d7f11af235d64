"""DynamicViT: eval keeps the schedule's count of tokens with the highest predicted keep probability; training
removes nothing, masks the dropped tokens out of attention and gives the ratio loss of the decisions it made;
the predictors save, reload and refuse another schedule."""
import pytest
import torch

import timm_tokcomp
from timm_tokcomp.methods.learned import load_learned, save_learned
from timm_tokcomp.methods.dynamicvit import EPS, RATIO_WEIGHT
from conftest import SMALL, make_model

N_PATCH = (SMALL["img_size"] // SMALL["patch_size"]) ** 2  # 64


def _model(**params):
    return timm_tokcomp.apply(make_model("registers"), "dynamicvit", trace_source=True,
                              **{"keep_rate": 0.6, "stages": (2, 3), **params})


def test_eval_keeps_the_tokens_with_the_highest_keep_probability(images):
    model = _model()
    p = model.num_prefix_tokens
    reducer, seen = timm_tokcomp.get_reducer(model), []
    plan = reducer.plan
    reducer.plan = lambda tokens, *args: seen.append(tokens) or plan(tokens, *args)
    with torch.no_grad():
        model(images)
        stats = timm_tokcomp.last_stats(model)
        assert stats.tokens_per_block == [p + 64, p + 38, p + 23, p + 23]
        x = seen[0]  # block 0's output: the tokens the first stage scores
        score = model.tokcomp["dynamicvit"].predictors["0"](x[:, p:], torch.ones(len(x), 64, 1))[..., 0]
    kept = score.topk(38, dim=-1).indices.sort(dim=-1).values
    held = stats.source[:, :, p:].sum(1) > 0  # (B, 64) patches still held at the end (after both stages)
    assert all(set(held[b].nonzero()[:, 0].tolist()) <= set(kept[b].tolist()) for b in range(len(x)))
    assert timm_tokcomp.get_reducer(model).method_loss() is None  # no training forward ran


def test_training_removes_nothing_and_the_ratio_loss_counts_the_sampled_decisions(images):
    model = _model().train()
    torch.manual_seed(0)
    out = model(images)
    stats = timm_tokcomp.last_stats(model)
    p = model.num_prefix_tokens
    assert stats.tokens_per_block == [p + 64] * 4 and stats.tokens_out == p + 64
    sizes = stats.size[:, p:, 0]
    assert torch.all((sizes == 1) | ((sizes - EPS).abs() < 1e-9))
    kept = [stats.real_tokens_per_block[i] - p for i in (1, 2)]  # after stage 1 and after stage 2
    assert torch.equal(kept[1], (sizes == 1).sum(1))
    expected = RATIO_WEIGHT * sum((k / 64 - t) ** 2 for k, t in zip(kept, (38 / 64, 23 / 64))).mean()
    loss = timm_tokcomp.get_reducer(model).method_loss()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert timm_tokcomp.get_reducer(model).method_loss() is None  # read once
    (out.logsumexp(-1).sum() + loss).backward()
    grads = [q.grad for q in model.tokcomp.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_tokens_dropped_in_training_do_not_reach_the_kept_tokens(images):
    """Under the same Gumbel noise, changing what the dropped tokens hold (after stage 1) leaves the class token's
    output unchanged up to the EPS leak."""
    model = _model(keep_rate=0.5, stages=(2,)).train()
    p = model.num_prefix_tokens
    torch.manual_seed(0)
    base = model(images)
    dropped = timm_tokcomp.last_stats(model).size[:, p:, 0] < 0.5  # (B, 64)
    assert dropped.any()

    block = model.blocks[1]  # runs after stage 1: give its dropped input tokens other contents

    def scrambled(x, *rest):
        noise = torch.randn(x[:, p:].shape, generator=torch.Generator().manual_seed(1)) * 10 * dropped.unsqueeze(-1)
        return type(block).forward_reduce(block, torch.cat([x[:, :p], x[:, p:] + noise], 1), *rest)

    block.forward_reduce = scrambled
    torch.manual_seed(0)
    changed = model(images)
    del block.forward_reduce
    assert timm_tokcomp.last_stats(model).size[:, p:, 0].lt(0.5).equal(dropped)  # the same decisions
    torch.testing.assert_close(changed, base, atol=1e-3, rtol=1e-3)


def test_saved_predictors_reload_and_refuse_another_schedule(tmp_path, images):
    model = _model().eval()
    with torch.no_grad():
        expected = model(images)
    save_learned(model.tokcomp["dynamicvit"], "dynamicvit", tmp_path)
    again = _model(predictor_params=load_learned("dynamicvit", tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(again(images), expected)
    with pytest.raises(ValueError, match=r"follow blocks \[0, 1\]; .* after blocks \[1, 2\]"):
        _model(stages=(3, 4), predictor_params=load_learned("dynamicvit", tmp_path))
    with pytest.raises(ValueError, match="prop_attn must stay on"):
        _model(prop_attn=False)
