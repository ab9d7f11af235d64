"""PYRA: untrained equals ToMe bit for bit, the modulated merge against a per-token loop, the paper's
parameter count, both forms at other schedules, and saving / loading with the errors for what does not fit."""
import pytest
import timm
import torch

import timm_tokcomp
from timm_tokcomp.methods.learned import config_file, load_learned, save_learned
from timm_tokcomp.ops.matching import bipartite_soft_matching
from timm_tokcomp.methods.pyra import PyraParams, pyra_merge
from timm_tokcomp.methods.schedules import NAMED_SCHEDULES

HIGH, LOW = NAMED_SCHEDULES["high"], NAMED_SCHEDULES["low"]


def _deit_tiny(**kwargs):
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_patch16_224", **kwargs)


def _train_a_little(model):
    """Non-zero token weights (as training makes them), so that PYRA differs from ToMe."""
    with torch.no_grad():
        for p in model.tokcomp.parameters():
            p.add_(torch.randn_like(p) * 0.5)


@pytest.fixture(scope="module")
def photos():
    return torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("schedule", [dict(r=HIGH), dict(r=LOW), dict(keep_rate=0.7), dict(r=8, form="pooled")])
def test_untrained_pyra_is_tome_bit_for_bit(schedule, photos):
    tome_schedule = {k: v for k, v in schedule.items() if k != "form"}
    tome = timm_tokcomp.apply(_deit_tiny(), "tome", **tome_schedule)
    pyra = timm_tokcomp.apply(_deit_tiny(), "pyra", **schedule)
    with torch.no_grad():
        assert torch.equal(pyra(photos), tome(photos))
    assert timm_tokcomp.last_stats(pyra).tokens_per_block == timm_tokcomp.last_stats(tome).tokens_per_block


def test_paper_parameter_count_for_vit_b_high():
    model = timm.create_model("vit_base_patch16_224.pyra_high")
    count = sum(p.numel() for p in model.tokcomp.parameters())
    # per block: LayerNorm (2 x 768) + W_D (768), plus one rank weight per merged token (sum of r = 192)
    assert count == 12 * 3 * 768 + sum(HIGH) == 27840


def _loop_reference(x, size, plan, params, layer):
    """Per image and merged token: modulate the source, then the size-weighted mean of every group."""
    p = plan.num_prefix
    out_x, out_size = [], []
    for i in range(x.shape[0]):
        a_pos = [j for j in range(p, x.shape[1]) if j % 2 == 0]  # the alternate split: A = even absolute positions
        b_pos = [j for j in range(p, x.shape[1]) if j % 2 == 1]
        src = [a_pos[j] for j in plan.src_idx[i].tolist()]
        dst = [b_pos[j] for j in plan.dst_idx[i].tolist()]
        layer_params = params.layers[str(layer)]
        pr = layer_params.norm(x[i, src] + x[i, dst])  # (r, D)
        c = 2 * torch.sigmoid((pr * layer_params.rank_weight[:len(src), None]).sum(0))  # (D,)
        t = 2 * torch.sigmoid(pr @ layer_params.token_weight) - 1  # (r,)
        modulated = x[i, src] * (1 + t[:, None] * c[None])
        groups = {b: ([x[i, b] * size[i, b]], [size[i, b]]) for b in b_pos}
        for s, b, m in zip(src, dst, modulated):
            groups[b][0].append(m * size[i, s])
            groups[b][1].append(size[i, s])
        kept = [x[i, :p]] + [x[i, a_pos[j]][None] for j in plan.unm_idx[i].tolist()]
        merged = [torch.stack(v).sum(0) / torch.stack(w).sum(0) for v, w in groups.values()]
        out_x.append(torch.cat(kept + [torch.stack(merged)]))
        kept_size = [size[i, :p]] + [size[i, a_pos[j]][None] for j in plan.unm_idx[i].tolist()]
        out_size.append(torch.cat(kept_size + [torch.stack([torch.stack(w).sum(0) for _, w in groups.values()])]))
    return torch.stack(out_x), torch.stack(out_size)


def test_modulated_merge_matches_a_per_token_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1 + 20, 16, generator=g)
    size = torch.randint(1, 4, (3, 21, 1), generator=g).float()
    params = PyraParams(16, [5, 5])
    with torch.no_grad():
        for p in params.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    plan = bipartite_soft_matching(torch.randn(3, 21, 8, generator=g), 5, 1)
    got_x, got_size = pyra_merge(x, size, plan, params.layers["1"])
    want_x, want_size = _loop_reference(x, size, plan, params, 1)
    assert torch.allclose(got_x, want_x, atol=1e-5) and torch.equal(got_size, want_size)


def test_trained_pyra_differs_from_tome_and_trains(photos):
    pyra = timm_tokcomp.apply(_deit_tiny(), "pyra", r=HIGH)
    tome = timm_tokcomp.apply(_deit_tiny(), "tome", r=HIGH)
    _train_a_little(pyra)
    with torch.no_grad():
        assert not torch.allclose(pyra(photos), tome(photos), atol=1e-3)
    pyra(photos).sum().backward()
    # the last block merges after its attention, so only its MLP sees the merged tokens, never the class token
    for name, p in pyra.tokcomp.named_parameters():
        assert (p.grad.abs().sum() > 0) == (".11." not in name), name


def test_paper_form_refuses_another_schedule_and_pooled_runs_at_any(photos):
    paper = timm_tokcomp.apply(_deit_tiny(), "pyra", r=HIGH)
    before = timm_tokcomp.get_reducer(paper)
    with pytest.raises(ValueError, match="fit the schedule"):
        timm_tokcomp.set_params(paper, r=LOW)
    assert timm_tokcomp.get_reducer(paper) is before  # unchanged

    pooled = timm_tokcomp.apply(_deit_tiny(), "pyra", r=HIGH, form="pooled")
    _train_a_little(pooled)
    trained = pooled.tokcomp.pyra
    with torch.no_grad():
        high = pooled(photos)
        timm_tokcomp.set_params(pooled, r=LOW)  # keeps the parameters
        assert pooled.tokcomp.pyra is trained
        low = pooled(photos)
        timm_tokcomp.set_params(pooled, r=HIGH)
        assert torch.equal(pooled(photos), high) and not torch.equal(low[:, :5], high[:, :5])
    assert timm_tokcomp.last_stats(pooled).tokens_out == 197 - sum(HIGH)


def test_save_load_round_trip_and_clear_errors(tmp_path, photos):
    model = timm_tokcomp.apply(_deit_tiny(), "pyra", r=HIGH)
    _train_a_little(model)
    save_learned(model.tokcomp.pyra, "pyra", tmp_path)
    loaded = load_learned("pyra", tmp_path)
    other = timm_tokcomp.apply(_deit_tiny(), "pyra", r=HIGH, pyra_params=loaded)
    with torch.no_grad():
        assert torch.equal(other(photos), model(photos))

    with pytest.raises(ValueError, match="width 192; the model has width 384"):
        timm_tokcomp.apply(timm.create_model("deit_small_patch16_224"), "pyra", r=HIGH, pyra_params=load_learned("pyra", tmp_path))
    with pytest.raises(ValueError, match="12 blocks; the model has 6"):
        timm_tokcomp.apply(_deit_tiny(depth=6), "pyra", r=2, pyra_params=load_learned("pyra", tmp_path))
    with pytest.raises(ValueError, match="fit the schedule"):
        timm_tokcomp.apply(_deit_tiny(), "pyra", r=LOW, pyra_params=load_learned("pyra", tmp_path))
    config = tmp_path / config_file("pyra")
    config.write_text(config.read_text().replace('"paper"', '"wide"'))
    with pytest.raises(ValueError, match="form must be one of"):
        load_learned("pyra", tmp_path)
    with pytest.raises(FileNotFoundError, match="pyra_config.json is missing"):
        load_learned("pyra", tmp_path / "nowhere")


def test_remove_and_other_methods_drop_the_parameters(photos):
    model = timm_tokcomp.apply(_deit_tiny(), "pyra", r=8)
    assert any(k.startswith("tokcomp.pyra.") for k in model.state_dict())
    timm_tokcomp.apply(model, "tome", r=8)
    assert not any(k.startswith("tokcomp") for k in model.state_dict())
    timm_tokcomp.apply(model, "pyra", r=8)
    timm_tokcomp.remove(model)
    assert set(model.state_dict()) == set(_deit_tiny().state_dict())
