"""Every registered token-reducing method through the same checks: forward at batch 1, backward to every
parameter, 'reduce nothing' equal to plain timm bit for bit, prefix tokens untouched, every patch held by at
most one token (exactly one for merging methods; total weight 1 for soft merging) with sizes counting them, deterministic output, and
remove() restoring the plain model."""
import pytest
import torch

import timm_tokcomp
from timm_tokcomp.methods import METHODS
from conftest import SMALL, VARIANTS, make_model

N_PATCH = (SMALL["img_size"] // SMALL["patch_size"]) ** 2  # 64
NOTHING = {"atm": dict(alpha=1.0, beta=0.0, theta_min=1.0, prefix_only_last_block=False)}  # no merge, full last MLP
REDUCING = {"atm": dict(alpha=0.5, beta=0.0, theta_min=0.5, prefix_only_last_block=False)}
DROPPING = {"topk", "ats", "l1", "l2", "linf", "dynamicvit"}  # pruned patches are dropped, held by no token
SOFT = {"patchmerger", "sinkhorn", "sit"}  # patches shared out over tokens by weights: held with total weight 1 up to round-off
TOKEN_METHODS = sorted(name for name, cls in METHODS.items() if not cls.dense)


def _reducing_params(method):
    return REDUCING.get(method, {"keep_rate": 0.6, "stages": (2, 3)})


def _variants(method):
    return [v for v in sorted(VARIANTS) if not (METHODS[method].needs_class_token and v == "avgpool_noclass")]


@pytest.mark.parametrize("method, variant", [(m, v) for m in TOKEN_METHODS for v in _variants(m)])
def test_reducing_nothing_is_plain_timm_bit_for_bit(method, variant, images):
    plain = make_model(variant)
    model = timm_tokcomp.apply(make_model(variant), method, **NOTHING.get(method, {"r": 0}))
    with torch.no_grad():
        assert torch.equal(model(images), plain(images))
    if "keep_rate" in METHODS[method].param_names():
        model = timm_tokcomp.apply(make_model(variant), method, keep_rate=1.0, stages=(2, 4))
        with torch.no_grad():
            assert torch.equal(model(images), plain(images))


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_method_contract(method, images):
    model = timm_tokcomp.apply(make_model("registers"), method, trace_source=True, **_reducing_params(method))
    p = model.num_prefix_tokens
    with torch.no_grad():
        out = model(images[:1])
        assert out.shape == (1, SMALL["num_classes"]) and torch.isfinite(out).all()
        first = model(images)
        assert torch.equal(first, model(images))  # deterministic
    stats = timm_tokcomp.last_stats(model)
    assert stats.tokens_out < N_PATCH + p
    held = stats.source.sum(1)  # (B, N0): tokens holding each original token
    assert torch.equal(stats.source[:, :p], torch.eye(N_PATCH + p)[:p].expand(len(images), -1, -1))
    assert torch.equal(stats.size[:, :p], torch.ones(len(images), p, 1))
    if method in SOFT:
        torch.testing.assert_close(stats.size[..., 0], stats.source.sum(-1))
        torch.testing.assert_close(held, torch.ones_like(held))
        assert stats.source.min() >= 0
    elif method in DROPPING:
        assert torch.equal(stats.size[..., 0], stats.source.sum(-1))
        assert held.max() == 1 and held.min() == 0
    else:
        assert torch.equal(stats.size[..., 0], stats.source.sum(-1))
        assert torch.equal(held, torch.ones_like(held))

    model.train()
    model(images).logsumexp(-1).sum().backward()
    missing = [n for n, prm in model.named_parameters() if prm.grad is None]
    assert not missing, f"no gradient reaches {missing}"

    timm_tokcomp.remove(model)
    plain = make_model("registers")
    plain.load_state_dict(model.state_dict())
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(images), plain(images))
